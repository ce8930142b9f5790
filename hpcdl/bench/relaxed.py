"""Relaxed consistency against synchronous LARS and PyTorch's own, on Fashion-MNIST.

Ben-Nun & Hoefler (ACM CSUR 2019, §6) list two levers past synchronous SGD: relax model
consistency (local SGD, Lin et al. ICLR'20) and compress what is sent (PowerSGD, Vogels et al.
NeurIPS'19). Every run here trains the zoo's ``resnet_small`` with LARS at the same global
batch, epochs, schedule and data (Debian's full Fashion-MNIST, 60,000 / 10,000) through the real
pipeline; only the consistency policy differs:

=========================  ===================================================================
run                        what keeps replicas consistent
=========================  ===================================================================
``sync``                   hpcdl: gradients averaged every step (the baseline)
``local_sgd``              hpcdl: post-local SGD, synchronous warm-up, then H local steps
``hierarchical``           hpcdl: gradients inside a node every step, models across nodes
                           every H (``--ranks-per-node`` virtual nodes)
``powersgd``               hpcdl: rank-r PowerSGD with error feedback, after the warm-up
``ddp_post_local_sgd``     PyTorch DDP + gloo, ``post_localSGD_hook`` + ``PostLocalSGDOptimizer``
                           (``PeriodicModelAverager``), subgroups of one rank: the same H
``ddp_powersgd``           PyTorch DDP + gloo, ``powerSGD_hook`` at the same rank and warm-up
``ddp_sync``               PyTorch DDP + gloo, its default allreduce: the anchors' own baseline
                           (their loop is not the Trainer's; compare each anchor with it too)
=========================  ===================================================================

``--seeds 0,1,2`` repeats every run per seed; the report then adds one row per run with the
mean over seeds, and the goal is judged on the means. Per run: final top-1, bytes each rank
passed to allreduce (counted where they are sent; PyTorch's from ``PowerSGDState`` and the
averager's period), training wall time, and ``hpcdl plan``'s predicted minutes for AlexNet-BN
and ResNet-50 at 2,048 ``skx`` sockets (32K batch) with the same H or compression. Goal: ≥ 4×
fewer bytes per step at ≤ 0.5 points of top-1 below ``sync``. docs/performance.md, "Relaxed
consistency".

    mpiexec -n 4 hpcdl bench relaxed --json relaxed.json --plot relaxed.png
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from typing import Any

from hpcdl.bench.runs import (
    add_run_arguments,
    fmnist_model,
    fmnist_recipe,
    parse_choices,
    report_runs,
    train_run,
)

COMMAND = "relaxed"
HELP = "local SGD, hierarchical local SGD, PowerSGD vs synchronous LARS and PyTorch DDP's"

OURS = ("sync", "local_sgd", "hierarchical", "powersgd")
ANCHORS = ("ddp_post_local_sgd", "ddp_powersgd", "ddp_sync")
RUNS = OURS + ANCHORS
ALGORITHM = {"sync": "sync", "local_sgd": "local_sgd", "hierarchical": "hierarchical_local_sgd",
             "powersgd": "powersgd"}
COLUMNS = ["run", "seed", "top1", "top1_std", "top1_minus_sync", "bytes_per_step",
           "bytes_reduction", "train_s", "plan_alexnet_bn_min", "plan_resnet50_min"]
PLAN_MODELS = {"alexnet_bn": "alexnet_bn_lars_32k", "resnet50": "resnet50_lars_32k"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--epochs", type=float, default=2, help="epochs of every run (2)")
    parser.add_argument("--runs", default=",".join(RUNS), help=f"subset of {','.join(RUNS)}")
    parser.add_argument("--seeds", default="0",
                        help="comma-separated seeds; every run once per seed (0)")
    parser.add_argument("--global-batch", type=int, default=256, help="images per step (256)")
    parser.add_argument("--local-steps", type=int, default=8, help="H of local SGD (8)")
    parser.add_argument("--powersgd-rank", type=int, default=2, help="PowerSGD rank r (2)")
    parser.add_argument("--sync-warmup-epochs", type=float, default=0.25,
                        help="synchronous epochs before local SGD / PowerSGD start (0.25, the "
                             "learning-rate warm-up)")
    parser.add_argument("--ranks-per-node", type=int, default=2,
                        help="virtual node size of the hierarchical run (2)")
    parser.add_argument("--lr", type=float, default=2.0, help="LARS base lr (2.0)")
    parser.add_argument("--trust-coefficient", type=float, default=0.02, help="LARS eta (0.02)")
    parser.add_argument("--width", type=int, default=8, help="resnet_small width (8)")
    add_run_arguments(parser, backend=False)
    parser.add_argument("--plot", metavar="FILE", help="write top-1 vs bytes per step as PNG")


# -- recipes -------------------------------------------------------------------------------
def recipe(args: argparse.Namespace, run: str, ranks: int, steps_per_epoch: int,
           seed: int = 0) -> dict:
    """The run's recipe (hpcdl.train.config schema): every run the same but ``comm``."""
    per_rank, rest = divmod(args.global_batch, ranks)
    if rest:
        raise SystemExit(f"hpcdl bench relaxed: --global-batch {args.global_batch} is not a "
                         f"multiple of {ranks} ranks")
    comm: dict[str, Any] = {"backend": "mpi"}
    if run in ALGORITHM and run != "sync":
        comm.update(algorithm=ALGORITHM[run], local_steps=args.local_steps,
                    sync_warmup_steps=warmup_steps(args, steps_per_epoch),
                    powersgd_rank=args.powersgd_rank)
    return fmnist_recipe(
        f"fmnist_{run}", "hpcdl bench relaxed", fmnist_model(args),
        {"global": args.global_batch, "per_rank": per_rank}, args.epochs,
        {"name": "lars", "momentum": 0.9, "weight_decay": 5e-4,
         "trust_coefficient": args.trust_coefficient},
        args.lr, args.sync_warmup_epochs, comm, workers=1, seed=seed, log_every_steps=50)


