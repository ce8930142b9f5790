"""The paper's claim at small scale: LARS trains at a large batch to the small-batch accuracy
(You et al. ICPP'18; You, Gitman & Ginsburg arXiv:1708.03888), against momentum SGD with linear
scaling and warm-up (Goyal et al. arXiv:1706.02677), on all of Fashion-MNIST through the real
pipeline (JPEG tree -> shards -> Trainer), ``resnet_small``, the same epochs for every run:

==============  ============  =====================================================
run             global batch  optimizer and schedule
==============  ============  =====================================================
``baseline``    128           momentum SGD, lr 0.1, poly(2) decay, no warm-up
``sgd_scaled``  1,536         momentum SGD, lr 0.1·1536/128 (linear scaling), warm-up
``lars``        1,536         LARS (η = 0.02, lr 2), warm-up, poly(2)
``lars_bf16``   1,536         ``lars`` in bf16 autocast (``train.precision: bfloat16``,
                             emulated where bf16 is not native); when asked for
==============  ============  =====================================================

1,536 ≈ 60,000 / 40, as 32K ≈ 1.28 M / 40; every forward pass is the baseline's per-rank batch
(the large batch accumulates). ``--holdout`` trains on the first 50,000 training images and
evaluates on the last 10,000. The bench JSON's ratios: ``lars_minus_baseline_top1`` (goal ≥ −1
point), ``lars_bf16_minus_lars_top1`` (goal ≥ −0.3: bf16's rounding alone, the same seed and
data order; ``bfloat16``, not ``auto``, which would fall back to float32 where bf16 is not
native and compare fp32 with itself; which it was is the JSON's ``machine.bf16_native``).
``--study`` runs the accuracy-vs-batch sweep instead (hpcdl/bench/batch_study.py).
docs/performance.md, "Convergence".

    mpiexec -n 2 hpcdl bench convergence --json convergence.json
"""
from __future__ import annotations

import argparse
import logging
import os
import time
from typing import Any

from hpcdl.bench.runs import (
    HOLDOUT,
    add_run_arguments,
    bench_workdir,
    fmnist_model,
    fmnist_recipe,
    fmnist_shards,
    micro_batching,
    parse_choices,
    report_runs,
    run_record,
    stopped_by_signal,
    train_run,
)

COMMAND = "convergence"
HELP = "Fashion-MNIST top-1: batch 128 SGD vs batch 1536 SGD+scaling+warm-up vs LARS"

RUNS = ("baseline", "sgd_scaled", "lars")  # the default --runs
EXTRA_RUNS = ("lars_bf16",)
COLUMNS = ["run", "optimizer", "global_batch", "accumulation", "base_lr", "warmup_epochs",
           "epochs", "steps", "top1", "top5", "eval_loss", "train_s", "images_per_s"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--epochs", type=float, default=12,
                        help="epochs of every run (default 12)")
    parser.add_argument("--runs", default=",".join(RUNS),
                        help=f"comma-separated subset of {','.join(RUNS + EXTRA_RUNS)} "
                             f"(default {','.join(RUNS)}; lars_bf16 is lars in bf16 autocast)")
    parser.add_argument("--small-batch", type=int, default=128, help="baseline global batch")
    parser.add_argument("--large-batch", type=int, default=1536,
                        help="large global batch (default 1536 ≈ 60,000/40, as 32K ≈ 1.28M/40)")
    parser.add_argument("--sgd-lr", type=float, default=0.1,
                        help="baseline SGD lr at --small-batch; sgd_scaled uses it × "
                             "large/small (linear scaling rule)")
    parser.add_argument("--lars-lr", type=float, default=2.0,
                        help="LARS base lr (large batch; BN and biases: plain momentum)")
    parser.add_argument("--trust-coefficient", type=float, default=0.02,
                        help="LARS η (0.02: chosen with --holdout at batch 1536)")
    parser.add_argument("--warmup-epochs", type=float, default=1.0,
                        help="linear warm-up of the two large-batch runs")
    parser.add_argument("--weight-decay", type=float, default=5e-4,
                        help="every run (LARS and SGD alike; BN and biases excluded for LARS)")
    parser.add_argument("--micro-batch", type=int, default=None,
                        help="images per rank per forward pass in every run (default: "
                             "small-batch / ranks); larger batches accumulate")
    parser.add_argument("--min-scale", type=float, default=0.7,
                        help="random-resized-crop minimum area (0.7: 28 px garments, the demo's)")
    parser.add_argument("--seed", type=int, default=0,
                        help="every run's seed (weights, data order, augmentation)")
    parser.add_argument("--model", default="resnet_small", help="a model of hpcdl.models")
    parser.add_argument("--width", type=int, default=16, help="resnet_small width")
    parser.add_argument("--holdout", action="store_true",
                        help=f"tune: train on all but the last {HOLDOUT} training images and "
                             f"evaluate on those (not on the test set)")
    add_run_arguments(parser)
    from hpcdl.bench.batch_study import add_study_arguments

    add_study_arguments(parser)


