"""Training-step throughput: hpcdl's step against the ceiling and the baselines, in one run.

Modes on the same ranks, model, batch and threads, taking turns (``--rounds``): ``ours`` (the
Trainer's step: overlapped GradientReducer, then LARS), ``no_comm`` (the same Trainer with its
reducer suspended: the ceiling, ``vs_no_comm``), ``ddp_gloo`` (PyTorch DDP on gloo,
``vs_ddp_gloo``), ``horovod`` (by name; absent, with the reason in ``absent_modes``, where
``horovod.torch`` does not import), ``ours@BACKEND``, ``ours_bf16`` (bf16 on the wire, on a
communicator of its own: a bf16 trial's pick, or ``ours``'s named backend), ``torch`` (plain
torch on the same model, LARS, schedule, precision and memory format, no hpcdl wrapper: each
mode's ``vs_torch``) and, with ``--shard-update``, ``ours_allreduce``.
Each step also records the NIC bytes of ``--nic``, the rank's CPU seconds and the reducer
thread's; the JSON names the hosts, their link shaping (``tc qdisc``) and the load average.
``flops_fraction_of_matmul`` (per mode and in ``ratios``): the step's training FLOP rate (6 ×
forward multiply-adds) over an n×n matmul's of the step's dtype on the same ranks.
docs/performance.md, "Training step" and "bf16".

    mpiexec -n 2 hpcdl bench train --model resnet50 --image-size 112 --synthetic --json F.json
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from hpcdl.bench.baselines import (
    Stepper,
    ddp_stepper,
    horovod_missing,
    horovod_stepper,
    torch_stepper,
)
from hpcdl.buckets import DEFAULT_BUCKET_MB
from hpcdl.cpus import (
    bf16_native,
    cpu_capability,
    cpu_model_name,
    memory_format_name,
    retain_freed_memory,
)
from hpcdl.host import nic_bytes, thread_cpu_s, thread_ids
from hpcdl.train.config import PRECISIONS
from hpcdl.train.precision import agreed_precision

COMMAND = "train"
HELP = "images/s per rank of hpcdl's step vs no communication (ceiling) and DDP on gloo"

MODES = ("ours", "no_comm", "ddp_gloo", "ours_allreduce", "ours_bf16", "horovod", "torch",
         "ddp_gloo_fp16")
COLUMNS = ["mode", "ranks", "batch_per_rank", "step_time_s", "images_per_s_per_rank",
           "compute_s", "comm_wait_s", "data_wait_s", "train_gflops_per_s",
           "flops_fraction_of_matmul", "vs_torch", "nic_tx_MB_per_step", "cpu_s_per_step",
           "comm_thread_cpu_share"]
#: The modes whose gradients cross the wire in 16 bits (the rest: float32).
WIRE_DTYPES = {"ours_bf16": "bfloat16", "ddp_gloo_fp16": "float16"}
#: --memory-format -> train.channels_last
MEMORY_FORMATS = {"auto": "auto", "channels_last": True, "contiguous": False}
#: The per-step counters each sample carries besides its times (see step_counters).
COUNTERS = ("nic_tx_bytes", "nic_rx_bytes", "cpu_s", "comm_thread_cpu_s")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="resnet50", help="a model of hpcdl.models")
    parser.add_argument("--image-size", type=int, default=112, help="input height = width")
    parser.add_argument("--num-classes", type=int, default=1000)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--synthetic", action="store_true",
                        help="random uint8 images made once in memory (no data wait)")
    source.add_argument("--data", metavar="SHARDS", help="real shards (data_prep output)")
    parser.add_argument("--batch", type=int, default=16, help="images per rank per step")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per mode")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds in which the modes take turns, each its share of --steps "
                             "(default min(4, --steps))")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first, per mode")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    parser.add_argument("--modes", default=None,
                        help=f"comma-separated subset of {','.join(MODES)}, or ours@BACKEND "
                             f"(default: the first three; the first four with --shard-update)")
    parser.add_argument("--no-comm", action="store_true",
                        help="only the compute ceiling (same as --modes no_comm)")
    parser.add_argument("--backend", default="auto",
                        help="comm backend of 'ours': auto (a timed trial of the model's "
                             "gradient buckets picks backend and buckets, printed and kept "
                             "in the JSON's comm_trial), rule, or a name")
    parser.add_argument("--bucket-mb", type=float, default=None,
                        help=f"fusion bucket size in MiB, ours and DDP alike (comm.bucket_mb; "
                             f"default {DEFAULT_BUCKET_MB:g}, or what --backend auto's trial "
                             f"chose; given, the trial keeps it)")
    parser.add_argument("--memory-format", choices=tuple(MEMORY_FORMATS), default="auto",
                        help="activation layout of every mode, as the recipes' "
                             "train.channels_last: auto (default) = channels_last for a "
                             "bfloat16 step, contiguous for float32; channels_last only with "
                             ">= 2 threads and a model oneDNN can train in it "
                             "(hpcdl.cpus.memory_format_name)")
    parser.add_argument("--malloc", choices=("retain", "default"), default="retain",
                        help="retain: glibc keeps freed activation memory (no page faults per "
                             "step); default: glibc's own thresholds")
    parser.add_argument("--workers", type=int, default=2, help="decode threads with --data")
    parser.add_argument("--matmul-size", type=int, default=2048,
                        help="n of the n×n fp32 matmul that sets the FLOP/s reference")
    parser.add_argument("--no-breakdown", dest="breakdown", action="store_false",
                        help="skip profiling a compute-only step into kernel categories")
    parser.add_argument("--shard-update", action="store_true",
                        help="ours shards the weight update (comm.shard_update; Xu et al. "
                             "2020); no_comm still runs the whole optimizer on every rank")
    parser.add_argument("--no-overlap-update", dest="overlap_update", action="store_false",
                        help="ours waits for every bucket, then takes one optimizer step "
                             "(comm.overlap_update: false), as DDP does; default: each "
                             "bucket's parameters step as soon as its average arrives")
    parser.add_argument("--precision", choices=PRECISIONS, default="auto",
                        help="every mode's compute dtype, as the recipes' train.precision: "
                             "auto (default, as every shipped recipe) = bfloat16 autocast "
                             "where bf16 is native (AVX512-BF16 or AMX), float32 elsewhere; "
                             "the FLOP reference is a matmul of that dtype. bfloat16 is "
                             "skipped, with a line saying why, where bf16 is not native")
    parser.add_argument("--bf16", dest="precision", action="store_const", const="bfloat16",
                        help="the same as --precision bfloat16")
    parser.add_argument("--nic", default="eth0",
                        help="network interface whose byte counters each step records")
    parser.add_argument("--json", metavar="FILE", help="write the results here (bench JSON)")


# -- inputs -----------------------------------------------------------------------------------
class SyntheticImages:
    """The loader contract of hpcdl.data (``set_epoch``, ``len``, iteration, ``data_wait_s``)
    over a few random uint8 batches made once: the step's cost without any input pipeline."""

    def __init__(self, batch_size: int, image_size: int, num_classes: int, length: int,
                 seed: int = 0, distinct: int = 4) -> None:
        import torch

        generator = torch.Generator().manual_seed(seed)
        self.batches = [
            (torch.randint(0, 256, (batch_size, 3, image_size, image_size), dtype=torch.uint8,
                           generator=generator),
             torch.randint(0, num_classes, (batch_size,), generator=generator))
            for _ in range(distinct)]
        self.length = length
        self.data_wait_s = 0.0

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.data_wait_s = 0.0

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator:
        for i in range(self.length):
            yield self.batches[i % len(self.batches)]


