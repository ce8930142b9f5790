"""A scale rehearsal on the test cluster: many MPICH ranks across 4 hosts, a tiny model and the
default backend (``auto``: shared memory inside a host, since every host runs several ranks).

- One rank (the last, on the last host) raises before a collective in training while the
  others wait in it: the job ends, non-zero, with that rank's error printed once, on a line
  naming the rank and its host, and no rank is left on any host.
- SIGUSR1 sent to every rank separately, each at its own random moment (skew 0-2 s), as srun
  delivers Slurm's time-limit signal: every rank stops at the same step, that step has exactly
  one checkpoint, the launch exits 75 (what slurm/job_body.sh requeues on), and `--resume auto`
  ends with the parameters of an uninterrupted run.
- Each rank's private memory (Private_Clean + Private_Dirty of /proc/PID/smaps_rollup, what
  P ranks on a host cost beyond the shared library pages) is measured mid-training.

Ranks: 4 hosts x HPCDL_SCALE_PER_HOST (default 2: 8 ranks, the CI size); the documented large
run (docs/scaling.md, "Scale rehearsal: many ranks across hosts") sets
HPCDL_SCALE_PER_HOST=8 (32 ranks) and
HPCDL_SCALE_RESULT=docs/results/scale-rehearsal-32-2026-12-02.json. The hosts are made again
as 4 for this module and as the session's 3 afterwards.
"""
from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster_hosts import REPO, SCRIPT, launcher_env, make_the_hosts_again
from test_faults import assert_no_rank_left, is_rank, processes

from hpcdl.train.trainer import EXIT_STOPPED_BY_SIGNAL

HOSTS = 4
PER_HOST = int(os.environ.get("HPCDL_SCALE_PER_HOST", "2"))
RANKS = HOSTS * PER_HOST
MAX_STEPS = 40        # the uninterrupted run; the signalled launch stops well before
SKEW_S = 2.0          # each rank's delivery: the first one's moment + uniform(0, SKEW_S)
#: a launch still running then is hung (not a timing assertion: it tells ended from hung)
LAUNCH_LIMIT_S = 300 + 20 * RANKS
RAISING = RANKS - 1   # the last rank: on the last host, away from rank 0's
RAISE_AT = 20         # its 20th collective: inside training (the parameters' broadcast is #2)
#: what the tests saw, written to HPCDL_SCALE_RESULT (a JSON file) by the last one
RESULT: dict = {}

RECIPE = """
name: tiny-scale
model: {name: resnet_small, num_classes: 3, width: 4, layers: [1, 1, 1]}
data: {image_size: 16, workers: 0}
batch: {global: 8, per_rank: 2}  # global: 2 x RANKS, overridden
epochs: 20
optimizer: {name: lars, momentum: 0.9, weight_decay: 5.0e-5}
schedule: {name: poly, base_lr: 1.0, warmup_epochs: 0.5}
train: {seed: 1, log_every_steps: 1, keep_checkpoints: 100}
comm: {backend: auto, bucket_mb: 0.004}
"""


@pytest.fixture(scope="module")
def four_hosts(cluster):
    cluster.script("up", str(HOSTS))
    cluster.hosts = cluster.script("hosts").split()
    try:
        yield cluster
    finally:  # fresh hosts for the next module: aborted MPICH jobs leave state that breaks
        make_the_hosts_again(cluster, 3)  # the next srun --mpi=pmi2 start (cluster_hosts.py)


@pytest.fixture(scope="module")
def setup(four_hosts):
    """8 shards of 3 x 64 images on the shared file system: 2 per host, 48 images a host, so
    every host count here has whole steps (3 an epoch at 8 ranks a host)."""
    from hpcdl.data_prep.shard import shard_tree
    from hpcdl.data_prep.synthetic import make_imagenet_tree

    root = four_hosts.workdir("scale")
    make_imagenet_tree(str(root / "tree"), num_classes=3, train_per_class=64, val_per_class=2,
                       size=(24, 20))
    shard_tree(str(root / "tree"), str(root / "shards"), shards=8, resize=20)
    (root / "tiny.yaml").write_text(RECIPE)
    return four_hosts, root


