"""Every entry point ends a stalled job by itself, names who stopped answering, and leaves no
rank behind -- under a real ``mpiexec``, on one host (tests/cluster has the multi-host rows).

The jobs are launched from this serial test (mpiexec is never nested in an MPI-launched pytest).
A frozen rank is a real ``SIGSTOP``; a rank cut off from its launcher is a real one too: its
``hydra_pmi_proxy`` is stopped as well, so the rank's MPI_Abort reaches no one (MPICH's
MPI_Abort then returns) and only the rank's own deadline can end it. "No rank left behind" is
read from the process table: every pid the job wrote is gone (or a zombie whose parent is the
stopped proxy) once the launcher has exited.
"""
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

STALL_ENV = {"HPCDL_STALL_WARN_S": "2", "HPCDL_STALL_ABORT_S": "6",
             "HPCDL_STALL_EXIT_GRACE_S": "2", "OMP_NUM_THREADS": "1"}

#: a user's own loop on hpcdl.comm.init: no watch_collectives, no run directory
OWN_LOOP = textwrap.dedent("""
    import os, sys, time
    import torch
    import hpcdl.comm

    out = sys.argv[1]
    comm = hpcdl.comm.init("mpi")
    grad = torch.ones(1000)
    for step in range(1, 1_000_000):
        comm.allreduce_(grad)
        if step == 20:  # running: tell the test who we are
            with open(os.path.join(out, f"pids-{comm.rank}.tmp"), "w") as f:
                f.write(f"{os.getpid()} {os.getppid()}")
            os.replace(os.path.join(out, f"pids-{comm.rank}.tmp"),
                       os.path.join(out, f"pids-{comm.rank}"))
        time.sleep(0.01)
""")


