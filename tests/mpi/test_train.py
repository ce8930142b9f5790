"""The trainer under real MPI: exact resume after a signal, agreement on stopping, evaluation,
the run directory. Tiny model (resnet_small, width 4) on tiny synthetic shards."""
import importlib.util
import json
import logging
import os

import pytest
import torch
from mpi4py import MPI
from signal_at import signal_after_step  # tests/signal_at.py

from hpcdl.train import checkpoint as ckpt
from hpcdl.train.config import RecipeError, config_from_dict
from hpcdl.train.trainer import NonFiniteLossError, Trainer, TrainOptions

PER_RANK = 2


def recipe(size, width=4, **train):
    return config_from_dict({
        "name": "tiny",
        "model": {"name": "resnet_small", "num_classes": 3, "width": width, "layers": [1, 1, 1]},
        "data": {"image_size": 16, "workers": 1},
        "batch": {"global": PER_RANK * size, "per_rank": PER_RANK},
        "epochs": 2,
        "optimizer": {"name": "lars", "momentum": 0.9, "weight_decay": 5.0e-5},
        "schedule": {"name": "poly", "base_lr": 1.0, "warmup_epochs": 0.5},
        "train": {"seed": 3, "log_every_steps": 2, **train},
        "comm": {"backend": "mpi", "bucket_mb": 0.004},  # several buckets per step
    })


@pytest.fixture(scope="module")
def shards(make_tiny_shards):
    return make_tiny_shards()



def run_trainer(config, shards, run_dir, comm, resume="none", hooks=(), **options):
    trainer = Trainer(config, shards, run_dir, comm,
                      options=TrainOptions(deterministic=True, progress=False, **options))
    trainer.after_step_hooks.extend(hooks)
    try:
        trainer.resume(resume)
        summary = trainer.train()
    finally:
        trainer.close()
    return trainer, summary


def test_resume_after_signal_ends_with_the_uninterrupted_parameters(
        shards, comm, world, shared_tmp):
    config = recipe(world.size)
    _, reference = run_trainer(config, shards, os.path.join(shared_tmp, "a"), comm, max_steps=7)
    assert reference["steps"] == 7

    # SIGUSR1 reaches the last rank only, after step 3's agreement (in the window between
    # the agreement and the step's end): every rank must stop at the same step, the next.
    run_b = os.path.join(shared_tmp, "b")
    _, stopped = run_trainer(config, shards, run_b, comm, max_steps=7,
                             hooks=[signal_after_step(3, world.size - 1)])
    assert stopped["stopped"] == "signal"
    assert world.allgather(stopped["steps"]) == [4] * world.size
    assert os.path.basename(ckpt.list_checkpoints(run_b)[-1]) == "ckpt-000000004.pt"

    resumed_trainer, resumed = run_trainer(config, shards, run_b, comm, resume="auto",
                                           max_steps=7)
    assert resumed["resumed_from"].endswith("ckpt-000000004.pt")
    assert resumed["params_sha256"] == reference["params_sha256"]
    assert resumed_trainer.check_replicas()  # every rank holds the same model
    if world.rank == 0:
        steps = [r["step"] for r in map(json.loads, open(os.path.join(run_b, "metrics.jsonl")))
                 if r["kind"] == "train"]
        assert steps == sorted(set(steps))  # no step recorded twice across the resume


