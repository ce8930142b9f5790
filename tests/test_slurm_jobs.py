"""Real Slurm jobs on a single-node cluster started for this module (tests/slurm/cluster.sh).

The cluster runs as root with every file in a private temporary directory; tests skip, with the
reason, only where it cannot exist at all (Slurm or munge not installed, not root). On CI both
hold (.ci/run installs the packages), so these tests run there.
"""
from __future__ import annotations

import ctypes.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from hpcdl.slurm.render import JobSpec, render_job

HERE = Path(__file__).resolve().parent
CLUSTER = HERE / "slurm" / "cluster.sh"
DEMO_RECIPE = HERE.parent / "recipes" / "demo_fmnist.yaml"

pytestmark = pytest.mark.slurm

HELLO = """\
from mpi4py import MPI
comm = MPI.COMM_WORLD
print(f"hello rank {comm.rank} of {comm.size}", flush=True)
"""


def _why_no_slurm() -> str | None:
    missing = [b for b in ("munged", "slurmctld", "slurmd", "sbatch", "scontrol")
               if shutil.which(b) is None]
    if missing:
        return f"Slurm/munge not installed ({', '.join(missing)} missing; apt-get install " \
               f"munge slurmctld slurmd slurm-client)"
    if os.geteuid() != 0:
        return "the test cluster's slurmd must run as root"
    return None


@pytest.fixture(scope="module")
def workdir():
    """Our own temporary directory: pytest's numbered ones are pruned by any other pytest
    session of the same user, which would delete the cluster's state under a running job."""
    directory = Path(tempfile.mkdtemp(prefix="hpcdl-slurm-test-"))
    yield directory
    if os.environ.get("HPCDL_SLURM_TEST_KEEP"):  # to read the job logs after a failure
        print(f"kept {directory}")
    else:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(workdir):
    reason = _why_no_slurm()
    if reason:
        pytest.skip(reason)
    directory = workdir / "cluster"
    started = subprocess.run([str(CLUSTER), "start", str(directory)], capture_output=True,
                             text=True, timeout=120)
    try:
        assert started.returncode == 0, f"cluster.sh start failed:\n{started.stderr}"
        previous = os.environ.get("SLURM_CONF")
        os.environ["SLURM_CONF"] = str(directory / "slurm.conf")
        yield directory
    finally:
        subprocess.run([str(CLUSTER), "stop", str(directory)], timeout=120)
        if started.returncode == 0:
            if previous is None:
                os.environ.pop("SLURM_CONF", None)
            else:
                os.environ["SLURM_CONF"] = previous


def sbatch(script: Path, *options: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["sbatch", "--parsable", *options, str(script)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, **(env or {})})


def job_field(job: str, name: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True,
                         text=True, check=True).stdout
    match = re.search(rf"\b{name}=(\S*)", out)
    return match.group(1) if match else ""


def wait_until(predicate, what: str, limit: float = 120.0):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {limit:.0f} s waiting for {what}")


@pytest.fixture(scope="module")
def shards(workdir):
    """Tiny real Fashion-MNIST shards (160 train images in 2 shards, 20 val in 1)."""
    from hpcdl.data_prep.fashion_mnist import write_tree
    from hpcdl.data_prep.shard import shard_tree

    root = workdir / "fmnist"
    write_tree(str(root / "tree"), source="demo", train_per_class=16, val_per_class=2)
    shard_tree(str(root / "tree"), str(root / "shards"), shards=2, val_shards=1, resize=0)
    return root / "shards"


@pytest.fixture(scope="module")
def recipe(workdir):
    """The demo recipe as it is now: every job of the module reads the same copy."""
    copy = workdir / DEMO_RECIPE.name
    shutil.copyfile(DEMO_RECIPE, copy)
    return copy


# The demo recipe scaled to the tiny data: 160 images / 32 = 5 steps an epoch, 5 epochs, no
# evaluation, bit-for-bit repeatable so that a resumed run can be compared with an
# uninterrupted one.
STEPS = 25
OVERRIDES = ("epochs=5", "batch.global=32", "batch.per_rank=16", "train.log_every_steps=1")
TRAIN_ARGS = ("--deterministic", "--no-eval", "--no-progress")