def make_loader(args: argparse.Namespace, comm, length: int):
    if args.synthetic:
        return SyntheticImages(args.batch, args.image_size, args.num_classes, length,
                               seed=comm.rank)
    from hpcdl.data import ShardedImageNet

    return ShardedImageNet.for_communicator(comm, args.data, "train", args.batch,
                                            image_size=args.image_size, workers=args.workers)


def endless(loader) -> Iterator:
    """Batches across epoch ends, so a short real split still feeds every timed step."""
    epoch = 0
    while True:
        loader.set_epoch(epoch)
        yield from loader
        epoch += 1


# -- the recipe every mode shares ----------------------------------------------------------
def bench_config(args: argparse.Namespace, ranks: int, precision: str = "float32"):
    """A recipe for timing: the ImageNet LARS recipe's optimizer, a small lr (random labels
    must not diverge during the timed steps), the bench's batch and bucket size, and the
    compute dtype ``--precision`` resolved to."""
    from hpcdl.train.config import config_from_dict

    return config_from_dict({
        "name": f"bench_train_{args.model}",
        "source": "hpcdl bench train",
        "model": {"name": args.model, "num_classes": args.num_classes},
        "data": {"image_size": args.image_size, "workers": args.workers},
        "batch": {"global": args.batch * ranks, "per_rank": args.batch},
        "epochs": 1,
        "optimizer": {"name": "lars", "momentum": 0.9, "weight_decay": 5.0e-5,
                      "trust_coefficient": 0.001},
        "schedule": {"name": "poly", "base_lr": 0.1, "warmup_epochs": 0, "power": 2.0},
        "train": {"channels_last": MEMORY_FORMATS[args.memory_format],
                  "log_every_steps": 10 ** 9, "precision": precision},
        # ours sends float32 as DDP does; ours_bf16 is the bf16-on-the-wire mode
        # --bucket-mb given: auto's trial times backends at that size only
        "comm": {"backend": args.backend, "trial_buckets": args.bucket_mb is None,
                 "bucket_mb": DEFAULT_BUCKET_MB if args.bucket_mb is None else args.bucket_mb,
                 "wire_dtype": "float32",
                 "overlap_update": bool(getattr(args, "overlap_update", True)),
                 "shard_update": bool(getattr(args, "shard_update", False))},
    }, origin="hpcdl bench train")


