"""Rank-aware logging: every line says which rank of how many on which host wrote it.

Rank 0 prints to the terminal (other ranks only errors), every rank writes its whole log to
``RUN_DIR/logs/rank-XXXX.log``; ``HPCDL_DEBUG=1`` raises every rank to DEBUG
(docs/debugging.md, "Logs you can follow").
"""
from __future__ import annotations

import logging
import os
import socket
import sys

from hpcdl.env import env_flag

LOGGER_NAME = "hpcdl"
#: Debug mode's one line per collective: to the rank's file only, never the terminal.
COLLECTIVES_LOGGER = "hpcdl.debug.collectives"
_FORMAT = "%(asctime)s [rank {rank}/{size} {host}] %(levelname)s %(name)s: %(message)s"
_handlers: list[logging.Handler] = []
_log_file: str | None = None


def debug_enabled() -> bool:
    """``HPCDL_DEBUG=1`` switches on debug mode (values: hpcdl.env)."""
    return env_flag("HPCDL_DEBUG")


def rank_log_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, "logs", f"rank-{rank:04d}.log")


def rank_prefix(rank: int, size: int, host: str | None = None) -> str:
    return f"[rank {rank}/{size} {host or socket.gethostname()}]"


def current_log_file() -> str | None:
    """The log file the last ``setup_rank_logging`` opened (stack dumps go there too)."""
    return _log_file


def _parse_level(level: int | str) -> int:
    if isinstance(level, int):
        return level
    value = logging.getLevelName(str(level).upper())
    if not isinstance(value, int):
        raise ValueError(f"unknown log level {level!r}: use debug, info, warning or error")
    return value


def setup_rank_logging(
    run_dir: str | None, rank: int, size: int, level: int | str = "info"
) -> logging.Logger:
    """Configure the ``hpcdl`` logger for this rank and return it. ``run_dir=None``: the
    terminal only (rank 0). Calling it again replaces the handlers it installed before."""
    global _log_file
    level_no = logging.DEBUG if debug_enabled() else _parse_level(level)
    formatter = logging.Formatter(_FORMAT.format(rank=rank, size=size, host=socket.gethostname()))
    logger = logging.getLogger(LOGGER_NAME)
    for handler in _handlers:
        logger.removeHandler(handler)
        handler.close()
    _handlers.clear()

    terminal = logging.StreamHandler(sys.stderr)
    # Only rank 0 talks on the terminal; other ranks' errors still reach it, or a crash on
    # rank 5 would be visible only in a file nobody is looking at.
    terminal.setLevel(level_no if rank == 0 else logging.ERROR)
    terminal.addFilter(lambda record: record.name != COLLECTIVES_LOGGER)
    _handlers.append(terminal)
    _log_file = None
    if run_dir is not None:
        _log_file = rank_log_path(run_dir, rank)
        os.makedirs(os.path.dirname(_log_file), exist_ok=True)
        to_file = logging.FileHandler(_log_file, mode="a", encoding="utf-8")
        to_file.setLevel(level_no)
        _handlers.append(to_file)
    for handler in _handlers:
        handler.setFormatter(formatter)
        logger.addHandler(handler)
    logger.setLevel(level_no)
    logger.propagate = False
    return logger
