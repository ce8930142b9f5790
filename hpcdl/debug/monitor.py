"""What ``Communicator._collective`` calls around every collective (hpcdl/comm/base.py).

``NULL_MONITOR`` (default) does nothing. ``watch_collectives(comm, run_dir)`` installs a live
``CollectiveMonitor``: its fast path is a counter and one tuple store per collective, which the
stall watchdog reads from its own thread; with ``HPCDL_DEBUG=1`` it also records and logs every
collective and writes the last ones when one fails; with a ``Timeline`` each collective is a
span on its issuing thread. ``HPCDL_INJECT=RANK:SEQ:raise|sleep=S`` acts before collective SEQ
(hpcdl/debug/inject.py).
"""
from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
import uuid
from collections import deque
from typing import Any

from hpcdl.debug.inject import announce_injection, is_named_point
from hpcdl.debug.log import COLLECTIVES_LOGGER, debug_enabled
from hpcdl.debug.stall import (
    IO_WAIT_S,
    StallWatchdog,
    default_heartbeat_dir,
    end_process,
    heartbeat_path,
    thresholds_from_env,
)
from hpcdl.env import env_text

RECORDS_KEPT = 10_000


class InjectedFault(RuntimeError):
    """Raised by ``HPCDL_INJECT=RANK:SEQ:raise`` (a rehearsal of a rank that dies)."""


class NullMonitor:
    """No debugging: every method is a no-op (the communicator's default)."""

    _watch = contextlib.nullcontext()

    def watch(self, name: str, meta: dict[str, Any]) -> contextlib.nullcontext:
        return self._watch

    def note(self, activity: str) -> None:
        pass

    def close(self) -> None:
        pass


NULL_MONITOR = NullMonitor()


def parse_injection(text: str) -> tuple[int, int, str, float] | None:
    """``"1:5:raise"`` -> (1, 5, "raise", 0.0); ``"1:3:sleep=30"`` -> (1, 3, "sleep", 30.0)."""
    text = text.strip()
    if not text:
        return None
    try:
        rank, seq, action = text.split(":", 2)
        kind, _, seconds = action.partition("=")
        named = is_named_point(seq)  # a pause at a point of the run, not at a collective
        if kind not in ("raise", "sleep") or (named and kind != "sleep"):
            raise ValueError(kind)
        parsed = int(rank), seq, kind, float(seconds or 0)
        return None if named else (parsed[0], int(seq), kind, parsed[3])
    except ValueError:
        raise ValueError(f"HPCDL_INJECT={text!r}: expected RANK:SEQ:raise, "
                         f"RANK:SEQ:sleep=SECONDS, RANK:checkpointN:sleep=SECONDS or "
                         f"RANK:exit:sleep=SECONDS") from None


class _Watch:
    __slots__ = ("monitor", "name", "meta", "seq", "t0")

    def __init__(self, monitor: CollectiveMonitor, name: str, meta: dict[str, Any]) -> None:
        self.monitor, self.name, self.meta = monitor, name, meta

    def __enter__(self) -> None:
        m = self.monitor
        seq = m.seq + 1
        if m.injection is not None and m.injection[1] == seq:
            m.inject(seq, self.name)
        m.seq = self.seq = seq
        # The one store the watchdog reads: (seq, name, meta, since, in_collective).
        m.state = (seq, self.name, self.meta, time.time(), True)
        self.t0 = time.perf_counter()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: object) -> bool:
        m = self.monitor
        dt = time.perf_counter() - self.t0
        m.wait_s += dt  # (hpcdl/debug/stragglers.py: who the others waited for)
        m.state = (self.seq, self.name, self.meta, time.time(), False)
        if m.timeline is not None:
            bucket = self.meta.get("bucket")
            label = self.name if bucket is None else f"{self.name} bucket {bucket}"
            m.timeline.complete(label, "comm", self.t0, dt, {"bytes": self.meta.get("bytes")})
        if m.records is not None:
            m.record(self.seq, self.name, self.meta, dt)
        if exc_type is not None:
            m.log_recent(f"collective #{self.seq} {self.name} failed with {exc_type.__name__}")
        return False


