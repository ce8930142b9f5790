"""LTFB against the data-parallel trainer a user would otherwise run: accuracy against wall-clock
time on all of Fashion-MNIST (Debian's ``dataset-fashion-mnist``: 60,000 train / 10,000 test),
the same ranks and the same number of images processed.

=================  ==========================================================================
run                what trains
=================  ==========================================================================
``data_parallel``  one trainer over all P ranks, global batch P x per-rank, every step one
                   allreduce over the world
``ltfb``           K trainers of P/K ranks (Jacobs et al., MLHPC'17), global batch P/K x
                   per-rank each, each on 1/K of the shards minus a 5 % tournament holdout; a
                   pairwise tournament every ``--tournament-interval`` steps
=================  ==========================================================================

Both process P x per-rank images per step, and the LTFB run gets as many steps as the
data-parallel one (its epochs are counted over its smaller partition). Each trainer evaluates
on the 10,000 test images every epoch; the LTFB curve is the best trainer's. The bench JSON
has every evaluation, the tournament rounds and the settings. docs/performance.md, "LTFB".

    mpiexec -n 4 hpcdl bench ltfb --json ltfb.json --plot docs/ltfb_accuracy.png
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import time
from typing import Any

from hpcdl.bench.runs import add_run_arguments, fmnist_model, fmnist_recipe, report_runs

COMMAND = "ltfb"
HELP = "Fashion-MNIST accuracy vs time: K LTFB trainers vs one data-parallel trainer"

COLUMNS = ["run", "trainer", "step", "images", "elapsed_s", "top1", "eval_loss"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--epochs", type=float, default=3,
                        help="data-parallel epochs; LTFB gets the same number of images "
                             "(default 3: ≈ 8-10 min on 2 quiet cores)")
    parser.add_argument("--trainers", type=int, default=2, help="LTFB trainers K (default 2)")
    parser.add_argument("--tournament-interval", type=int, default=50, metavar="N",
                        help="steps between tournament rounds (default 50)")
    parser.add_argument("--tournament-metric", choices=("top1", "loss"), default="top1")
    parser.add_argument("--exchange", choices=("weights", "weights+optimizer"),
                        default="weights")
    parser.add_argument("--tournament-holdout", type=float, default=0.05, metavar="F",
                        help="fraction of each trainer's samples held out for tournaments")
    parser.add_argument("--per-rank", type=int, default=64, help="batch per rank (both runs)")
    parser.add_argument("--optimizer", choices=("sgd", "lars"), default="sgd")
    parser.add_argument("--lr", type=float, default=None,
                        help="learning rate at global batch 128, scaled linearly with each "
                             "run's batch (default: 0.1 for sgd, 1.0 for lars)")
    parser.add_argument("--width", type=int, default=16, help="resnet_small width")
    add_run_arguments(parser)
    parser.add_argument("--plot", metavar="FILE", help="write top-1 vs wall-clock time (PNG)")


# -- recipes ----------------------------------------------------------------------------------
def recipe(args: argparse.Namespace, global_batch: int, epochs: float) -> dict[str, Any]:
    """One run's recipe: the same model, data, optimizer and schedule shape for both runs,
    the learning rate scaled linearly with the batch (Goyal et al. 2017)."""
    base = args.lr if args.lr is not None else (0.1 if args.optimizer == "sgd" else 1.0)
    optimizer: dict[str, Any] = {"name": args.optimizer, "momentum": 0.9, "weight_decay": 5e-4}
    if args.optimizer == "lars":
        optimizer["trust_coefficient"] = 0.001
    return fmnist_recipe(
        f"fmnist_{args.optimizer}_b{global_batch}",
        "hpcdl bench ltfb (Jacobs et al. MLHPC'17 vs data parallel)", fmnist_model(args),
        {"global": global_batch, "per_rank": args.per_rank}, epochs, optimizer,
        base * global_batch / 128, 0.5, {"backend": args.backend}, min_scale=0.35,
        eval_every_epochs=1)


def ltfb_epochs(shard_dir: str, args: argparse.Namespace, world_size: int) -> float:
    """LTFB epochs giving each trainer as many steps as the data-parallel run takes."""
    from hpcdl.data.format import read_manifest, split_shards
    from hpcdl.train.tournament import partition_samples

    counts = [e["num_samples"] for e in split_shards(read_manifest(shard_dir), "train")]
    dp_steps_per_epoch = sum(counts) // world_size // args.per_rank
    trainer_size = world_size // args.trainers
    parts = partition_samples(counts, args.trainers, args.tournament_holdout, seed=0,
                              min_holdout=trainer_size)
    ltfb_steps_per_epoch = min(len(t) for t, _ in parts) // trainer_size // args.per_rank
    return args.epochs * dp_steps_per_epoch / ltfb_steps_per_epoch


# -- the two runs -----------------------------------------------------------------------------
def timed_run(world, args, shard_dir: str, run_dir: str,
              ltfb: bool) -> tuple[float, dict[str, Any]]:
    """The data-parallel run or the LTFB run (each trainer opens its own communicator): the
    wall-clock start (time.time()) its curve is measured from, and its summary."""
    from hpcdl.train.config import config_from_dict
    from hpcdl.train.ltfb import LTFB, LTFBOptions
    from hpcdl.train.session import RunSession
    from hpcdl.train.trainer import Trainer, TrainOptions

    ranks = world.size // args.trainers if ltfb else world.size
    epochs = ltfb_epochs(shard_dir, args, world.size) if ltfb else args.epochs
    config = config_from_dict(recipe(args, args.per_rank * ranks, epochs),
                              origin=f"hpcdl bench ltfb: {'ltfb' if ltfb else 'data_parallel'}")
    options = TrainOptions(max_steps=args.max_steps, progress=False)
    world.Barrier()
    start = time.time()
    with RunSession(world, None if ltfb else config.comm, log_level=None,
                    threads=None) as session:
        if ltfb:
            runner = LTFB(config, shard_dir, run_dir, world, LTFBOptions(
                trainers=args.trainers, interval=args.tournament_interval,
                metric=args.tournament_metric, exchange=args.exchange,
                holdout_fraction=args.tournament_holdout), options, backend=args.backend)
        else:
            runner = Trainer(config, shard_dir, run_dir, session.comm, options=options)
        return start, session.own(runner).train()


# -- the record -------------------------------------------------------------------------------
def eval_points(run: str, metrics_path: str, start: float, images_per_step: int,
                trainer: int | None = None) -> list[dict[str, Any]]:
    """One record per evaluation in a metrics.jsonl: time since ``start`` and top-1."""
    from hpcdl.train.metrics import read_metrics

    return [{"run": run, "trainer": "" if trainer is None else trainer, "step": r["step"],
             "images": r["step"] * images_per_step, "elapsed_s": r["time"] - start,
             "top1": r["top1"], "eval_loss": r["loss"]}
            for r in read_metrics(metrics_path) if r.get("kind") == "eval"]


def best_of(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The LTFB curve: at each step, the best trainer's evaluation (timed when the last
    trainer finished evaluating it)."""
    by_step: dict[int, list[dict[str, Any]]] = {}
    for p in points:
        by_step.setdefault(p["step"], []).append(p)
    curve = []
    for step in sorted(by_step):
        group = by_step[step]
        top = max(group, key=lambda p: p["top1"])
        curve.append({**top, "run": "ltfb_best", "trainer": top["trainer"],
                      "elapsed_s": max(p["elapsed_s"] for p in group)})
    return curve


