"""Summarize a run directory and plot its metrics.

    hpcdl report RUN_DIR            # prints the summary, writes RUN_DIR/plots/*.png

Plots: loss.png, accuracy.png (top-1/top-5), lr.png, throughput.png (compute / comm wait /
data wait per step, images/s). Needs no MPI: run it on the login node after the job.
"""
from __future__ import annotations

import argparse
import os
import sys

COMMAND = "report"
HELP = "print a run's summary and plot loss, accuracy, lr and throughput"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="run directory of hpcdl train")
    parser.add_argument("--plots", default=None, metavar="DIR",
                        help="where to write the PNGs (default RUN_DIR/plots)")


def run(args: argparse.Namespace) -> int:
    from hpcdl.train.report import plot_run, summarize_run

    if not os.path.isdir(args.run_dir):
        print(f"hpcdl report: {args.run_dir} is not a directory", file=sys.stderr)
        return 2
    print(summarize_run(args.run_dir))
    try:
        paths = plot_run(args.run_dir, args.plots)
    except (FileNotFoundError, ValueError) as exc:
        print(f"hpcdl report: {exc}", file=sys.stderr)
        return 2
    for path in paths:
        print(f"wrote {path}")
    return 0