class CollectiveMonitor:
    """Live monitor of one rank's collectives; see the module docstring."""

    def __init__(self, rank: int, size: int, record: bool = False, timeline: Any = None,
                 injection: str = "") -> None:
        self.rank, self.size = rank, size
        self.seq = 0
        self.wait_s = 0.0  # seconds spent inside watched collectives, summed
        self.hosts: list[str] = []  # every rank's host (watch_collectives)
        self.job: str | None = None  # the job id of the heartbeat directory (watch_collectives)
        now = time.time()
        self.state: tuple[int, str, dict, float, bool] = (0, "", {}, now, False)
        self.activity: tuple[str, float] = ("", now)
        self.records: deque[dict[str, Any]] | None = deque(maxlen=RECORDS_KEPT) if record \
            else None
        self.timeline = timeline
        parsed = parse_injection(injection)
        self.injection = parsed if parsed is not None and parsed[0] == rank else None
        self.watchdog: StallWatchdog | None = None
        self.owns_heartbeat_dir = False
        self._log = logging.getLogger(COLLECTIVES_LOGGER)

    def watch(self, name: str, meta: dict[str, Any]) -> _Watch:
        return _Watch(self, name, meta)

    def note(self, activity: str) -> None:
        """What this rank is doing between collectives ("data wait", "checkpoint step 400"):
        the stall report shows it for ranks that have not arrived."""
        self.activity = (activity, time.time())

    def record(self, seq: int, name: str, meta: dict[str, Any], seconds: float) -> None:
        entry = {"seq": seq, "name": name, "bucket": meta.get("bucket"),
                 "shapes": meta.get("shapes"), "dtype": meta.get("dtype", meta.get("dtypes")),
                 "bytes": meta.get("bytes"), "seconds": round(seconds, 6)}
        self.records.append(entry)
        self._log.debug("collective %s", entry)

    def log_recent(self, why: str, count: int = 10) -> None:
        if not self.records:
            return
        recent = list(self.records)[-count:]
        self._log.error("%s; this rank's last %d collectives:\n%s", why, len(recent),
                        "\n".join(f"  {r}" for r in recent))

    def inject(self, seq: int, name: str) -> None:
        _, _, kind, seconds = self.injection
        if kind == "sleep":
            self.note(f"sleeping {seconds:g} s (HPCDL_INJECT) before #{seq} {name}")
            time.sleep(seconds)
            self.note("")
            return
        self.injection = None  # one fault: the teardown's own collectives must not raise again
        raise InjectedFault(f"HPCDL_INJECT: rank {self.rank} raises before collective #{seq} "
                            f"{name}")

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog.join()
            published = self.watchdog.wait_published(IO_WAIT_S)
            # a clean end leaves no temporary heartbeat behind (a write still hanging might
            # recreate it: then the folder stays)
            if self.owns_heartbeat_dir and published:
                _remove_quietly(self.watchdog.heartbeat_dir, self.rank)
            self.watchdog = None


def _remove_quietly(directory: str, rank: int) -> None:
    with contextlib.suppress(OSError):
        os.unlink(heartbeat_path(directory, rank))
    with contextlib.suppress(OSError):
        os.rmdir(directory)  # the last rank of this host to leave removes the job's folder


def watch_collectives(comm: Any, run_dir: str | None = None, *, record: bool | None = None,
                      warn_s: float | None = None, abort_s: float | None = None,
                      timeline: Any = None, abort: Any = None) -> CollectiveMonitor:
    """Install a live monitor on ``comm`` (collective: call on every rank) and return it.

    Replaces ``hpcdl.comm.init``'s default. ``record`` defaults to debug mode; thresholds to
    ``HPCDL_STALL_WARN_S`` / ``HPCDL_STALL_ABORT_S``. Heartbeats and stall dumps go to
    ``RUN_DIR/logs/heartbeat/``, else ``HPCDL_HEARTBEAT_DIR/JOB`` or the host's temporary
    directory (removed on a clean close). ``abort(code)`` defaults to MPI_Abort on COMM_WORLD,
    then the rank ending itself ``HPCDL_STALL_EXIT_GRACE_S`` later; a caller's owns the end.
    """
    mpi_comm = comm.mpi_comm
    previous = comm.monitor  # hpcdl.comm.init's: the same ranks, their hosts already known
    hosts, job = getattr(previous, "hosts", None), getattr(previous, "job", None)
    unwatch_collectives(comm)
    if not (job and hosts and len(hosts) == comm.size):
        me = (socket.gethostname(), uuid.uuid4().hex if mpi_comm.Get_rank() == 0 else None)
        peers = mpi_comm.allgather(me)  # every rank's host, for reports that lack heartbeats
        hosts, job = [host for host, _ in peers], peers[0][1]
    monitor = CollectiveMonitor(comm.rank, comm.size,
                                record=debug_enabled() if record is None else record,
                                timeline=timeline, injection=env_text("HPCDL_INJECT"))
    monitor.hosts, monitor.job = hosts, job
    from mpi4py import MPI

    announce_injection(MPI.COMM_WORLD.Get_rank())  # parsed above: a bad value raised there
    thresholds = thresholds_from_env(warn_s, abort_s)
    if thresholds.enabled:
        exit_process = None
        if abort is None:
            abort, exit_process = MPI.COMM_WORLD.Abort, end_process
        if run_dir:
            heartbeat_dir = os.path.join(run_dir, "logs", "heartbeat")
        else:
            heartbeat_dir = default_heartbeat_dir(job)
            monitor.owns_heartbeat_dir = True
        monitor.watchdog = StallWatchdog(monitor, thresholds, heartbeat_dir, job, abort,
                                         hosts=hosts,
                                         exit_process=exit_process)
        monitor.watchdog.start()
    comm.set_monitor(monitor)
    return monitor


def unwatch_collectives(comm: Any) -> None:
    """Stop the watchdog and put the no-op monitor back."""
    monitor = comm.monitor
    if isinstance(monitor, CollectiveMonitor):
        monitor.close()
    comm.set_monitor(NULL_MONITOR)


def watch_region(comm: Any, name: str, meta: dict[str, Any] | None = None) -> Any:
    """Count a collective made directly on ``comm.mpi_comm`` (a control Allreduce, a gather)
    as one, so the stall report covers it (``with watch_region(comm, "agree on stop"): ...``).
    Every rank must enter the same regions in the same order (like any collective)."""
    return comm.monitor.watch(name, meta or {})


def note_activity(comm: Any, activity: str) -> None:
    """Tell the stall report what this rank does between collectives (cheap; no-op when off)."""
    comm.monitor.note(activity)