def warmup_steps(args: argparse.Namespace, steps_per_epoch: int) -> int:
    return max(2, round(args.sync_warmup_epochs * steps_per_epoch))  # DDP's PowerSGD needs > 1


# -- ours ----------------------------------------------------------------------------------
def train_ours(world, args, run: str, shard_dir: str, out: str, seed: int = 0
               ) -> dict[str, Any]:
    from hpcdl.data import ShardedImageNet
    from hpcdl.train.config import CommConfig
    from hpcdl.train.session import RunSession

    per_node = args.ranks_per_node if run == "hierarchical" else None
    # the communicator's defaults; the run's reducer takes its recipe's bucket size
    with RunSession(world, CommConfig(backend="mpi"), log_level=None, threads=None,
                    ranks_per_node=per_node) as session:
        steps_per_epoch = len(ShardedImageNet.for_communicator(
            session.comm, shard_dir, "train", args.global_batch // world.size, image_size=28,
            workers=0))
        # seed 0 keeps the first pass's directory name: it resumes
        summary = train_run(session.comm, recipe(args, run, world.size, steps_per_epoch, seed),
                            shard_dir, os.path.join(out, run if seed == 0 else f"{run}-s{seed}"),
                            args.max_steps)
    traffic = summary["traffic"]
    return {"run": run, "seed": seed, "top1": summary["top1"], "steps": summary["steps"],
            "bytes_per_rank": traffic["bytes_world"], "bytes_node_per_rank": traffic["bytes_node"],
            "train_s": summary["train_s_total"], "traffic": traffic}


