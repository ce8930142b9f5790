"""Slurm's time-limit signal reaches the ranks of a real ``mpiexec -n P hpcdl train`` one by one
(srun forwards it task by task), each at its own moment of a step: here ``os.kill`` on every
rank's pid, skewed by 0-2 s, from outside. However it lands, every rank stops at the same step,
that step has exactly one checkpoint, the launch exits 75 (what slurm/job_body.sh requeues on),
and resuming run after run ends with exactly the parameters of an uninterrupted run. A signal
during set-up (before the first step, while the trainer is built and resumes) stops the run at
the first step's agreement, not the rank.

Tiny model, the default backend (``auto``: shared memory on one host), ``--deterministic``.
A chain of launches in one run directory, each a trial and the next one's resume. Serial test
that launches its own mpiexec (never nested inside an MPI-launched rank)."""
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from hpcdl.train.trainer import EXIT_STOPPED_BY_SIGNAL

pytestmark = [pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec"),
              pytest.mark.slow]

#: 4 here (2 cores: about 40 s a launch); HPCDL_SIGNAL_SKEW_RANKS=8 on a bigger machine
RANKS = int(os.environ.get("HPCDL_SIGNAL_SKEW_RANKS", "4"))
#: a signalled launch's cap: the recipe's whole run (20 epochs of 24 steps), which no trial
#: reaches however fast the steps are (each stops within SKEW_S + one step of its first signal)
MAX_STEPS = 480
FINAL_STEPS = 8      # the last resume and the uninterrupted reference run this far past the stops
SKEW_TRIALS = 3      # launches signalled mid-training, after the one signalled during set-up
SKEW_S = 2.0         # each rank's delivery: the first one's moment + uniform(0, SKEW_S)
LAUNCH_LIMIT_S = 240  # a launch still running then is hung (ranks split): the test fails

RECIPE = """
name: tiny-auto
model: {name: resnet_small, num_classes: 3, width: 4, layers: [1, 1, 1]}
data: {image_size: 16, workers: 1}
batch: {global: 8, per_rank: 2}  # global: 2 x RANKS, overridden
epochs: 20
optimizer: {name: lars, momentum: 0.9, weight_decay: 5.0e-5}
schedule: {name: poly, base_lr: 1.0, warmup_epochs: 0.5}
train: {seed: 1, log_every_steps: 1, keep_checkpoints: 100}
comm: {backend: auto, bucket_mb: 0.004}
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """192 training images: 24 steps of global batch 8 per epoch (4 ranks), so the trials
    cross epoch ends (a checkpoint there) as well as plain steps."""
    from hpcdl.data_prep.shard import shard_tree
    from hpcdl.data_prep.synthetic import make_imagenet_tree

    root = tmp_path_factory.mktemp("skew")
    make_imagenet_tree(str(root / "tree"), num_classes=3, train_per_class=64, val_per_class=2,
                       size=(24, 20))
    shard_tree(str(root / "tree"), str(root / "shards"), shards=4, resize=20)
    (root / "tiny.yaml").write_text(RECIPE)
    return root


def launch(root, run, *extra, max_steps=MAX_STEPS):
    cmd = ["mpiexec", "-n", str(RANKS), sys.executable, "-m", "hpcdl.cli.main", "train",
           "--recipe", str(root / "tiny.yaml"), "--data", str(root / "shards"),
           "--out", str(root / run), "--deterministic", "--no-eval", "--no-progress",
           "--max-steps", str(max_steps), f"batch.global={2 * RANKS}", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MPIEXEC_TIMEOUT": str(LAUNCH_LIMIT_S + 60)}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def finish(proc):
    """(exit code, output); a launch that outlives LAUNCH_LIMIT_S is killed and fails."""
    try:
        out, _ = proc.communicate(timeout=LAUNCH_LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"mpiexec -n {RANKS} hung for {LAUNCH_LIMIT_S} s after the signals (ranks "
                    f"acting on different steps):\n{out[-3000:]}")
    return proc.returncode, out


def rank_pids(mpiexec_pid):
    """The pids of the ranks mpiexec started (its descendants running hpcdl), from /proc."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read()
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append((int(entry), cmdline))
    found, todo = [], [mpiexec_pid]
    while todo:
        for pid, cmdline in children.get(todo.pop(), []):
            todo.append(pid)
            if b"hpcdl.cli.main" in cmdline:
                found.append(pid)
    return found


def wait_for(condition, proc, what, limit_s=LAUNCH_LIMIT_S):
    deadline = time.monotonic() + limit_s
    while not condition():
        if proc.poll() is not None:
            pytest.fail(f"the launch ended ({proc.returncode}) before {what}:\n"
                        f"{proc.communicate()[0][-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} after {limit_s} s")
        time.sleep(0.05)


def last_train_step(run_dir):
    """The newest step in metrics.jsonl (truncated to the checkpoint's step at resume)."""
    try:
        with open(run_dir / "metrics.jsonl") as f:
            steps = [r["step"] for r in map(json.loads, f) if r.get("kind") == "train"]
    except (OSError, ValueError):
        return -1
    return steps[-1] if steps else -1