# -- the experiment's recipes -----------------------------------------------------------------
def run_recipes(args: argparse.Namespace, ranks: int = 2) -> dict[str, dict[str, Any]]:
    """The three recipes as dicts (hpcdl.train.config schema), same model, data, epochs and
    per-forward (batch-norm) batch."""
    micro = args.micro_batch or args.small_batch // ranks
    if micro < 1:
        raise SystemExit(f"hpcdl bench convergence: --small-batch {args.small_batch} is "
                         f"smaller than {ranks} ranks")

    def recipe(name: str, batch: int, optimizer: dict[str, Any], base_lr: float,
               warmup_epochs: float) -> dict[str, Any]:
        return fmnist_recipe(
            name, "hpcdl bench convergence (You et al. ICPP'18 at batch/dataset = 1/40)",
            fmnist_model(args), micro_batching(batch, micro, ranks), args.epochs, optimizer,
            base_lr, warmup_epochs, {"backend": args.backend}, min_scale=args.min_scale,
            seed=args.seed, channels_last=True)

    sgd = {"name": "sgd", "momentum": 0.9, "weight_decay": args.weight_decay}
    lars_opt = {"name": "lars", "momentum": 0.9, "weight_decay": args.weight_decay,
                "trust_coefficient": args.trust_coefficient}
    large, small, warmup = args.large_batch, args.small_batch, args.warmup_epochs
    recipes = {
        "baseline": recipe(f"fmnist_sgd_b{small}", small, sgd, args.sgd_lr, 0),
        "sgd_scaled": recipe(f"fmnist_sgd_scaled_b{large}", large, sgd,
                             args.sgd_lr * large / small, warmup),
        "lars": recipe(f"fmnist_lars_b{large}", large, lars_opt, args.lars_lr, warmup),
    }
    lars = recipes["lars"]
    recipes["lars_bf16"] = {**lars, "name": lars["name"] + "_bf16",
                            "train": {**lars["train"], "precision": "bfloat16"}}
    return recipes


def convergence_ratios(records: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Differences in top-1 percentage points (goal: LARS ≥ baseline − 1)."""
    ratios: dict[str, Any] = {f"{name}_top1": r["top1"] for name, r in records.items()}
    for name, reference in (("lars", "baseline"), ("sgd_scaled", "baseline"),
                            ("lars_bf16", "lars")):
        r, base = records.get(name), records.get(reference)
        if r and base and r["top1"] is not None and base["top1"] is not None:
            ratios[f"{name}_minus_{reference}_top1"] = 100.0 * (r["top1"] - base["top1"])
    return ratios


def run(args: argparse.Namespace) -> int:
    if args.study:
        from hpcdl.bench.batch_study import run_study

        return run_study(args)
    runs = parse_choices("convergence", "--runs", args.runs, RUNS + EXTRA_RUNS)
    if args.epochs <= 0 or args.small_batch < 1 or args.large_batch < 1:
        raise SystemExit("hpcdl bench convergence: --epochs, --small-batch and --large-batch "
                         "must be positive")
    from hpcdl.bench import check_model_argument

    check_model_argument("convergence", args.model)
    from mpi4py import MPI

    from hpcdl.train.config import CommConfig
    from hpcdl.train.session import RunSession
    from hpcdl.train.trainer import EXIT_STOPPED_BY_SIGNAL

    world = MPI.COMM_WORLD
    log = logging.getLogger("hpcdl.bench")
    with bench_workdir(world, args.out, "hpcdl-convergence-") as out:
        start = time.perf_counter()
        shard_dir = fmnist_shards(world, args, out, args.holdout)
        log.info("Fashion-MNIST shards ready in %s (%.0f s)", shard_dir,
                 time.perf_counter() - start)
        recipes = run_recipes(args, world.size)
        records = {}
        # the communicator's defaults (each run's reducer takes its recipe's bucket size)
        with RunSession(world, CommConfig(backend=args.backend), log_level=None) as session:
            for name in runs:
                seed = f"-s{args.seed}" if args.seed else ""   # seed 0: the earlier name
                run_dir = os.path.join(out, f"{name}-e{args.epochs:g}{seed}")
                log.info("run %s: %s", name, recipes[name]["name"])
                summary = train_run(session.comm, recipes[name], shard_dir, run_dir,
                                    args.max_steps)
                if stopped_by_signal(summary, name, out):
                    return EXIT_STOPPED_BY_SIGNAL
                records[name] = run_record(name, recipes[name], summary)
                log.info("run %s: top-1 %.4f after %s epochs (%.0f s)", name,
                         summary["top1"] or float("nan"), summary["epochs"], summary["train_s"])
        if world.rank == 0:
            report_runs("convergence", list(records.values()), convergence_ratios(records),
                        world.size, COLUMNS, args.json, start,
                        split="holdout: last 10,000 training images" if args.holdout
                        else "test: the 10,000 test images")
    return 0