# -- PyTorch's anchors -----------------------------------------------------------------------
def train_anchor(world, args, run: str, shard_dir: str, seed: int = 0) -> dict[str, Any]:
    """DDP + gloo with PyTorch's hook for ``run``, the same model, data, LARS and schedule."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook, powerSGD_hook
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hpcdl.bench.baselines import plain_step
    from hpcdl.comm.gloo import init_process_group_over_mpi
    from hpcdl.data import ShardedImageNet
    from hpcdl.train.config import config_from_dict
    from hpcdl.train.trainer import recipe_model, recipe_optimizer, recipe_schedule

    if not dist.is_initialized():  # the default gloo group, once per process
        init_process_group_over_mpi(world)
    per_rank = args.global_batch // world.size
    loader = ShardedImageNet(shard_dir, split="train", node_index=0, num_nodes=1,
                             local_rank=world.rank, local_size=world.size, batch_size=per_rank,
                             image_size=28, seed=seed, workers=1, min_scale=0.7)
    steps_per_epoch = len(loader)
    config = config_from_dict(recipe(args, "sync", world.size, steps_per_epoch, seed))
    total = max(1, math.ceil(args.epochs * steps_per_epoch))
    last = min(total, args.max_steps or total)
    warmup = warmup_steps(args, steps_per_epoch)
    torch.manual_seed(seed)
    model = recipe_model(config)
    # BN statistics per rank, as ours
    ddp = DDP(model, bucket_cap_mb=config.comm.bucket_mb, broadcast_buffers=False)
    schedule = recipe_schedule(config, steps_per_epoch, total)
    optimizer = recipe_optimizer(config, model, schedule)
    dense = sum(p.numel() * 4 for p in model.parameters())
    if run == "ddp_post_local_sgd":
        # Subgroups of one rank: after the warm-up no gradient leaves its rank (plain local
        # SGD, like ours); the averager averages the models every H steps.
        subgroup, _ = dist.new_subgroups(group_size=1)
        state = post_localSGD_hook.PostLocalSGDState(process_group=None, subgroup=subgroup,
                                                     start_localSGD_iter=warmup)
        ddp.register_comm_hook(state, post_localSGD_hook.post_localSGD_hook)
        optimizer = PostLocalSGDOptimizer(
            optim=optimizer, averager=PeriodicModelAverager(period=args.local_steps,
                                                            warmup_steps=warmup))
    elif run == "ddp_powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None,
                                            matrix_approximation_rank=args.powersgd_rank,
                                            start_powerSGD_iter=warmup, random_seed=seed)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    train_step = plain_step(ddp, optimizer, schedule, bf16=False)  # the lr of step `step`
    step, start = 0, time.perf_counter()
    while step < last:
        loader.set_epoch(step // steps_per_epoch)
        for batch in loader:
            train_step(batch)
            step += 1
            if step >= last or step % steps_per_epoch == 0:
                break
    train_s = time.perf_counter() - start
    if run == "ddp_post_local_sgd":
        averages = len(range(warmup, step, args.local_steps))  # PeriodicModelAverager's
        sent = min(warmup, step) * dense + averages * dense
    elif run == "ddp_sync":
        sent = step * dense  # DDP's default hook: every gradient, every step
    else:
        # PowerSGD's own statistics: elements sent after compression (and before, during
        # the hook's vanilla-allreduce warm-up, which they do not count).
        sent = min(warmup, step) * dense + 4 * state.total_numel_after_compression
    top1 = evaluate_anchor(world, model, shard_dir, per_rank)
    dist.barrier()
    return {"run": run, "seed": seed, "top1": top1, "steps": step, "bytes_per_rank": int(sent),
            "bytes_node_per_rank": 0, "train_s": train_s}


def evaluate_anchor(world, model, shard_dir: str, per_rank: int) -> float:
    """Top-1 of the world's average model (parameters and BN statistics), as ours evaluate."""
    import numpy as np
    import torch
    import torch.distributed as dist

    from hpcdl.data import ShardedImageNet, normalize

    with torch.no_grad():
        for t in model.state_dict().values():
            if t.is_floating_point():
                dist.all_reduce(t)
                t.div_(world.size)
    loader = ShardedImageNet(shard_dir, split="val", node_index=0, num_nodes=1,
                             local_rank=world.rank, local_size=world.size, batch_size=per_rank,
                             image_size=28, workers=1)
    loader.set_epoch(0)
    model.eval()
    counts = np.zeros(2)
    with torch.no_grad():
        for images, labels in loader:
            counts += [float((model(normalize(images)).argmax(1) == labels).sum()), len(labels)]
    total = world.allreduce(counts)
    return float(total[0] / total[1])


