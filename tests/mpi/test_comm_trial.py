"""``comm.backend: auto``'s start-up trial under real MPI (hpcdl/comm/trial.py): every rank
opens the same backend and layout from the same agreed times, the budget bounds how many
measurements run, a candidate that raises is excluded, summary.json keeps the record, and
``rule`` opens what ``auto`` opened before the trial existed. No timing assertions: what is
checked is what ran and what was agreed, never how fast."""
import json
import os
import threading
import time
from pathlib import Path

import pytest
from mpi4py import MPI

import hpcdl.comm
from hpcdl.buckets import LAST_BUCKET_BYTES, MIB, TRIAL_SAMPLE_MB
from hpcdl.comm.trial import TRIAL_ROUNDS, Layout, bucket_numels, choose, run_trial
from hpcdl.train.config import CommConfig, config_from_dict
from hpcdl.train.session import RunSession, open_communicator, recipe_gradients
from hpcdl.train.trainer import Trainer, TrainOptions

#: ~6 MiB of fp32 gradients: at a 0.5 MiB recipe bucket, 4 MiB, 25 MiB and 64 MiB give three
#: distinct layouts (25 and 64 MiB both hold everything but the first layers' bucket)
NUMELS = [30_000, 200_000, 600_000, 700_000, 20_000, 2_000]


def open_candidate(world):
    def open_(name, layout, wire_dtype):
        return hpcdl.comm.init(name, world, bucket_bytes=layout.bucket_bytes,
                               wire_dtype=wire_dtype, last_bucket_bytes=layout.last_bucket_bytes)
    return open_


def distinct_layouts(bucket_mb):
    seen = []
    for layout in [Layout(bucket_mb, 1.0)] + [Layout(mb, 1.0) for mb in (4.0, 25.0, 64.0)
                                               if mb != bucket_mb]:
        buckets = bucket_numels(NUMELS, 4, layout)
        if buckets not in seen:
            seen.append(buckets)
    return len(seen)


def test_every_rank_holds_the_same_times_and_opens_the_same_choice(world):
    section = CommConfig(backend="auto", bucket_mb=0.5, trial_s=60.0)
    with open_communicator(section, world, gradients=NUMELS) as comm:
        trial = comm.trial
        mine = (comm.backend, comm.bucket_bytes, comm.last_bucket_bytes,
                json.dumps(trial.record()["candidates"]))
        assert world.allgather(mine) == [mine] * world.size
        assert trial.fallback is None and trial.measurements
        assert comm.backend == trial.backend == trial.record()["chosen"]["backend"]
        assert comm.bucket_bytes == trial.layout.bucket_bytes
        assert comm.last_bucket_bytes == trial.layout.last_bucket_bytes
        picked = choose(trial.measurements)  # the pure rule, on the agreed times
        assert (picked.backend, picked.layout) == (trial.backend, trial.layout)
        assert trial.measurements[0].backend == hpcdl.comm.auto_backend(world)  # rule's first


def test_the_run_session_logs_the_trial_once_on_rank_0(world, shared_tmp):
    run_dir = os.path.join(shared_tmp, "session")
    section = CommConfig(backend="auto", bucket_mb=0.5, trial_buckets=False)
    with RunSession(world, section, run_dir=run_dir, log_level="info", threads=None,
                    gradients=NUMELS) as session:
        backend = session.comm.backend
    world.Barrier()
    logs = [Path(run_dir, "logs", f"rank-{r:04d}.log").read_text() for r in range(world.size)]
    lines = [line for line in logs[0].splitlines() if "(trial, " in line]
    assert len(lines) == 1 and f"comm: {backend}, buckets 0.5 MiB" in lines[0]
    assert all("(trial, " not in log for log in logs[1:])


