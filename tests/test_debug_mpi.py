"""The failures of docs/debugging.md, rehearsed under a real ``mpiexec -n 2``.

Each test launches a job -- ``hpcdl train`` on a tiny synthetic tree, or a small training-like
script (allreduce a gradient, update, checkpoint on rank 0) -- from this serial test, so mpiexec
is never nested inside an MPI-launched pytest. Faults are injected with ``HPCDL_INJECT``
(hpcdl/debug/monitor.py) or by the job itself.
"""
import os
import subprocess
import sys
import textwrap

JOB = textwrap.dedent("""
    import os, sys
    import torch
    from mpi4py import MPI
    import hpcdl.comm
    from hpcdl.debug import (install_fail_fast, install_stack_dump, setup_rank_logging,
                             watch_collectives)
    from hpcdl.io import atomic_write

    run_dir, scenario = sys.argv[1], sys.argv[2]
    comm = hpcdl.comm.init("mpi")
    setup_rank_logging(run_dir, comm.rank, comm.size, "info")
    install_fail_fast(MPI.COMM_WORLD)
    install_stack_dump()
    watch_collectives(comm, run_dir)
    weights = torch.zeros(4)
    for step in range(1, 7):
        wrong = scenario == "mismatch" and comm.rank == 1 and step == 3
        grad = torch.ones(5 if wrong else 4)
        comm.allreduce_flat_(grad, bucket=0)
        weights -= 0.1 * grad[:4]
        if comm.rank == 0:
            state = {"step": step, "weights": weights}
            atomic_write(os.path.join(run_dir, "ckpt.pt"), lambda f: torch.save(state, f))
    print(f"rank {comm.rank} finished", flush=True)
""")


def launch(tmp_path, scenario, ranks=2, **env):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    run_dir = tmp_path / "run"
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "MPIEXEC_TIMEOUT": "100", **env}
    out = subprocess.run(["mpiexec", "-n", str(ranks), sys.executable, str(script), str(run_dir),
                          scenario], capture_output=True, text=True, env=full_env, timeout=150)
    return out, run_dir


def test_mismatched_shapes_end_the_job_naming_both_shapes_and_ranks(tmp_path):
    # HPCDL_DEBUG=1 checks every collective's signature (without it, a layout only its first
    # time on each rank; a mismatch then shows up in the stall report instead).
    out, run_dir = launch(tmp_path, "mismatch", HPCDL_DEBUG="1")
    assert out.returncode == 1, out.stderr
    assert "CollectiveMismatchError" in out.stderr
    assert "rank 0: allreduce(shapes=[(4,)]" in out.stderr
    assert "rank 1: allreduce(shapes=[(5,)]" in out.stderr
    # debug mode: every collective is recorded with its name, bucket, shape, dtype and bytes
    log = (run_dir / "logs" / "rank-0001.log").read_text()
    assert "'name': 'allreduce', 'bucket': 0, 'shapes': [(4,)], 'dtype': 'float32', " \
           "'bytes': 16" in log




def test_a_rank_that_raises_mid_training_aborts_the_job_and_keeps_the_last_checkpoint(
        tmp_path, tiny_shards, tiny_recipe):
    from hpcdl.train.checkpoint import latest_valid_checkpoint

    run_dir = tmp_path / "run"
    # Rank 1's gradient thread raises at its 36th collective: a few steps in (3 for the
    # initial broadcast, then one allreduce per bucket per step, checked once per layout),
    # after the checkpoint of step 2. Rank 0 is then blocked in that step's allreduce.
    cmd = ["mpiexec", "-n", "2", sys.executable, "-m", "hpcdl.cli.main", "train",
           "--recipe", tiny_recipe, "--data", tiny_shards,
           "--out", str(run_dir), "--max-steps", "12", "--checkpoint-every", "2", "--no-eval"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MPIEXEC_TIMEOUT": "150",
           "HPCDL_INJECT": "1:36:raise"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=200)
    # Exit 1 is fail-fast's MPI_Abort, not the stall watchdog's 3 (which waits 600 s).
    assert out.returncode == 1, out.stdout + out.stderr
    assert "[rank 1/2 " in out.stderr and "InjectedFault" in out.stderr
    assert not (run_dir / "summary.json").exists()  # the job did not run to the end
    path, state = latest_valid_checkpoint(str(run_dir))
    assert 2 <= state["step"] < 12, path
    assert "InjectedFault" in (run_dir / "logs" / "rank-0001.log").read_text()


def test_a_sleeping_rank_gets_a_stall_report_then_an_abort(tmp_path):
    out, run_dir = launch(tmp_path, "stall", ranks=4, HPCDL_INJECT="2:4:sleep=60",
                          HPCDL_STALL_WARN_S="2", HPCDL_STALL_ABORT_S="6")
    assert out.returncode == 4, out.stderr  # STALL_EXIT_CODE (4) through MPI_Abort
    assert "stall: rank 0 has waited" in out.stderr
    assert "1 of 4 rank(s) have not arrived: 2\n" in out.stderr
    assert "rank 2: last finished #3 allreduce" in out.stderr
    assert "sleeping 60 s (HPCDL_INJECT)" in out.stderr
    # The reason is in the log file of a waiting rank that aborted (stderr may lose its last
    # lines when MPI_Abort takes the launcher down first).
    logs = [(run_dir / "logs" / f"rank-{r:04d}.log").read_text() for r in (0, 1, 3)]
    assert any("stall: aborting the job (MPI_Abort 4) after" in text for text in logs)
    assert (run_dir / "logs" / "heartbeat" / "rank-0002.json").exists()