def with_trial_buckets(config, comm):
    """``config`` with the bucket size ``comm.backend: auto``'s trial chose, so every mode
    (``ours@BACKEND``, ``ours_bf16``, DDP's ``bucket_cap_mb``) uses the same buckets as
    ``ours``; rank 0 prints the trial's line. Unchanged without a trial."""
    if comm.trial is None:
        return config
    if comm.rank == 0:
        print(f"bench train: {comm.trial.line()}", file=sys.stderr, flush=True)
    return dataclasses.replace(config, comm=dataclasses.replace(
        config.comm, bucket_mb=comm.trial.bucket_mb))


# -- timing -------------------------------------------------------------------------------------
# Each mode is a Stepper (hpcdl/bench/baselines.py). Every mode stays built for the whole
# run, so the modes can take turns (see time_rounds).


@contextlib.contextmanager
def trainer_steppers(comm, config, loader, modes: list[str]) -> Iterator[dict[str, Stepper]]:
    """``ours`` (Trainer.train_step, overlapped reducer) and ``no_comm`` (the same step with
    the reducer suspended) on ONE Trainer: the two modes share the model's memory, optimizer
    state and buffers, so their difference is the communication alone, not where each
    instance's tensors happen to lie (two instances running identical code differed by 4% on
    this VM)."""
    from hpcdl.train.trainer import Trainer, TrainOptions

    # a Trainer that communicates when any mode does (ours_allreduce suspends sharding only)
    communicates = bool({"ours", "ours_allreduce"} & set(modes))
    options = TrainOptions(no_comm=not communicates, progress=False, handle_signals=False,
                           write_files=False, evaluate=False)
    with tempfile.TemporaryDirectory(prefix="hpcdl-bench-train-") as run_dir:
        trainer = Trainer(config, None, run_dir, comm, options=options, train_loader=loader)

        def ours(batch) -> float:
            trainer.train_step([batch])
            return trainer.reducer.comm_wait_s

        def no_comm(batch) -> float:
            with trainer.reducer.suspended():
                trainer.train_step([batch])
            return 0.0

        def ours_allreduce(batch) -> float:
            # --shard-update: the same Trainer's step without sharding (allreduce, the whole
            # update on every rank), so sharding is compared on one instance.
            with trainer.optimizer.unsharded():
                trainer.train_step([batch])
            return trainer.reducer.comm_wait_s

        try:
            yield {mode: {"ours": ours, "no_comm": no_comm,
                          "ours_allreduce": ours_allreduce}[mode] for mode in modes}
        finally:
            trainer.close()


def bf16_wire_backend(requested: str, comm) -> str:
    """The backend of ``ours_bf16``, bf16 on the wire being a communicator's property:
    ``auto`` (``--backend``'s default) runs a trial of its own among the backends that send
    bf16 (one that cannot, ``mpi``, drops out of it), as a bf16 run's ``auto`` would; otherwise
    ``ours``'s backend where it sends bf16 (hpcdl.train.precision), else ``ring`` in place of
    ``mpi``."""
    from hpcdl.train.precision import BF16_WIRE_BACKENDS

    if requested == "auto":
        return "auto"
    return comm.backend if comm.backend in BF16_WIRE_BACKENDS else "ring"


def own_backend(mode: str) -> str | None:
    """``ours@BACKEND`` -> BACKEND (``ours`` on a communicator of that backend), else None."""
    return mode.split("@", 1)[1] if mode.startswith("ours@") else None


@contextlib.contextmanager
def own_comm_stepper(world, config, loader, backend: str,
                     wire_dtype: str = "float32") -> Iterator[Stepper]:
    """``ours`` on a Trainer and a communicator of its own: ``ours@BACKEND`` (the same
    overlapped reducer on another backend) and ``ours_bf16`` (bf16 on the wire, which is
    fixed when a communicator is built). Its stepper carries ``.backend`` and ``.trial``
    (``backend="auto"``: the trial of this communicator's own, on the model's gradients)."""
    from hpcdl.train.session import RunSession, recipe_gradients

    section = dataclasses.replace(config.comm, backend=backend, wire_dtype=wire_dtype)
    with RunSession(world, section, log_level=None, threads=None,
                    gradients=recipe_gradients(config)) as session, \
            trainer_steppers(session.comm, config, loader, ["ours"]) as steppers:
        step = steppers["ours"]
        step.backend = session.comm.backend
        step.trial = session.comm.trial
        yield step


