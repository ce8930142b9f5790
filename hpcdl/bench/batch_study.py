"""The papers' central figure in miniature: top-1 against global batch, LARS against linear
scaling + warm-up (``hpcdl bench convergence --study``; You, Gitman & Ginsburg arXiv:1708.03888
Fig. 1; Goyal et al. arXiv:1706.02677), the same epochs for every batch (default
{128, 384, 768, 1,536, 3,072}: ImageNet's 8K and 32K are ≈ 375 and 1,536 here).

Kept fair: each (optimizer, batch) tries the same ``--grid`` of lrs around its method's rule
(SGD linear, LARS square-root scaling of its global rate, η fixed), widened past an edge for
both optimizers (``--extend-edges``); tuned on the holdout split, then the chosen lr trains
with ``--seeds`` seeds and is scored once on the test split; every forward pass is
``--micro-batch`` images per rank whatever the batch (ghost batch norm, Hoffer et al.,
arXiv:1705.08741). Each run has its own directory under ``--out`` and a ``record.json`` when
done: the same command resumes (SIGTERM/SIGUSR1 stops the study with exit 75).

Output: a table (the seeds' top-1 mean, sample sd, min and max per optimizer and batch), the
bench JSON with every run's record, and a PNG of top-1 against batch. docs/performance.md,
"Convergence (accuracy against batch)".
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from hpcdl.bench.runs import fmnist_model, fmnist_recipe, micro_batching
from hpcdl.errors import BadInputError, mark_agreed
from hpcdl.io import atomic_write_text

__all__ = ["StudyRun", "OPTIMIZERS", "centre_lr", "tuning_runs", "edge_extensions", "select_lr",
           "final_runs",
           "study_recipe", "study_micro_batch", "aggregate", "execute_study", "plot_study",
           "STUDY_COLUMNS"]

OPTIMIZERS = ("lars", "sgd")
RECORD = "record.json"
SIGNATURE = "study.json"
# What every run of one study shares; a second invocation on the same --out must match it.
SIGNATURE_KEYS = ("epochs", "model", "width", "micro_batch", "warmup_epochs", "weight_decay",
                  "trust_coefficient", "min_scale", "source", "sgd_lr", "small_batch",
                  "lars_lr", "max_steps", "decay_policy")
# Which parameters weight decay applies to. LARS always leaves BN's γ/β and every bias undecayed
# (the MLPerf skip list); "skip_bn_bias" gives SGD the same (Goyal et al. §5.1 leave BN's
# coefficients undecayed too), "sgd_decays_all" is the first studies' SGD (every parameter).
DECAY_POLICIES = ("skip_bn_bias", "sgd_decays_all")
STUDY_COLUMNS = ["optimizer", "global_batch", "lr", "holdout_top1", "tuned_lrs", "at_edge",
                 "top1_mean", "top1_std", "top1_min", "top1_max", "seeds", "train_s_mean"]
# The batch the LARS centre is anchored at: the three-run bench tuned lr 2 / η 0.02 there.
LARS_ANCHOR_BATCH = 1536


@dataclass(frozen=True)
class StudyRun:
    """One training run of the study: ``phase`` is ``tune`` (holdout split) or ``final``
    (test split)."""

    phase: str
    optimizer: str
    batch: int
    lr: float
    seed: int

    @property
    def key(self) -> str:
        return f"{self.phase}-{self.optimizer}-b{self.batch}-lr{self.lr:.6g}-s{self.seed}"


def parse_list(text: str, kind: Callable[[str], Any], flag: str) -> list[Any]:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise mark_agreed(BadInputError(f"{flag} {text!r} is not a comma-separated "
                         f"list of numbers")) from None
    if not values or any(v <= 0 for v in values):
        raise mark_agreed(BadInputError(f"{flag} {text!r} needs positive values"))
    return values


def centre_lr(optimizer: str, batch: int, args: argparse.Namespace) -> float:
    """The middle of the lr grid: linear scaling for SGD (Goyal et al. §2.1), square-root
    scaling for LARS's global rate."""
    if optimizer == "sgd":
        return args.sgd_lr * batch / args.small_batch
    return args.lars_lr * math.sqrt(batch / LARS_ANCHOR_BATCH)


