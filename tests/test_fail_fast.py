"""Fail-fast is the default of ``hpcdl.comm.init()``: a user's own script that raises on one
rank ends the whole job, non-zero, with that rank's traceback -- under a real ``mpiexec``.
On every backend, also when the error passes through a teardown that needs the peers (a
``with`` block closing the communicator, ``hpcdl train``'s own ``finally``): the rank prints
its traceback once, naming rank and host, and aborts before that teardown.

Serial tests that launch their own mpiexec (never nested inside an MPI-launched pytest). A job
that hangs is killed by the subprocess timeout and the test fails; there is no timing
assertion beyond that bound."""
import functools
import os
import shutil
import signal
import socket
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


def run_job(tmp_path, ranks: int, fail_fast: str = "on", *args: str, script_text: str = "",
            env: dict | None = None, bound_s: float = HANG_BOUND_S,
            program: list | None = None) -> subprocess.CompletedProcess:
    """Run USER_SCRIPT (or ``script_text``, or ``program``) under mpiexec; a job still running
    after ``bound_s`` is killed (its whole process group) and reported as hung (returncode
    None)."""
    if program is None:
        script = tmp_path / "user_script.py"
        script.write_text(script_text or USER_SCRIPT)
        program = [sys.executable, str(script), fail_fast, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    env.pop("MPIEXEC_TIMEOUT", None)  # the bound here is the test's, not the launcher's
    proc = subprocess.Popen(["mpiexec", "-n", str(ranks), *program], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=bound_s)
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



#: The same loop inside ``with hpcdl.comm.init(BACKEND) as comm``: the error passes through
#: ``close()``, which on ``shm`` frees a shared window and on ``gloo`` barriers -- collectives
#: the other ranks, waiting in the allreduce, never join. ``outside``: rank 1 raises in its
#: main thread between collectives; ``inside``: HPCDL_INJECT makes it raise inside its 4th
#: allreduce call while the others are in that allreduce.
WITH_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    import hpcdl.comm

    backend, where = sys.argv[2], sys.argv[3]
    with hpcdl.comm.init(backend) as comm:
        weights = torch.zeros(8)
        for iteration in range(1, 1000):
            if where == "outside" and comm.rank == 1 and iteration == 3:
                raise RuntimeError(f"user bug on rank {comm.rank} at iteration {iteration}")
            grad = torch.ones(8)
            comm.allreduce_(grad)
            weights -= 0.1 * grad
    print("finished", flush=True)
""")
#: a job ending on an error ends within seconds; this bound only tells "ended" from "hung"
#: (the stall watchdog's own abort comes after 600 s)
ERROR_BOUND_S = 60
BACKENDS = ["mpi", "shm", "ring", "gloo", "ccl"]


@functools.lru_cache(maxsize=1)
def ccl_environment() -> dict | None:
    """The environment tests/ccl_env.sh exports (None: it cannot assemble oneCCL here)."""
    script = os.path.join(os.path.dirname(__file__), "ccl_env.sh")
    try:
        out = subprocess.run(["bash", "-c", f'eval "$(bash {script})" && env -0'],
                             capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return None
    if out.returncode != 0:
        return None
    env = dict(item.split("=", 1) for item in out.stdout.split("\0") if "=" in item)
    return {k: env[k] for k in ("CCL_ROOT", "LD_LIBRARY_PATH", "CPATH") if k in env}


def backend_environment(backend: str) -> dict:
    if backend != "ccl":
        return {}
    env = ccl_environment()
    if env is None:
        pytest.skip("backend ccl: tests/ccl_env.sh cannot assemble oneCCL here")
    return dict(env)  # a copy: the cached one stays as the script exported it


def assert_ended_with_one_traceback(job, ranks: int, message: str) -> None:
    """The job ended (not killed at the bound), non-zero, and rank 1's error is printed exactly
    once, on a line that names rank 1 and this host."""
    assert job.returncode is not None, f"the job hung (killed after {ERROR_BOUND_S} s):\n" \
                                       f"{job.stdout}"
    assert job.returncode != 0, job.stdout
    lines = [line for line in job.stdout.splitlines() if message in line]
    assert len(lines) == 1, job.stdout
    assert lines[0].startswith(f"[rank 1/{ranks} {socket.gethostname()}]"), job.stdout
    assert "aborting the job" in job.stdout and "finished" not in job.stdout


@pytest.mark.parametrize("where", ["outside", "inside"])
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rank_that_raises_inside_a_with_block_ends_the_job_on_every_backend(
        tmp_path, backend, ranks, where):
    env = backend_environment(backend)
    if where == "inside":
        env["HPCDL_INJECT"] = "1:4:raise"
    job = run_job(tmp_path, ranks, "on", backend, where, script_text=WITH_SCRIPT, env=env,
                  bound_s=ERROR_BOUND_S)
    message = "RuntimeError: user bug on rank 1 at iteration 3" if where == "outside" \
        else "InjectedFault: HPCDL_INJECT: rank 1 raises before collective #4"
    assert_ended_with_one_traceback(job, ranks, message)


@pytest.mark.parametrize("backend", ["mpi", "shm", "ring", "gloo", "ccl"])
def test_hpcdl_train_ends_on_one_ranks_error_before_its_teardown(
        tmp_path, tiny_shards, tiny_recipe, backend):
    # Rank 1's main thread raises before the 2nd collective, the initial broadcast of the
    # parameters, while rank 0 is inside it; the command's teardown (closing the trainer and
    # the communicator) would wait for rank 0.
    env = {**backend_environment(backend), "HPCDL_INJECT": "1:2:raise"}
    program = [sys.executable, "-m", "hpcdl.cli.main", "train", "--recipe", tiny_recipe,
               "--data", tiny_shards, "--out", str(tmp_path / "run"), "--backend", backend,
               "--max-steps", "4", "--no-eval"]
    job = run_job(tmp_path, 2, env=env, bound_s=ERROR_BOUND_S, program=program)
    assert_ended_with_one_traceback(
        job, 2, "InjectedFault: HPCDL_INJECT: rank 1 raises before collective #2")
    assert job.returncode == 1, job.stdout  # fail-fast's abort, not the stall watchdog's


@pytest.fixture(scope="module")
def shards_with_one_more_class(tmp_path_factory):
    """Shards of 3 classes x 8 images plus ONE image of a 4th class: under a 3-class model its
    label would be out of range in one rank's forward pass while the other waits in the step's
    allreduce (a user's data bug, as it really happens). The loader's class check now finds it
    before step 1, on every rank alike."""
    from hpcdl.data_prep.shard import shard_tree
    from hpcdl.data_prep.synthetic import make_imagenet_tree

    root = tmp_path_factory.mktemp("bad-label")
    tree = make_imagenet_tree(str(root / "tree"), num_classes=4, train_per_class=8,
                              val_per_class=1, size=(24, 20))
    fourth = tree.classes[-1]
    for key in sorted(k for k in tree.labels if k.startswith(f"train/{fourth}/"))[1:]:
        os.unlink(os.path.join(str(root / "tree"), key))
    shard_tree(str(root / "tree"), str(root / "shards"), shards=2, resize=20)
    return str(root / "shards")


@pytest.mark.parametrize("backend", BACKENDS)
def test_hpcdl_train_ends_on_a_data_error_before_step_1_printing_it_once(
        tmp_path, shards_with_one_more_class, tiny_recipe, backend):
    env = backend_environment(backend)
    program = [sys.executable, "-m", "hpcdl.cli.main", "train", "--recipe", tiny_recipe,
               "--data", shards_with_one_more_class, "--out", str(tmp_path / "run"),
               "--backend", backend, "--no-eval", "epochs=4"]
    job = run_job(tmp_path, 2, env=env, bound_s=ERROR_BOUND_S, program=program)
    assert job.returncode is not None, f"the job hung (killed after {ERROR_BOUND_S} s):\n" \
                                       f"{job.stdout}"
    assert job.returncode == 2, job.stdout  # agreed bad input: every rank exits 2, no abort
    lines = [line for line in job.stdout.splitlines() if "has 4 classes, the recipe's "
             "model.num_classes is 3" in line]
    assert len(lines) == 1, job.stdout