# -- what a step costs the host, read from the operating system --------------------------------
def comm_thread_ids(compute: set[int]) -> set[int]:
    """The threads that move gradients, for every mode alike: all of this process's but the
    ``compute`` ones (main and torch's intra-op pool, taken before any communicator opened)
    and the loader's decode threads -- the reducer's, the transports' own (gloo's loop and
    workers, DDP's among them), the stall watchdog."""
    from hpcdl.data.loader import LOADER_THREAD_NAME

    loader = {t.native_id for t in threading.enumerate()
              if t.name.startswith(LOADER_THREAD_NAME)}
    return thread_ids() - compute - loader


def compute_thread_ids(threads: int) -> set[int]:
    """This process's threads once torch's intra-op pool of ``threads`` has started: call it
    before any communicator opens (:func:`comm_thread_ids` counts every thread after)."""
    import torch

    torch.set_num_threads(threads)
    square = torch.ones(256, 256)
    torch.mm(square, square)  # a parallel region: the pool's threads exist from here on
    return thread_ids()


def step_counters(nic: str | None, compute: set[int] | None = None
                  ) -> Callable[[], dict[str, float | None]]:
    """A reader of the counters a step's sample records (COUNTERS): the NIC's bytes, the
    process's CPU seconds (all threads), the communication threads' CPU seconds
    (:func:`comm_thread_ids`; ``compute`` None: the threads there are now)."""
    compute = thread_ids() if compute is None else compute

    def read() -> dict[str, float | None]:
        sent_received = nic_bytes(nic) if nic else None
        return {"nic_tx_bytes": sent_received[0] if sent_received else None,
                "nic_rx_bytes": sent_received[1] if sent_received else None,
                # the process clock (every thread) in ns: os.times() counts 10-ms ticks,
                # which a few-ms step of a small model rounds to nothing
                "cpu_s": time.process_time(),
                "comm_thread_cpu_s": thread_cpu_s(comm_thread_ids(compute))}
    return read


def counter_deltas(before: dict[str, float | None],
                   after: dict[str, float | None]) -> dict[str, float | None]:
    return {k: (None if before[k] is None or after[k] is None else after[k] - before[k])
            for k in before}


