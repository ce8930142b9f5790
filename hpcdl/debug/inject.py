"""``HPCDL_INJECT``: rehearsed faults, one variable for every kind (docs/debugging.md).

``RANK:SEQ:raise`` / ``RANK:SEQ:sleep=S`` act before a collective (hpcdl.debug.monitor);
``RANK:POINTN:sleep=S`` pauses rank RANK at a named point of its run, the N-th time it gets
there (N defaults to 1): ``checkpoint`` (inside a checkpoint write, after the data and before
the rename; hpcdl/train/checkpoint.py), ``exit`` (before MPI_Finalize;
hpcdl.debug.stall.guard_mpi_finalize) and ``startup`` (inside ``hpcdl.comm.init``, before the
communicator is created: a hold at start-up, hpcdl/debug/startup.py). How the fault tests
land a fault in those phases.
"""
from __future__ import annotations

import os
import re

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
    text = os.environ.get("HPCDL_INJECT", "") if text is None else text
    match = _NAMED.fullmatch(text.strip())
    if match is None or match.group(2) != point or int(match.group(1)) != rank:
        return 0, 0.0
    return int(match.group(3) or 1), float(match.group(4))
