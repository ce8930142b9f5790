"""A chrome://tracing (Perfetto) timeline of one training run.

Complete events (``"ph": "X"``, ``ts``/``dur`` in microseconds), ``pid`` = rank, ``tid`` = the
recording thread, so the communication thread's reductions sit on their own row under the
backward pass. ``Timeline(None)`` is disabled: ``span`` returns a shared no-op context.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from hpcdl.io import atomic_write_text

_NULL_SPAN = contextlib.nullcontext()


class Timeline:
    """Collects spans in memory; ``save()`` writes them atomically as Trace Event JSON.

    With ``mpi_comm``, ``save()`` is collective: rank 0 writes every rank's events. Without
    it (or while an exception unwinds) each rank r > 0 writes ``path`` with ``.rank-XXXX``
    before the extension."""

    def __init__(self, path: str | None, rank: int = 0, mpi_comm: Any = None,
                 max_events: int = 1_000_000):
        self.path = path
        self.rank = rank
        self.mpi_comm = mpi_comm
        self.max_events = max_events
        self.dropped = 0
        self._events: list[dict[str, Any]] | None = [] if path else None
        self._tids: dict[int, int] = {}
        # Wall-clock origin so ranks line up on one axis (clocks of a cluster agree to NTP's
        # precision); perf_counter measures the intervals themselves.
        self._wall0 = time.time() - time.perf_counter()

    @property
    def enabled(self) -> bool:
        return self._events is not None

    def _tid(self) -> int:
        ident = threading.get_ident()
        tid = self._tids.get(ident)
        if tid is None:
            tid = self._tids[ident] = len(self._tids)
            self._events.append({"ph": "M", "name": "thread_name", "pid": self.rank, "tid": tid,
                                 "args": {"name": threading.current_thread().name}})
        return tid

    def complete(self, name: str, cat: str, start_s: float, dur_s: float,
                 args: dict[str, Any] | None = None) -> None:
        """Record an already-timed interval (``time.perf_counter`` seconds) on this thread."""
        if self._events is None:
            return
        if len(self._events) >= self.max_events:
            self.dropped += 1  # bounded memory on long runs; the count is saved with the trace
            return
        event = {"ph": "X", "name": name, "cat": cat, "pid": self.rank, "tid": self._tid(),
                 "ts": round((self._wall0 + start_s) * 1e6, 3), "dur": round(dur_s * 1e6, 3)}
        if args:
            event["args"] = args
        self._events.append(event)

    def span(self, name: str, cat: str = "train", **args: Any) -> contextlib.AbstractContextManager:
        """``with timeline.span("backward", "compute"):`` records one complete event."""
        if self._events is None:
            return _NULL_SPAN
        return self._span(name, cat, args)

    @contextlib.contextmanager
    def _span(self, name: str, cat: str, args: dict[str, Any]) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.complete(name, cat, start, time.perf_counter() - start, args or None)

    def events(self) -> list[dict[str, Any]]:
        return list(self._events or [])

    def _rank_path(self) -> str:
        if self.rank == 0:
            return self.path
        root, ext = os.path.splitext(self.path)
        return f"{root}.rank-{self.rank:04d}{ext or '.json'}"

    def save(self) -> str | None:
        """Write the trace (atomically); returns the path written on this rank, or None."""
        if self._events is None:
            return None
        events = [{"ph": "M", "name": "process_name", "pid": self.rank,
                   "args": {"name": f"rank {self.rank}"}}] + self._events
        dropped = self.dropped
        # save() in a ``finally`` while an exception unwinds this rank: the other ranks are not
        # coming to the gather (they wait in an allreduce), so write this rank's own file.
        unwinding = sys.exc_info()[0] is not None
        if self.mpi_comm is not None and not unwinding:
            gathered = self.mpi_comm.gather((events, dropped), root=0)
            if self.mpi_comm.Get_rank() != 0:
                return None
            events = [e for rank_events, _ in gathered for e in rank_events]
            dropped = sum(d for _, d in gathered)
            path = self.path
        else:
            path = self._rank_path()
        trace = {"traceEvents": events, "displayTimeUnit": "ms",
                 "otherData": {"dropped_events": dropped}}
        atomic_write_text(path, json.dumps(trace) + "\n")
        return path