def test_an_ample_budget_runs_every_distinct_measurement_a_tiny_one_only_the_first(world):
    candidates = {"mpi": "float32", "ring": "float32"}
    ample = run_trial(world, NUMELS, candidates, "mpi", 0.5, 600.0, open_candidate(world))
    # stage 1: both backends; stage 2: the winner at the distinct other sizes; stage 3: the
    # winner's best size without a first-layers bucket -- unless that gives buckets already
    # timed (which size wins is a measurement: either can happen)
    staged = len(candidates) + distinct_layouts(0.5) - 1
    assert len(ample.measurements) in (staged, staged + 1), ample.measurements
    layouts = [(m.backend, m.buckets, m.bucket_mb, m.first_bucket_mb)
               for m in ample.measurements]
    assert len(set(layouts)) == len(layouts)
    assert ample.planned == len(candidates) + 3 + 1
    assert ample.rounds_run == TRIAL_ROUNDS * len(ample.measurements)
    if len(ample.measurements) == staged + 1:
        assert ample.measurements[-1].first_bucket_mb == 0.0

    tiny = run_trial(world, NUMELS, candidates, "mpi", 0.5, 1e-9, open_candidate(world))
    assert [(m.backend, m.bucket_mb) for m in tiny.measurements] == [("mpi", 0.5)]
    assert tiny.rounds_run == TRIAL_ROUNDS
    assert (tiny.backend, tiny.bucket_mb, tiny.fallback) == ("mpi", 0.5, None)
    # the sample fitted to the budget from the probe of the link, the same on every rank:
    # whole at an ample budget, the 1 MiB floor at a tiny one
    assert world.allgather(ample.sample_mb) == [TRIAL_SAMPLE_MB] * world.size
    assert world.allgather(tiny.record()["sample_mb"]) == [1.0] * world.size


