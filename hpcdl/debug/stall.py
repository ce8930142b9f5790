"""Stall reports: which ranks have not arrived at a collective, and what they last did.

Channel: a shared directory of heartbeat files (``RUN_DIR/logs/heartbeat/rank-XXXX.json``),
written by each rank's watchdog thread, not an MPI RMA window. Passive-target RMA needs the
target to make MPI progress in many MPI builds (MPICH over ch4:ofi without hardware RMA among
them), and the rank we most need to hear from is exactly the one that is *not* calling MPI (it is
sleeping, decoding JPEGs or stuck in Python). A heartbeat file is written by that rank's own
watchdog thread, which keeps running while the main thread sleeps; it survives the job's abort,
so a person can ``cat`` it afterwards. To keep the file system quiet, a rank writes its file only
when its state has been unchanged for ``quiet_s`` (a healthy rank never does) -- every rank of a
stalled job is quiet, so every one has published by the time the warning fires.

The fast path (``hpcdl.debug.monitor``) only stores a tuple per collective; this module's thread
does the rest. The report logic is pure functions over heartbeat dicts (unit-testable).
"""
from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hpcdl.debug.log import LOGGER_NAME

DEFAULT_WARN_S = 60.0
DEFAULT_ABORT_S = 600.0
#: MPI_Abort error code of a stall abort (an uncaught exception aborts with 1).
STALL_EXIT_CODE = 3


@dataclass(frozen=True)
class StallThresholds:
    """Seconds a collective may wait before a report (``warn_s``) and before MPI_Abort
    (``abort_s``); 0 switches either off."""

    warn_s: float = DEFAULT_WARN_S
    abort_s: float = DEFAULT_ABORT_S

    def __post_init__(self) -> None:
        if self.warn_s < 0 or self.abort_s < 0:
            raise ValueError(f"stall thresholds must be >= 0 s, got warn={self.warn_s} "
                             f"abort={self.abort_s}")
        if self.warn_s and self.abort_s and self.abort_s < self.warn_s:
            raise ValueError(f"HPCDL_STALL_ABORT_S={self.abort_s} is below "
                             f"HPCDL_STALL_WARN_S={self.warn_s}: the report would never print")

    @property
    def enabled(self) -> bool:
        return bool(self.warn_s or self.abort_s)


def thresholds_from_env(warn_s: float | None = None, abort_s: float | None = None,
                        environ: Mapping[str, str] = os.environ) -> StallThresholds:
    """API arguments win over ``HPCDL_STALL_WARN_S`` / ``HPCDL_STALL_ABORT_S``, which win over
    the defaults (60 s, 600 s)."""
    def pick(value: float | None, var: str, default: float) -> float:
        if value is not None:
            return float(value)
        text = environ.get(var, "").strip()
        if not text:
            return default
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{var}={text!r} is not a number of seconds") from None
    return StallThresholds(pick(warn_s, "HPCDL_STALL_WARN_S", DEFAULT_WARN_S),
                           pick(abort_s, "HPCDL_STALL_ABORT_S", DEFAULT_ABORT_S))


# -- heartbeat files --------------------------------------------------------------------------
def heartbeat_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank-{rank:04d}.json")


def write_heartbeat(directory: str, record: Mapping[str, Any]) -> None:
    """Replace this rank's heartbeat (rename: a reader sees the old or the new, never half)."""
    path = heartbeat_path(directory, int(record["rank"]))
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(record, f)
    # No fsync: the reader is a live process on a coherent (or close-to-open) file system;
    # durability across a crash is not what a heartbeat is for.
    os.replace(tmp, path)


def read_heartbeats(directory: str, size: int, job: str) -> dict[int, dict[str, Any]]:
    """Every rank's latest heartbeat of this job (files of an earlier job are ignored)."""
    beats = {}
    for rank in range(size):
        try:
            with open(heartbeat_path(directory, rank), encoding="utf-8") as f:
                record = json.load(f)
        except (OSError, ValueError):
            continue
        if record.get("job") == job:
            beats[rank] = record
    return beats


