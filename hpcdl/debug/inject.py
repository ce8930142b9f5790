"""``HPCDL_INJECT``: rehearsed faults, one variable for every kind (docs/debugging.md).

``RANK:SEQ:raise`` / ``RANK:SEQ:sleep=S`` act before a collective (hpcdl.debug.monitor);
``RANK:POINTN:sleep=S`` pauses rank RANK the N-th time (default 1) it reaches ``checkpoint``
(inside a write, before the rename), ``exit`` (before MPI_Finalize) or ``startup`` (inside
``hpcdl.comm.init``, before the communicator exists).
"""
from __future__ import annotations

import logging
import re

from hpcdl.debug.log import LOGGER_NAME
from hpcdl.env import env_text

#: the named points a pause can be injected at
NAMED_POINTS = ("checkpoint", "exit", "startup")
_NAMED = re.compile(r"(\d+):([a-z]+)(\d*):sleep=([0-9.]+)")


def is_named_point(seq: str) -> bool:
    """Whether the SEQ field of ``HPCDL_INJECT`` names a point (``checkpoint2``), not a
    collective's number."""
    return seq.rstrip("0123456789") in NAMED_POINTS


def injected_pause(rank: int, point: str, text: str | None = None) -> tuple[int, float]:
    """(N, seconds) when ``HPCDL_INJECT`` (or ``text``) is ``RANK:POINTN:sleep=SECONDS`` for
    this ``rank`` and ``point``; (0, 0.0) otherwise."""
    text = env_text("HPCDL_INJECT") if text is None else text
    match = _NAMED.fullmatch(text.strip())
    if match is None or match.group(2) != point or int(match.group(1)) != rank:
        return 0, 0.0
    return int(match.group(3) or 1), float(match.group(4))


_announced = False


def describe_injection(text: str) -> str:
    """What ``HPCDL_INJECT=text`` will do, in words (text as ``parse_injection`` accepts it)."""
    rank, seq, action = text.strip().split(":", 2)
    kind, _, seconds = action.partition("=")
    point, count = seq.rstrip("0123456789"), seq[len(seq.rstrip("0123456789")):] or "1"
    if point == "checkpoint":
        return f"rank {rank} pauses {seconds} s inside checkpoint write #{count}"
    if point == "exit":
        return f"rank {rank} sleeps {seconds} s before MPI_Finalize"
    if kind == "raise":
        return f"rank {rank} raises before its collective #{seq}"
    return f"rank {rank} sleeps {seconds} s before its collective #{seq}"


def announce_injection(world_rank: int, text: str | None = None) -> str | None:
    """On world rank 0, once per process, warn that ``HPCDL_INJECT`` is set and what it will
    do: it is a rehearsal tool, and ``sbatch --export=ALL`` carries it from the submitting
    shell into a production run. Returns the line (None when nothing was said)."""
    global _announced
    text = env_text("HPCDL_INJECT") if text is None else text.strip()
    if not text or world_rank != 0 or _announced:
        return None
    _announced = True
    line = (f"HPCDL_INJECT={text!r} is set: {describe_injection(text)} (a rehearsed fault, "
            f"docs/debugging.md); unset HPCDL_INJECT unless this run is a rehearsal")
    logging.getLogger(LOGGER_NAME).warning(line)
    return line
