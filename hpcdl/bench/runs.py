"""Fashion-MNIST training runs shared by the multi-run benches (``bench convergence``, its
``--study``, ``bench ltfb``, ``bench relaxed``): the data, one run with the real Trainer, its
record, and the directory the runs share. A floor below every bench, so no bench imports
another's command module.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

from hpcdl.errors import BadInputError, mark_agreed

__all__ = ["HOLDOUT", "add_run_arguments", "bench_workdir", "fmnist_model", "fmnist_recipe",
           "fmnist_shards", "micro_batching", "parse_choices", "prepare_shards", "report_runs",
           "run_record", "stopped_by_signal", "train_run", "write_holdout_source"]

HOLDOUT = 10_000  # training images held out by --holdout (as many as the test set)


def add_run_arguments(parser: argparse.ArgumentParser, backend: bool = True) -> None:
    """The options every multi-run bench shares: data, run directories, early stop, JSON."""
    parser.add_argument("--source", default="debian",
                        help="Fashion-MNIST idx files: debian (default), demo, or a folder")
    parser.add_argument("--data", metavar="DIR", default=None,
                        help="keep/reuse the JPEG tree and shards here (default: under --out)")
    parser.add_argument("--out", metavar="DIR", default=None,
                        help="keep the run directories here (default: a temporary directory, "
                             "removed); rerunning with the same DIR resumes each run")
    parser.add_argument("--max-steps", type=int, default=None,
                        help="stop every run after this global step (quick checks)")
    if backend:
        parser.add_argument("--backend", default="auto", help="comm backend")
    parser.add_argument("--json", metavar="FILE", help="write the results here (bench JSON)")


def parse_choices(bench: str, flag: str, text: str, known: tuple[str, ...]) -> list[str]:
    """``--runs``-like options: a comma-separated subset of ``known`` (bad input: exit 2)."""
    chosen = [c.strip() for c in text.split(",") if c.strip()]
    if not chosen or any(c not in known for c in chosen):
        raise SystemExit(f"hpcdl bench {bench}: {flag} {text!r}: choose from {','.join(known)}")
    return chosen


def fmnist_model(args: argparse.Namespace) -> dict[str, Any]:
    """The recipe's model section: ``--model`` (``--width`` for resnet_small), 10 classes."""
    model = {"name": getattr(args, "model", "resnet_small"), "num_classes": 10}
    if model["name"] == "resnet_small":
        model["width"] = args.width
    return model


def fmnist_recipe(name: str, source: str, model: dict[str, Any], batch: dict[str, int],
                  epochs: float, optimizer: dict[str, Any], base_lr: float,
                  warmup_epochs: float, comm: dict[str, Any], min_scale: float = 0.7,
                  workers: int = 2, **train: Any) -> dict[str, Any]:
    """A Fashion-MNIST recipe (hpcdl.train.config schema) of the multi-run benches: 28 px,
    poly(2) decay after a linear warm-up, 1 MiB buckets; ``train`` overrides seed 0, one
    evaluation at the end (the table's number), a log line every 20 steps and checkpoints at
    epoch ends (an interrupted bench resumes with the same --out)."""
    return {
        "name": name, "source": source, "model": model,
        "data": {"image_size": 28, "val_resize": 28, "min_scale": min_scale,
                 "workers": workers},
        "batch": batch, "epochs": epochs, "optimizer": optimizer,
        "schedule": {"name": "poly", "base_lr": base_lr, "warmup_epochs": warmup_epochs,
                     "power": 2.0},
        "train": {"seed": 0, "eval_every_epochs": 0, "keep_checkpoints": 1,
                  "log_every_steps": 20, **train},
        "comm": {"bucket_mb": 1, **comm},
    }


def micro_batching(global_batch: int, micro: int, ranks: int) -> dict[str, int]:
    """The recipe's batch section: ``global_batch`` = ``micro`` × ``ranks`` × accumulation.

    Batch norm normalises over each forward pass, so every run sees the same statistics batch
    and only the optimizer's batch grows, as when the paper adds workers at 32 images each
    (ghost batch norm, Hoffer et al., arXiv:1705.08741)."""
    accumulation, rest = divmod(global_batch, micro * ranks)
    if rest or accumulation == 0:
        raise SystemExit(f"hpcdl bench convergence: global batch {global_batch} is not a "
                         f"multiple of --micro-batch {micro} x {ranks} ranks")
    return {"global": global_batch, "per_rank": micro, "accumulation": accumulation}


# -- data -------------------------------------------------------------------------------------
def write_holdout_source(folder: str, source: str, holdout: int = HOLDOUT) -> str:
    """idx files whose 'test' split is the last ``holdout`` training images (tuning split)."""
    from hpcdl.data_prep.fashion_mnist import FILES, load_split, write_idx

    images, labels = load_split(source, "train")
    if len(labels) <= holdout:
        raise ValueError(f"--holdout: {source} has {len(labels)} training images, need more "
                         f"than {holdout}")
    os.makedirs(folder, exist_ok=True)
    parts = {"train": slice(0, len(labels) - holdout), "val": slice(len(labels) - holdout, None)}
    for split, part in parts.items():
        write_idx(os.path.join(folder, FILES[split][0]), images[part])
        write_idx(os.path.join(folder, FILES[split][1]), labels[part])
    return folder


