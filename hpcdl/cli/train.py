"""Train a recipe data-parallel over MPI ranks (one rank per socket).

    mpiexec -n 4 hpcdl train --recipe recipes/demo_fmnist.yaml --data SHARDS --out RUN_DIR \\
        [key=value ...]

RUN_DIR receives config.yaml, metrics.jsonl, summary.json, checkpoints/, logs/. Exit codes
and what a rejected command leaves behind: docs/training.md, "Exit codes".
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

from hpcdl.errors import EXIT_BAD_INPUT, BadInputError

COMMAND = "train"
HELP = "train a recipe with MPI data parallelism (checkpoint/resume, metrics)"

__all__ = ["COMMAND", "EXIT_BAD_INPUT", "HELP", "add_arguments", "run"]

log = logging.getLogger("hpcdl.train")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", required=True, help="recipe YAML (recipes/*.yaml)")
    parser.add_argument("--data", required=True, help="shard directory (data_prep output)")
    parser.add_argument("--out", required=True, metavar="RUN_DIR",
                        help="run directory (shared by all ranks)")
    add_session_arguments(parser)
    parser.add_argument("--resume", default="auto", metavar="auto|PATH|none",
                        help="auto: newest valid checkpoint in RUN_DIR/checkpoints (default); "
                             "none: start fresh")
    parser.add_argument("--verify-shards", action="store_true",
                        help="check the sha256 of every shard this run reads before training "
                             "(sizes are always checked); as `hpcdl prep verify`, split over "
                             "the ranks")
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
    parser.add_argument("--timeline", default=None, metavar="FILE",
                        help="write a chrome://tracing timeline of each step")
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


def add_session_arguments(parser: argparse.ArgumentParser) -> None:
    """What every training command takes besides its own: recipe overrides, the backend, the
    log level and the progress bar (``hpcdl train``, ``hpcdl demo``)."""
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="recipe overrides with dotted keys, e.g. batch.per_rank=32 epochs=2")
    parser.add_argument("--backend", default=None,
                        help="comm backend (auto: a timed trial at start; rule; mpi, ring, "
                             "shm, gloo, ccl); default: the recipe's comm.backend")
    parser.add_argument("--log-level", default="info", help="debug, info, warning, error")
    progress = parser.add_mutually_exclusive_group()
    progress.add_argument("--progress", dest="progress", action="store_true", default=None,
                          help="progress bar on rank 0 (default: when stderr is a terminal)")
    progress.add_argument("--no-progress", dest="progress", action="store_false")


def _check_options(args: argparse.Namespace) -> None:
    """Flag values (the same on every rank)."""
    for flag in ("max_steps", "checkpoint_every"):
        value = getattr(args, flag)
        if value is not None and value < (1 if flag == "max_steps" else 0):
            raise BadInputError(f"--{flag.replace('_', '-')} {value}: must be positive")
    if args.algorithm != "ltfb" and args.trainers != 1:
        raise BadInputError(f"--trainers {args.trainers} needs --algorithm ltfb")


def _train_options(args: argparse.Namespace):
    from hpcdl.train.trainer import TrainOptions

    return TrainOptions(deterministic=args.deterministic, no_comm=args.no_comm,
                        max_steps=args.max_steps, checkpoint_every=args.checkpoint_every,
                        ipex=args.ipex, progress=args.progress, evaluate=not args.no_eval,
                        verify_shards=args.verify_shards)


def _recipe_value_error(recipe: str, exc: Exception) -> BadInputError:
    """A factory rejecting a recipe value (unknown model, optimizer, schedule; a batch the
    rank count cannot give), named with the recipe: the same on every rank, since every rank
    reads the same recipe. Other bad input (data, manifest) already names its file."""
    from hpcdl.train.config import RecipeError

    if isinstance(exc, BadInputError) and not isinstance(exc, RecipeError):
        return exc
    return BadInputError(f"{recipe}: {exc}")


@contextlib.contextmanager
def _abort_unless_shared(world) -> Iterator[None]:
    """An error this rank may have alone ends the job here, before any teardown that needs
    the peers (a shared window freed, a barrier, a library finalized): they wait for this rank
    in the step's collective. Bad input prints its one line and exits 2 (a shard unreadable
    on one node), anything else its traceback, once, with rank and host, and exits 1. Errors
    every rank raised together (a checkpoint the disk had no room for) propagate up to
    hpcdl/cli/main.py, which prints them once; the session closes collectively."""
    from hpcdl.cli.main import report_bad_input
    from hpcdl.debug.faults import abort_on_unshared_error

    try:
        yield
    except BaseException as exc:
        if isinstance(exc, BadInputError) and not exc.agreed and world.Get_size() > 1:
            report_bad_input(COMMAND, exc)  # MPI_Abort ...
            os._exit(EXIT_BAD_INPUT)  # ... which MPICH returns from once its launcher knows
        abort_on_unshared_error(exc)
        raise


@dataclass
class RunDirectory:
    """What this command may remove of ``--out`` if it rejects its input: ``created``, the
    highest directory of the path ``out`` that did not exist before (None: --out existed), until
    ``training`` starts (from then on the run's logs and metrics are its record)."""

    created: str | None
    out: str = ""
    training: bool = False


def first_missing_directory(path: str) -> str | None:
    """The highest directory of ``path`` that does not exist yet (None: it all exists)."""
    path, missing = os.path.abspath(path), None
    while not os.path.lexists(path):
        missing, parent = path, os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return missing


def _remove_what_was_created(run_dir: RunDirectory, world) -> None:
    """After bad input every rank raised together: rank 0 removes the directory this command
    created (every rank first closes its log file in it, at the barrier)."""
    from hpcdl.debug.log import setup_rank_logging
    from hpcdl.io import remove_created_directories

    if run_dir.created and not run_dir.training:
        setup_rank_logging(None, world.Get_rank(), world.Get_size())  # the terminal only
    world.Barrier()
    if world.Get_rank() == 0 and run_dir.created and not run_dir.training:
        remove_created_directories(run_dir.out, run_dir.created)


def exit_code(summary: dict) -> int:
    """EXIT_STOPPED_BY_SIGNAL when the ranks agreed to stop on a signal, else 0. A signal after
    the run's last agreement changes nothing (the run is complete, its final checkpoint
    written, and ranks it reached at different moments would otherwise exit differently): it
    is logged on the ranks it reached."""
    from hpcdl.train import signals
    from hpcdl.train.trainer import EXIT_STOPPED_BY_SIGNAL

    if summary["stopped"] == "signal":
        return EXIT_STOPPED_BY_SIGNAL
    late = signals.pending()
    if late is not None:
        log.warning("signal %s after the run's last step (%s at step %d): nothing left to "
                    "checkpoint, exit 0", signals.name(late), summary["stopped"],
                    summary["steps"])
    return 0


def _train_to_the_end(runner, args: argparse.Namespace, world, run_dir: RunDirectory,
                      trainers: int | None = None) -> int:
    """Resume (every rank agreeing), train, log the end and return the exit code. With LTFB
    (``trainers``) a non-finite loss in one trainer aborts the whole job with code 3: its
    partners would otherwise wait for it in the next exchange."""
    from hpcdl.errors import agreed
    from hpcdl.train.trainer import EXIT_NONFINITE_LOSS, NonFiniteLossError

    with agreed(world):
        runner.resume(args.resume)
    run_dir.training = True
    try:
        summary = runner.train()
    except NonFiniteLossError as exc:
        log.error("%s", exc)
        if trainers is not None and trainers > 1:
            world.Abort(EXIT_NONFINITE_LOSS)
        return EXIT_NONFINITE_LOSS
    if world.rank == 0:
        best = "" if trainers is None else f"{trainers} trainer(s), best "
        log.info("done: %s step %d/%d, %stop-1 %s, %.1f s, params sha256 %s",
                 summary["stopped"], summary["steps"], summary["total_steps"], best,
                 summary["top1"], summary["wall_s"], summary["params_sha256"][:16])
    return exit_code(summary)


def run(args: argparse.Namespace) -> int:
    from hpcdl.train import signals

    # Before anything slow (MPI's start-up, torch, the data): from here a SIGUSR1/SIGTERM is
    # recorded and acted on at the ranks' next agreement; once the command returns, ignored.
    with signals.until_exit():
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from mpi4py import MPI  # MPI_Init: bounded by hpcdl.cli.main (HPCDL_STARTUP_TIMEOUT_S)

    from hpcdl.errors import agreed
    from hpcdl.train.config import load_recipe
    from hpcdl.train.session import check_output_dir
    from hpcdl.train.trainer import require_ipex

    world = MPI.COMM_WORLD
    # Rank 0 looks before any rank can create --out: the others wait in this broadcast.
    run_dir = RunDirectory(world.bcast(first_missing_directory(args.out)
                                       if world.Get_rank() == 0 else None, root=0), args.out)
    try:
        with agreed(world):  # every rank reads the same recipe and flags; --out may differ
            config = load_recipe(args.recipe, args.overrides)
            _check_options(args)
            if args.ipex:
                require_ipex()
            check_output_dir(args.out)
        if args.algorithm == "ltfb":
            return run_ltfb(args, config, world, run_dir)
        return run_data_parallel(args, config, world, run_dir)
    except BadInputError as exc:
        if exc.agreed or world.Get_size() == 1:  # every rank is here: none still writes
            _remove_what_was_created(run_dir, world)
        raise


def _session(args: argparse.Namespace, world, config, communicator: bool = True):
    """The run session of ``hpcdl train`` (hpcdl/train/session.py); ``communicator`` False:
    none of its own (LTFB's trainers open theirs)."""
    from hpcdl.train.session import RunSession, job_seconds_left, recipe_gradients

    # comm.backend: auto times the recipe model's own gradient buckets (hpcdl/comm/trial.py),
    # for at most 1% of what is left of the Slurm job
    gradients = recipe_gradients(config) if communicator else None
    return RunSession(world, config.comm if communicator else None, run_dir=args.out,
                      backend=args.backend, log_level=args.log_level, timeline=args.timeline,
                      precision=config.train.precision, gradients=gradients,
                      deterministic=args.deterministic, run_s=job_seconds_left())


def run_data_parallel(args: argparse.Namespace, config, world, run_dir: RunDirectory) -> int:
    """``hpcdl train`` with one data-parallel trainer over every rank."""
    from hpcdl.debug.stragglers import StragglerReport
    from hpcdl.errors import agreed
    from hpcdl.train.checkpoint import resume_layout
    from hpcdl.train.trainer import Trainer

    with _session(args, world, config) as session, _abort_unless_shared(world):
        comm = session.comm
        # The checkpoint's rank count, batch and epoch length, read first: a resume on
        # another rank count (requeued onto other nodes) adapts the per-rank batch, or is
        # refused here naming the rank counts that would work, before any rank loads data.
        layout = resume_layout(args.resume, args.out, world)
        with agreed(world):
            try:
                trainer = session.own(Trainer(
                    config, args.data, args.out, comm, options=_train_options(args),
                    timeline=session.timeline, resume_layout=layout))
            except ValueError as exc:
                if layout and layout.get("world_size") != comm.size:
                    raise BadInputError(
                        f"--resume {args.resume}: the checkpoint in {args.out} was written "
                        f"by {layout.get('world_size')} ranks: {exc}") from exc
                raise _recipe_value_error(args.recipe, exc) from exc
        # each log interval, the rank the others waited for (two tiny allreduces)
        trainer.after_step_hooks.append(
            StragglerReport(comm, config.train.log_every_steps))
        return _train_to_the_end(trainer, args, world, run_dir)


def run_ltfb(args: argparse.Namespace, config, world, run_dir: RunDirectory) -> int:
    """``hpcdl train --algorithm ltfb``: the same session, with threads from the whole
    world's nodes and one communicator per trainer (hpcdl/train/ltfb.py)."""
    from hpcdl.errors import agreed
    from hpcdl.train.ltfb import LTFB, LTFBOptions
    from hpcdl.train.tournament import split_world

    ltfb = LTFBOptions(trainers=args.trainers, interval=args.tournament_interval,
                       metric=args.tournament_metric, exchange=args.exchange,
                       holdout_fraction=args.tournament_holdout)
    with agreed(world):
        try:
            ltfb.validate()
            if world.size % ltfb.trainers:
                split_world(world, ltfb.trainers)  # raises the message naming both numbers
        except ValueError as exc:
            raise BadInputError(str(exc)) from exc
        if ltfb.trainers > 1 and args.resume not in ("auto", "none"):
            raise BadInputError(f"--resume {args.resume}: with {ltfb.trainers} LTFB trainers "
                                f"use auto or none (all trainers resume from one common step)")
    with _session(args, world, config, communicator=False) as session:
        with agreed(world):
            try:
                runner = session.own(LTFB(config, args.data, args.out, world, ltfb,
                                          _train_options(args), backend=args.backend,
                                          timeline=session.timeline))
            except (ValueError, KeyError) as exc:
                raise _recipe_value_error(args.recipe, exc) from exc
        with _abort_unless_shared(world):
            session.watch(runner.comm, runner.trainer.run_dir)
            return _train_to_the_end(runner, args, world, run_dir, trainers=ltfb.trainers)