def render_demo(recipe: Path, shards: Path, run_dir: Path, *options: str,
                overrides: tuple[str, ...] = ()) -> Path:
    """`hpcdl slurm render` of the generic template: one node, 2 ranks (this VM has 1 socket).
    ``options`` go to render, ``overrides`` after the module's OVERRIDES (the last one wins)."""
    script = run_dir.parent / f"{run_dir.name}.sbatch"
    subprocess.run([sys.executable, "-m", "hpcdl.cli.main", "slurm", "render", "--arch",
                    "generic", "--nodes", "1", "--ranks-per-node", "2", "--recipe",
                    str(recipe), "--data", str(shards), "--out", str(run_dir), "--time",
                    "01:00:00", "--signal-seconds", "120", "--job-name", run_dir.name,
                    "--output", str(script), *(f"--train-arg={a}" for a in TRAIN_ARGS),
                    *options, *OVERRIDES, *overrides], check=True, timeout=300)
    return script


def job_env(workdir: Path, **extra: str) -> dict[str, str]:
    """Node-local staging inside the test's directory (job ids restart with each cluster)."""
    return {"HPCDL_LOCAL_DIR": str(workdir / "local"), **extra}


def read_log(run_dir: Path) -> str:
    return next((run_dir / "logs").glob("slurm-*.out")).read_text()


def test_mpi_hello_sees_two_ranks_under_srun_pmi2_and_mpiexec(cluster, workdir):
    (workdir / "hello.py").write_text(HELLO)
    script = workdir / "hello.sbatch"
    script.write_text(f"""#!/bin/bash
#SBATCH --nodes=1 --ntasks=2 --output={workdir}/hello-%j.out
cd {workdir}
echo "== srun"; srun --mpi=pmi2 {sys.executable} hello.py
echo "== mpiexec"; mpiexec -n 2 {sys.executable} hello.py
""")
    result = sbatch(script, "--wait")
    assert result.returncode == 0, result.stderr
    log = next(workdir.glob("hello-*.out")).read_text()
    srun_part, mpiexec_part = log.split("== mpiexec")
    for part in (srun_part, mpiexec_part):
        # srun --mpi=none would print "rank 0 of 1" twice and still exit 0.
        assert sorted(re.findall(r"hello rank (\d) of (\d)", part)) == [("0", "2"), ("1", "2")]


def test_sbatch_reads_hostile_names_and_paths_as_plain_strings(cluster, recipe, shards,
                                                               workdir):
    evil = "x $(touch PWNED1) `touch PWNED2`; touch PWNED3 'q' \"d\" %j"
    run_dir = workdir / evil.replace("%", "")  # % is refused in a run directory
    script = workdir / "evil.sbatch"
    rendered = render_job(JobSpec(arch="generic", nodes=1, ranks_per_node=2, recipe=str(recipe),
                                  data=str(shards), out=str(run_dir), job_name=evil,
                                  partition="debug", overrides=list(OVERRIDES)))
    script.write_text(rendered.script)
    (run_dir / "logs").mkdir(parents=True)
    submitted = sbatch(script, "--hold")  # parsed and queued, never started
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    try:
        shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True,
                               check=True).stdout
    finally:
        subprocess.run(["scancel", job], check=True)
    assert f"JobName={evil}\n" in shown
    assert f"StdOut={run_dir}/logs/slurm-{job}.out\n" in shown
    assert not list(workdir.rglob("PWNED*"))


@pytest.fixture(scope="module")
def uninterrupted_run(cluster, recipe, shards, workdir):
    """The demo trained to the end in one job (doctor, staging, 2 ranks): the reference."""
    run_dir = workdir / "run-once"
    result = sbatch(render_demo(recipe, shards, run_dir), "--wait", env=job_env(workdir))
    return run_dir, result


def test_generic_template_trains_two_ranks_to_the_end(uninterrupted_run, workdir):
    run_dir, result = uninterrupted_run
    log = read_log(run_dir)
    assert result.returncode == 0, log
    assert "doctor: srun --mpi=pmi2" in log
    assert "MPI mpich, launcher srun-pmi2" in log  # --mpi auto: asked mpi4py at run time
    assert re.search(r"^0/2 .*\n1/2 ", log, re.M)  # doctor's table: one row per rank
    assert "node 0/1: copied 3" in log  # 2 train + 1 val shard staged to node-local disk
    assert "--data " + str(workdir / "local" / "hpcdl-shards-") in log
    assert "training finished with exit code 0" in log
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["ranks"], summary["steps"], summary["stopped"]) == (2, STEPS, "completed")
    assert not list((workdir / "local").iterdir())  # local shards removed after the run