# -- the planner -----------------------------------------------------------------------------
def planned_minutes(run: str, args: argparse.Namespace) -> dict[str, float]:
    """``hpcdl plan``'s total for each paper model's 32K recipe at 2,048 skx sockets."""
    from hpcdl.plan.machine import load_machine
    from hpcdl.plan.model import IMAGENET_TRAIN_IMAGES, PlanInputs, plan
    from hpcdl.plan.workload import powersgd_compression_ratio, workload

    machine = load_machine("skx")
    out = {}
    for model_name in PLAN_MODELS:
        extra: dict[str, Any] = {}
        if run in ("local_sgd", "ddp_post_local_sgd"):
            extra["local_steps"] = args.local_steps
        elif run == "hierarchical":
            extra.update(local_steps=args.local_steps, hierarchical_local=True)
        elif run in ("powersgd", "ddp_powersgd"):
            extra["compression_ratio"] = powersgd_compression_ratio(model_name,
                                                                    args.powersgd_rank)
        if extra:  # the same synchronous first phase, in epochs of ImageNet at 32K
            extra["sync_warmup_steps"] = round(args.sync_warmup_epochs
                                               * (IMAGENET_TRAIN_IMAGES // 32768))
        inputs = PlanInputs(global_batch=32768, procs=2048,
                            procs_per_node=machine.ranks_per_node,
                            epochs=100 if model_name == "alexnet_bn" else 90, **extra)
        out[f"plan_{model_name}_min"] = plan(machine, workload(model_name), inputs).total_s / 60
    return out


# -- the report ------------------------------------------------------------------------------
def finish(records: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Per-step bytes, the reduction against ``sync`` and the top-1 difference against the
    ``sync`` run of the same seed, in place; with several seeds, one row per run with the
    means (``seed`` = "mean", ``top1_std`` the sample standard deviation) is appended.
    Returns the ratios, from the means (goal per run: reduction ≥ 4 at top1_minus_sync ≥
    −0.5); anchors are also compared with ``ddp_sync`` (``{run}_top1_minus_ddp_sync``)."""
    plans: dict[str, dict[str, float]] = {}
    for r in records:
        r.setdefault("seed", 0)
        r["bytes_per_step"] = r["bytes_per_rank"] / max(1, r["steps"])
        if r["run"] not in plans:
            plans[r["run"]] = planned_minutes(r["run"], args)
        r.update(plans[r["run"]])
    for baseline, key in (("sync", "top1_minus_sync"), ("ddp_sync", "top1_minus_ddp_sync")):
        base = {r["seed"]: r for r in records if r["run"] == baseline}
        for r in records:
            if r["seed"] in base and r["run"] != baseline:
                r[key] = 100.0 * (r["top1"] - base[r["seed"]]["top1"])
                if baseline == "sync":
                    r["bytes_reduction"] = (base[r["seed"]]["bytes_per_step"]
                                            / max(r["bytes_per_step"], 1e-9))
    runs = list(dict.fromkeys(r["run"] for r in records))
    rows = {run: [r for r in records if r["run"] == run] for run in runs}
    # several seeds: a mean row per run, which the ratios then read
    summary = {run: rows[run][0] for run in runs}
    if any(len(group) > 1 for group in rows.values()):
        summary = {run: mean_row(run, rows[run]) for run in runs}
        records.extend(summary.values())
    ratios: dict[str, Any] = {}
    for run in runs:
        r = summary[run]
        if "top1_minus_ddp_sync" in r and run.startswith("ddp"):
            ratios[f"{run}_top1_minus_ddp_sync"] = r["top1_minus_ddp_sync"]
        if "top1_minus_sync" not in r:
            continue
        ratios[f"{run}_bytes_reduction"] = r["bytes_reduction"]
        ratios[f"{run}_top1_minus_sync"] = r["top1_minus_sync"]
        ratios[f"{run}_goal_met"] = bool(r["bytes_reduction"] >= 4
                                         and r["top1_minus_sync"] >= -0.5)
    return ratios


def mean_row(run: str, group: list[dict[str, Any]]) -> dict[str, Any]:
    """The mean over seeds of every number of ``group`` (one run's records)."""
    row: dict[str, Any] = {"run": run, "seed": "mean", "seeds": [r["seed"] for r in group]}
    for key, value in group[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "seed" \
                and all(key in r for r in group):
            row[key] = statistics.fmean(r[key] for r in group)
    row["top1_std"] = statistics.stdev(r["top1"] for r in group) if len(group) > 1 else 0.0
    row["top1_min"] = min(r["top1"] for r in group)
    row["top1_max"] = max(r["top1"] for r in group)
    return row


def plot(path: str, records: list[dict[str, Any]]) -> None:
    from hpcdl.results import png_axes

    means = [r for r in records if r.get("seed") == "mean"]  # several seeds: mean, min-max
    with png_axes(path, (6.4, 4.2)) as ax:
        for r in means or records:
            marker = "s" if r["run"].startswith("ddp") else "o"
            spread = ([[100 * (r["top1"] - r["top1_min"])],
                       [100 * (r["top1_max"] - r["top1"])]] if means else None)
            ax.errorbar(r["bytes_per_step"] / 1e6, 100 * r["top1"], yerr=spread, fmt=marker,
                        capsize=3)
            ax.annotate(r["run"], (r["bytes_per_step"] / 1e6, 100 * r["top1"]), fontsize=8,
                        xytext=(4, 4), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_xlabel("MB passed to allreduce per rank per step (log)")
        ax.set_ylabel("Fashion-MNIST test top-1 (%)")
        ax.set_title("Relaxed consistency vs synchronous LARS (o: hpcdl, s: PyTorch DDP)",
                     fontsize=9)
        ax.grid(True, alpha=0.3)


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        seeds = []
    if not seeds or len(set(seeds)) != len(seeds):
        raise SystemExit(f"hpcdl bench relaxed: --seeds {text!r}: give distinct integers, "
                         f"e.g. 0,1,2")
    return seeds


def run(args: argparse.Namespace) -> int:
    runs = parse_choices("relaxed", "--runs", args.runs, RUNS)
    from mpi4py import MPI

    from hpcdl.bench.runs import bench_workdir, fmnist_shards

    world = MPI.COMM_WORLD
    if "hierarchical" in runs and world.size % args.ranks_per_node:
        raise SystemExit(f"hpcdl bench relaxed: {world.size} ranks do not make nodes of "
                         f"--ranks-per-node {args.ranks_per_node}")
    with bench_workdir(world, args.out, "hpcdl-relaxed-") as out:
        start = time.perf_counter()
        shard_dir = fmnist_shards(world, args, out, holdout=False)
        records = []
        for seed in parse_seeds(args.seeds):
            for name in runs:
                if name in ANCHORS:
                    records.append(train_anchor(world, args, name, shard_dir, seed=seed))
                else:
                    records.append(train_ours(world, args, name, shard_dir, out, seed=seed))
                if world.rank == 0:
                    print(f"{name} seed {seed}: top-1 {records[-1]['top1']:.4f}, "
                          f"{records[-1]['bytes_per_rank'] / 1e6:.1f} MB, "
                          f"{records[-1]['train_s']:.0f} s", file=sys.stderr, flush=True)
        if world.rank == 0:
            ratios = finish(records, args)
            report_runs("relaxed", records, ratios, world.size, COLUMNS, args.json, start,
                        settings={k: getattr(args, k) for k in (
                            "seeds", "epochs", "global_batch", "local_steps", "powersgd_rank",
                            "sync_warmup_epochs", "ranks_per_node", "lr", "trust_coefficient",
                            "width", "source")})
            if args.plot:
                plot(args.plot, records)
                print(f"wrote {args.plot}")
            sys.stdout.flush()
    return 0
