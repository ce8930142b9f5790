"""``hpcdl prep`` is watched like ``hpcdl train``: a rank left waiting for a stuck peer ends the
job with a stall report instead of holding the allocation forever.

Rank 0, the node's copier, is held inside its copy (a read that never returns, here a sleep);
rank 1 waits for it in the phase's gather. The test launches mpiexec itself."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

STUCK_COPIER = textwrap.dedent("""
    import sys, time
    from mpi4py import MPI
    import hpcdl.data_prep.stage
    from hpcdl.cli.main import main

    if MPI.COMM_WORLD.rank == 0:
        hpcdl.data_prep.stage.stage_node = lambda *args, **kwargs: time.sleep(120)
    sys.exit(main(["prep", "stage", "--shards", sys.argv[1], "--to", sys.argv[2]]))
""")


def test_a_rank_stuck_while_staging_ends_the_job_with_a_stall_report(tmp_path, tiny_shards):
    script = tmp_path / "stage.py"
    script.write_text(STUCK_COPIER)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "HPCDL_STALL_WARN_S": "1", "HPCDL_STALL_ABORT_S": "4",
           "HPCDL_HEARTBEAT_DIR": str(tmp_path / "heartbeat")}
    try:
        out = subprocess.run(["mpiexec", "-n", "2", sys.executable, str(script), tiny_shards,
                              str(tmp_path / "local")], capture_output=True, text=True,
                             env=env, timeout=90)
    except subprocess.TimeoutExpired:
        raise AssertionError("prep stage still waiting 90 s after a rank stuck: no "
                             "watchdog") from None
    assert out.returncode != 0
    assert "stall: aborting the job" in out.stderr, out.stderr
    assert "not arrived: rank 0" in out.stderr, out.stderr  # the stuck copier, named


def test_prep_stage_under_the_watchdog_completes_and_leaves_no_heartbeat(tmp_path, tiny_shards):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "HPCDL_HEARTBEAT_DIR": str(tmp_path / "heartbeat")}
    out = subprocess.run(["mpiexec", "-n", "2", sys.executable, "-m", "hpcdl.cli.main", "prep",
                          "stage", "--shards", tiny_shards, "--to", str(tmp_path / "local")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "stall" not in out.stderr, out.stderr
    assert not any((tmp_path / "heartbeat").rglob("*.json"))