# -- the report (pure) ------------------------------------------------------------------------
def describe_signature(meta: Mapping[str, Any]) -> str:
    """Shapes and dtype of a collective's arguments, as the heartbeat carries them."""
    parts = [f"{k}={meta[k]}" for k in ("shapes", "dtype", "dtypes", "root") if k in meta]
    return ", ".join(parts)


def disagreeing(seq: int, beats: Mapping[int, Mapping[str, Any]]) -> dict[str, list[int]]:
    """Ranks waiting at collective number ``seq`` grouped by what they are in: more than one
    group means the ranks called different collectives (or shapes) at the same point."""
    groups: dict[str, list[int]] = {}
    for rank, beat in sorted(beats.items()):
        if beat.get("in_collective") and int(beat["seq"]) == seq:
            what = f"{beat['name']}({beat.get('signature', '')})"
            groups.setdefault(what, []).append(rank)
    return groups


def not_arrived(seq: int, size: int, beats: Mapping[int, Mapping[str, Any]]) -> list[int]:
    """Ranks that have not entered collective number ``seq``: behind it, or silent."""
    late = []
    for rank in range(size):
        beat = beats.get(rank)
        if beat is None or int(beat["seq"]) < seq:
            late.append(rank)
    return late


def describe_rank_state(beat: Mapping[str, Any] | None, now: float) -> str:
    """One line: where a rank is, what it last did, and how old that news is."""
    if beat is None:
        return ("no heartbeat: the process died, has not started hpcdl, or holds the GIL "
                "in native code (check its log, or py-spy dump it)")
    where = (f"waiting in #{beat['seq']} {beat['name']}" if beat.get("in_collective")
             else f"last finished #{beat['seq']} {beat['name'] or '(none yet)'}")
    if beat.get("bucket") is not None:
        where += f" (bucket {beat['bucket']})"
    text = f"{where} {now - float(beat['since']):.1f} s ago"
    if beat.get("activity"):
        text += f"; then: {beat['activity']} ({now - float(beat['activity_since']):.1f} s ago)"
    return f"{text} [host {beat.get('host', '?')} pid {beat.get('pid', '?')}]"


def format_stall_report(rank: int, size: int, seq: int, name: str, waited_s: float,
                        beats: Mapping[int, Mapping[str, Any]], now: float,
                        max_listed: int = 16) -> str:
    """The text the waiting ranks print: the collective, who is missing, what they did last."""
    late = not_arrived(seq, size, beats)
    groups = disagreeing(seq, beats)
    head = f"stall: rank {rank} has waited {waited_s:.1f} s in collective #{seq} {name}; "
    if late:
        head += f"{len(late)} of {size} rank(s) have not arrived: {_compact_ranks(late)}"
    elif len(groups) <= 1:
        head += "every rank has arrived (a slow network, or an MPI progress problem)"
    lines = [head]
    if len(groups) > 1:
        lines[0] += ("" if late else "every rank has arrived ") + \
            f"but they are in DIFFERENT collectives at #{seq} (a mismatch: rerun with " \
            f"HPCDL_DEBUG=1 to fail at the first differing call):"
        lines += [f"    rank{'s' if len(r) > 1 else ''} {_compact_ranks(r)}: {what}"
                  for what, r in groups.items()]
    for r in late[:max_listed]:
        lines.append(f"  rank {r}: {describe_rank_state(beats.get(r), now)}")
    if len(late) > max_listed:
        lines.append(f"  ... and {len(late) - max_listed} more (see logs/heartbeat/)")
    return "\n".join(lines)


def _compact_ranks(ranks: Sequence[int]) -> str:
    """[0,1,2,5,7,8] -> '0-2,5,7-8' so 2,048 ranks fit on a line."""
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ",".join(parts)


