"""A run directory whose file system stops answering mid-run does not switch the watchdog off:
the job still ends by the stall abort, within its bound.

The file system is a FUSE mirror of a temporary directory (tests/programs/passthrough_fs.py)
whose daemon is stopped with SIGSTOP once the run has logged a step: from then on every
``open``/``write``/``rename`` under RUN_DIR blocks (as on a hung Lustre), nothing fails. The
ranks' main threads block in their next log or metrics write (or wait in a collective for a
rank that does), and each watchdog -- whose heartbeat writes, heartbeat reads, dump and log
lines all go to that file system -- must still decide from memory and MPI_Abort the job.
Launched from this serial test under a real mpiexec; a job still running at the subprocess
bound fails the test.
"""
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec")

PASSTHROUGH = os.path.join(os.path.dirname(__file__), "programs", "passthrough_fs.py")
STALL_ENV = {"HPCDL_STALL_WARN_S": "2", "HPCDL_STALL_ABORT_S": "6",
             "HPCDL_STALL_EXIT_GRACE_S": "2", "OMP_NUM_THREADS": "1"}
BOUND_S = 120


def _fuse_missing() -> str | None:
    try:
        import fuse  # noqa: F401 - fusepy, which loads libfuse.so.2
    except (ImportError, OSError) as exc:
        return f"needs fusepy and libfuse2 (pip install fusepy; apt-get install libfuse2): {exc}"
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "needs /dev/fuse (a FUSE mount) on this machine"
    return None


@pytest.fixture
def freezable_mount(tmp_path):
    """(source, mountpoint, daemon): a FUSE mirror of ``source``; SIGSTOP the daemon to make
    the mount stop answering. Thawed and unmounted at the end."""
    missing = _fuse_missing()
    if missing:
        pytest.skip(missing)
    source, mountpoint = tmp_path / "source", tmp_path / "mnt"
    source.mkdir()
    mountpoint.mkdir()
    daemon = subprocess.Popen([sys.executable, PASSTHROUGH, str(source), str(mountpoint)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    deadline = time.monotonic() + 20
    while not os.path.ismount(mountpoint) and time.monotonic() < deadline \
            and daemon.poll() is None:
        time.sleep(0.1)
    if not os.path.ismount(mountpoint):
        daemon.kill()
        pytest.skip(f"cannot mount a FUSE file system here: {daemon.communicate()[0][-300:]}")
    try:
        yield source, mountpoint, daemon
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
        subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True)
        daemon.terminate()
        try:
            daemon.wait(timeout=10)
        except subprocess.TimeoutExpired:
            daemon.kill()


def _wait_for_a_logged_step(metrics, job, timeout=240.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics.exists() and metrics.read_text().count("\n") >= 1:
            return
        if job.poll() is not None:
            pytest.fail(f"the job ended before its first logged step: {job.communicate()}")
        time.sleep(0.2)
    pytest.fail("the job logged no step")


def test_a_run_directory_that_stops_answering_still_ends_by_the_stall_abort(
        freezable_mount, tiny_shards, tiny_recipe):
    from hpcdl.debug.stall import STALL_EXIT_CODE

    source, mountpoint, daemon = freezable_mount
    cmd = ["mpiexec", "-n", "2", sys.executable, "-m", "hpcdl.cli.main", "train",
           "--recipe", tiny_recipe, "--data", tiny_shards, "--out", str(mountpoint / "run"),
           "--backend", "shm", "--no-eval", "--checkpoint-every", "0", "epochs=1000"]
    env = {**os.environ, **STALL_ENV}
    env.pop("MPIEXEC_TIMEOUT", None)
    job = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, start_new_session=True)
    try:
        # read through the source, never the mount: the test must not block on it either
        _wait_for_a_logged_step(source / "run" / "metrics.jsonl", job)
        os.kill(daemon.pid, signal.SIGSTOP)
        out, err = job.communicate(timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        out, err = job.communicate()
        pytest.fail(f"the job hung on the frozen file system (killed after {BOUND_S} s):\n"
                    f"{err[-3000:]}")
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == STALL_EXIT_CODE, err[-3000:]
    assert f"stall: aborting the job (MPI_Abort {STALL_EXIT_CODE})" in err, err[-3000:]
    # the ranks hang in their log and metrics writes: named as such, not as a lost peer
    assert "in file system: " in err, err[-3000:]
    assert "did not answer within" in err, err[-3000:]  # the report says why it knows less
