"""The first run: train a small ResNet on real Fashion-MNIST over MPI, in minutes.

    mpiexec -n 2 hpcdl demo [--out DIR] [--epochs E] [--max-steps N] [KEY=VALUE ...]

Rank 0 writes the Fashion-MNIST subset shipped with hpcdl as an ImageNet-shaped JPEG tree and
shards it (data_prep); then every rank trains recipes/demo_fmnist.yaml (LARS, warm-up, poly
decay) and rank 0 prints top-1 on held-out test images. Without --out the run directory is a
temporary one, removed at the end; with --out DIR it is kept (summary.json, metrics.jsonl,
logs/, checkpoints/), and running again with the same DIR resumes from its last checkpoint.
"""
from __future__ import annotations

import argparse
import sys

COMMAND = "demo"
HELP = "train on real Fashion-MNIST end to end (data prep, MPI training, top-1) in minutes"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="keep the run directory here (default: a temporary one, removed)")
    parser.add_argument("--epochs", type=float, default=None,
                        help="epochs to train (default: the recipe's)")
    parser.add_argument("--max-steps", type=int, default=None, metavar="N",
                        help="stop after global step N (a quick check)")
    parser.add_argument("--recipe", default=None,
                        help="recipe YAML (default: recipes/demo_fmnist.yaml)")
    parser.add_argument("--source", default="demo",
                        help="Fashion-MNIST to use: demo (shipped subset, default), debian "
                             "(/usr/share/datasets/fashion-mnist, 60k/10k), or a folder of "
                             "idx files")
    from hpcdl.cli.train import add_session_arguments

    add_session_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from mpi4py import MPI

    from hpcdl.train.config import RecipeError
    from hpcdl.train.demo import DemoOptions, format_result, run_demo

    rank = MPI.COMM_WORLD.rank
    for flag in ("epochs", "max_steps"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            if rank == 0:
                print(f"hpcdl demo: --{flag.replace('_', '-')} {value}: must be positive",
                      file=sys.stderr)
            return 2
    options = DemoOptions(out=args.out, recipe=args.recipe, overrides=args.overrides,
                          epochs=args.epochs, max_steps=args.max_steps, source=args.source,
                          backend=args.backend, progress=args.progress,
                          log_level=args.log_level)
    try:
        summary = run_demo(options)
    except (RecipeError, FileNotFoundError) as exc:
        if rank == 0:
            print(f"hpcdl demo: {exc}", file=sys.stderr)
        return 2
    if rank == 0:
        print(format_result(summary, kept=args.out is not None), flush=True)
    return 0