def burn_cpu(seconds: float) -> None:
    """Spin until this thread has used ``seconds`` of CPU (its own clock, not the wall's)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class Spinning:
    """A real ``mpi`` communicator whose every reduction also burns ``seconds`` of CPU, on
    the calling thread (``where="here"``, as a polling progress engine does) or on a worker
    it started when opened (``"beside"``, as gloo's threads do); ``"first"``: only its first
    reduction does, on the calling thread (a one-off set-up: connections, first touch)."""

    def __init__(self, inner, seconds: float, where: str) -> None:
        self.inner, self.seconds, self.where = inner, seconds, where
        self.calls = 0
        if where == "beside":
            self.asked, self.done = threading.Event(), threading.Event()
            self.worker = threading.Thread(target=self._serve, daemon=True)
            self.worker.start()

    def _serve(self) -> None:
        while True:
            self.asked.wait()
            self.asked.clear()
            if self.seconds is None:
                return
            burn_cpu(self.seconds)
            self.done.set()

    def allreduce_flat_(self, buffer, average=False):
        self.calls += 1
        if self.where == "here" or (self.where == "first" and self.calls == 1):
            burn_cpu(self.seconds)
        elif self.where == "beside":
            self.done.clear()
            self.asked.set()
            self.done.wait()
        return self.inner.allreduce_flat_(buffer, average=average)

    def empty(self, numel, dtype):
        return self.inner.empty(numel, dtype)

    def close(self):
        if self.where == "beside":
            self.seconds = None
            self.asked.set()
            self.worker.join()
        self.inner.close()


def test_the_cpu_a_transports_threads_burn_is_counted_scaled_and_agreed(world):
    """Rank r's transports burn 0.02·(r+1) s of CPU per reduction, on the reducing thread or
    on a thread of their own; plain ``mpi`` burns only what MPI does. Every rank records the
    same per-step CPU for each, at least the slowest rank's burn over a step's bytes, and
    summary.json's record carries it."""
    burn = 0.02 * (world.rank + 1)
    opened = {}

    def open_(name, layout, wire_dtype):
        inner = hpcdl.comm.init("mpi", world, bucket_bytes=layout.bucket_bytes,
                                last_bucket_bytes=layout.last_bucket_bytes)
        opened[name] = inner if name == "mpi" else Spinning(inner, burn, name)
        return opened[name]

    trial = run_trial(world, NUMELS, {"mpi": "float32", "here": "float32",
                                      "beside": "float32"},
                      "mpi", 0.5, 600.0, open_, vary_buckets=False)
    assert [m.backend for m in trial.measurements] == ["mpi", "here", "beside"]
    cpu = {m.backend: m.transport_cpu_s for m in trial.measurements}
    assert world.allgather(cpu) == [cpu] * world.size
    slowest = 0.02 * world.size
    # a thread the transport started is read from /proc in clock ticks: two reads, each up
    # to a tick short; the record rounds to 1e-4 s
    ticks = 2 / os.sysconf("SC_CLK_TCK")
    for m in trial.measurements[1:]:
        assert m.timed_share == 1.0  # the sample holds every bucket: nothing is scaled
        # the burn of every reduction of a timed round (the untimed one is no step's)
        per_round = slowest * opened[m.backend].calls / (1 + TRIAL_ROUNDS)
        least = per_round - (ticks / TRIAL_ROUNDS if m.backend == "beside" else 0.0)
        assert m.transport_cpu_s >= least - 1e-4, m
        assert m.seconds >= m.transport_cpu_s  # the score includes it
    recorded = {c["backend"]: c["transport_cpu_s"] for c in trial.record()["candidates"]}
    assert recorded == cpu


def test_a_transports_one_off_cpu_at_its_first_reduction_costs_no_step(world):
    """The untimed round takes a candidate's one-off 0.5 s of CPU (every rank's first
    reduction): counted, it would add its share of every round to the per-step CPU."""
    def open_(name, layout, wire_dtype):
        inner = hpcdl.comm.init("mpi", world, bucket_bytes=layout.bucket_bytes,
                                last_bucket_bytes=layout.last_bucket_bytes)
        return inner if name == "mpi" else Spinning(inner, 0.5, "first")

    trial = run_trial(world, NUMELS, {"mpi": "float32", "first": "float32"}, "mpi", 0.5,
                      600.0, open_, vary_buckets=False)
    cpu = {m.backend: m.transport_cpu_s for m in trial.measurements}
    assert cpu["first"] < cpu["mpi"] + 0.5 / (1 + TRIAL_ROUNDS) / 2, cpu


def test_a_candidate_that_raises_is_excluded_with_its_reason(world):
    # mpi refuses bf16 on the wire (hpcdl/comm/base.py): a real error, raised on every rank
    candidates = {"mpi": "bfloat16", "ring": "float32"}
    trial = run_trial(world, NUMELS, candidates, "mpi", 0.5, 600.0, open_candidate(world),
                      vary_buckets=False)
    assert set(trial.excluded) == {"mpi"}
    assert trial.excluded["mpi"].startswith("rank 0:") and "wire_dtype" in trial.excluded["mpi"]
    assert [m.backend for m in trial.measurements] == ["ring"]
    assert trial.backend == "ring"


def test_no_candidate_left_falls_back_to_the_rule(world):
    trial = run_trial(world, NUMELS, {"mpi": "bfloat16"}, "mpi", 0.5, 600.0,
                      open_candidate(world))
    assert (trial.backend, trial.fallback, trial.measurements) == (
        "mpi", "no candidate could be timed", [])
    assert "mpi" in trial.excluded


def test_rule_and_a_deterministic_run_open_what_the_rule_says(world):
    rule = hpcdl.comm.auto_backend(world)
    section = CommConfig(backend="rule", bucket_mb=0.5)
    with open_communicator(section, world, gradients=NUMELS) as comm:
        assert (comm.backend, comm.trial) == (rule, None)
        assert (comm.bucket_bytes, comm.last_bucket_bytes) == (MIB // 2, LAST_BUCKET_BYTES)
    auto = CommConfig(backend="auto", bucket_mb=0.5)
    with open_communicator(auto, world, gradients=NUMELS, deterministic=True) as comm:
        assert (comm.backend, comm.bucket_bytes, comm.last_bucket_bytes) == (
            rule, MIB // 2, LAST_BUCKET_BYTES)
        assert comm.trial.measurements == [] and "deterministic" in comm.trial.fallback
    with open_communicator(CommConfig(backend="auto", trial_s=0), world,
                           gradients=NUMELS) as comm:
        assert comm.backend == rule and comm.trial.fallback == "comm.trial_s: 0"


def tiny_recipe(size):
    return config_from_dict({
        "name": "tiny",
        "model": {"name": "resnet_small", "num_classes": 3, "width": 4, "layers": [1, 1, 1]},
        "data": {"image_size": 16, "workers": 1},
        "batch": {"global": 2 * size, "per_rank": 2},
        "epochs": 1,
        "optimizer": {"name": "lars", "momentum": 0.9},
        "schedule": {"name": "poly", "base_lr": 0.1, "warmup_epochs": 0},
        "train": {"seed": 3, "log_every_steps": 1, "eval_every_epochs": 0},
        "comm": {"backend": "auto", "bucket_mb": 0.004, "trial_s": 60},
    })


@pytest.fixture(scope="module")
def shards(make_tiny_shards):
    return make_tiny_shards()


def test_summary_json_keeps_the_trial_and_the_reducer_uses_its_layout(world, shards,
                                                                     shared_tmp):
    config = tiny_recipe(world.size)
    run_dir = os.path.join(shared_tmp, "run")
    with open_communicator(config.comm, world, gradients=recipe_gradients(config)) as comm:
        trainer = Trainer(config, shards, run_dir, comm,
                          options=TrainOptions(progress=False, max_steps=2, evaluate=False))
        try:
            chosen = next(m for m in comm.trial.measurements if m.layout == comm.trial.layout
                          and m.backend == comm.backend)
            assert len(trainer.reducer.buckets) == chosen.buckets  # the layout that was timed
            trainer.train()
        finally:
            trainer.close()
    world.Barrier()
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    record = summary["comm_trial"]
    assert record["chosen"]["backend"] == summary["backend"]
    assert record["decided_by"] == "trial" and record["candidates"]
    assert record["rounds_run"] == TRIAL_ROUNDS * len(record["candidates"])
    assert {c["backend"] for c in record["candidates"]} | set(record["excluded"]) >= {
        "mpi", "ring", "gloo", "ccl"}
    assert record["previous"] is None


def test_a_resumed_run_records_what_the_run_before_used(world, shards, shared_tmp):
    # the trial runs again at every start (a requeue may land on other nodes): the resumed
    # run's summary names what the interrupted one used, whatever this start chose
    config = tiny_recipe(world.size)
    run_dir = os.path.join(shared_tmp, "resumed")
    first = train_steps(config, shards, run_dir, 2, "none")
    fallback = config_from_dict({**config.to_dict(), "comm": {**config.to_dict()["comm"],
                                                              "trial_s": 0}})
    second = train_steps(fallback, shards, run_dir, 3, "auto")
    assert second["resumed_from"] and second["steps"] == 3
    assert second["comm_trial"]["previous"] == {**first["comm_trial"]["chosen"], "steps": 2}
    assert second["comm_trial"]["fallback"] == "comm.trial_s: 0"


def train_steps(config, shards, run_dir, steps, resume):
    with open_communicator(config.comm, MPI.COMM_WORLD,
                           gradients=recipe_gradients(config)) as comm:
        trainer = Trainer(config, shards, run_dir, comm,
                          options=TrainOptions(progress=False, max_steps=steps, evaluate=False))
        try:
            trainer.resume(resume)
            summary = trainer.train()
        finally:
            trainer.close()
    MPI.COMM_WORLD.Barrier()
    return MPI.COMM_WORLD.bcast(summary, root=0)