# -- the watchdog thread ----------------------------------------------------------------------
class StallWatchdog(threading.Thread):
    """Publishes this rank's heartbeat when quiet; reports and aborts a collective that waits
    past the thresholds. ``monitor`` is the rank's CollectiveMonitor (its state is read here)."""

    def __init__(self, monitor: Any, thresholds: StallThresholds, heartbeat_dir: str | None,
                 job: str, abort: Any, poll_s: float | None = None) -> None:
        super().__init__(name="hpcdl-stall-watchdog", daemon=True)
        self.monitor = monitor
        self.thresholds = thresholds
        self.heartbeat_dir = heartbeat_dir
        self.job = job
        self.abort = abort  # callable(code): MPI_Abort on the world
        shortest = min(t for t in (thresholds.warn_s, thresholds.abort_s) if t)
        self.poll_s = poll_s or min(1.0, shortest / 4)
        self.quiet_s = min(2.0, shortest / 3)
        self.host = socket.gethostname()
        self._stop_event = threading.Event()
        self._published: tuple | None = None
        self._warned_seq = -1
        self.reports: list[str] = []
        if heartbeat_dir:
            os.makedirs(heartbeat_dir, exist_ok=True)

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        while not self._stop_event.wait(self.poll_s):
            try:
                self.tick(time.time())
            except Exception:  # noqa: BLE001 - the watchdog must never take the rank down
                logging.getLogger(LOGGER_NAME).exception("stall watchdog failed")

    def heartbeat(self) -> dict[str, Any]:
        m = self.monitor
        seq, name, meta, since, in_collective = m.state
        activity, activity_since = m.activity
        return {"job": self.job, "rank": m.rank, "size": m.size, "host": self.host,
                "pid": os.getpid(), "seq": seq, "name": name, "bucket": meta.get("bucket"),
                "signature": describe_signature(meta), "in_collective": in_collective,
                "since": since, "activity": activity, "activity_since": activity_since}

    def tick(self, now: float) -> None:
        m = self.monitor
        state = (m.state, m.activity)
        last_change = max(m.state[3], m.activity[1])
        if self.heartbeat_dir and state != self._published and now - last_change >= self.quiet_s:
            write_heartbeat(self.heartbeat_dir, self.heartbeat())
            self._published = state
        seq, name, _, since, in_collective = m.state
        if not in_collective:
            return
        waited = now - since
        t = self.thresholds
        if t.warn_s and waited >= t.warn_s and self._warned_seq != seq:
            self._warned_seq = seq
            self._report(seq, name, waited, now, logging.WARNING)
        if t.abort_s and waited >= t.abort_s:
            text = self._report(seq, name, waited, now, logging.CRITICAL)
            reason = (f"stall: aborting the job (MPI_Abort {STALL_EXIT_CODE}) after "
                      f"{waited:.1f} s > HPCDL_STALL_ABORT_S={t.abort_s:g}")
            # In the rank's log file as well: MPI_Abort may kill the launcher before it has
            # forwarded the last lines of stderr, and the file is what stays.
            logging.getLogger(LOGGER_NAME).critical("%s", reason)
            if m.rank != 0:  # (rank 0's logger already prints to the terminal)
                sys.stderr.write(f"[rank {m.rank}/{m.size} {self.host}] {reason}\n")
                sys.stderr.flush()
            self.reports.append(text)
            self.abort(STALL_EXIT_CODE)

    def _report(self, seq: int, name: str, waited: float, now: float, level: int) -> str:
        m = self.monitor
        beats = read_heartbeats(self.heartbeat_dir, m.size, self.job) if self.heartbeat_dir else {}
        beats[m.rank] = self.heartbeat()  # our own state is always current
        if not self.heartbeat_dir:
            text = (f"stall: rank {m.rank} has waited {waited:.1f} s in collective #{seq} {name} "
                    f"(no heartbeat directory: pass run_dir to watch_collectives to learn which "
                    f"ranks are missing)")
        else:
            text = format_stall_report(m.rank, m.size, seq, name, waited, beats, now)
        logging.getLogger(LOGGER_NAME).log(level, "%s", text)
        # Every waiting rank logs the report to its file; only the lowest waiting rank puts it
        # on the terminal, so 2,047 copies do not bury it.
        # (rank 0's logger already prints to the terminal.)
        arrived = [r for r, b in beats.items() if b.get("in_collective") and b["seq"] == seq]
        if m.rank != 0 and m.rank == min(arrived, default=m.rank):
            sys.stderr.write(f"[rank {m.rank}/{m.size} {self.host}] {text}\n")
            sys.stderr.flush()
        self.reports.append(text)
        return text