def tuning_runs(args: argparse.Namespace) -> list[StudyRun]:
    """Every (optimizer, batch, lr) of the grid, seed 0, on the holdout split: the same number
    of values for each optimizer at each batch."""
    return [StudyRun("tune", opt, batch, round(centre_lr(opt, batch, args) * factor, 6), 0)
            for batch in args.batch_list for opt in args.optimizer_list
            for factor in args.grid_list]


def edge_extensions(args: argparse.Namespace, records: dict[str, dict[str, Any]],
                    runs: Sequence[StudyRun], factors: dict[tuple[str, int], list[float]]
                    ) -> list[StudyRun]:
    """The tuning runs one extension adds: for each (optimizer, batch) whose best holdout lr
    is the smallest or the largest value tried, one grid step beyond that edge (``factors``,
    per optimizer and batch, updated here). Repeated ``--extend-edges`` times, this ends with
    every chosen lr interior, or says which is not (``at_edge`` in the table)."""
    extra = []
    # the ratio between neighbouring grid factors (2 for ×0.5, ×1, ×2); 2 for a single value
    grid = sorted(args.grid_list)
    step = grid[1] / grid[0] if len(grid) > 1 else 2.0
    for batch in args.batch_list:
        for opt in args.optimizer_list:
            best, _ = select_lr(records, runs, opt, batch)
            mine = factors[(opt, batch)]
            lrs = sorted(r.lr for r in runs if r.phase == "tune" and r.optimizer == opt
                         and r.batch == batch)
            if best == lrs[0]:
                new = mine[0] / step
            elif best == lrs[-1]:
                new = mine[-1] * step
            else:
                continue
            factors[(opt, batch)] = sorted([*mine, new])
            extra.append(StudyRun("tune", opt, batch,
                                  round(centre_lr(opt, batch, args) * new, 6), 0))
    return extra


def _score(record: dict[str, Any] | None) -> float:
    top1 = None if record is None else record.get("top1")
    return -1.0 if top1 is None or not math.isfinite(top1) else float(top1)


def select_lr(records: dict[str, dict[str, Any]], runs: Sequence[StudyRun], optimizer: str,
              batch: int) -> tuple[float, float]:
    """(lr, holdout top-1) of the best tuning run of (optimizer, batch); a tie goes to the
    smaller lr, a diverged run (top-1 None/NaN) scores -1."""
    candidates = [r for r in runs if r.phase == "tune" and r.optimizer == optimizer
                  and r.batch == batch]
    if not candidates:
        raise ValueError(f"no tuning runs for {optimizer} at batch {batch}")
    best = max(candidates, key=lambda r: (_score(records.get(r.key)), -r.lr))
    return best.lr, _score(records.get(best.key))


def final_runs(args: argparse.Namespace, chosen: dict[tuple[str, int], float]) -> list[StudyRun]:
    return [StudyRun("final", opt, batch, chosen[(opt, batch)], seed)
            for batch in args.batch_list for opt in args.optimizer_list
            for seed in range(args.seeds)]