def ltfb_ratios(dp: list[dict[str, Any]], best: list[dict[str, Any]],
                summary: dict[str, Any]) -> dict[str, Any]:
    ratios: dict[str, Any] = {}
    if dp and best:
        ratios["dp_final_top1"] = dp[-1]["top1"]
        ratios["ltfb_final_top1"] = best[-1]["top1"]
        ratios["ltfb_minus_dp_top1_points"] = 100.0 * (best[-1]["top1"] - dp[-1]["top1"])
        ratios["ltfb_over_dp_wall"] = best[-1]["elapsed_s"] / max(dp[-1]["elapsed_s"], 1e-9)
    rounds = [r for r in summary.get("rounds", []) if r.get("partner") is not None]
    ratios["tournament_rounds"] = len({r["round"] for r in rounds})
    ratios["models_replaced"] = sum(1 for r in rounds if r.get("replaced"))
    if rounds:
        ratios["mean_tournament_s"] = sum(r["tournament_s"] for r in rounds) / len(rounds)
    return ratios


def plot_curves(path: str, dp: list[dict[str, Any]], trainers: list[list[dict[str, Any]]],
                best: list[dict[str, Any]], title: str) -> None:
    from hpcdl.results import png_axes

    with png_axes(path, (6.4, 4.2)) as ax:
        ax.plot([p["elapsed_s"] for p in dp], [100 * p["top1"] for p in dp], "o-",
                label="data parallel (1 trainer)")
        for t, points in enumerate(trainers):
            ax.plot([p["elapsed_s"] for p in points], [100 * p["top1"] for p in points], ":",
                    alpha=0.6, label=f"LTFB trainer {t}")
        ax.plot([p["elapsed_s"] for p in best], [100 * p["top1"] for p in best], "s-",
                label="LTFB best trainer")
        ax.set_xlabel("wall-clock time since start (s)")
        ax.set_ylabel("test top-1 (%)")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)


