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


def run_within_bound(cmd: list[str], env: dict[str, str], cwd=None) -> tuple[int, str]:
    """(exit code, output) of ``cmd``; a job still running after BOUND_S fails the test."""
    job = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = job.communicate(timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        pytest.fail(f"{' '.join(cmd)}: start-up hung (killed after {BOUND_S} s, no bound): "
                    f"{job.communicate()[0]}")
    return job.returncode, out


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec")
@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_a_rank_held_at_start_up_ends_the_job_saying_what_to_try(tmp_path, backend):
    script = tmp_path / "start.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HPCDL_STARTUP_TIMEOUT_S": "5",
           "HPCDL_INJECT": "1:startup:sleep=600"}
    env.pop("MPIEXEC_TIMEOUT", None)
    code, out = run_within_bound(["mpiexec", "-n", "2", sys.executable, str(script), backend],
                                 env)
    assert code == STALL_EXIT_CODE, out
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


# ---- every command's MPI_Init, under a PMI server that never answers ----------------------
# MPICH's simple PMI client (what Hydra's mpiexec gives every rank) connects to PMI_PORT at
# MPI_Init and waits for the server's reply: a socket that listens and never answers holds
# MPI_Init for real, as a launcher whose PMI exchange never completes does.

def _mpich() -> bool:
    from hpcdl.mpi_library import loaded_library

    try:
        return loaded_library(initialize=False).flavor == "mpich"
    except Exception:  # noqa: BLE001 - no MPI library to ask: not this test's machine
        return False


@pytest.fixture
def silent_pmi():
    """Environment for one rank whose PMI server accepts the connection and never answers."""
    import socket

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(4)
        port = server.getsockname()[1]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HPCDL_STARTUP_TIMEOUT_S": "3",
               "PMI_PORT": f"127.0.0.1:{port}", "PMI_ID": "1", "PMI_RANK": "1", "PMI_SIZE": "2"}
        for var in ("PMI_FD", "HPCDL_INJECT", "MPIEXEC_TIMEOUT"):
            env.pop(var, None)
        yield env


def _hpcdl(argv: list[str], env: dict[str, str], cwd) -> subprocess.CompletedProcess:
    code, out = run_within_bound([sys.executable, "-m", "hpcdl.cli.main", *argv], env, cwd)
    return subprocess.CompletedProcess(argv, code, out)


@pytest.mark.skipif(not _mpich(), reason="needs MPICH's simple PMI client (PMI_PORT)")
@pytest.mark.parametrize("argv", [
    ["demo", "--max-steps", "1"],
    ["bench", "allreduce", "--sizes", "1K", "--backends", "mpi", "--only-listed"],
    ["prep", "shard", "--src", "tree", "--out", "shards", "--shards", "1"],
    ["doctor"],
], ids=["demo", "bench", "prep", "doctor"])
def test_a_command_whose_mpi_init_never_ends_ends_within_the_bound(tmp_path, silent_pmi, argv):
    result = _hpcdl(argv, silent_pmi, tmp_path)
    assert result.returncode == STALL_EXIT_CODE, result.stdout
    line = next((ln for ln in result.stdout.splitlines() if ln.startswith("[rank 1 ")), "")
    assert "start-up did not end within HPCDL_STARTUP_TIMEOUT_S=3 s: stuck in MPI_Init" in line, \
        result.stdout
    assert "srun --mpi=pmi2" in line, line


@pytest.mark.skipif(not _mpich(), reason="needs MPICH's simple PMI client (PMI_PORT)")
def test_a_command_without_mpi_does_not_start_it(tmp_path, silent_pmi):
    # the same silent PMI: a command that initialised MPI would be held, then ended (exit 4)
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("no generated block here\n")
    result = _hpcdl(["bench", "report", "--docs", "--check", "--root", str(tmp_path)],
                    silent_pmi, tmp_path)
    assert result.returncode == 0, result.stdout
    assert "0 block(s) differ" in result.stdout