def test_run_directory_holds_config_metrics_summary(shards, comm, world, shared_tmp):
    run = os.path.join(shared_tmp, "run")
    trainer, summary = run_trainer(recipe(world.size, keep_checkpoints=1), shards, run, comm,
                                   max_steps=3, checkpoint_every=1)
    assert summary["global_batch"] == PER_RANK * world.size and summary["ranks"] == world.size
    assert summary["stopped"] == "max_steps" and 0.0 <= summary["top1"] <= 1.0
    if world.rank == 0:
        # tensorboard/: the event files, when the optional package is installed
        expected = ["checkpoints", "config.yaml", "metrics.jsonl", "summary.json"]
        if importlib.util.find_spec("tensorboard") is not None:
            expected.append("tensorboard")
        assert sorted(os.listdir(run)) == sorted(expected)
        assert len(ckpt.list_checkpoints(run)) == 1  # keep_checkpoints=1
        records = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
        train = [r for r in records if r["kind"] == "train"]
        assert {"step", "epoch", "loss", "lr", "images_per_s", "data_wait_s",
                "comm_wait_s"} <= set(train[0])
        (evaluation,) = [r for r in records if r["kind"] == "eval"]
        assert evaluation["samples"] == 12  # every validation image once, across all ranks
        on_disk = json.load(open(os.path.join(run, "summary.json")))
        assert on_disk["params_sha256"] == summary["params_sha256"]


class NaNAt(torch.nn.Module):
    """Wraps a model; from forward call ``at`` on, rank ``rank`` returns NaN logits."""

    def __init__(self, model, rank, at):
        super().__init__()
        self.model, self.rank, self.at, self.calls = model, rank, at, 0

    def forward(self, x):
        self.calls += 1
        out = self.model(x)
        if self.calls >= self.at and MPI.COMM_WORLD.rank == self.rank:
            out = out * float("nan")
        return out


def test_non_finite_loss_on_one_rank_stops_every_rank_at_that_step(
        shards, comm, world, shared_tmp):
    from hpcdl.models import create_model

    config = recipe(world.size)
    model = NaNAt(create_model("resnet_small", num_classes=3, width=4, layers=[1, 1, 1]),
                  rank=world.size - 1, at=4)
    run = os.path.join(shared_tmp, "nan")
    trainer = Trainer(config, shards, run, comm, model=model,
                      options=TrainOptions(progress=False, checkpoint_every=2))
    try:
        with pytest.raises(NonFiniteLossError, match="at step 4") as info:
            trainer.train()
        before = trainer.params_sha256()
    finally:
        trainer.close()
    assert world.allgather(info.value.step) == [4] * world.size
    assert world.allgather(before) == [before] * world.size  # no rank stepped on the NaN
    assert os.path.basename(ckpt.list_checkpoints(run)[-1]) == "ckpt-000000002.pt"


def test_recipe_global_batch_mismatch_names_the_fix(shards, comm, world, shared_tmp):
    config = recipe(world.size)
    config.batch.global_ = PER_RANK * world.size * 2
    with pytest.raises(RecipeError, match=f"batch.per_rank={PER_RANK * 2}"):
        Trainer(config, shards, os.path.join(shared_tmp, "x"), comm)


def test_no_comm_leaves_each_rank_its_own_gradients(shards, comm, world, shared_tmp):
    trainer, summary = run_trainer(recipe(world.size), shards, os.path.join(shared_tmp, "nc"),
                                   comm, max_steps=2, no_comm=True, evaluate=False)
    assert summary["reducer"].startswith("disabled") and summary["comm_wait_s"] == 0.0
    hashes = world.allgather(summary["params_sha256"])
    if world.size > 1:
        assert len(set(hashes)) == world.size  # different data, no averaging: replicas differ