def _start(tmp_path, ranks=2):
    script = tmp_path / "own_loop.py"
    script.write_text(OWN_LOOP)
    env = {**os.environ, **STALL_ENV, "HPCDL_HEARTBEAT_DIR": str(tmp_path / "heartbeat")}
    return subprocess.Popen(["mpiexec", "-n", str(ranks), sys.executable, str(script),
                             str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)


def _pids(tmp_path, ranks, job, timeout=180.0):
    """{rank: (pid, parent pid)} once every rank is in its loop."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        paths = [tmp_path / f"pids-{r}" for r in range(ranks)]
        if all(p.exists() for p in paths):
            return {r: tuple(map(int, p.read_text().split())) for r, p in enumerate(paths)}
        if job.poll() is not None:
            pytest.fail(f"the job ended before its loop: {job.communicate()}")
        time.sleep(0.2)
    pytest.fail("the job did not start its loop")


def _running(pid):
    """Alive and not a zombie (a zombie has ended; its parent has not reaped it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pid, timeout=120.0):
    deadline = time.monotonic() + timeout
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _running(pid)


def _left_behind(pids):
    """Ranks still running once the launcher has exited (it may take a moment to reap them)."""
    return [pid for pid, _ in pids.values() if not _wait_gone(pid, timeout=30.0)]


def _one_dump(tmp_path, rank):
    dumps = list((tmp_path / "heartbeat").glob(f"*/rank-{rank:04d}.stall.txt"))
    assert len(dumps) == 1, dumps
    return dumps[0].read_text()


def test_a_users_own_loop_aborts_a_job_with_a_frozen_rank_naming_it(tmp_path):
    job = _start(tmp_path)
    try:
        pids = _pids(tmp_path, 2, job)
        os.kill(pids[0][0], signal.SIGSTOP)  # rank 0 freezes mid-loop; rank 1 waits for it
        out, err = job.communicate(timeout=150)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 4, err  # STALL_EXIT_CODE (4), through MPI_Abort
    host = socket.gethostname()
    line = next(x for x in _one_dump(tmp_path, 1).splitlines() if x.startswith("stall: abort"))
    assert "in #" in line and f"on rank 1 ({host}); rank gone: rank 0 on {host} silent since " in \
        line, line
    assert f"rank gone: rank 0 on {host}" in err  # the same line on the terminal
    assert _left_behind(pids) == []


def test_a_rank_cut_off_from_its_launcher_ends_itself_after_its_abort_fails(tmp_path):
    job = _start(tmp_path)
    proxy = None
    try:
        pids = _pids(tmp_path, 2, job)
        (rank0, proxy), (rank1, _) = pids[0], pids[1]
        # Rank 0 frozen and the launcher's proxy frozen: rank 1's MPI_Abort reaches no one.
        os.kill(rank0, signal.SIGSTOP)
        os.kill(proxy, signal.SIGSTOP)
        ended = _wait_gone(rank1)  # bound: warn + abort + grace + polling, well under 120 s
        os.kill(proxy, signal.SIGCONT)  # the "repair": the launcher cleans up the rest
        out, err = job.communicate(timeout=120)
    finally:
        if proxy is not None:
            os.kill(proxy, signal.SIGCONT)
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert ended, "rank 1 outlived its failed MPI_Abort"
    dump = _one_dump(tmp_path, 1)
    assert "rank gone: rank 0 on " in dump.splitlines()[0]
    assert dump.splitlines()[1].startswith("stall: MPI_Abort did not end rank 1 (") and \
        "the rank ends itself with exit 4" in dump.splitlines()[1]
    assert job.returncode != 0
    assert _left_behind(pids) == []


def test_the_demo_has_the_watchdog_at_start_up_and_keeps_every_ranks_state(tmp_path):
    # Rank 1 stalls before its first collective (the wait for rank 0's data preparation):
    # a start-up fault. Before, `hpcdl demo` printed nothing and hung.
    run_dir = tmp_path / "demo"
    env = {**os.environ, **STALL_ENV, "HPCDL_INJECT": "1:1:sleep=300"}
    out = subprocess.run(["mpiexec", "-n", "2", sys.executable, "-m", "hpcdl.cli.main", "demo",
                          "--out", str(run_dir), "--max-steps", "4", "--no-progress",
                          # the run's own communicator: comm.backend auto's trial would meet
                          # the stall first, on a candidate watched from the default directory
                          "comm.backend=rule"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 4, out.stdout + out.stderr
    heartbeat = run_dir / "logs" / "heartbeat"
    dump = (heartbeat / "rank-0000.stall.txt").read_text()
    # rank 0 passes the broadcast (it is the root) and waits in its next collective
    assert dump.startswith("stall: aborting the job (MPI_Abort 4) after ")
    assert "alive but not arrived: rank 1 on " in dump.splitlines()[0]
    assert "sleeping 300 s (HPCDL_INJECT)" in (heartbeat / "rank-0001.json").read_text()
    assert "stall: aborting the job (MPI_Abort 4)" in \
        (run_dir / "logs" / "rank-0000.log").read_text()


def test_a_raw_mpi_call_outside_the_communicator_is_watched_too(tmp_path):
    # A user's own world.Barrier() (or a trainer's loss agreement, a checkpoint's gather):
    # the watchdog reads the main thread's frame and names the call and its line.
    script = tmp_path / "raw_barrier.py"
    script.write_text(textwrap.dedent("""
        import time
        from mpi4py import MPI
        import hpcdl.comm

        comm = hpcdl.comm.init("mpi")
        world = MPI.COMM_WORLD
        world.Barrier()
        if world.rank == 1:
            time.sleep(300)
        world.Barrier()
    """))
    env = {**os.environ, **STALL_ENV, "HPCDL_HEARTBEAT_DIR": str(tmp_path / "heartbeat")}
    out = subprocess.run(["mpiexec", "-n", "2", sys.executable, str(script)],
                         capture_output=True, text=True, env=env, timeout=200)
    assert out.returncode == 4, out.stderr
    line = _one_dump(tmp_path, 0).splitlines()[0]
    assert "in MPI Barrier at raw_barrier.py:11 on rank 0 (" in line, line
    assert "alive but not arrived: rank 1 on " in line, line
