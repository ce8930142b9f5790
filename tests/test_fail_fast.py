"""Fail-fast is the default of ``hpcdl.comm.init()``: a user's own script that raises on one
rank ends the whole job, non-zero, with that rank's traceback -- under a real ``mpiexec``.

Serial tests that launch their own mpiexec (never nested inside an MPI-launched pytest). A job
that hangs is killed by the subprocess timeout and the test fails; there is no timing
assertion beyond that bound."""
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec")

#: A training-like loop of the user's own: rank 1 raises at iteration 3 while the other ranks
#: are already inside that iteration's allreduce.
USER_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    import hpcdl.comm

    comm = hpcdl.comm.init("mpi", fail_fast=sys.argv[1] == "on")
    weights = torch.zeros(8)
    for iteration in range(1, 1000):
        if comm.rank == 1 and iteration == 3:
            raise RuntimeError(f"user bug on rank {comm.rank} at iteration {iteration}")
        grad = torch.ones(8)
        comm.allreduce_(grad)
        weights -= 0.1 * grad
    print("finished", flush=True)
""")
HANG_BOUND_S = 120


def run_job(tmp_path, ranks: int, fail_fast: str = "on") -> subprocess.CompletedProcess:
    """Run USER_SCRIPT under mpiexec; a job still running after HANG_BOUND_S is killed (its
    whole process group) and reported as hung (returncode None)."""
    script = tmp_path / "user_script.py"
    script.write_text(USER_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("MPIEXEC_TIMEOUT", None)  # the bound here is the test's, not the launcher's
    proc = subprocess.Popen(["mpiexec", "-n", str(ranks), sys.executable, str(script),
                             fail_fast], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=HANG_BOUND_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return subprocess.CompletedProcess(proc.args, None, out)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out)


@pytest.mark.parametrize("ranks", [2, 3])
def test_a_rank_that_raises_ends_the_whole_job_with_its_traceback(tmp_path, ranks):
    job = run_job(tmp_path, ranks)
    assert job.returncode is not None, f"the job hung (killed after {HANG_BOUND_S} s):\n" \
                                       f"{job.stdout}"
    assert job.returncode != 0, job.stdout
    # rank 1's traceback, every line prefixed with its rank, and the abort that ended the rest
    assert f"[rank 1/{ranks} " in job.stdout, job.stdout
    assert "uncaught RuntimeError in thread MainThread; aborting the job" in job.stdout
    assert "RuntimeError: user bug on rank 1 at iteration 3" in job.stdout
    assert "user_script.py" in job.stdout and "finished" not in job.stdout