def test_time_limit_signal_checkpoints_requeues_and_resumes(cluster, uninterrupted_run, recipe,
                                                           shards, workdir):
    run_dir = workdir / "run-requeue"
    # The tiny run trains its 25 steps in well under a second, faster than the poll below
    # sees step 2 where bf16 is native: rank 0's first checkpoint write (step 5) pauses, so
    # the signal lands mid-run (a pause changes no number: the run stays bit-comparable).
    submitted = sbatch(render_demo(recipe, shards, run_dir),
                       env=job_env(workdir, HPCDL_DOCTOR="0",
                                   HPCDL_INJECT="0:checkpoint1:sleep=8"))
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    metrics = run_dir / "metrics.jsonl"
    wait_until(lambda: metrics.exists() and '"step": 2,' in metrics.read_text(),
               "the first training steps", limit=300)
    # --signal=B:USR1@T can come much earlier than T on short jobs; deliver it ourselves.
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True)
    wait_until(lambda: job_field(job, "Restarts") == "1" and
               job_field(job, "JobState") == "PENDING", "the job to requeue itself")
    # A requeued job waits ~120 s (BeginTime) before it may start again. Start it now, but
    # only once the first run's step daemons are gone: a new step 1 whose socket the old
    # step 1 still cleans up fails its PMI-2 exchange ("failed to send temp kvs").
    wait_until(lambda: not list(cluster.glob(f"spool/*/*_{job}.*")), "the old steps to end")
    subprocess.run(["scontrol", "update", f"jobid={job}", "StartTime=now"], check=True)
    wait_until(lambda: job_field(job, "JobState") in ("COMPLETED", "FAILED", "CANCELLED"),
               "the resumed job to finish", limit=300)
    log = read_log(run_dir)
    assert job_field(job, "JobState") == "COMPLETED", log
    assert "restart 0 " in log and "restart 1 " in log  # one log holds both runs (append)
    assert "checkpoint written; requeueing job" in log
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from"], log
    reference = json.loads((uninterrupted_run[0] / "summary.json").read_text())
    assert summary["steps"] == reference["steps"] == STEPS
    assert summary["params_sha256"] == reference["params_sha256"]


# ---- the MPI matrix under Slurm (docs/mpi.md) ------------------------------------------------
# Intel MPI and Open MPI each run from their own venv (tests/mpi_env.sh). tests/run.sh builds them
# while the other tests run, then runs these (marker mpi_matrix) with HPCDL_REQUIRE_MPI_MATRIX=1,
# so that a missing venv fails there instead of skipping.
# MPICH is this interpreter's own MPI: the tests above.
MPI_VENVS = Path(os.environ.get("HPCDL_MPI_VENVS") or HERE.parent / ".mpi-venvs")
# What each needs on one node, as in tests/mpi_exec.sh: Intel MPI's shared-memory fabric only,
# and Open MPI's mpirun refuses root unless told twice.
ONE_NODE_ENV = {"impi": {"I_MPI_FABRICS": "shm"},
                "openmpi": {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}}
SRUN_PMI = {"impi": "pmi2", "openmpi": "pmix"}
LIBRARY = {"impi": "Intel MPI 2021.18", "openmpi": "Open MPI 5."}


def mpi_venv_env(mpi: str) -> dict[str, str]:
    """The job environment that puts ``mpi``'s venv first on PATH."""
    venv = MPI_VENVS / mpi
    if not (venv / "bin" / "hpcdl").exists():
        why = f"no {mpi} venv at {venv}: build it with tests/mpi_env.sh {mpi}"
        if os.environ.get("HPCDL_REQUIRE_MPI_MATRIX") == "1":
            pytest.fail(why)
        pytest.skip(why)
    return {"PATH": f"{venv / 'bin'}:{os.environ['PATH']}", "VIRTUAL_ENV": str(venv),
            **ONE_NODE_ENV[mpi]}


# The PMI library each needs from the system under srun. Slurm's own pmi2 plugin serves MPICH
# (whose wheel carries its own PMI-2 client), but Intel MPI loads Slurm's client library
# libpmi2.so (I_MPI_PMI_LIBRARY, found with ldconfig as the job script does), and Slurm's
# mpi/pmix plugin dlopen()s the unversioned libpmix.so from the PMIx directory it was built
# with: only the -dev package ships that name (Debian: libpmi2-0, libpmix-dev; .ci/run and
# the README list them). Without them the job fails after minutes with a PMI error.
SLURM_PLUGIN_DIRS = ("/usr/lib/x86_64-linux-gnu/slurm-wlm", "/usr/lib/aarch64-linux-gnu/slurm-wlm",
                     "/usr/lib64/slurm", "/usr/lib/slurm", "/usr/local/lib/slurm")