def run(args: argparse.Namespace) -> int:
    if args.epochs <= 0 or args.per_rank < 1 or args.trainers < 2:
        raise SystemExit("hpcdl bench ltfb: --epochs and --per-rank must be positive and "
                         "--trainers at least 2")
    from mpi4py import MPI

    from hpcdl.bench.runs import bench_workdir, fmnist_shards
    from hpcdl.train.threads import configure_threads

    world = MPI.COMM_WORLD
    if world.size % args.trainers:
        if world.rank == 0:
            print(f"hpcdl bench ltfb: --trainers {args.trainers} does not divide the "
                  f"{world.size} MPI ranks (run e.g. mpiexec -n {2 * args.trainers})",
                  file=sys.stderr)
        return 2
    log = logging.getLogger("hpcdl.bench")
    with bench_workdir(world, args.out, "hpcdl-ltfb-") as out:
        shard_dir = fmnist_shards(world, args, out, holdout=False)
        # threads from the node layout of the whole world (both runs use every rank)
        configure_threads(world)
        dp_dir, ltfb_dir = os.path.join(out, "data_parallel"), os.path.join(out, "ltfb")
        for d in (dp_dir, ltfb_dir):  # fresh runs: the curves are timed from the start
            if world.rank == 0:
                shutil.rmtree(d, ignore_errors=True)
        log.info("data-parallel run on %d ranks", world.size)
        dp_start, _ = timed_run(world, args, shard_dir, dp_dir, ltfb=False)
        log.info("LTFB run: %d trainers x %d ranks", args.trainers,
                 world.size // args.trainers)
        ltfb_start, summary = timed_run(world, args, shard_dir, ltfb_dir, ltfb=True)
        if world.rank == 0:
            images_per_step = args.per_rank * world.size
            dp = eval_points("data_parallel", os.path.join(dp_dir, "metrics.jsonl"), dp_start,
                             images_per_step)
            trainers = [eval_points("ltfb", os.path.join(ltfb_dir, f"trainer-{t:02d}",
                                                         "metrics.jsonl"),
                                    ltfb_start, images_per_step, trainer=t)
                        for t in range(args.trainers)]
            best = best_of([p for points in trainers for p in points])
            report_runs("ltfb", dp + [p for pts in trainers for p in pts] + best,
                        ltfb_ratios(dp, best, summary), world.size, COLUMNS, args.json,
                        rounds=summary["rounds"], settings={k: getattr(args, k) for k in (
                            "epochs", "trainers", "tournament_interval", "tournament_metric",
                            "exchange", "tournament_holdout", "per_rank", "optimizer", "lr",
                            "width", "max_steps")})
            if args.plot:
                plot_curves(args.plot, dp, trainers, best,
                            f"Fashion-MNIST, {world.size} ranks: 1 data-parallel trainer vs "
                            f"LTFB {args.trainers} x {world.size // args.trainers}")
                print(f"wrote {args.plot}")
            sys.stdout.flush()
    return 0