@pytest.mark.parametrize("threads", [1, pytest.param(2, marks=pytest.mark.max_ranks(2))])
def test_channels_last_and_bf16_request_train(shards, comm, world, shared_tmp, caplog,
                                              threads):
    from hpcdl.cpus import bf16_native

    caplog.set_level(logging.INFO, logger="hpcdl.train")   # the precision line
    # width 16: no strided 1x1 below 16 input channels (hpcdl.models.channels_last)
    config = recipe(world.size, width=16, channels_last=True, precision="auto")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        trainer, summary = run_trainer(config, shards, os.path.join(shared_tmp, "cl"), comm,
                                       max_steps=2, evaluate=False)
    finally:
        torch.set_num_threads(before)
    assert summary["steps"] == 2
    conv = next(m for m in trainer.model.modules() if isinstance(m, torch.nn.Conv2d))
    if threads > 1:
        assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    else:  # channels_last only with >= 2 threads (hpcdl.cpus.memory_format_name): said so
        assert trainer.memory_format == torch.contiguous_format
        assert "channels_last" in caplog.text
    expected = "bfloat16" if world.allreduce(int(bf16_native()), op=MPI.MIN) else "float32"
    assert summary["precision"] == trainer.precision == expected
    if world.rank == 0:   # the run as it ran: a resume elsewhere keeps the dtype
        with open(os.path.join(shared_tmp, "cl", "config.yaml"), encoding="utf-8") as f:
            assert f"precision: {expected}" in f.read()
    if expected == "bfloat16":
        assert trainer.autocast_dtype == torch.bfloat16
    else:  # said so, and trained in float32
        assert trainer.autocast_dtype is None
        assert "no native bf16" in caplog.text or world.rank != 0


@pytest.mark.parametrize("channels_last", [True, "auto"])
def test_channels_last_is_applied_on_two_cores(shards, world, shared_tmp, caplog,
                                               channels_last):
    """The test above on one rank whose 2 threads have the cores to themselves: rank 0 alone
    trains (channels_last needs >= 2 threads per rank, see Trainer._memory_format) while the
    other ranks sleep. ``auto`` (the shipped recipes) is channels_last where the run computes
    in bf16.
    """
    import time

    import hpcdl.comm
    from hpcdl.cpus import bf16_native

    threads = 2
    if (os.cpu_count() or 1) < threads:
        pytest.skip(f"{os.cpu_count()} core: channels_last needs {threads} threads on a rank")
    outcome = None
    caplog.set_level(logging.INFO, logger="hpcdl.train")   # the precision line
    if world.rank == 0:
        before = torch.get_num_threads()
        alone = hpcdl.comm.init("mpi", MPI.COMM_SELF)
        torch.set_num_threads(threads)
        try:
            trainer, summary = run_trainer(
                recipe(1, width=16, channels_last=channels_last, precision="auto"), shards,
                os.path.join(shared_tmp, f"cl2-{channels_last}"), alone, max_steps=2,
                evaluate=False)
            conv = next(m for m in trainer.model.modules() if isinstance(m, torch.nn.Conv2d))
            outcome = {"steps": summary["steps"], "memory_format": str(trainer.memory_format),
                       "conv_channels_last": conv.weight.is_contiguous(
                           memory_format=torch.channels_last),
                       "autocast": str(trainer.autocast_dtype),
                       "said_no_bf16": "no native bf16" in caplog.text}
        finally:  # the other ranks wait for this barrier whatever happened
            torch.set_num_threads(before)
            alone.close()
            # Non-blocking like theirs: a blocking collective never matches a non-blocking
            # one (MPI 3.1, sec. 5.12).
            world.Ibarrier().Wait()
    else:
        waiting = world.Ibarrier()
        while not waiting.Test():  # asleep, not spinning in MPI: the 2 cores are rank 0's
            time.sleep(0.05)
    outcome = world.bcast(outcome, root=0)
    assert outcome is not None, "rank 0 did not train (its error is in its own output)"
    assert outcome["steps"] == 2
    native = world.bcast(bf16_native(), root=0)
    if channels_last is True or native:
        assert outcome["memory_format"] == str(torch.channels_last)
        assert outcome["conv_channels_last"]
    else:   # auto in a float32 run: the layout it always had
        assert outcome["memory_format"] == str(torch.contiguous_format)
    if native:
        assert outcome["autocast"] == str(torch.bfloat16)
    else:
        assert outcome["autocast"] == "None" and outcome["said_no_bf16"]