def study_micro_batch(args: argparse.Namespace, ranks: int) -> int:
    """Images per rank per forward pass: fixed by the study's settings, never by the batches
    one invocation runs (``--batches 3072`` alone once gave 1,536 and broke the comparison)."""
    return args.micro_batch or max(1, args.small_batch // ranks)


def study_recipe(run: StudyRun, args: argparse.Namespace, ranks: int) -> dict[str, Any]:
    """The run as a recipe dict (hpcdl.train.config schema)."""
    if run.optimizer == "lars":
        optimizer = {"name": "lars", "momentum": 0.9, "weight_decay": args.weight_decay,
                     "trust_coefficient": args.trust_coefficient}
    else:
        optimizer = {"name": "sgd", "momentum": 0.9, "weight_decay": args.weight_decay}
        if args.decay_policy == "skip_bn_bias":
            optimizer.update(bn_weight_decay=False, bias_decay_mult=0.0)
    return fmnist_recipe(
        f"fmnist_study_{run.key}",
        "hpcdl bench convergence --study (You et al. arXiv:1708.03888 Fig. 1 in miniature)",
        fmnist_model(args), micro_batching(run.batch, study_micro_batch(args, ranks), ranks),
        args.epochs, optimizer, run.lr, args.warmup_epochs, {"backend": args.backend},
        min_scale=args.min_scale, seed=run.seed, channels_last=True)


def aggregate(records: dict[str, dict[str, Any]], finals: Sequence[StudyRun],
              holdout: dict[tuple[str, int], float], tune: Sequence[StudyRun] = ()
              ) -> list[dict[str, Any]]:
    """One row per (optimizer, batch): the seeds' top-1 mean, sample std, min and max, how
    many lrs were tuned and whether the chosen one is still an edge of them."""
    rows = []
    groups: dict[tuple[str, int], list[StudyRun]] = {}
    for run in finals:
        groups.setdefault((run.optimizer, run.batch), []).append(run)
    for (opt, batch), runs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        done = [records[r.key] for r in runs if r.key in records]
        top1 = [_score(r) for r in done]
        rows.append({
            "optimizer": opt, "global_batch": batch, "lr": runs[0].lr,
            "holdout_top1": holdout.get((opt, batch)),
            "tuned_lrs": len(tried := sorted(r.lr for r in tune if r.optimizer == opt
                                             and r.batch == batch)),
            "at_edge": bool(tried) and runs[0].lr in (tried[0], tried[-1]),
            "top1_mean": statistics.fmean(top1) if top1 else None,
            "top1_std": statistics.stdev(top1) if len(top1) > 1 else 0.0 if top1 else None,
            "top1_min": min(top1) if top1 else None, "top1_max": max(top1) if top1 else None,
            "seeds": len(top1),
            "train_s_mean": statistics.fmean(r.get("train_s", 0.0) for r in done) if done
            else None,
        })
    return rows


def study_ratios(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """LARS minus SGD at each batch, and each optimizer's drop from its smallest batch, in
    top-1 percentage points."""
    by = {(r["optimizer"], r["global_batch"]): r["top1_mean"] for r in rows
          if r["top1_mean"] is not None}
    batches = sorted({b for _, b in by})
    ratios: dict[str, float] = {}
    for b in batches:
        if ("lars", b) in by and ("sgd", b) in by:
            ratios[f"lars_minus_sgd_top1_b{b}"] = 100.0 * (by[("lars", b)] - by[("sgd", b)])
    for opt in OPTIMIZERS:
        mine = [b for b in batches if (opt, b) in by]
        if len(mine) > 1:
            ratios[f"{opt}_drop_top1_b{mine[0]}_to_b{mine[-1]}"] = \
                100.0 * (by[(opt, mine[0])] - by[(opt, mine[-1])])
    return ratios


def plot_study(rows: Sequence[dict[str, Any]], path: str) -> str:
    """Top-1 (seed mean, bar from min to max) against global batch, one line per optimizer."""
    from hpcdl.results import png_axes

    labels = {"lars": "LARS", "sgd": "SGD, linear scaling + warm-up (Goyal et al.)"}
    with png_axes(path, (6.4, 4.0), dpi=100) as ax:
        for opt in OPTIMIZERS:
            mine = [r for r in rows if r["optimizer"] == opt and r["top1_mean"] is not None]
            if not mine:
                continue
            y = [100 * r["top1_mean"] for r in mine]
            low = [100 * (r["top1_mean"] - r["top1_min"]) for r in mine]
            high = [100 * (r["top1_max"] - r["top1_mean"]) for r in mine]
            ax.errorbar([r["global_batch"] for r in mine], y, yerr=[low, high], marker="o",
                        capsize=3, label=labels[opt])
        ax.set_xscale("log", base=2)
        ax.set_xlabel("global batch (Fashion-MNIST, 60,000 images)")
        ax.set_ylabel("test top-1 (%), seed mean, min-max")
        ax.set_title("Accuracy against batch size at a fixed epoch budget")
        ax.grid(True, alpha=0.3)
        ax.legend()
    return path


Runner = Callable[[StudyRun, str], "dict[str, Any] | None"]


def _do_runs(runs: Iterable[StudyRun], runner: Runner, out: str, records: dict[str, Any],
             write: bool, barrier: Callable[[], None]) -> bool:
    """Run what has no record.json yet; False when a run stopped on a signal."""
    for run in runs:
        run_dir = os.path.join(out, run.key)
        path = os.path.join(run_dir, RECORD)
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                records[run.key] = json.load(f)
            continue
        record = runner(run, run_dir)
        if record is None:
            return False
        record = {**asdict(run), **record}
        if write:
            os.makedirs(run_dir, exist_ok=True)
            atomic_write_text(path, json.dumps(record, indent=1) + "\n")
        barrier()  # every rank sees the record before anyone reads it back
        records[run.key] = record
    return True


def check_signature(args: argparse.Namespace, out: str, write: bool) -> None:
    """Refuse to mix runs of different settings in one --out: record.json files are reused by
    run name (optimizer, batch, lr, seed), which does not name epochs, width and the rest."""
    signature = {k: getattr(args, k) for k in SIGNATURE_KEYS}
    path = os.path.join(out, SIGNATURE)
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
        if saved != signature:
            diff = {k: (saved.get(k), signature[k]) for k in signature if saved.get(k) !=
                    signature[k]}
            raise mark_agreed(BadInputError(f"{path} was written by a study "
                             f"with other settings (saved, now): {diff}; use another --out or "
                             f"the same settings"))
    elif write:
        os.makedirs(out, exist_ok=True)
        atomic_write_text(path, json.dumps(signature, indent=1) + "\n")


def reuse_records(args: argparse.Namespace, out: str) -> int:
    """Copy the runs of an earlier study's bench JSON (``--reuse-runs``) into ``out`` as
    finished runs, each only if every setting its record carries is this study's (epochs,
    per-rank batch, accumulation, warm-up, weight decay, η, and for SGD the decay policy);
    returns how many were taken. The model and width are not in a record: the file must come
    from a study of the same model."""
    path = args.reuse_runs
    try:
        with open(path, encoding="utf-8") as f:
            old = json.load(f)["runs"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BadInputError(f"--reuse-runs {path}: not a study's bench JSON ({e})") from None
    taken = 0
    for record in old:
        run = StudyRun(record["phase"], record["optimizer"], record["batch"], record["lr"],
                       record["seed"])
        if run.optimizer not in args.optimizer_list:
            continue
        recipe = study_recipe(run, args, record["ranks"])
        wanted = {"epochs": float(args.epochs), "micro_batch": recipe["batch"]["per_rank"],
                  "accumulation": recipe["batch"]["accumulation"],
                  "warmup_epochs": args.warmup_epochs, "weight_decay": args.weight_decay,
                  "trust_coefficient": recipe["optimizer"].get("trust_coefficient")}
        if any(record.get(k) != v for k, v in wanted.items()):
            continue
        # records from before decay_policy was recorded: SGD then decayed every parameter
        if run.optimizer == "sgd" and record.get("decay_policy",
                                                 "sgd_decays_all") != args.decay_policy:
            continue
        target = os.path.join(out, run.key, RECORD)
        if not os.path.exists(target):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            atomic_write_text(target, json.dumps({**record, "reused_from": path}, indent=1)
                              + "\n")
        taken += 1
    return taken


def execute_study(args: argparse.Namespace, runner: Runner, out: str, write: bool = True,
                  barrier: Callable[[], None] = lambda: None) -> dict[str, Any] | None:
    """Tune on the holdout split, pick each (optimizer, batch)'s lr, train the finals with
    ``args.seeds`` seeds on the test split; ``runner(run, run_dir)`` trains one run and
    returns its record (``top1``, ``train_s``, ...) or None when stopped by a signal (then
    this returns None too). Runs with a record.json under ``out`` are not run again."""
    check_signature(args, out, write)
    if getattr(args, "reuse_runs", None) and write:
        reuse_records(args, out)
    barrier()
    records: dict[str, dict[str, Any]] = {}
    tune = tuning_runs(args)
    if not _do_runs(tune, runner, out, records, write, barrier):
        return None
    factors = {(opt, batch): sorted(args.grid_list) for batch in args.batch_list
               for opt in args.optimizer_list}
    for _ in range(getattr(args, "extend_edges", 0)):
        extra = edge_extensions(args, records, tune, factors)
        if not extra:
            break
        tune += extra
        if not _do_runs(extra, runner, out, records, write, barrier):
            return None
    chosen, holdout = {}, {}
    for batch in args.batch_list:
        for opt in args.optimizer_list:
            chosen[(opt, batch)], holdout[(opt, batch)] = select_lr(records, tune, opt, batch)
    finals = final_runs(args, chosen)
    if not _do_runs(finals, runner, out, records, write, barrier):
        return None
    rows = aggregate(records, finals, holdout, tune)
    return {"rows": rows, "ratios": study_ratios(rows),
            "runs": [records[r.key] for r in (*tune, *finals)]}


def add_study_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--study", action="store_true",
                        help="the accuracy-vs-batch sweep (LARS vs linear scaling + warm-up), "
                             "tuned on a holdout split, 3 seeds per final point")
    parser.add_argument("--batches", default="128,384,768,1536,3072",
                        help="--study: global batches (default 128,384,768,1536,3072)")
    parser.add_argument("--grid", default="0.5,1,2",
                        help="--study: lr multipliers of each method's centre lr, the same "
                             "count for both (default 0.5,1,2)")
    parser.add_argument("--extend-edges", type=int, default=3,
                        help="--study: times a grid is widened one step past the edge its best "
                             "lr sits on (default 3; 0: the grid alone)")
    parser.add_argument("--seeds", type=int, default=3, help="--study: seeds per final point")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS),
                        help="--study: which optimizers (default lars,sgd)")
    parser.add_argument("--decay-policy", choices=DECAY_POLICIES, default="skip_bn_bias",
                        help="--study: skip_bn_bias (default): no decay on BN and biases for "
                             "either optimizer; sgd_decays_all: SGD decays every parameter")
    parser.add_argument("--reuse-runs", metavar="JSON", default=None,
                        help="--study: reuse the matching runs of an earlier study's bench "
                             "JSON (same model and width)")
    parser.add_argument("--plot", metavar="PNG", default=None,
                        help="--study: the top-1 vs batch plot (default OUT/study.png)")