def time_rounds(world, steppers: dict[str, Stepper], loader, steps: int, warmup: int,
                rounds: int, counters: Callable[[], dict[str, float | None]] | None = None,
                ) -> dict[str, list[dict[str, float | None]]]:
    """Per-step (step, comm wait, data wait) seconds of every mode, after ``warmup`` untimed
    steps each, the modes taking turns in ``rounds`` rotated rounds: a drift during the run
    (heap growth, cache and frequency state, a neighbour's load) is spread over all modes
    instead of landing in one. ``counters`` (step_counters) adds what each step cost."""
    batches = endless(loader)
    samples: dict[str, list[dict[str, float | None]]] = {mode: [] for mode in steppers}
    names = list(steppers)
    for mode in names:
        for _ in range(warmup):
            steppers[mode](next(batches))
    shares = [steps // rounds + (1 if r < steps % rounds else 0) for r in range(rounds)]
    for r, share in enumerate(shares):
        order = names[r % len(names):] + names[:r % len(names)]
        for mode in order:
            world.Barrier()  # every rank starts the mode's steps together
            for _ in range(share):
                before = counters() if counters else None
                start = time.perf_counter()
                batch = next(batches)
                data_wait = time.perf_counter() - start
                comm_wait = steppers[mode](batch)
                sample = {"step": time.perf_counter() - start, "comm_wait": comm_wait,
                          "data_wait": data_wait}
                if before is not None:
                    sample.update(counter_deltas(before, counters()))
                samples[mode].append(sample)
    return samples


#: Operator categories of the step's time (torch.profiler self time), first match wins.
KERNEL_CATEGORIES = (
    ("convolution", ("convolution", "conv2d", "conv_")),
    ("matmul", ("addmm", "aten::mm", "aten::bmm", "linear")),
    ("batch_norm", ("batch_norm",)),
    ("elementwise", ("relu", "threshold", "clamp", "add", "mul", "div", "sub", "copy_", "fill",
                     "zero", "where", "sqrt", "norm", "foreach", "lerp")),
    ("pooling", ("pool",)),
)


def kernel_category(op: str) -> str:
    lower = op.lower()
    for category, needles in KERNEL_CATEGORIES:
        if any(n in lower for n in needles):
            return category
    return "other"


def compute_breakdown(step: Stepper, batches: Iterator, train_flops_per_image: float,
                      batch: int, steps: int = 2) -> dict[str, float]:
    """Profile ``steps`` steps (torch.profiler, CPU) and split their time by kernel category.

    Returns each category's share of the profiled time, the step time under the profiler,
    and ``dense_gflops_per_s``: the step's FLOPs over the time spent in convolution and
    matmul kernels alone -- the FLOP rate the step would have if every other operator
    (batch norm, ReLU, adds, pooling, the optimizer) took no time at all."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step(next(batches))
        wall = (time.perf_counter() - start) / steps
    seconds: dict[str, float] = {}
    for event in prof.key_averages():
        category = kernel_category(event.key)
        seconds[category] = seconds.get(category, 0.0) + event.self_cpu_time_total / 1e6 / steps
    total = sum(seconds.values()) or 1.0
    result = {f"{c}_share": t / total for c, t in sorted(seconds.items())}
    dense = seconds.get("convolution", 0.0) + seconds.get("matmul", 0.0)
    result["profiled_step_s"] = wall
    result["dense_gflops_per_s"] = (train_flops_per_image * batch / dense / 1e9) if dense else 0.0
    return result


def print_breakdown(breakdown: dict[str, Any], matmul: float) -> None:
    shares = ", ".join(f"{k[:-6]} {100 * v:.1f}%" for k, v in breakdown.items()
                       if k.endswith("_share"))
    print(f"compute breakdown ({breakdown['mode']}, rank 0, profiled): {shares}; convolution "
          f"and matmul kernels alone run at {breakdown['dense_gflops_per_s']:.1f} GFLOP/s = "
          f"{breakdown['dense_gflops_per_s'] * 1e9 / matmul:.2f} of the matmul reference",
          file=sys.stderr, flush=True)


def matmul_rates(n: int, seconds: float = 2.0, min_repeats: int = 3,
                 dtype: str = "float32") -> tuple[float, float]:
    """(FLOPs per wall second, FLOPs per CPU second of this process) of an n×n matmul of
    ``dtype`` on this rank's threads. The second is what a shared core does not move: a
    step and a matmul that each wait for cores still compare per CPU second."""
    import torch

    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=generator).to(getattr(torch, dtype)) for _ in range(2))
    out = torch.empty(n, n, dtype=a.dtype)
    torch.mm(a, b, out=out)
    repeats, start, cpu_start = 0, time.perf_counter(), time.process_time()
    while repeats < min_repeats or time.perf_counter() - start < seconds:
        torch.mm(a, b, out=out)
        repeats += 1
    flops = 2.0 * n ** 3 * repeats
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    return flops / wall, flops / cpu if cpu > 0 else math.nan


# -- summarising over ranks -----------------------------------------------------------------------
def mean_of(rows: list[dict[str, float | None]], key: str) -> float | None:
    """The mean of ``key`` over the rows that hold a value for it (None: none does)."""
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.fmean(values) if values else None


def rank_means(samples: list[dict[str, float]]) -> dict[str, float | None]:
    means = {key: mean_of(samples, key) for key in ("step", "comm_wait", "data_wait")}
    means["step_median"] = statistics.median(s["step"] for s in samples)
    for key in COUNTERS:
        if any(key in s for s in samples):
            means[key] = mean_of(samples, key)
    return means


def mode_record(mode: str, per_rank: list[dict[str, float | None]], batch: int,
                train_flops_per_image: float) -> dict[str, Any]:
    """One record per mode: each quantity the mean over ranks of the per-rank mean."""
    step = mean_of(per_rank, "step")
    comm_wait = mean_of(per_rank, "comm_wait")
    data_wait = mean_of(per_rank, "data_wait")
    compute = step - (comm_wait or 0.0) - (data_wait or 0.0)
    record = {
        "mode": mode, "ranks": len(per_rank), "batch_per_rank": batch,
        "step_time_s": step,
        "step_time_median_s": mean_of(per_rank, "step_median"),
        "step_time_max_rank_s": max(r["step"] for r in per_rank),
        "images_per_s_per_rank": batch / step,
        "compute_s": compute, "comm_wait_s": comm_wait, "data_wait_s": data_wait,
        "train_gflops_per_s": train_flops_per_image * batch / compute / 1e9,
    }
    if any(key in r for r in per_rank for key in COUNTERS):
        record.update(step_costs(per_rank, step))
    return record


def step_costs(per_rank: list[dict[str, float | None]], step: float) -> dict[str, Any]:
    """What a step cost the hosts, per step: NIC bytes (each rank reads its host's counter,
    so the mean over ranks is the mean over hosts when every host runs as many ranks), the
    rank's CPU seconds and its communication thread's, and their shares of the step."""
    tx, rx = mean_of(per_rank, "nic_tx_bytes"), mean_of(per_rank, "nic_rx_bytes")
    cpu, comm_cpu = mean_of(per_rank, "cpu_s"), mean_of(per_rank, "comm_thread_cpu_s")
    return {
        "nic_tx_bytes_per_step": tx, "nic_rx_bytes_per_step": rx,
        "nic_tx_MB_per_step": tx / 1e6 if tx is not None else None,
        "cpu_s_per_step": cpu,
        "cpu_share_of_step": cpu / step if cpu is not None else None,
        "comm_thread_cpu_s_per_step": comm_cpu,
        "comm_thread_cpu_share": comm_cpu / step if comm_cpu is not None else None,
    }


def compare_with_peak_and_torch(records: dict[str, dict[str, Any]], matmul: float,
                                matmul_per_cpu_s: float | None = None,
                                train_flops_per_image: float | None = None) -> None:
    """Add to each mode's record its FLOP rate's fraction of the dtype's matmul peak
    (``flops_fraction_of_matmul``, of the compute part of the step), the same per CPU second
    of the process (``cpu_flops_fraction_of_matmul``: the step's FLOPs per CPU second over
    the matmul's, when both are given: what load on shared cores does not move) and, when the
    ``torch`` mode ran, its images/s over plain torch's (``vs_torch``)."""
    plain = records.get("torch")
    for record in records.values():
        record["flops_fraction_of_matmul"] = record["train_gflops_per_s"] * 1e9 / matmul
        cpu_s = record.get("cpu_s_per_step")
        if matmul_per_cpu_s and train_flops_per_image and cpu_s:
            record["cpu_flops_fraction_of_matmul"] = (
                train_flops_per_image * record["batch_per_rank"] / cpu_s / matmul_per_cpu_s)
        if plain is not None:
            record["vs_torch"] = (record["images_per_s_per_rank"]
                                  / plain["images_per_s_per_rank"])


def ratios_of(records: dict[str, dict[str, Any]], matmul: float,
              train_flops_per_image: float) -> dict[str, Any]:
    ratios: dict[str, Any] = {}

    def compare(prefix: str, mode: str, others: tuple[str, ...]) -> None:
        """``prefix + other``: images/s of ``mode`` over those of each other mode run."""
        for other in others:
            if other in records:
                ratios[prefix + other] = (records[mode]["images_per_s_per_rank"]
                                          / records[other]["images_per_s_per_rank"])

    ours = records.get("ours")
    if ours is not None:
        ratios["images_per_s_per_rank"] = ours["images_per_s_per_rank"]
        compare("vs_", "ours", ("no_comm", "ddp_gloo", "horovod", "torch"))
    if "no_comm" in records:   # hpcdl's compute-only step against plain torch's
        compare("no_comm_vs_", "no_comm", ("torch",))
    for mode in records:   # ours@BACKEND: the same comparisons, by name
        if own_backend(mode):
            compare(f"{mode}_vs_", mode, ("no_comm", "ddp_gloo"))
    if "ours_bf16" in records:   # bf16 gradients on the wire
        compare("bf16_wire_vs_", "ours_bf16", ("no_comm", "ddp_gloo", "ddp_gloo_fp16", "ours"))
    if "ddp_gloo_fp16" in records:   # DDP's own 16-bit wire against its fp32 one
        compare("ddp_fp16_wire_vs_", "ddp_gloo_fp16", ("no_comm", "ddp_gloo"))
    plain = records.get("ours_allreduce")
    if plain is not None:   # --shard-update: the unsharded step of the same run
        compare("allreduce_vs_", "ours_allreduce", ("no_comm", "ddp_gloo"))
        if ours is not None:
            ratios["sharded_vs_allreduce"] = (ours["images_per_s_per_rank"]
                                              / plain["images_per_s_per_rank"])
    # Compute efficiency of the step's compute part (comm and data waits excluded), taken from
    # ours, or from the ceiling when ours was not run.
    base = ours or records.get("no_comm") or records.get("ddp_gloo") or records.get("torch")
    if base is not None:
        ratios["flops_fraction_of_matmul"] = base["train_gflops_per_s"] * 1e9 / matmul
        ratios["comm_wait"] = (base["comm_wait_s"] or 0.0) / base["step_time_s"]
        ratios["data_wait"] = (base["data_wait_s"] or 0.0) / base["step_time_s"]
    ratios["matmul_gflops_per_s_per_rank"] = matmul / 1e9
    ratios["train_gflop_per_image"] = train_flops_per_image / 1e9
    return ratios


def parse_modes(args: argparse.Namespace) -> list[str]:
    if args.no_comm:
        return ["no_comm"]
    shard = getattr(args, "shard_update", False)
    spec = args.modes
    if spec is None:   # the default: every mode that applies
        spec = ",".join(MODES[:4] if shard else MODES[:3])
    modes = [m.strip() for m in spec.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES and not own_backend(m)]
    if unknown or not modes:
        raise SystemExit(f"hpcdl bench train: --modes {spec!r}: choose from "
                         f"{', '.join(MODES)}, or ours@BACKEND (e.g. ours@gloo)")
    if shard and any(own_backend(m) for m in modes):
        raise SystemExit("hpcdl bench train: ours@BACKEND modes run the plain allreduce; "
                         "drop --shard-update or those modes")
    if "ours_bf16" in modes and shard:
        raise SystemExit("hpcdl bench train: mode ours_bf16 (bf16 on the wire) cannot run with "
                         "--shard-update (the sharded update allgathers fp32 parameters); "
                         "drop one of the two")
    if "ours_allreduce" in modes and not shard:
        raise SystemExit("hpcdl bench train: mode ours_allreduce (ours without sharding, on "
                         "the sharded Trainer) needs --shard-update; without it, ours is "
                         "the allreduce")
    return modes


def check_args(args: argparse.Namespace) -> None:
    if args.rounds is None:
        args.rounds = min(4, max(args.steps, 1))
    if args.rounds > args.steps:
        raise SystemExit(f"hpcdl bench train: --rounds {args.rounds} is more than --steps "
                         f"{args.steps}: every round needs at least one step per mode")
    for name, low in (("batch", 1), ("steps", 1), ("rounds", 1), ("warmup", 0), ("threads", 1),
                      ("image_size", 8), ("matmul_size", 64)):
        if getattr(args, name) < low:
            raise SystemExit(f"hpcdl bench train: --{name.replace('_', '-')} must be >= {low}, "
                             f"got {getattr(args, name)}")


def record_backend(mode: str, comm, steppers: dict[str, Stepper]) -> str:
    if mode in ("ddp_gloo", "ddp_gloo_fp16"):
        return "gloo"
    if mode == "horovod":
        return "horovod (MPI)"
    return getattr(steppers[mode], "backend", comm.backend)


def overlaps_update(mode: str, args: argparse.Namespace) -> bool:
    """Whether ``mode`` steps each bucket as its average arrives (the Trainer's overlapped
    update, LARS being per tensor): hpcdl's communicating modes unless ``--no-overlap-update``
    or a sharded optimizer (``--shard-update``'s Trainer, ``ours_allreduce`` too); the ceiling
    and the baselines take one step after backward."""
    sharded = args.shard_update and mode in ("ours", "ours_allreduce")
    return args.overlap_update and mode.startswith("ours") and not sharded


def link_shaping(nic: str) -> str | None:
    """This host's queueing discipline on ``nic`` (``tc qdisc show``: a ``tbf rate`` line on
    a shaped link), or None where tc or the NIC is missing."""
    if not nic or shutil.which("tc") is None or nic_bytes(nic) is None:
        return None
    try:
        shown = subprocess.run(["tc", "qdisc", "show", "dev", nic], capture_output=True,
                               text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return shown.stdout.strip() or None if shown.returncode == 0 else None


def hosts_note(hosts: list[tuple[str, str | None]], nic: str) -> dict[str, Any]:
    """The hosts the ranks ran on (rank order), ranks per host and each host's shaping."""
    names = [name for name, _ in hosts]
    unique = list(dict.fromkeys(names))
    return {"hosts": unique, "ranks_per_host": {h: names.count(h) for h in unique},
            "nic": nic, "link_shaping": {name: shaping for name, shaping in hosts}}


def bf16_skip_reason() -> str | None:
    """Why ``--precision bfloat16`` cannot be measured here, or None: emulated bf16 would time
    the emulation."""
    if bf16_native():
        return None
    return (f"hpcdl bench train --precision bfloat16: skipped: this CPU ({cpu_model_name()}, "
            f"torch capability {cpu_capability()}) has no native bf16 (AVX512-BF16 or AMX "
            "with torch at AVX-512); run it on a Cooper Lake, Sapphire Rapids or Zen 4 node")


def run(args: argparse.Namespace) -> int:
    check_args(args)
    modes = parse_modes(args)
    from mpi4py import MPI

    if args.precision == "bfloat16" and (reason := bf16_skip_reason()) is not None:
        if MPI.COMM_WORLD.rank == 0:
            print(reason, flush=True)
            if args.json:
                from hpcdl.results import bench_report, write_json

                report = bench_report("train", [], {}, ranks=MPI.COMM_WORLD.size)
                write_json(args.json, {**report, "skipped": reason})
        return 0

    absent = {}
    if "horovod" in modes and (reason := horovod_missing()) is not None:
        modes = [m for m in modes if m != "horovod"]
        absent["horovod"] = reason
        if MPI.COMM_WORLD.rank == 0:
            print(f"hpcdl bench train: mode horovod absent: {reason}", file=sys.stderr,
                  flush=True)

    from hpcdl.models import channels_last_unsafe_layer, create_model, flops
    from hpcdl.results import bench_report, emit
    from hpcdl.train.session import RunSession, recipe_gradients

    world = MPI.COMM_WORLD
    load_before = os.getloadavg()
    malloc = "retain" if args.malloc == "retain" and retain_freed_memory() else "default"
    precision = agreed_precision(args.precision, world)
    config = bench_config(args, world.size, precision)
    compute_threads = compute_thread_ids(args.threads)
    # no rank logs: the bench prints its own lines; fail-fast comes with the communicator
    with RunSession(world, config.comm, log_level=None, threads=args.threads,
                    gradients=recipe_gradients(config)) as session:
        comm = session.comm
        config = with_trial_buckets(config, comm)
        model = create_model(args.model, num_classes=args.num_classes)
        macs = flops(model, args.image_size)
        unsafe_layer = channels_last_unsafe_layer(model)  # the records' layout, as ours runs
        del model
        train_flops_per_image = 6.0 * macs  # 2 FLOPs per multiply-add; backward ≈ 2× forward
        loader = make_loader(args, comm, args.warmup + args.steps)
        if comm.rank == 0:
            print(f"bench train: {', '.join(modes)} on {comm.size} rank(s), {args.warmup} "
                  f"warm-up + {args.steps} timed steps each in {args.rounds} round(s), batch "
                  f"{args.batch} x {args.model} @{args.image_size}px",
                  file=sys.stderr, flush=True)
        with contextlib.ExitStack() as stack:
            built = {}
            trainer_modes = [m for m in modes if m in ("ours", "no_comm", "ours_allreduce")]
            if trainer_modes:
                built.update(stack.enter_context(
                    trainer_steppers(comm, config, loader, trainer_modes)))
            for mode in modes:
                if own_backend(mode) is not None:
                    built[mode] = stack.enter_context(own_comm_stepper(
                        world, config, loader, own_backend(mode)))
            if "ours_bf16" in modes:
                built["ours_bf16"] = stack.enter_context(own_comm_stepper(
                    world, config, loader, bf16_wire_backend(args.backend, comm),
                    wire_dtype="bfloat16"))
            for mode in ("ddp_gloo", "ddp_gloo_fp16"):
                if mode in modes:
                    built[mode] = stack.enter_context(ddp_stepper(
                        world, config, args.warmup + args.steps, mode == "ddp_gloo_fp16"))
            for mode, stepper in (("horovod", horovod_stepper), ("torch", torch_stepper)):
                if mode in modes:
                    built[mode] = stack.enter_context(stepper(config, args.warmup + args.steps))
            steppers = {mode: built[mode] for mode in modes}
            samples = time_rounds(world, steppers, loader, args.steps, args.warmup,
                                  args.rounds, counters=step_counters(args.nic, compute_threads))
            breakdown = None
            profiled = next((m for m in ("no_comm", "ours", "ddp_gloo", "torch")
                             if m in steppers), None)
            if args.breakdown and profiled is not None:
                world.Barrier()
                breakdown = compute_breakdown(steppers[profiled], endless(loader),
                                              train_flops_per_image, args.batch)
                breakdown["mode"] = profiled
        records = {}
        for mode in modes:
            per_rank = world.allgather(rank_means(samples[mode]))
            records[mode] = mode_record(mode, per_rank, args.batch, train_flops_per_image)
        world.Barrier()  # every rank multiplies at once, as every rank trained at once
        rates = world.allgather(matmul_rates(args.matmul_size, dtype=precision))
        matmul = statistics.fmean(wall for wall, _ in rates)
        matmul_per_cpu_s = statistics.fmean(cpu for _, cpu in rates)
        hosts = world.allgather((MPI.Get_processor_name(), link_shaping(args.nic)))
        if comm.rank == 0:
            layout = memory_format_name(config.train.channels_last, args.threads, precision,
                                        unsafe_layer)
            compare_with_peak_and_torch(records, matmul, matmul_per_cpu_s,
                                        train_flops_per_image)
            for mode, record in records.items():
                record.update(model=args.model, image_size=args.image_size, threads=args.threads,
                              memory_format=layout, malloc=malloc, precision=precision,
                              wire_dtype=WIRE_DTYPES.get(mode, "float32"),
                              shard_update=bool(args.shard_update and mode == "ours"),
                              overlap_update=overlaps_update(mode, args),
                              backend=record_backend(mode, comm, steppers),
                              bucket_mb=config.comm.bucket_mb,
                              input="synthetic" if args.synthetic else args.data)
            report = bench_report("train", list(records.values()),
                                  ratios_of(records, matmul, train_flops_per_image),
                                  ranks=comm.size)
            ratios = report["ratios"]
            ratios["matmul_gflops_per_cpu_s_per_rank"] = matmul_per_cpu_s / 1e9
            if breakdown is not None:
                # Upper bound of the FLOP fraction with every non-dense operator fused away.
                ratios["dense_kernels_fraction_of_matmul"] = \
                    breakdown["dense_gflops_per_s"] * 1e9 / matmul
                report["compute_breakdown"] = breakdown
                print_breakdown(breakdown, matmul)
            report["machine"].update(
                threads_per_rank=args.threads, omp_num_threads=os.environ.get("OMP_NUM_THREADS"),
                **hosts_note(hosts, args.nic),
                load_average={"before": list(load_before), "after": list(os.getloadavg())})
            if absent:
                report["absent_modes"] = absent
            if comm.trial is not None:
                report["comm_trial"] = comm.trial.record()
            bf16_trial = getattr(steppers.get("ours_bf16"), "trial", None)
            if bf16_trial is not None:
                report["comm_trial_bf16_wire"] = bf16_trial.record()
            emit(report, COLUMNS, args.json)
    return 0