def slurm_pmix_library_paths() -> list[Path]:
    """Where Slurm's mpi/pmix plugin opens libpmix.so: ``DIR/libpmix.so`` for the directory
    compiled into the plugin, else the bare name (the loader's search path)."""
    paths = []
    for plugin_dir in SLURM_PLUGIN_DIRS:
        for plugin in sorted(Path(plugin_dir).glob("mpi_pmix*.so")):
            for directory in re.findall(rb"\x00(/[\w./+-]*pmix[\w./+-]*)\x00",
                                        plugin.read_bytes()):
                paths.append(Path(directory.decode()) / "libpmix.so")
    return list(dict.fromkeys(paths))  # mpi_pmix.so is often a link to mpi_pmix_v4.so


def why_no_pmi_library(mpi: str) -> str | None:
    """A line naming the system library ``mpi`` needs under srun when it is absent."""
    if mpi == "impi" and ctypes.util.find_library("pmi2") is None:
        return ("libpmi2.so not found (ldconfig -p): Intel MPI under srun --mpi=pmi2 loads "
                "Slurm's PMI-2 client; apt-get install libpmi2-0")
    if mpi == "openmpi":
        candidates = slurm_pmix_library_paths()
        if candidates and not any(path.exists() for path in candidates):
            return (f"{' or '.join(map(str, candidates))} missing: Slurm's mpi/pmix plugin opens "
                    "it for srun --mpi=pmix; apt-get install libpmix-dev")
        if not candidates and not _loadable("libpmix.so"):
            return ("libpmix.so not loadable: Slurm's mpi/pmix plugin opens it for "
                    "srun --mpi=pmix; apt-get install libpmix-dev")
    return None


def _loadable(library: str) -> bool:
    try:
        ctypes.CDLL(library)
    except OSError:
        return False
    return True


@pytest.fixture
def pmi_library(mpi):
    reason = why_no_pmi_library(mpi)
    if reason:
        pytest.skip(reason)


@pytest.mark.mpi_matrix
@pytest.mark.parametrize("mpi", ["impi", "openmpi"])
def test_mpi_hello_sees_two_ranks_under_srun_and_its_own_mpiexec(cluster, pmi_library, workdir,
                                                                 mpi):
    env = mpi_venv_env(mpi)
    (workdir / "hello.py").write_text(HELLO)
    script = workdir / f"hello-{mpi}.sbatch"
    oversubscribe = "--oversubscribe" if mpi == "openmpi" else ""
    # `import hpcdl` first, as every hpcdl command does: it points Intel MPI at its tuning files
    # (I_MPI_ROOT), without which MPI_Init spins forever under srun.
    script.write_text(f"""#!/bin/bash
#SBATCH --nodes=1 --ntasks=2 --output={workdir}/hello-{mpi}-%j.out
cd {workdir}
export I_MPI_PMI_LIBRARY=$(ldconfig -p | awk '/libpmi2\\.so/ {{print $NF; exit}}')
echo "== srun"; srun --mpi={SRUN_PMI[mpi]} python -c 'import hpcdl; exec(open("hello.py").read())'
echo "== mpiexec"; unset I_MPI_PMI_LIBRARY; mpiexec {oversubscribe} -n 2 python hello.py
""")
    result = sbatch(script, "--wait", env=env)
    log = next(workdir.glob(f"hello-{mpi}-*.out")).read_text()
    assert result.returncode == 0, log
    srun_part, mpiexec_part = log.split("== mpiexec")
    for part in (srun_part, mpiexec_part):
        ranks = sorted(re.findall(r"hello rank (\d) of (\d)", part))
        assert ranks == [("0", "2"), ("1", "2")], log


@pytest.mark.mpi_matrix
@pytest.mark.parametrize("mpi", ["impi", "openmpi"])
def test_generic_template_trains_under_each_mpi_with_its_launcher(cluster, pmi_library, recipe,
                                                                 shards, workdir, mpi):
    env = mpi_venv_env(mpi)
    run_dir = workdir / f"run-{mpi}"
    script = render_demo(recipe, shards, run_dir, "--mpi", mpi, overrides=("epochs=1",))
    result = sbatch(script, "--wait", env={**job_env(workdir), **env})
    log = read_log(run_dir)
    assert result.returncode == 0, log
    assert f"MPI {mpi}, launcher srun-{SRUN_PMI[mpi]}" in log
    assert f"train: srun --mpi={SRUN_PMI[mpi]}" in log
    if mpi == "impi":  # found in Debian's libpmi2-0 (.ci/run installs it), not given
        assert "I_MPI_PMI_LIBRARY=/" in log
    assert re.search(rf"^mpi_name +{re.escape(LIBRARY[mpi])}", log, re.M), log  # doctor
    assert re.search(r"^0/2 .*\n1/2 ", log, re.M)  # doctor's table: both ranks in one world
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["ranks"], summary["steps"], summary["stopped"]) == (2, 5, "completed")