def launch(cluster, root: Path, run: str, *extra: str, env: dict[str, str] | None = None
           ) -> tuple[subprocess.Popen, Path]:
    """``hpcdl train`` (this checkout's) as RANKS ranks of MPICH across the 4 hosts."""
    line = (f"{cluster.launch_command('mpich', cluster.hosts, PER_HOST)} {sys.executable} -m "
            f"hpcdl.cli.main train --recipe {root / 'tiny.yaml'} --data {root / 'shards'} "
            f"--out {root / run} --deterministic --no-eval --no-progress --max-steps "
            f"{MAX_STEPS} batch.global={2 * RANKS} {' '.join(extra)}")
    log = root / f"{run}.{len(list(root.glob(f'{run}.*.log')))}.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([str(SCRIPT), "exec", cluster.hosts[0], "bash", "-c",
                                 f"cd {REPO} && exec {line}"], stdout=f, stderr=subprocess.STDOUT,
                                env=cluster.env({**launcher_env("mpich"), **(env or {})}),
                                start_new_session=True)
    proc.log = log
    return proc, log


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    """(exit code, output); a launch that outlives LAUNCH_LIMIT_S is killed and fails."""
    try:
        code = proc.wait(timeout=LAUNCH_LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"{RANKS} ranks hung for {LAUNCH_LIMIT_S} s:\n"
                    f"{proc.log.read_text(errors='replace')[-3000:]}")
    return code, proc.log.read_text(errors="replace")


def rank_pids(cluster) -> dict[int, str]:
    """pid -> host of every rank of the job now running on the hosts (seconds on a loaded
    machine: every host's /proc is walked)."""
    return {pid: host for host in cluster.hosts for pid, _, cmd in processes(cluster, host)
            if is_rank(cmd) and "hpcdl.cli.main" in cmd}


def every_rank(cluster, proc: subprocess.Popen) -> dict[int, str]:
    """The launch's RANKS ranks, once all have started (found before training, so that a
    signal sent at a step lands near it)."""
    found: dict[int, str] = {}

    def started() -> bool:
        found.clear()
        found.update(rank_pids(cluster))
        return len(found) == RANKS
    wait_for(started, proc, f"{RANKS} ranks")
    return found


def last_step(run_dir: Path) -> int:
    try:
        with open(run_dir / "metrics.jsonl") as f:
            steps = [r["step"] for r in map(json.loads, f) if r.get("kind") == "train"]
    except (OSError, ValueError):
        return -1
    return steps[-1] if steps else -1


