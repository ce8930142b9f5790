"""Write an sbatch script for a training run, checked before it reaches the queue.

  hpcdl slurm render --arch skx --nodes 64 --recipe recipes/resnet50_lars_32k.yaml \\
      --data /scratch/imagenet-shards --time 12:00:00 --partition skx-normal \\
      --out $SCRATCH/runs/r50-32k batch.per_rank=256 > job.sbatch
  sbatch job.sbatch

The script goes to stdout (or --output), warnings and errors to stderr; a job that would fail
(batch not divisible over the ranks, too few shards for the nodes, no time for a checkpoint,
missing recipe) exits non-zero with a message naming the value. docs/slurm.md describes the
templates and how to adapt them to a site.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from hpcdl.errors import EXIT_BAD_INPUT
from hpcdl.slurm.render import ARCHES, KNL_MEMORY_MODES, LAUNCHERS, MPIS

COMMAND = "slurm"
HELP = "render an sbatch script (skx, knl, generic) after checking the job"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="slurm", metavar="ACTION", required=True)
    render = sub.add_parser("render", help="fill a template and validate the job")
    render.add_argument("--arch", required=True, choices=tuple(ARCHES),
                        help="skx: 2 ranks/node, one per socket; knl: 1 rank/node; generic: "
                        "one rank per socket discovered on the node")
    render.add_argument("--nodes", type=int, required=True)
    render.add_argument("--recipe", required=True, help="recipes/NAME.yaml")
    render.add_argument("--data", required=True, help="shard directory (with manifest.json)")
    render.add_argument("--time", default="02:00:00", help="Slurm time limit (default 02:00:00)")
    render.add_argument("--partition", default=None)
    render.add_argument("--account", default=None)
    render.add_argument("--job-name", default="hpcdl")
    render.add_argument("--out", default=None,
                        help="run directory (default runs/JOB_NAME); its logs/ holds the job log")
    render.add_argument("--mpi", default="auto", choices=MPIS,
                        help="the MPI mpi4py loads in the job (auto: asked at run time); it "
                             "picks the launcher and Intel MPI's I_MPI_PMI_LIBRARY (docs/mpi.md)"
                             "; HPCDL_MPI overrides it at submit time")
    render.add_argument("--launcher", default="auto", choices=LAUNCHERS,
                        help="auto: srun-pmi2 for MPICH and Intel MPI, the Open MPI choice of "
                             "docs/mpi.md for Open MPI; HPCDL_LAUNCHER overrides it at submit "
                             "time")
    render.add_argument("--ranks-per-node", type=int, default=None,
                        help="generic only: fixed ranks per node instead of one per socket")
    render.add_argument("--signal-seconds", type=int, default=300,
                        help="send the checkpoint signal this long before the limit (300)")
    render.add_argument("--setup", default="",
                        help="file the job sources first (module loads, venv activation)")
    render.add_argument("--local-dir", default="/tmp",
                        help="node-local directory for staged shards (default /tmp)")
    render.add_argument("--node-memory-gb", type=float, default=None,
                        help="memory per node for the batch check (skx 192, knl 96 assumed)")
    render.add_argument("--cores-per-socket", type=int, default=24, help="skx: cores per socket")
    render.add_argument("--knl-cores", type=int, default=68, help="knl: cores per node")
    render.add_argument("--knl-os-cores", type=int, default=4,
                        help="knl: cores left to the OS and MPI progress")
    render.add_argument("--knl-memory-mode", default="auto", choices=KNL_MEMORY_MODES)
    render.add_argument("--train-arg", action="append", default=[], metavar="ARG",
                        dest="train_args",
                        help="an extra `hpcdl train` option, repeatable: "
                        "--train-arg=--deterministic --train-arg=--max-steps=100")
    render.add_argument("--output", "-o", default=None, help="write the script here, not stdout")
    render.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="recipe overrides, passed on to hpcdl train")


def run(args: argparse.Namespace) -> int:
    from hpcdl.io import atomic_write_text
    from hpcdl.slurm.render import JobSpec, RenderError, render_job

    # every option of the command is a field of JobSpec, under the same name
    spec = JobSpec(**{f.name: getattr(args, f.name) for f in dataclasses.fields(JobSpec)})
    try:
        rendered = render_job(spec)
    except RenderError as exc:  # a value a person fixes: one line, exit 2 like every command
        print(f"hpcdl slurm render: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for warning in rendered.warnings:
        print(f"hpcdl slurm render: warning: {warning}", file=sys.stderr)
    # sbatch does not create the directory of --output; a job whose log cannot be opened
    # fails without a word, so make it now.
    logs = os.path.join(rendered.run_dir, "logs")
    for flag, path, write in (
            ("--out", logs, lambda: os.makedirs(logs, exist_ok=True)),
            ("--output", args.output, lambda: atomic_write_text(args.output, rendered.script))):
        try:
            if path:
                write()
        except OSError as exc:
            print(f"hpcdl slurm render: error: {flag}: cannot write {path} ({exc})",
                  file=sys.stderr)
            return EXIT_BAD_INPUT
    if not args.output:
        sys.stdout.write(rendered.script)
    layout = f"{rendered.ranks} ranks" if rendered.ranks else "ranks discovered at run time"
    batch = f", per-rank batch {rendered.per_rank_batch}" if rendered.per_rank_batch else ""
    compute = (f"{rendered.compute_threads} compute" if rendered.compute_threads is not None
               else "compute threads from the node's cores")
    print(f"hpcdl slurm render: {args.arch}, {args.nodes} node(s), {layout}{batch}; "
          f"{compute} + {rendered.decode_workers} decode thread(s) per rank; "
          f"log: {rendered.run_dir}/logs/slurm-JOBID.out", file=sys.stderr)
    return 0
