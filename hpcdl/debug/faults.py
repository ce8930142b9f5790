"""Fail fast on a dead rank, and dump stacks of a live one (docs/debugging.md, section 4).

``install_fail_fast``: an uncaught exception, in the main or the communication thread, prints
its traceback with the rank and ``MPI_Abort``s the job, instead of leaving the others blocked
in their next allreduce until the time limit. Every teardown that needs peers (a window free,
a barrier) starts with ``abort_on_unshared_error()``, since a ``finally`` runs before the hook:
an error the peers do not share aborts there; only an agreed end reaches the teardown.

``install_stack_dump``: ``SIGUSR2`` writes every thread's Python stack to the log
(``faulthandler``); ``HPCDL_DUMP=1`` does so every ``HPCDL_DUMP_EVERY_S`` seconds.
"""
from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from types import TracebackType
from typing import Any, TextIO

from hpcdl.debug.log import LOGGER_NAME, current_log_file, rank_prefix
from hpcdl.env import env_flag, env_seconds
from hpcdl.errors import BadInputError

ABORT_EXIT_CODE = 1
_dump_file: TextIO | None = None
#: COMM_WORLD once fail-fast is installed (None: a caller that handles a dead rank itself)
_abort_world: Any = None


def format_rank_traceback(
    rank: int, size: int, exc_type: type[BaseException], exc: BaseException | None,
    tb: TracebackType | None, thread_name: str = "MainThread", prefix_lines: bool = True,
) -> str:
    """The traceback with a rank prefix on every line, so interleaved stderr stays readable."""
    prefix = rank_prefix(rank, size, socket.gethostname()) + " " if prefix_lines else ""
    lines = [f"uncaught {exc_type.__name__} in thread {thread_name}; aborting the job\n"]
    lines += traceback.format_exception(exc_type, exc, tb)
    return "".join(f"{prefix}{line}" for chunk in lines for line in chunk.splitlines(True))


def _log_to_files(text: str) -> None:
    """Put the traceback in this rank's log file (the terminal gets it from stderr below)."""
    logger = logging.getLogger(LOGGER_NAME)
    record = logger.makeRecord(LOGGER_NAME, logging.CRITICAL, __file__, 0, "%s",
                               (text.rstrip("\n"),), None)
    for handler in logger.handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


# MPI_Abort makes the launcher kill every process at once, losing lines its proxy has not yet
# forwarded (an aborting rank's bad-input line): a moment's grace lets them through.
OUTPUT_GRACE_S = 0.5


def _flush_streams() -> None:
    for stream in (sys.stderr, sys.stdout):
        with contextlib.suppress(Exception):  # a closed stream must not stop the abort
            stream.flush()


def abort_after_output(mpi_comm: Any, code: int) -> None:
    """Flush this rank's streams, give the launcher time to forward them, then MPI_Abort."""
    _flush_streams()
    time.sleep(OUTPUT_GRACE_S)
    mpi_comm.Abort(code)


def _report_and_abort(mpi_comm: Any, rank: int, size: int, exc_info: tuple,
                      thread_name: str = "MainThread") -> None:
    """The traceback to this rank's log file and, rank-prefixed, to stderr; then MPI_Abort."""
    with contextlib.suppress(Exception):  # logging must not stop the abort
        _log_to_files(format_rank_traceback(rank, size, *exc_info, thread_name,
                                            prefix_lines=False))
    _flush_streams()
    sys.stderr.write(format_rank_traceback(rank, size, *exc_info, thread_name))
    abort_after_output(mpi_comm, ABORT_EXIT_CODE)
    os._exit(ABORT_EXIT_CODE)  # MPI_Abort returned (cut off from the launcher): end this rank


def is_shared_error(exc: BaseException) -> bool:
    """Whether every rank raises ``exc`` together, so the collective teardown may run:
    ``SystemExit`` (a command's own exit, decided the same on every rank) and errors marked
    ``agreed`` (:func:`hpcdl.errors.agree_on`, a non-finite loss agreed in the step)."""
    return isinstance(exc, SystemExit) or bool(getattr(exc, "agreed", False))


def abort_on_unshared_error(exc: BaseException | None = None) -> None:
    """Called first by every teardown that needs peers. When this rank is unwinding an error
    its peers do not share (``exc``, default the one being handled), print its traceback with
    rank and host and abort the whole job: does not return. Otherwise (no error, an agreed
    one, one rank, fail-fast not installed) return at once."""
    world = _abort_world
    if exc is None:
        exc = sys.exc_info()[1]
        if isinstance(exc, BadInputError):
            # Bad input is checked alike on every rank, and a constructor that tears down
            # on it (LTFB, oneCCL) runs inside the caller's ``agreed`` block, which agrees
            # on it after the teardown; an entry point passes ``exc`` to decide itself.
            return
    if exc is None or world is None or is_shared_error(exc):
        return
    _report_and_abort(world, world.Get_rank(), world.Get_size(),
                      (type(exc), exc, exc.__traceback__), threading.current_thread().name)


def install_fail_fast(mpi_comm: Any) -> None:
    """Abort the whole MPI job when any thread of this rank dies of an uncaught exception,
    or reaches a teardown that needs peers while unwinding one (``abort_on_unshared_error``)."""
    global _abort_world
    rank, size = mpi_comm.Get_rank(), mpi_comm.Get_size()
    if size > 1:
        _abort_world = mpi_comm

    def on_main_exception(exc_type: type[BaseException], exc: BaseException,
                          tb: TracebackType | None) -> None:
        _report_and_abort(mpi_comm, rank, size, (exc_type, exc, tb))

    def on_thread_exception(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is SystemExit:
            return
        name = args.thread.name if args.thread is not None else "?"
        _report_and_abort(mpi_comm, rank, size,
                          (args.exc_type, args.exc_value, args.exc_traceback), name)

    sys.excepthook = on_main_exception
    threading.excepthook = on_thread_exception


def install_stack_dump(path: str | None = None) -> str:
    """Register ``SIGUSR2`` to dump all threads' Python stacks to ``path`` (default: this
    rank's log file, else stderr); returns where dumps go."""
    global _dump_file
    path = path or current_log_file()
    if _dump_file is not None and _dump_file is not sys.stderr:
        _dump_file.close()
    # faulthandler writes to the file descriptor from a signal handler, so it needs a file it
    # keeps open for the life of the process, separate from logging's handler.
    _dump_file = open(path, "a", encoding="utf-8") if path else sys.stderr  # noqa: SIM115
    faulthandler.register(signal.SIGUSR2, file=_dump_file, all_threads=True, chain=False)
    if env_flag("HPCDL_DUMP"):
        every_s = env_seconds("HPCDL_DUMP_EVERY_S")
        faulthandler.dump_traceback_later(every_s, repeat=True, file=_dump_file)
    return path or "<stderr>"


def dump_stacks_now() -> None:
    """Write every thread's stack where ``install_stack_dump`` sends them (or stderr)."""
    target = _dump_file or sys.stderr
    target.flush()
    faulthandler.dump_traceback(file=target, all_threads=True)
    target.flush()
