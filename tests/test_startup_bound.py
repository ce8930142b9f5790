"""Start-up has a bound: a rank held before its communicator exists (a launcher's PMI that never
answers, a shared window or oneCCL's init that never returns) ends the job within
``HPCDL_STARTUP_TIMEOUT_S``, saying where it was stuck and what to try -- under a real
``mpiexec``, with the hold rehearsed by ``HPCDL_INJECT=RANK:startup:sleep=S``. A job still
running at the subprocess bound fails the test (no timing assertion beyond it)."""
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest

from hpcdl.debug.stall import STALL_EXIT_CODE
from hpcdl.debug.startup import startup_timeout_s
from hpcdl.errors import BadInputError

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    import hpcdl.comm

    comm = hpcdl.comm.init(sys.argv[1])
    comm.allreduce_(torch.ones(4))
    print("started", flush=True)
""")
BOUND_S = 90


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec")
@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_a_rank_held_at_start_up_ends_the_job_saying_what_to_try(tmp_path, backend):
    script = tmp_path / "start.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HPCDL_STARTUP_TIMEOUT_S": "5",
           "HPCDL_INJECT": "1:startup:sleep=600"}
    env.pop("MPIEXEC_TIMEOUT", None)
    job = subprocess.Popen(["mpiexec", "-n", "2", sys.executable, str(script), backend],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    try:
        out, _ = job.communicate(timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        pytest.fail(f"start-up hung (killed after {BOUND_S} s): {job.communicate()[0]}")
    assert job.returncode == STALL_EXIT_CODE, out
    assert "started" not in out
    line = next((ln for ln in out.splitlines() if ln.startswith("[rank 1 ")), "")
    assert "start-up did not end within HPCDL_STARTUP_TIMEOUT_S=5 s: stuck in creating the " \
           f"'{backend}' communicator" in line, out
    assert "srun --mpi=pmi2" in line and "mpirun" in line, line


def test_the_start_up_bound_reads_its_variable(monkeypatch):
    assert startup_timeout_s({}) == 300.0  # the documented default (hpcdl/env.py)
    assert startup_timeout_s({"HPCDL_STARTUP_TIMEOUT_S": "0"}) == 0.0
    with pytest.raises(BadInputError,
                       match="HPCDL_STARTUP_TIMEOUT_S='soon': expected a number of seconds"):
        startup_timeout_s({"HPCDL_STARTUP_TIMEOUT_S": "soon"})