def run_study(args: argparse.Namespace) -> int:
    """The MPI side: shards for both splits, one Trainer per run, rank 0 reports."""
    from mpi4py import MPI

    from hpcdl.bench import runs as bench_runs
    from hpcdl.train.config import CommConfig
    from hpcdl.train.session import RunSession
    from hpcdl.train.trainer import EXIT_STOPPED_BY_SIGNAL

    args.batch_list = parse_list(args.batches, int, "--batches")
    args.grid_list = parse_list(args.grid, float, "--grid")
    args.optimizer_list = bench_runs.parse_choices("convergence", "--optimizers",
                                                   args.optimizers, OPTIMIZERS)
    if args.seeds < 1:
        raise mark_agreed(BadInputError("--seeds must be >= 1"))
    if args.extend_edges < 0:
        raise mark_agreed(BadInputError("--extend-edges must be >= 0"))
    world = MPI.COMM_WORLD
    # Pinned in study.json: another rank count (hence another per-rank batch) on the same
    # --out is refused instead of mixing batch-norm batches.
    args.micro_batch = study_micro_batch(args, world.size)
    log = logging.getLogger("hpcdl.bench")
    with bench_runs.bench_workdir(world, args.out, "hpcdl-study-") as out:
        start = time.perf_counter()
        shards = {"tune": bench_runs.fmnist_shards(world, args, out, holdout=True),
                  "final": bench_runs.fmnist_shards(world, args, out, holdout=False)}
        session = RunSession(world, CommConfig(backend=args.backend), log_level=None)

        def runner(run: StudyRun, run_dir: str) -> dict[str, Any] | None:
            recipe = study_recipe(run, args, world.size)
            log.info("study run %s (%s split)", run.key, run.phase)
            summary = bench_runs.train_run(session.comm, recipe, shards[run.phase], run_dir,
                                           args.max_steps)
            if bench_runs.stopped_by_signal(summary, run.key, out):
                return None
            record = bench_runs.run_record(run.key, recipe, summary)
            return {**record, "decay_policy": args.decay_policy}

        with session:
            result = execute_study(args, runner, out, write=world.rank == 0,
                                   barrier=world.Barrier)
        if result is None:
            return EXIT_STOPPED_BY_SIGNAL
        if world.rank == 0:
            bench_runs.report_runs(
                "convergence-study", result["rows"], result["ratios"], world.size,
                STUDY_COLUMNS, args.json, start, runs=result["runs"],
                split="tuned on the last 10,000 training images; finals on the test set")
            default_plot = (os.path.join(out, "study.png") if args.out
                            else "convergence-study.png")
            print(f"wrote {plot_study(result['rows'], args.plot or default_plot)}")
            sys.stdout.flush()
    return 0
