"""Train a recipe data-parallel over MPI ranks (one rank per socket).

    mpiexec -n 4 hpcdl train --recipe recipes/demo_fmnist.yaml --data SHARDS --out RUN_DIR \\
        [key=value ...]

Rank and size come from MPI (mpiexec, srun, ibrun). RUN_DIR receives config.yaml,
metrics.jsonl, summary.json, checkpoints/, logs/. Exit codes: 0 done, 2 bad recipe or options,
3 non-finite loss (last good checkpoint kept), 75 checkpointed and stopped by SIGUSR1/SIGTERM
(resume with --resume auto). See docs/training.md.
"""
from __future__ import annotations

import argparse
import sys

COMMAND = "train"
HELP = "train a recipe with MPI data parallelism (checkpoint/resume, metrics)"

EXIT_BAD_INPUT = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", required=True, help="recipe YAML (recipes/*.yaml)")
    parser.add_argument("--data", required=True, help="shard directory (data_prep output)")
    parser.add_argument("--out", required=True, metavar="RUN_DIR",
                        help="run directory (shared by all ranks)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="recipe overrides with dotted keys, e.g. batch.per_rank=32 epochs=2")
    parser.add_argument("--backend", default=None,
                        help="comm backend (auto, mpi, ring, shm, gloo, ccl); default: the "
                             "recipe's comm.backend")
    parser.add_argument("--resume", default="auto", metavar="auto|PATH|none",
                        help="auto: newest valid checkpoint in RUN_DIR/checkpoints (default)")
    parser.add_argument("--deterministic", action="store_true",
                        help="bit-for-bit repeatable on the same rank count")
    parser.add_argument("--ipex", action="store_true",
                        help="use intel_extension_for_pytorch (must be installed)")
    parser.add_argument("--checkpoint-every", type=int, default=None, metavar="N",
                        help="checkpoint every N steps (overrides train.checkpoint_every_steps)")
    parser.add_argument("--max-steps", type=int, default=None, metavar="N",
                        help="stop after global step N (tests, benchmarks)")
    parser.add_argument("--no-comm", action="store_true",
                        help="do not reduce gradients (compute-only ceiling; ranks diverge)")
    parser.add_argument("--no-eval", action="store_true", help="skip evaluation")
    parser.add_argument("--log-level", default="info", help="debug, info, warning, error")
    parser.add_argument("--timeline", default=None, metavar="FILE",
                        help="write a chrome://tracing timeline of each step")
    progress = parser.add_mutually_exclusive_group()
    progress.add_argument("--progress", dest="progress", action="store_true", default=None,
                          help="progress bar on rank 0 (default: when stderr is a terminal)")
    progress.add_argument("--no-progress", dest="progress", action="store_false")
    ltfb = parser.add_argument_group("LTFB (Jacobs et al. MLHPC'17; docs/ltfb.md)")
    ltfb.add_argument("--algorithm", choices=("dp", "ltfb"), default="dp",
                      help="dp: one data-parallel trainer (default); ltfb: K trainers with "
                           "tournaments")
    ltfb.add_argument("--trainers", type=int, default=1, metavar="K",
                      help="LTFB trainers; must divide the rank count (default 1)")
    ltfb.add_argument("--tournament-interval", type=int, default=100, metavar="N",
                      help="a tournament round every N steps (default 100)")
    ltfb.add_argument("--tournament-metric", choices=("top1", "loss"), default="top1",
                      help="score on the held-out tournament set (default top1)")
    ltfb.add_argument("--exchange", choices=("weights", "weights+optimizer"),
                      default="weights", help="what the loser adopts (default weights)")
    ltfb.add_argument("--tournament-holdout", type=float, default=0.05, metavar="F",
                      help="fraction of each trainer's training samples held out for "
                           "tournaments (default 0.05)")


def _fail(rank: int, message: str, code: int = EXIT_BAD_INPUT) -> int:
    if rank == 0:
        print(f"hpcdl train: {message}", file=sys.stderr)
    return code


def setup_logging(run_dir: str, rank: int, size: int, level: str, mpi_comm) -> None:
    """The one place the trainer's logging and failure handling are set up (hpcdl/debug)."""
    from hpcdl.debug import install_fail_fast, install_stack_dump, setup_rank_logging

    setup_rank_logging(run_dir, rank, size, level)
    install_stack_dump()
    if size > 1:
        install_fail_fast(mpi_comm)  # an uncaught error on one rank ends the job, not hangs it


def run(args: argparse.Namespace) -> int:
    import logging

    from mpi4py import MPI

    from hpcdl.train.checkpoint import CheckpointError, resume_layout
    from hpcdl.train.config import RecipeError, load_recipe
    from hpcdl.train.trainer import (
        EXIT_NONFINITE_LOSS,
        EXIT_STOPPED_BY_SIGNAL,
        IpexUnavailableError,
        NonFiniteLossError,
        Trainer,
        TrainOptions,
        require_ipex,
    )

    world = MPI.COMM_WORLD
    try:
        config = load_recipe(args.recipe, args.overrides)
    except RecipeError as exc:
        return _fail(world.rank, str(exc))
    if args.ipex:
        try:
            require_ipex()
        except IpexUnavailableError as exc:
            return _fail(world.rank, str(exc))
    for flag in ("max_steps", "checkpoint_every"):
        value = getattr(args, flag)
        if value is not None and value < (1 if flag == "max_steps" else 0):
            return _fail(world.rank, f"--{flag.replace('_', '-')} {value}: must be positive")
    if args.algorithm == "ltfb":
        from hpcdl.train.ltfb import run_command

        return run_command(args, config, world)
    if args.trainers != 1:
        return _fail(world.rank, f"--trainers {args.trainers} needs --algorithm ltfb")

    import hpcdl.comm
    from hpcdl.debug import Timeline, watch_collectives
    from hpcdl.train.threads import configure_threads

    try:
        comm = hpcdl.comm.init(args.backend or config.comm.backend, world,
                               bucket_bytes=int(config.comm.bucket_mb * 2**20),
                               wire_dtype=config.comm.wire_dtype)
    except (ValueError, KeyError) as exc:
        return _fail(world.rank, f"comm: {exc}")
    setup_logging(args.out, comm.rank, comm.size, args.log_level, world)
    log = logging.getLogger("hpcdl.train")
    configure_threads(comm)
    timeline = Timeline(args.timeline, comm.rank, world) if args.timeline else None
    # stall reports/abort (HPCDL_STALL_WARN_S/_ABORT_S), HPCDL_DEBUG records, bucket spans
    watch_collectives(comm, args.out, timeline=timeline)
    options = TrainOptions(deterministic=args.deterministic, no_comm=args.no_comm,
                           max_steps=args.max_steps, checkpoint_every=args.checkpoint_every,
                           ipex=args.ipex, progress=args.progress, evaluate=not args.no_eval)
    trainer = None
    try:
        # The checkpoint's rank count, batch and epoch length, read first: a resume on another
        # rank count (requeued onto other nodes) adapts the per-rank batch, or is refused here
        # naming the rank counts that would work, before any rank loads data.
        layout = resume_layout(args.resume, args.out, world)
        try:
            trainer = Trainer(config, args.data, args.out, comm, options=options,
                              timeline=timeline, resume_layout=layout)
        except ValueError as exc:  # RecipeError, or a factory rejecting a recipe value
            if layout and layout.get("world_size") != comm.size:
                return _fail(comm.rank, f"--resume {args.resume}: the checkpoint in {args.out} "
                                        f"was written by {layout.get('world_size')} ranks: {exc}")
            return _fail(comm.rank, f"{args.recipe}: {exc}")
        try:
            trainer.resume(args.resume)
        except CheckpointError as exc:
            return _fail(comm.rank, f"--resume {args.resume}: {exc}")
        try:
            summary = trainer.train()
        except NonFiniteLossError as exc:
            log.error("%s", exc)
            return EXIT_NONFINITE_LOSS
        if comm.rank == 0:
            log.info("done: %s step %d/%d, top-1 %s, %.1f s, params sha256 %s",
                     summary["stopped"], summary["steps"], summary["total_steps"],
                     summary["top1"], summary["wall_s"], summary["params_sha256"][:16])
        return EXIT_STOPPED_BY_SIGNAL if summary["stopped"] == "signal" else 0
    finally:
        if timeline is not None:
            timeline.save()
        if trainer is not None:
            trainer.close()
        comm.close()