def send_skewed(pids, rng, after_first=lambda: None):
    """SIGUSR1 to each rank, the first at a random moment of the step under way, each other
    one uniform(0, SKEW_S) later; a rank that has already exited is skipped. Returns the
    delays and what ``after_first()`` returned, called right after the first delivery."""
    at = sorted((rng.uniform(0.0, SKEW_S), pid) for pid in pids)
    start, seen = time.monotonic() + rng.uniform(0.0, 0.3), None
    for i, (delay, pid) in enumerate(at):
        time.sleep(max(0.0, start + delay - time.monotonic()))
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
        if i == 0:
            seen = after_first()
    return [round(d, 3) for d, _ in at], seen


def stop_steps(run_dir):
    """Per rank: the steps it logged stopping at, in order (every launch of the chain)."""
    steps = {}
    for name in sorted(os.listdir(run_dir / "logs")):
        if re.fullmatch(r"rank-\d+\.log", name):
            text = (run_dir / "logs" / name).read_text()
            steps[name] = [int(s) for s in re.findall(r"checkpointed at step (\d+), stopping",
                                                      text)]
    return steps


def checkpoint_steps(run_dir):
    return sorted(int(n[5:-3]) for n in os.listdir(run_dir / "checkpoints"))


def check_stopped(root, run, code, out, stops):
    """Every rank stopped at one step, the last of ``stops``; one checkpoint of it, the newest."""
    run_dir = root / run
    assert code == EXIT_STOPPED_BY_SIGNAL, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped"] == "signal" and summary["steps"] == stops[-1]
    per_rank = stop_steps(run_dir)
    assert len(per_rank) == RANKS and all(s == stops for s in per_rank.values()), per_rank
    assert checkpoint_steps(run_dir)[-1] == stops[-1]
    path = str(run_dir / "checkpoints" / f"ckpt-{stops[-1]:09d}.pt")
    assert (run_dir / "logs" / "rank-0000.log").read_text().count(f"checkpoint {path}\n") == 1


def test_skewed_signals_stop_every_rank_at_one_step_and_resume_exactly(setup):
    seed = int(os.environ.get("HPCDL_TEST_SEED", time.time_ns() % 2**32))
    rng, root = random.Random(seed), setup
    run_dir, stops, trials = root / "run", [], [("seed", seed)]

    # Set-up: every rank is signalled once its log exists (communicator up), before the first
    # step; the trainer is still being built and resumed. It stops at step 1's agreement (2's
    # if the first signal came after step 1's, on a machine where set-up is that quick).
    proc = launch(root, "run", "--resume", "none")
    wait_for(lambda: len(rank_pids(proc.pid)) == RANKS and all(
        (run_dir / "logs" / f"rank-{r:04d}.log").exists() for r in range(RANKS)), proc,
        "rank logs")
    delays, step_at_first = send_skewed(rank_pids(proc.pid), rng,
                                        lambda: last_train_step(run_dir))
    trials.append(("set-up", delays, step_at_first))
    code, out = finish(proc)
    stops.append(json.loads((run_dir / "summary.json").read_text())["steps"]
                 if code == EXIT_STOPPED_BY_SIGNAL else -1)
    check_stopped(root, "run", code, out, stops)
    assert step_at_first >= 0 or stops[-1] <= 2, trials

    # Mid-training: each launch resumes the last one's checkpoint and is signalled, skewed.
    for _ in range(SKEW_TRIALS):
        proc = launch(root, "run")  # --resume auto
        start = stops[-1]
        wait_for(lambda start=start: last_train_step(run_dir) > start, proc, "a training step")
        trials.append(("training", *send_skewed(rank_pids(proc.pid), rng,
                                                lambda: last_train_step(run_dir))))
        code, out = finish(proc)
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["resumed_from"].endswith(f"ckpt-{start:09d}.pt"), (trials, out[-3000:])
        stops.append(summary["steps"])
        check_stopped(root, "run", code, out, stops)
        assert start < stops[-1] < MAX_STEPS, (stops, trials)

    # The max-steps cap only ends the run (the schedule spans the recipe's epochs), so a
    # reference to a few steps past the last stop sees the same learning rates as the chain.
    final = stops[-1] + FINAL_STEPS
    last, reference = launch(root, "run", max_steps=final), launch(root, "ref", "--resume",
                                                                     "none", max_steps=final)
    code, out = finish(last)
    assert code == 0, out[-3000:]
    resumed = json.loads((run_dir / "summary.json").read_text())
    code, out = finish(reference)
    assert code == 0, out[-3000:]
    ref = json.loads((root / "ref" / "summary.json").read_text())
    assert resumed["steps"] == ref["steps"] == final
    assert resumed["backend"] == ref["backend"] == "shm"
    assert resumed["params_sha256"] == ref["params_sha256"], (stops, trials)
