"""Slurm across the test cluster's hosts: the rendered generic template (`hpcdl slurm render`)
submitted with sbatch -N 2 and -N 3, its shards staged to each host's own /tmp, and a job
requeued onto a different number of hosts that resumes with the same global batch (the
elastic resume, docs/training.md) to the uninterrupted run's step count.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster_hosts import REPO, VENVS, job_field, on_controller, require_mpi, slurm_missing

DEMO_RECIPE = REPO / "recipes" / "demo_fmnist.yaml"
# The demo recipe scaled to tiny data: 180 images in 6 equal shards, so 1, 2 and 3 hosts each
# hold the same number of images per rank and an epoch is 180 // 24 = 7 steps on any of them;
# a global batch that 1, 2 and 3 ranks divide, so a job can resume on another host count.
STEPS = 3 * 7
ELASTIC_STEPS = 20 * 7
OVERRIDES = ("epochs=3", "batch.global=24", "batch.per_rank=null", "train.log_every_steps=1",
             "data.workers=0")
TRAIN_ARGS = ("--deterministic", "--no-eval", "--no-progress")


@pytest.fixture(scope="module")
def slurm(cluster):
    missing = slurm_missing()
    if missing:
        pytest.skip(missing)
    cluster.script("slurm", "up", timeout=120)
    return cluster


@pytest.fixture(scope="module")
def shards(cluster):
    """Real Fashion-MNIST shards on the shared file system: 6 train shards of 30, 1 val."""
    from hpcdl.data_prep.fashion_mnist import write_tree
    from hpcdl.data_prep.shard import shard_tree

    root = cluster.workdir("fmnist")
    write_tree(str(root / "tree"), source="demo", train_per_class=18, val_per_class=2)
    shard_tree(str(root / "tree"), str(root / "shards"), shards=6, val_shards=1, resize=0)
    return root / "shards"


def render(cluster, shards: Path, run_dir: Path, nodes: str, *overrides: str) -> Path:
    script = run_dir.parent / f"{run_dir.name}.sbatch"
    subprocess.run([sys.executable, "-m", "hpcdl.cli.main", "slurm", "render", "--arch",
                    "generic", "--nodes", nodes.split("-")[-1], "--ranks-per-node", "1",
                    "--recipe", str(DEMO_RECIPE), "--data", str(shards), "--out", str(run_dir),
                    "--time", "01:00:00", "--signal-seconds", "120", "--job-name", run_dir.name,
                    "--output", str(script), *(f"--train-arg={a}" for a in TRAIN_ARGS),
                    *OVERRIDES, *overrides], check=True, timeout=300, capture_output=True)
    return script


def log_of(run_dir: Path) -> str:
    return next((run_dir / "logs").glob("slurm-*.out")).read_text()


def staged_on(cluster, host: str, job: str) -> list[str]:
    return cluster.listing(host, f"/tmp/hpcdl-shards-{job} 2>/dev/null || true")


@pytest.fixture(scope="module")
def two_host_run(slurm, shards):
    run_dir = slurm.workdir("run") / "two-hosts"
    script = render(slurm, shards, run_dir, "2")
    done = on_controller(slurm, f"HPCDL_KEEP_LOCAL=1 sbatch --parsable --wait -N 2 {script}",
                         check=False)
    job = done.stdout.strip().split(";")[0]
    return run_dir, job, done


def test_sbatch_N2_trains_one_rank_on_each_host_to_the_end(two_host_run):
    run_dir, _, done = two_host_run
    log = log_of(run_dir)
    assert done.returncode == 0, log
    assert re.search(r"restart 0 on h\[1-2\]: 2 node\(s\) x 1 rank", log), log
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["ranks"], summary["steps"], summary["stopped"]) == (2, STEPS, "completed")
    # doctor's table under srun names one host per rank.
    assert re.search(r"^0/2 +h1 ", log, re.M) and re.search(r"^1/2 +h2 ", log, re.M), log


def test_each_host_staged_only_its_own_shards_into_its_own_tmp(slurm, two_host_run, shards):
    _, job, done = two_host_run
    assert done.returncode == 0
    manifest = json.loads((shards / "manifest.json").read_text())
    expected = {f"h{k + 1}": sorted(e["name"] for e in manifest["shards"] if e["index"] % 2 == k)
                for k in range(2)}
    for host, names in expected.items():
        assert [f for f in staged_on(slurm, host, job) if f.endswith(".h5")] == names
    assert staged_on(slurm, "h3", job) == []  # not in the allocation
    for host in ("h1", "h2"):
        slurm.run(host, f"rm -rf /tmp/hpcdl-shards-{job}", check=True)


def test_a_host_without_its_shards_fails_before_the_first_step_naming_the_host(slurm, shards):
    """`hpcdl prep stage` across h1 and h2 (mpiexec, one rank per host), then h2's copy lost:
    `hpcdl train` stops with one line naming h2 and its directory, exit 2, no step taken."""
    local = "/tmp/hpcdl-stage-test"
    stage = slurm.mpirun("mpich", ["h1", "h2"], 1,
                         f"hpcdl prep stage --shards {shards} --to {local}", check=False)
    assert stage.returncode == 0, stage.stdout + stage.stderr
    assert slurm.listing("h1", local) != slurm.listing("h2", local)  # each its own shards
    slurm.run("h2", f"rm -rf {local}", check=True)
    out = slurm.workdir("missing") / "run"
    done = slurm.mpirun("mpich", ["h1", "h2"], 1,
                        f"hpcdl train --recipe {DEMO_RECIPE} --data {local} --out {out} "
                        f"--no-eval --no-progress {' '.join(OVERRIDES)}", check=False)
    slurm.run("h1", f"rm -rf {local}", check=True)
    text = done.stdout + done.stderr
    assert done.returncode == 2, text[-3000:]
    assert [line for line in text.splitlines() if "h2" in line and local in line], text[-3000:]
    metrics = out / "metrics.jsonl"
    assert not metrics.exists() or '"step"' not in metrics.read_text()


def wait_until(predicate, what: str, limit: float = 300.0) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(1)
    raise AssertionError(f"timed out after {limit:.0f} s waiting for {what}")


def test_requeued_onto_two_hosts_then_three_resumes_to_the_same_step_count(slurm, shards):
    """3 hosts -> checkpoint + requeue, h3 drained, the pending job shrunk to 2 nodes (what
    Slurm does to a requeued job whose nodes are gone, by hand) -> 2 hosts -> requeue, h3
    back -> 3 hosts: the same global batch throughout, the uninterrupted step count at the end."""
    run_dir = slurm.workdir("run") / "elastic"
    # 20 epochs: on a quiet machine the demo's 21 steps end before a USR1 can land.
    script = render(slurm, shards, run_dir, "3", f"epochs={ELASTIC_STEPS // 7}")
    job = on_controller(slurm, f"HPCDL_DOCTOR=0 sbatch --parsable {script}"
                        ).stdout.strip().split(";")[0]
    metrics = run_dir / "metrics.jsonl"

    def steps_logged() -> int:
        return metrics.read_text().count('"step"') if metrics.exists() else 0

    def state() -> str:
        return job_field(slurm, job, "JobState")

    def requeue_at(step: int, restarts: str) -> None:
        wait_until(lambda: steps_logged() >= step, f"step {step}")
        on_controller(slurm, f"scancel --signal=USR1 --batch {job}")
        wait_until(lambda: job_field(slurm, job, "Restarts") == restarts and
                   state() == "PENDING", "the job to requeue itself")
        # A new step whose socket the old step's daemon still cleans up fails its PMI-2
        # exchange: start again only once every host's old steps are gone.
        wait_until(lambda: not list(slurm.directory.glob(f"run/slurmd-h*/*_{job}.*")),
                   "the old steps to end")

    def start_on(nodes: int) -> None:
        # One task per node: the task count goes with the node count, or Slurm keeps both.
        on_controller(slurm, f"scontrol update jobid={job} NumNodes={nodes} NumTasks={nodes}")
        on_controller(slurm, f"scontrol update jobid={job} StartTime=now")
        wait_until(lambda: state() == "RUNNING", f"{nodes} hosts")

    try:
        wait_until(lambda: state() == "RUNNING", "3 hosts")
        requeue_at(4, "1")
        on_controller(slurm, "scontrol update nodename=h3 state=drain reason=test")
        start_on(2)
        requeue_at(steps_logged() + 3, "2")
        on_controller(slurm, "scontrol update nodename=h3 state=resume")
        start_on(3)
        wait_until(lambda: state() in ("COMPLETED", "FAILED", "CANCELLED"), "the end")
    finally:
        on_controller(slurm, "scontrol update nodename=h3 state=resume", check=False)
    log = log_of(run_dir)
    assert state() == "COMPLETED", log
    starts = re.findall(r"restart (\d) on (\S+): (\d) node", log)
    assert [(r, n) for r, _, n in starts] == [("0", "3"), ("1", "2"), ("2", "3")], log
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == ELASTIC_STEPS and summary["ranks"] == 3, summary


@pytest.mark.parametrize("mpi", ["impi", "openmpi"])
def test_template_trains_across_hosts_under_each_mpis_launcher(slurm, shards, mpi):
    """`--mpi impi|openmpi`: the template picks srun --mpi=pmi2 (Intel MPI, with Slurm's
    libpmi2.so) or srun --mpi=pmix (Open MPI); the job runs from that MPI's venv, one rank on
    each of 2 hosts, and trains to the end."""
    require_mpi(mpi)
    venv = VENVS / mpi
    run_dir = slurm.workdir("run") / f"two-hosts-{mpi}"
    script = render(slurm, shards, run_dir, "2", "epochs=1", "--mpi", mpi)
    network = {"impi": "I_MPI_FABRICS=shm:ofi FI_PROVIDER=tcp FI_TCP_IFACE=eth0",
               "openmpi": "OMPI_MCA_btl_tcp_if_include=eth0 OMPI_MCA_oob_tcp_if_include=eth0"}
    done = on_controller(slurm, f"PATH={venv / 'bin'}:$PATH VIRTUAL_ENV={venv} {network[mpi]} "
                                f"HPCDL_DOCTOR=0 sbatch --parsable --wait -N 2 {script}",
                         check=False)
    log = log_of(run_dir)
    assert done.returncode == 0, log[-4000:]
    launcher = {"impi": "srun-pmi2", "openmpi": "srun-pmix"}[mpi]
    assert f"MPI {mpi}, launcher {launcher}" in log
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["ranks"], summary["steps"]) == (2, 7), summary
    assert "[rank 1/2 h2]" in (run_dir / "logs" / "rank-0001.log").read_text()


# MPICH's PMI client prints each request it sends under PMI_DEBUG=1.
PMI_PUT = re.compile(r"send to fd=\d+ pmi: (cmd=put kvsname=\S+ key=\S+ value=)(\S*)")
HELLO = {
    "plain": "from mpi4py import MPI\n",
    "hpcdl": "from hpcdl.debug import import_mpi_within_bound\nMPI = import_mpi_within_bound()\n",
}
SAY_HELLO = "print(f'hello rank {MPI.COMM_WORLD.rank} of {MPI.COMM_WORLD.size}', flush=True)\n"


def longest_possible_put(stderr: str) -> int:
    """The longest PMI-1 put line the published values' byte counts allow: MPICH shortens runs
    of zero bytes ("[n]"), so the same value without zeros is two characters a byte."""
    longest = 0
    for prefix, value in PMI_PUT.findall(stderr):
        tokens = re.findall(r"\[(\d+)\]|([0-9A-F]{2})", value)
        raw = sum(int(run) if run else 1 for run, _ in tokens)
        longest = max(longest, len(prefix) + max(len(value), 2 * raw) + 1)
    return longest


def test_mpich_pmi_requests_fit_one_slurm_read_under_srun_pmi2(slurm):
    """Slurm's pmi2 plugin takes a PMI-1 request in one 1,024-byte read, and a longer one is
    cut (MPI_Init then hangs). hpcdl's ranks, one on each host, publish what fits whatever
    its bytes; plain mpi4py on MPICH's default UCX module does not, which this test can see."""
    from hpcdl.mpi_library import SLURM_PMI1_READ_BYTES, loaded_library

    if loaded_library(initialize=False).flavor != "mpich":
        pytest.skip("the PMI-1 client under srun --mpi=pmi2 is MPICH's")
    workdir = slurm.workdir("pmi")
    longest = {}
    for name, start in HELLO.items():
        (workdir / f"{name}_hello.py").write_text(start + SAY_HELLO)
        done = on_controller(slurm, f"cd {workdir} && PMI_DEBUG=1 srun --mpi=pmi2 -N 2 -n 2 "
                             f"{sys.executable} {name}_hello.py", timeout=300, check=False)
        said = sorted(re.findall(r"hello rank (\d) of (\d)", done.stdout))
        assert done.returncode == 0 and said == [("0", "2"), ("1", "2")], done.stderr[-3000:]
        longest[name] = longest_possible_put(done.stderr)
    assert longest["hpcdl"] <= SLURM_PMI1_READ_BYTES < longest["plain"], longest
