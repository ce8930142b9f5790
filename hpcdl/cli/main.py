"""The one `hpcdl` command.

Each sub-command is a module of this package that defines ``COMMAND`` (its name), ``HELP``,
``add_arguments(parser)`` and ``run(args) -> int``; this file only finds and dispatches them,
so adding a command is adding one file. Modules keep heavy imports (torch, mpi4py) inside
``run`` so that ``hpcdl --help`` stays fast and works without MPI.

Bad input (:class:`hpcdl.errors.BadInputError`) that a command lets through ends here as one
line, ``hpcdl CMD: what is wrong and what to do``, and exit code 2: printed by rank 0 when
every rank raised it (``agreed``), else by the rank that did, which then aborts the job (the
others may be waiting for it in a collective). ``--log-level debug`` or ``HPCDL_DEBUG=1`` add
the traceback.

Every command's MPI_Init is bounded here (``HPCDL_STARTUP_TIMEOUT_S``,
hpcdl/debug/startup.py), on the first import of ``mpi4py.MPI`` wherever it happens.
"""
from __future__ import annotations

import argparse
import contextlib
import socket
import sys
import traceback
from collections.abc import Sequence

import hpcdl
import hpcdl.cli
from hpcdl.cli.commands import add_command_parsers, command_modules
from hpcdl.env import EnvVarError, check_environment
from hpcdl.errors import EXIT_BAD_INPUT, BadInputError, mark_agreed


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpcdl",
        description="Large-batch ImageNet training on CPU clusters with MPI.",
    )
    parser.add_argument("--version", action="version", version=f"hpcdl {hpcdl.__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_command_parsers(subparsers, command_modules(hpcdl.cli, skip=("main",)))
    return parser


def report_bad_input(command: str, error: BadInputError, debug: bool = False) -> int:
    """Print ``hpcdl COMMAND: message`` once and return :data:`EXIT_BAD_INPUT`; when ``error``
    may be this rank's alone, print it with the rank and abort the whole job instead."""
    # COMM_WORLD when this process has initialised MPI, else None (a command without MPI)
    mpi = sys.modules.get("mpi4py.MPI")
    world = mpi.COMM_WORLD if mpi is not None and mpi.Is_initialized() else None
    rank, size = (world.Get_rank(), world.Get_size()) if world is not None else (0, 1)
    alone = size > 1 and not error.agreed
    if rank == 0 or alone:
        if debug:
            traceback.print_exception(error, file=sys.stderr)
        where = f"rank {rank} of {size} on {socket.gethostname()}: " \
            if alone and not str(error).startswith("rank ") else ""
        print(f"hpcdl {command}: {where}{error}", file=sys.stderr, flush=True)
    if alone:
        from hpcdl.debug.faults import abort_after_output

        abort_after_output(world, EXIT_BAD_INPUT)
    return EXIT_BAD_INPUT


def _debug(args: argparse.Namespace) -> bool:
    from hpcdl.debug.log import debug_enabled

    try:
        on = debug_enabled()
    except EnvVarError:  # HPCDL_DEBUG itself is the bad input being reported
        on = False
    return on or str(getattr(args, "log_level", "")).lower() == "debug"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "_run"):
        parser.print_help()
        return 2
    try:
        check_environment()  # every HPCDL_* variable, before the command does anything
        from hpcdl.debug.startup import mpi_init_bounded

        # Written once for every command: MPI_Init, wherever a command first imports mpi4py,
        # ends within HPCDL_STARTUP_TIMEOUT_S; commands that never import it never start MPI.
        with mpi_init_bounded():
            return int(args._run(args) or 0)
    except BadInputError as error:
        return report_bad_input(args.command, error, _debug(args))
    except SystemExit as stop:
        # The benches check their arguments with SystemExit("hpcdl bench NAME: what is
        # wrong"), the same on every rank: bad input, exit 2 like every other command's.
        if args.command != "bench" or not isinstance(stop.code, str):
            raise
        message = stop.code.removeprefix("hpcdl bench").removeprefix(":").strip()
        return report_bad_input(args.command, mark_agreed(BadInputError(message)),
                                _debug(args))


def cli() -> None:
    """The ``hpcdl`` executable: :func:`main`, then the process ends (MPI_Finalize guarded:
    a peer cut off at that moment would otherwise hold this rank forever)."""
    from hpcdl.train import signals

    signals.own_process()  # a late stop signal is discarded, not fatal, while this rank ends
    code = main()
    from hpcdl.debug.stall import guard_mpi_finalize

    with contextlib.suppress(EnvVarError):  # already reported as the command's bad input
        guard_mpi_finalize()
    sys.exit(code)


if __name__ == "__main__":
    cli()