def test_a_narrow_strided_1x1_trains_contiguous_naming_the_layer(shards, comm, world,
                                                                  shared_tmp, caplog):
    """resnet_small at width 4 down-samples through a 1x1 stride-2 convolution of 4 input
    channels, which oneDNN's channels_last backward cannot compute (hpcdl.models.channels_last:
    it crashed, hung or returned wrong gradients): asked for channels_last on 2 threads, the
    run trains contiguous and says which layer, and every mode of the bench would too."""
    from hpcdl.bench.baselines import recipe_memory_format

    caplog.set_level(logging.WARNING, logger="hpcdl.train")
    config = recipe(world.size, channels_last=True)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        trainer, summary = run_trainer(config, shards, os.path.join(shared_tmp, "narrow"),
                                       comm, max_steps=2, evaluate=False)
        baseline = recipe_memory_format(config, 2, trainer.model)
    finally:
        torch.set_num_threads(before)
    assert summary["steps"] == 2
    assert trainer.memory_format == baseline == torch.contiguous_format
    assert ("layer2.0.downsample.0 (1x1 convolution, stride 2, 4 input channels)"
            in caplog.text)


def test_fractional_epochs_complete_at_total_steps(shards, comm, world, shared_tmp):
    config = recipe(world.size)
    config.epochs = 0.5
    trainer, summary = run_trainer(config, shards, os.path.join(shared_tmp, "half"), comm,
                                   evaluate=False)
    assert summary["stopped"] == "completed"
    assert summary["steps"] == summary["total_steps"] == -(-trainer.steps_per_epoch // 2)


def test_total_steps_runs_past_the_nominal_epochs_as_a_solver_s_max_iter(
        shards, comm, world, shared_tmp):
    """train.total_steps (Caffe's max_iter, e.g. NVCaffe's 32K solver: 4,000 steps where 100
    epochs are 3,900) trains exactly that many steps, into the next epoch, and the schedule
    decays over them."""
    with pytest.raises(RecipeError, match="train.total_steps must be >= 1"):
        recipe(world.size, total_steps=0)
    config = recipe(world.size)
    config.epochs = 1
    trainer = Trainer(config, shards, os.path.join(shared_tmp, "one_epoch"), comm,
                      options=TrainOptions(progress=False, evaluate=False))
    steps = trainer.steps_per_epoch + 2
    trainer.close()
    config.train.total_steps = steps
    trainer, summary = run_trainer(config, shards, os.path.join(shared_tmp, "max_iter"), comm,
                                   evaluate=False)
    assert summary["stopped"] == "completed"
    assert summary["steps"] == summary["total_steps"] == steps
    assert trainer.schedule(steps) == pytest.approx(0.0, abs=1e-12)   # poly reaches 0 there
    assert trainer.schedule(steps - 2) > 0.0


def test_the_update_bucket_by_bucket_is_the_step_of_one_update(shards, comm, world, shared_tmp,
                                                                monkeypatch):
    """comm.overlap_update (the default): each bucket's parameters step as soon as their
    average arrives; the run ends with the parameters of waiting for every bucket and then
    one optimizer step."""
    import dataclasses

    import hpcdl.optim

    config = recipe(world.size)
    assert config.comm.overlap_update
    once = dataclasses.replace(config, comm=dataclasses.replace(config.comm,
                                                                overlap_update=False))
    parts = []
    step_parameters = hpcdl.optim.step_parameters
    monkeypatch.setattr(hpcdl.optim, "step_parameters",
                        lambda optimizer, params: (parts.append(len(params)),
                                                   step_parameters(optimizer, params)))
    trainer, overlapped = run_trainer(config, shards, os.path.join(shared_tmp, "ov"), comm,
                                      max_steps=4, evaluate=False)
    buckets = len(trainer.reducer.buckets)
    assert world.size == 1 or (buckets > 1 and len(parts) == 4 * buckets)
    parts.clear()
    _, whole = run_trainer(once, shards, os.path.join(shared_tmp, "one"), comm, max_steps=4,
                           evaluate=False)
    assert parts == []
    assert overlapped["params_sha256"] == whole["params_sha256"]