def wait_for(condition, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + LAUNCH_LIMIT_S
    while not condition():
        if proc.poll() is not None:
            pytest.fail(f"the launch ended ({proc.returncode}) before {what}:\n"
                        f"{proc.log.read_text(errors='replace')[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} after {LAUNCH_LIMIT_S} s")
        time.sleep(0.1)


def private_kib(pid: int) -> int | None:
    """Private_Clean + Private_Dirty of ``pid`` (kB): its memory no other process shares."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            fields = dict(line.split()[:2] for line in f if line.startswith("Private_"))
    except OSError:
        return None
    return int(fields["Private_Clean:"]) + int(fields["Private_Dirty:"])


def mem_available_gib() -> float:
    with open("/proc/meminfo") as f:
        return round(next(int(ln.split()[1]) for ln in f if ln.startswith("MemAvailable:"))
                     / 2**20, 1)


def send_skewed(pids: list[int], rng: random.Random) -> list[float]:
    """SIGUSR1 to each rank, the first at a random moment, each other one uniform(0, SKEW_S)
    after it; a rank that has already exited is skipped."""
    at = sorted((rng.uniform(0.0, SKEW_S), pid) for pid in pids)
    start = time.monotonic() + rng.uniform(0.0, 0.3)
    for delay, pid in at:
        time.sleep(max(0.0, start + delay - time.monotonic()))
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    return [round(d, 3) for d, _ in at]


def checkpoint_steps(run_dir: Path) -> list[int]:
    return sorted(int(m.group(1)) for p in (run_dir / "checkpoints").iterdir()
                  if (m := re.fullmatch(r"ckpt-(\d+)\.pt", p.name)))


def test_one_rank_raising_ends_the_job_printing_its_error_once_naming_rank_and_host(setup):
    cluster, root = setup
    started = time.monotonic()
    proc, _ = launch(cluster, root, "raise", "--resume", "none",
                     env={"HPCDL_INJECT": f"{RAISING}:{RAISE_AT}:raise"})
    code, out = finish(proc)
    print(f"\n{RANKS} ranks on {HOSTS} hosts: rank {RAISING} raised, launcher exit {code} after "
          f"{time.monotonic() - started:.1f} s (start-up included)")
    assert code == 1, out[-3000:]  # fail-fast's MPI_Abort
    message = f"InjectedFault: HPCDL_INJECT: rank {RAISING} raises before collective #{RAISE_AT}"
    lines = [ln for ln in out.splitlines() if message in ln]
    assert len(lines) == 1, out[-4000:]
    assert lines[0].startswith(f"[rank {RAISING}/{RANKS} {cluster.hosts[-1]}]"), lines[0]
    assert "stall: aborting" not in out, out[-3000:]  # fail-fast ended it, not the watchdog
    assert_no_rank_left(cluster)
    RESULT["raise"] = {"exit": code, "launch_s": round(time.monotonic() - started, 1),
                       "line": lines[0].strip()}


def test_skewed_signals_stop_every_rank_at_one_step_and_resume_exactly(setup):
    cluster, root = setup
    seed = int(os.environ.get("HPCDL_TEST_SEED", time.time_ns() % 2**32))
    rng = random.Random(seed)
    run_dir, record = root / "run", {"ranks": RANKS, "hosts": HOSTS, "per_host": PER_HOST,
                                     "seed": seed, "cores": os.cpu_count(),
                                     "mem_available_gib": mem_available_gib()}

    # the uninterrupted reference; each rank's private memory measured mid-training
    reference, _ = launch(cluster, root, "ref", "--resume", "none")
    pids = every_rank(cluster, reference)
    wait_for(lambda: last_step(root / "ref") >= 3, reference, "step 3 of the reference")
    memory = {pid: private_kib(pid) for pid in pids}
    code, out = finish(reference)
    assert code == 0, out[-3000:]
    kib = sorted(v for v in memory.values() if v)
    record["private_mib_per_rank"] = {"min": round(kib[0] / 1024, 1),
                                      "median": round(kib[len(kib) // 2] / 1024, 1),
                                      "max": round(kib[-1] / 1024, 1)}

    proc, _ = launch(cluster, root, "run", "--resume", "none")
    pids = every_rank(cluster, proc)
    wait_for(lambda: last_step(run_dir) >= 3, proc, "step 3")
    record["signalled_after_step"] = last_step(run_dir)
    record["delays_s"] = send_skewed(list(pids), rng)
    code, out = finish(proc)
    assert code == EXIT_STOPPED_BY_SIGNAL, (record, out[-3000:])
    summary = json.loads((run_dir / "summary.json").read_text())
    stop = summary["steps"]
    assert summary["stopped"] == "signal" and 3 <= stop < MAX_STEPS, (record, summary)
    stops = {p.name: re.findall(r"checkpointed at step (\d+), stopping", p.read_text())
             for p in (run_dir / "logs").glob("rank-*.log")}
    assert len(stops) == RANKS and all(s == [str(stop)] for s in stops.values()), stops
    assert checkpoint_steps(run_dir)[-1] == stop
    path = run_dir / "checkpoints" / f"ckpt-{stop:09d}.pt"
    assert (run_dir / "logs" / "rank-0000.log").read_text().count(f"checkpoint {path}\n") == 1

    code, out = finish(launch(cluster, root, "run")[0])  # --resume auto
    assert code == 0, out[-3000:]
    resumed = json.loads((run_dir / "summary.json").read_text())
    ref = json.loads((root / "ref" / "summary.json").read_text())
    assert resumed["resumed_from"].endswith(path.name), resumed
    assert resumed["steps"] == ref["steps"] == MAX_STEPS
    assert resumed["backend"] == ref["backend"] == "shm"
    assert resumed["params_sha256"] == ref["params_sha256"], record
    record.update(stopped_at=stop, exit_codes=[EXIT_STOPPED_BY_SIGNAL, 0],
                  params_equal=True, backend=ref["backend"])
    RESULT["signals"] = record
    print(f"\n{json.dumps(RESULT)}")
    result = os.environ.get("HPCDL_SCALE_RESULT")
    if result:
        Path(result).write_text(json.dumps(RESULT, indent=1) + "\n")