def fmnist_shards(world: Any, args: argparse.Namespace, out: str, holdout: bool) -> str:
    """The shards of one split under ``--data`` (default ``OUT/data``)."""
    data_dir = os.path.abspath(args.data) if args.data else os.path.join(out, "data")
    return prepare_shards(world, data_dir, args.source, holdout)


def prepare_shards(world, data_dir: str, source: str, holdout: bool) -> str:
    """Rank 0 writes the JPEG tree; all ranks shard it (data_prep, MPI-parallel). Reuses
    ``data_dir/shards`` (``shards-holdout``) when its manifest is already there."""
    from hpcdl.data.format import MANIFEST
    from hpcdl.data_prep.fashion_mnist import write_tree
    from hpcdl.data_prep.shard import shard_tree

    suffix = "-holdout" if holdout else ""  # the two splits never share a folder
    shard_dir = os.path.join(data_dir, f"shards{suffix}")
    if os.path.exists(os.path.join(shard_dir, MANIFEST)):
        return shard_dir
    tree = os.path.join(data_dir, f"tree{suffix}")
    error = None
    if world.rank == 0:
        try:
            if holdout:
                source = write_holdout_source(os.path.join(data_dir, "idx"), source)
            write_tree(tree, source=source)
        except (OSError, ValueError) as exc:
            error = f"writing Fashion-MNIST ({source}) to {tree}: {exc}"
    error = world.bcast(error, root=0)
    if error:  # --source or --data (a missing file, an unwritable directory): on every rank
        raise mark_agreed(BadInputError(error))
    shard_tree(tree, shard_dir, shards=16, resize=0, comm=world)
    return shard_dir


# -- one run ----------------------------------------------------------------------------------
def train_run(comm, recipe: dict[str, Any], shard_dir: str, run_dir: str,
              max_steps: int | None) -> dict[str, Any]:
    """Train one recipe with the real Trainer; resumes from ``run_dir`` when it has a
    checkpoint. Returns the trainer's summary."""
    from hpcdl.train.config import config_from_dict
    from hpcdl.train.trainer import Trainer, TrainOptions

    config = config_from_dict(recipe, origin=f"hpcdl bench: {recipe['name']}")
    options = TrainOptions(max_steps=max_steps, progress=False)
    trainer = Trainer(config, shard_dir, run_dir, comm, options=options)
    try:
        trainer.resume("auto")
        return trainer.train()
    finally:
        trainer.close()


def stopped_by_signal(summary: dict[str, Any], name: str, out: str) -> bool:
    """SIGTERM/SIGUSR1 (Slurm's time limit) checkpointed the run: the bench stops too, so a
    requeued job with the same --out resumes where it was."""
    if summary["stopped"] != "signal":
        return False
    logging.getLogger("hpcdl.bench").warning(
        "run %s stopped by a signal at step %d: stopping the bench (rerun with --out %s to "
        "resume)", name, summary["steps"], out)
    return True


def run_record(name: str, recipe: dict[str, Any], summary: dict[str, Any]) -> dict[str, Any]:
    return {"run": name, "optimizer": recipe["optimizer"]["name"],
            "global_batch": summary["global_batch"],
            "micro_batch": recipe["batch"]["per_rank"],
            "accumulation": recipe["batch"]["accumulation"],
            "base_lr": recipe["schedule"]["base_lr"],
            "warmup_epochs": recipe["schedule"]["warmup_epochs"],
            "trust_coefficient": recipe["optimizer"].get("trust_coefficient"),
            "weight_decay": recipe["optimizer"]["weight_decay"],
            "epochs": summary["epochs"], "steps": summary["steps"], "top1": summary["top1"],
            "top5": summary["top5"], "eval_loss": summary["eval_loss"],
            "train_s": summary["train_s_total"], "images_per_s": summary["images_per_s"],
            "ranks": summary["ranks"], "stopped": summary["stopped"]}


def report_runs(bench: str, rows: list[dict[str, Any]], ratios: dict[str, Any], ranks: int,
                columns: list[str], json_path: str | None, start: float | None = None,
                **extra: Any) -> None:
    """Rank 0's end of a multi-run bench: the table, and the bench JSON with ``extra`` keys
    (and ``total_s`` since ``start``, a perf_counter reading)."""
    from hpcdl.results import bench_report, emit

    report = {**bench_report(bench, rows, ratios, ranks=ranks), **extra}
    if start is not None:
        report["total_s"] = time.perf_counter() - start
    emit(report, columns, json_path)
    sys.stdout.flush()


@contextlib.contextmanager
def bench_workdir(world: Any, out: str | None, prefix: str) -> Iterator[str]:
    """The directory a multi-run bench works in, shared by every rank: ``out`` when given
    (kept, so runs resume), else a temporary one made by rank 0 and removed at the end. Also
    makes a failing rank take the job down and gives every rank its log under it (a run
    session without a communicator: each run opens its own)."""
    from hpcdl.train.session import RunSession, run_directory

    with run_directory(world, out or None, prefix) as path, \
            RunSession(world, run_dir=path, threads=None) as session:
        session.at_close(world.Barrier)
        yield path
