"""Stall reports: which ranks have not arrived at a collective, and what they last did; past
``abort_s``, the end of the job.

Heartbeat files (``RUN_DIR/logs/heartbeat/rank-XXXX.json``) are the channel between ranks, not
an MPI RMA window; why, and how a rank ends itself when MPI_Abort reaches no one:
docs/debugging.md, section 5. A rank writes its file only when its state has been unchanged
for ``quiet_s``, at most once per ``beat_s``; a report says "not heard from", never more.

The watchdog decides from memory (its clock, the monitor's state tuple, peers' hosts); all
file-system work runs on a short-lived thread it waits for at most ``IO_WAIT_S``, so a hung
file system costs the report its details, never the abort. The report logic is pure
functions over heartbeat dicts.
"""
from __future__ import annotations

import contextlib
import faulthandler
import gc
import json
import linecache
import logging
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hpcdl.cpus import format_cpu_list as compact_ranks  # [0,1,2,5] -> '0-2,5': 2,048 fit
from hpcdl.debug.inject import injected_pause
from hpcdl.debug.log import LOGGER_NAME
from hpcdl.env import VARIABLES, env_seconds, env_text

DEFAULT_WARN_S = float(VARIABLES["HPCDL_STALL_WARN_S"].default)
DEFAULT_ABORT_S = float(VARIABLES["HPCDL_STALL_ABORT_S"].default)
#: Seconds MPI_Abort gets to end this rank before it ends itself (HPCDL_STALL_EXIT_GRACE_S).
DEFAULT_EXIT_GRACE_S = float(VARIABLES["HPCDL_STALL_EXIT_GRACE_S"].default)
#: MPI_Abort error code of a stall abort: an uncaught exception aborts with 1, bad input 2, a
#: non-finite loss 3 (hpcdl/train/trainer.py), a signal's checkpoint-and-stop 75.
STALL_EXIT_CODE = 4
#: Seconds the deciding thread waits for a file-system step (reading heartbeats, a dump, a log
#: line) before it goes on without it: a hung file system must not hold the abort.
IO_WAIT_S = 2.0
#: The watchdog's own threads (its file-system steps, MPI_Abort): never what the main thread
#: waits for.
WATCHDOG_THREADS = frozenset({"hpcdl-stall-watchdog", "hpcdl-watchdog-io", "hpcdl-heartbeat-write",
                              "hpcdl-heartbeat-read", "hpcdl-stall-dump", "hpcdl-mpi-abort"})


def run_bounded(work: Any, timeout_s: float, name: str = "hpcdl-watchdog-io") -> bool:
    """Run ``work()`` on a daemon thread and wait at most ``timeout_s``; True when it finished
    (its exceptions are swallowed: best effort). A thread stuck in a hung file system stays
    behind, blocked, until the process ends."""
    done = threading.Event()

    def target() -> None:
        try:
            work()
        except Exception:  # noqa: BLE001 - best effort: the caller goes on without it
            pass
        finally:
            done.set()

    threading.Thread(target=target, name=name, daemon=True).start()
    return done.wait(timeout_s) if timeout_s > 0 else False


@dataclass(frozen=True)
class StallThresholds:
    """Seconds a collective may wait before a report (``warn_s``) and before MPI_Abort
    (``abort_s``); 0 switches either off. ``exit_grace_s``: how long MPI_Abort gets before
    the rank ends itself."""

    warn_s: float = DEFAULT_WARN_S
    abort_s: float = DEFAULT_ABORT_S
    exit_grace_s: float = DEFAULT_EXIT_GRACE_S

    def __post_init__(self) -> None:
        if self.warn_s < 0 or self.abort_s < 0 or self.exit_grace_s < 0:
            raise ValueError(f"stall thresholds must be >= 0 s, got warn={self.warn_s} "
                             f"abort={self.abort_s} exit grace={self.exit_grace_s}")
        if self.warn_s and self.abort_s and self.abort_s < self.warn_s:
            raise ValueError(f"HPCDL_STALL_ABORT_S={self.abort_s} is below "
                             f"HPCDL_STALL_WARN_S={self.warn_s}: the report would never print")

    @property
    def enabled(self) -> bool:
        return bool(self.warn_s or self.abort_s)


def thresholds_from_env(warn_s: float | None = None, abort_s: float | None = None,
                        environ: Mapping[str, str] = os.environ) -> StallThresholds:
    """API arguments win over ``HPCDL_STALL_WARN_S`` / ``HPCDL_STALL_ABORT_S``, which win over
    the defaults (60 s, 600 s); ``HPCDL_STALL_EXIT_GRACE_S`` (10 s)."""
    def pick(value: float | None, var: str) -> float:
        return float(value) if value is not None else env_seconds(var, environ)
    return StallThresholds(pick(warn_s, "HPCDL_STALL_WARN_S"),
                           pick(abort_s, "HPCDL_STALL_ABORT_S"),
                           pick(None, "HPCDL_STALL_EXIT_GRACE_S"))


# -- heartbeat files --------------------------------------------------------------------------
def heartbeat_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank-{rank:04d}.json")


def default_heartbeat_dir(job: str, environ: Mapping[str, str] = os.environ) -> str:
    """Where a communicator without a run directory keeps heartbeats and dumps:
    ``HPCDL_HEARTBEAT_DIR`` (put it on a shared file system to see other hosts' ranks), else
    this host's temporary directory; one sub-directory per job."""
    base = env_text("HPCDL_HEARTBEAT_DIR", environ) or os.path.join(
        tempfile.gettempdir(), f"hpcdl-heartbeat-{os.getuid()}")
    return os.path.join(base, job[:12])


def stall_dump_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank-{rank:04d}.stall.txt")


def write_heartbeat(directory: str, record: Mapping[str, Any]) -> None:
    """Replace this rank's heartbeat (rename: a reader sees the old or the new, never half)."""
    path = heartbeat_path(directory, int(record["rank"]))
    tmp = f"{path}.tmp"
    try:
        f = open(tmp, "w", encoding="utf-8")  # noqa: SIM115
    except FileNotFoundError:  # a host's last rank to leave removed the job's folder
        os.makedirs(directory, exist_ok=True)
        f = open(tmp, "w", encoding="utf-8")  # noqa: SIM115
    with f:
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
    return [rank for rank in range(size) if rank not in beats or int(beats[rank]["seq"]) < seq]


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
    if beat.get("blocked_in") and not beat.get("in_collective"):
        text += f"; now blocked in {blocked_label(beat['blocked_in'])}"
    if beat.get("activity"):
        text += f"; then: {beat['activity']} ({now - float(beat['activity_since']):.1f} s ago)"
    return f"{text} [host {beat.get('host', '?')} pid {beat.get('pid', '?')}]"


def format_stall_report(rank: int, size: int, seq: int, name: str, waited_s: float,
                        beats: Mapping[int, Mapping[str, Any]], now: float) -> str:
    """The text the waiting ranks print: the collective, who is missing, what they did last."""
    late = not_arrived(seq, size, beats)
    groups = disagreeing(seq, beats)
    head = f"stall: rank {rank} has waited {waited_s:.1f} s in collective #{seq} {name}; "
    if late:
        head += f"{len(late)} of {size} rank(s) have not arrived: {compact_ranks(late)}"
    elif size == 1:  # a world-level call on a one-rank communicator (LTFB's exchange)
        head += "its peers are outside this rank's communicator (the call's name gives them)"
    elif len(groups) <= 1:
        head += "every rank has arrived (a slow network, or an MPI progress problem)"
    lines = [head]
    if len(groups) > 1:
        lines[0] += ("" if late else "every rank has arrived ") + \
            f"but they are in DIFFERENT collectives at #{seq} (a mismatch: rerun with " \
            f"HPCDL_DEBUG=1 to fail at the first differing call):"
        lines += [f"    rank{'s' if len(r) > 1 else ''} {compact_ranks(r)}: {what}"
                  for what, r in groups.items()]
    lines += rank_states(late, beats, now, "logs/heartbeat/")
    return "\n".join(lines)


def rank_states(ranks: Sequence[int], beats: Mapping[int, Mapping[str, Any]], now: float,
                more_in: str, max_listed: int = 16) -> list[str]:
    """One line per rank (the first ``max_listed``) saying where it is, then how many more."""
    lines = [f"  rank {r}: {describe_rank_state(beats.get(r), now)}" for r in ranks[:max_listed]]
    if len(ranks) > max_listed:
        lines.append(f"  ... and {len(ranks) - max_listed} more (see {more_in})")
    return lines


def utc_clock(t: float) -> str:
    return time.strftime("%H:%M:%S UTC", time.gmtime(t))


def last_heard(beat: Mapping[str, Any]) -> float:
    """When a rank's heartbeat was last written (older records: its last change of state)."""
    if "beat" in beat:
        return float(beat["beat"])
    return max(float(beat["since"]), float(beat.get("activity_since") or 0))


def classify_peers(rank: int, size: int, seq: int | None,
                   beats: Mapping[int, Mapping[str, Any]], hosts: Sequence[str], now: float,
                   stale_s: float, since: float) -> dict[str, list[int]]:
    """Every other rank, by what the side channel says while this rank has waited since
    ``since`` in ``#seq`` (when ``#seq-1`` completed: the last moment every rank answered):
    ``gone`` (nothing from it for more than ``stale_s`` after that moment and its heartbeat:
    frozen, killed, or cut off; a rank that never wrote counts only where its host's ranks
    write here), ``unheard`` (no heartbeat, and none from its host: another host's directory),
    ``busy`` (alive, not arrived at ``#seq``, in no MPI call), ``waiting`` (alive, inside
    ``#seq`` like us, or blocked in any MPI call: a collective or a raw one). A live rank
    that is quiet rewrites its heartbeat within ``stale_s``."""
    seen_hosts = {hosts[r] for r in beats if r < len(hosts)}
    kinds: dict[str, list[int]] = {"gone": [], "unheard": [], "busy": [], "waiting": []}
    for r in range(size):
        if r == rank:
            continue
        beat = beats.get(r)
        if beat is None:
            visible = r < len(hosts) and hosts[r] in seen_hosts
            kinds["gone" if visible and now - since > stale_s else "unheard"].append(r)
        elif now - max(last_heard(beat), since) > stale_s:
            kinds["gone"].append(r)
        elif beat.get("in_collective") or _in_mpi(beat) or \
                (seq is not None and int(beat["seq"]) >= seq):
            # Alive and inside a collective -- ours, an earlier one, or a later one it reached
            # because its share of ours left it (an eager send into a dead link completes on
            # the sender) -- or blocked in a raw MPI call between two of ours (the trainer's
            # loss check: we passed it, so its data left us): every such rank waits on data
            # in flight, not on work.
            kinds["waiting"].append(r)
        else:
            kinds["busy"].append(r)
    return kinds


def _in_mpi(beat: Mapping[str, Any]) -> bool:
    """Blocked in a raw MPI call (not in a file-system one: that rank is stuck, not waiting)."""
    what = beat.get("blocked_in")
    return bool(what) and not str(what).startswith(FILE_PREFIX)


def _ranks_on_hosts(ranks: Sequence[int], hosts: Sequence[str], max_hosts: int = 8) -> str:
    """'rank 1 on h2' / 'ranks 0-3 on h1, 4-7 on h2' (grouped by host, hosts in rank order)."""
    by_host: dict[str, list[int]] = {}
    for r in ranks:
        by_host.setdefault(hosts[r] if r < len(hosts) else "?", []).append(r)
    parts = [f"{compact_ranks(rs)} on {host}" for host, rs in list(by_host.items())[:max_hosts]]
    if len(by_host) > max_hosts:
        parts.append(f"... {len(by_host) - max_hosts} more hosts")
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


def stall_verdict(rank: int, size: int, seq: int | None,
                  beats: Mapping[int, Mapping[str, Any]],
                  hosts: Sequence[str], now: float, stale_s: float, since: float) -> str:
    """The one line that names who stopped answering, where, and since when; "rank gone" vs
    "slow link" as far as the heartbeats can tell. ``since``: when this rank entered ``#seq``
    (the last moment every rank was known to answer: ``#seq-1`` had completed)."""
    if size == 1:  # a world-level call watched on a one-rank communicator (LTFB's exchange)
        return (f"waiting since {utc_clock(since)} on ranks outside this rank's communicator: "
                f"the ones the call's name gives (their host or its link failed, or they are "
                f"slow)")
    kinds = classify_peers(rank, size, seq, beats, hosts, now, stale_s, since)
    parts = []
    if kinds["gone"]:
        first = min(max(last_heard(beats[r]), since) if r in beats else since
                    for r in kinds["gone"])
        parts.append(f"rank gone: {_ranks_on_hosts(kinds['gone'], hosts)} silent since "
                     f"{utc_clock(first)} ({now - first:.0f} s; frozen, killed or cut off)")
    if kinds["unheard"]:
        parts.append(f"not heard from since {utc_clock(since)} ({now - since:.0f} s): "
                     f"{_ranks_on_hosts(kinds['unheard'], hosts)} (no heartbeat here: another "
                     f"host's directory, or not running hpcdl)")
    if kinds["busy"]:
        parts.append(f"alive but not arrived: {_ranks_on_hosts(kinds['busy'], hosts)} "
                     f"(busy or stuck outside collectives)")
    if not parts:
        where = sorted(set(hosts)) if hosts else []
        seqs = sorted({int(b["seq"]) for r, b in beats.items()
                       if r != rank and b.get("in_collective")} | ({seq} if seq else set()))
        inside = (f"inside #{seq}" if seqs == [seq] else
                  f"inside collectives {', '.join(f'#{s}' for s in seqs)} (sent, not received)"
                  ) if seq is not None else "inside an MPI call"
        link = (f"; data moves slowly or not at all between hosts {','.join(where)}"
                if len(where) > 1 else " (one host: an MPI progress problem)")
        parts.append(f"slow link: every rank is alive and {inside} since {utc_clock(since)}{link}")
    return "; ".join(parts)


#: Blocking calls a thread may sit in outside the communicator's watched collectives: mpi4py's
#: collectives and waits on any communicator (a trainer's loss agreement, a checkpoint's
#: gathers, ``agreed``'s allgather, a user's own ``world.Barrier()``) and torch.distributed's.
BLOCKING_CALLS = frozenset({
    "Allreduce", "allreduce", "Bcast", "bcast", "Barrier", "barrier", "Gather", "gather",
    "Gatherv", "Allgather", "allgather", "Allgatherv", "Scatter", "scatter", "Scatterv",
    "Reduce", "reduce", "Reduce_scatter", "Alltoall", "alltoall", "Alltoallv", "Scan", "Exscan",
    "Sendrecv", "sendrecv", "Recv", "recv", "Send", "send", "Ssend", "ssend", "Probe", "probe",
    "Wait", "Waitall", "waitall", "Waitany", "Dup", "Split", "Split_type", "Create",
    "all_reduce", "all_gather", "broadcast", "monitored_barrier",
})
#: File-system calls a thread hangs in when its file system stops answering (a Lustre hang:
#: nothing fails, ``open``/``write`` never return): a log line, metrics, a checkpoint, a
#: heartbeat. Past the thresholds they are reported and end the job like a blocked MPI call.
FILE_CALLS = frozenset({
    "open", "write", "writelines", "flush", "fsync", "fdatasync", "replace", "rename",
    "makedirs", "mkdir", "unlink", "remove", "rmdir", "truncate", "stat", "listdir", "scandir",
})
FILE_PREFIX = "file system: "


def blocked_label(what: str) -> str:
    """How a report names a blocked call: ``MPI bcast at ...`` or ``file system: write at``."""
    return what if what.startswith(FILE_PREFIX) else f"MPI {what}"


def blocked_call(frame: Any) -> str | None:
    """``"bcast at hpcdl/train/trainer.py:681"`` when ``frame`` -- a thread's newest Python
    frame -- is inside a C call named in :data:`BLOCKING_CALLS` (``"file system: write at
    ..."`` for one in :data:`FILE_CALLS`), else None.

    A call into C code opens no Python frame, so the instruction the frame stopped at *is* the
    call; its source span (``co_positions``, Python >= 3.11) names the callee."""
    code = frame.f_code
    try:
        line, _, col, _ = list(code.co_positions())[frame.f_lasti // 2]
    except (AttributeError, IndexError, ValueError):
        return None
    if line is None or col is None:
        return None
    text = linecache.getline(code.co_filename, line)[col:]
    name = text.split("(", 1)[0].rsplit(".", 1)[-1].strip()
    if name not in BLOCKING_CALLS and name not in FILE_CALLS:
        return None
    return f"{FILE_PREFIX if name in FILE_CALLS else ''}{name} at {short_path(code)}:{line}"


def short_path(code: Any) -> str:
    """A code object's file as a report names it: from ``hpcdl/`` on, else its base name."""
    path = code.co_filename
    marker = "hpcdl" + os.sep
    return path[path.rfind(marker):] if marker in path else os.path.basename(path)


#: Linux x86_64 system calls that touch a file system, by the number
#: ``/proc/self/task/TID/syscall`` shows first; those in FD_SYSCALLS name a descriptor.
FILE_SYSCALLS = {0: "read", 1: "write", 2: "open", 3: "close", 4: "stat", 5: "fstat", 6: "lstat",
                 17: "pread64", 18: "pwrite64", 19: "readv", 20: "writev", 74: "fsync",
                 75: "fdatasync", 76: "truncate", 77: "ftruncate", 78: "getdents", 82: "rename",
                 83: "mkdir", 84: "rmdir", 87: "unlink", 217: "getdents64", 257: "openat",
                 258: "mkdirat", 262: "newfstatat", 263: "unlinkat", 264: "renameat",
                 316: "renameat2", 332: "statx"}
FD_SYSCALLS = frozenset({"read", "write", "close", "fstat", "pread64", "pwrite64", "readv",
                         "writev", "fsync", "fdatasync", "ftruncate", "getdents", "getdents64"})


def thread_syscall(native_id: int | None) -> str | None:
    """The raw ``/proc/self/task/TID/syscall`` line of a thread (None: not readable here)."""
    if native_id is None or os.uname().machine != "x86_64":
        return None
    try:
        with open(f"/proc/self/task/{native_id}/syscall", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return None


def file_syscall(line: str | None) -> str | None:
    """``"close of /run/ckpt.pt"`` when a ``/proc/.../syscall`` line is a file-system call
    (one on a socket, a pipe or a device is not), else None. What a Python frame cannot show:
    a file's implicit close at the end of a ``with``, a write inside a C extension."""
    fields = (line or "").split()
    if not fields or not fields[0].isdigit() or int(fields[0]) not in FILE_SYSCALLS:
        return None
    name = FILE_SYSCALLS[int(fields[0])]
    if name not in FD_SYSCALLS:
        return name
    try:
        target = os.readlink(f"/proc/self/fd/{int(fields[1], 16)}")
    except (OSError, ValueError, IndexError):
        return None
    if not target.startswith("/") or (target.startswith("/dev/")
                                      and not target.startswith("/dev/shm/")):
        return None
    return f"{name} of {target}"


_FRAMES_LOCK = threading.Lock()


def current_frames() -> dict[int, Any]:
    """Every other thread's newest frame: ``sys._current_frames()`` less the calling thread's
    own, with the cyclic garbage collector held off while it runs.

    The caller's own frame is left out because it would close a cycle (its frame holds the
    dict in a local, the dict holds its frame): every frame in the dict, and the tensors
    their locals hold (a step's activations and gradients), would then outlive the step
    until the cyclic collector ran -- up to hundreds of MB per look, on a watchdog that looks
    every second.

    Up to CPython 3.11 the call holds the interpreter's thread-list lock while it creates
    frame objects; an allocation there can start a collection whose finalizers (a
    ``threading.local`` in a cycle) take the same lock again: the calling thread deadlocks
    holding the GIL and every thread of the rank stops (python/cpython#106883, fixed in 3.12
    by the same guard inside the call). The lock keeps two watchdogs of one process from
    re-enabling the collector under each other."""
    with _FRAMES_LOCK:
        enabled = gc.isenabled()
        gc.disable()
        try:
            frames = sys._current_frames()
            del frames[threading.get_ident()]
            return frames
        finally:
            if enabled:
                gc.enable()


def frame_key(frame: Any) -> tuple | None:
    """Where a thread's newest frame stands: unchanged between two looks, the thread has not
    moved (None: no such thread)."""
    return None if frame is None else (id(frame), frame.f_lasti, frame.f_lineno)


def kill_child_processes() -> list[int]:
    """SIGKILL this process's children (data-loader workers...): they must not outlive it.
    Returns their pids."""
    me, killed = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[1]) == me:
                os.kill(int(entry), signal.SIGKILL)
                killed.append(int(entry))
        except (OSError, IndexError, ValueError):
            continue
    return killed


def end_process(code: int) -> None:
    """The last resort of a rank whose MPI_Abort reached no one: children first, then itself."""
    kill_child_processes()
    os._exit(code)


#: The shortest time MPI_Finalize is given before SIGALRM ends the rank.
FINALIZE_MIN_S = 60.0


def guard_mpi_finalize(environ: Mapping[str, str] = os.environ) -> float:
    """Arm SIGALRM so this process ends if MPI_Finalize outlasts ``HPCDL_STALL_ABORT_S`` (at
    least :data:`FINALIZE_MIN_S`: an exit under load may be slow, not stuck); returns the limit
    armed (0: none). Call once the command's work is done. MPI_Finalize waits for every peer,
    outside any watchdog; SIGALRM's default action ends the process from the kernel whatever
    the interpreter does (docs/debugging.md, the faults' table). ``HPCDL_INJECT=RANK:exit:
    sleep=S`` rehearses it."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return 0.0
    abort_s = thresholds_from_env(environ=environ).abort_s
    limit = max(abort_s, FINALIZE_MIN_S) if abort_s > 0 else 0.0
    _, seconds = injected_pause(mpi.COMM_WORLD.Get_rank(), "exit",
                                env_text("HPCDL_INJECT", environ))
    if seconds > 0:
        logging.getLogger(LOGGER_NAME).warning("sleeping %g s (HPCDL_INJECT) before MPI_Finalize",
                                               seconds)
        time.sleep(seconds)
    if limit <= 0:
        return 0.0
    logging.getLogger(LOGGER_NAME).debug("MPI_Finalize gets %.0f s, then SIGALRM ends the rank",
                                         limit)
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(max(1, int(limit + 0.999)))
    return limit


# -- the watchdog thread ----------------------------------------------------------------------
class StallWatchdog(threading.Thread):
    """Publishes this rank's heartbeat when quiet; reports and aborts a collective that waits
    past the thresholds; ``monitor``: the rank's CollectiveMonitor. ``abort(code)`` ends the job
    (MPI_Abort); ``exit_process(code)`` (None: trust ``abort``) ends this process if ``abort``
    has not ``exit_grace_s`` later. ``hosts[r]``: rank r's host, for reports."""

    def __init__(self, monitor: Any, thresholds: StallThresholds, heartbeat_dir: str | None,
                 job: str, abort: Any, poll_s: float | None = None,
                 hosts: Sequence[str] | None = None, exit_process: Any = None) -> None:
        super().__init__(name="hpcdl-stall-watchdog", daemon=True)
        self.monitor = monitor
        self.thresholds = thresholds
        self.heartbeat_dir = heartbeat_dir
        self.job = job
        self.abort = abort  # callable(code): MPI_Abort on the world
        self.exit_process = exit_process
        shortest = min(t for t in (thresholds.warn_s, thresholds.abort_s) if t)
        self.poll_s = poll_s or min(1.0, shortest / 4)
        self.quiet_s = min(2.0, shortest / 3)
        # a quiet rank rewrites its heartbeat this often; a beat older than stale_s is "gone"
        self.beat_s = max(self.quiet_s, min(10.0, shortest / 4))
        self.stale_s = 3 * self.beat_s + 2 * self.poll_s
        self.host = socket.gethostname()
        self.hosts = list(hosts) if hosts else [self.host if r == monitor.rank else "?"
                                                for r in range(monitor.size)]
        self._stop_event = threading.Event()
        self._writer: threading.Thread | None = None
        self._unanswered = False  # the heartbeat directory did not answer a read in time
        self._written_at = 0.0
        self._warned: tuple[int, str, float] | None = None  # (seq, name, since) of the warning
        self._warned_seq = -1
        self._aborting = False
        # the main thread blocked in a raw MPI call (blocked_call): where, since when
        self._main_ident = threading.main_thread().ident
        self._main_native_id = threading.main_thread().native_id
        self._main_syscall: str | None = None  # the syscall line a file-system label came from
        self._blocked_key: tuple | None = None
        self._blocked_since = 0.0
        self._blocked_what: str | None = None
        self._blocked_checked = False
        # the other thread the blocked main thread waits for, in a file-system call: (ident,
        # frame key); a stop is over when either thread moves
        self._file_thread: tuple[int, tuple] | None = None
        self._blocked_warned = False
        self.reports: list[str] = []
        if heartbeat_dir:
            os.makedirs(heartbeat_dir, exist_ok=True)

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        # One beat at start: the directory then holds every live rank of every host it can
        # see, so a rank frozen before it was ever quiet reads as "gone" (its beat went
        # stale), not "not heard from" (which says: another host's directory).
        if self.heartbeat_dir:
            self._publish(self.heartbeat())
        while not self._stop_event.wait(self.poll_s):
            try:
                self.tick(time.time())
            except Exception:  # noqa: BLE001 - the watchdog must never take the rank down
                logging.getLogger(LOGGER_NAME).exception("stall watchdog failed")

    def heartbeat(self, now: float | None = None) -> dict[str, Any]:
        m = self.monitor
        seq, name, meta, since, in_collective = m.state
        activity, activity_since = m.activity
        return {"job": self.job, "rank": m.rank, "size": m.size, "host": self.host,
                "pid": os.getpid(), "seq": seq, "name": name, "bucket": meta.get("bucket"),
                "signature": describe_signature(meta), "in_collective": in_collective,
                "since": since, "activity": activity, "activity_since": activity_since,
                "blocked_in": self._blocked_what, "beat": time.time() if now is None else now}

    def tick(self, now: float) -> None:
        m = self.monitor
        last_change = max(m.state[3], m.activity[1])
        quiet = now - last_change >= self.quiet_s
        # At most one write per beat_s per rank, changed or not: a step with a collective-free
        # gap (a slow batch, an evaluation) would otherwise have every rank create and rename
        # a file in one directory -- 2,048 per such step. A stall is reported after warn_s
        # >= quiet_s + beat_s, by when the file holds the stalled state.
        if self.heartbeat_dir and quiet and now - self._written_at >= self.beat_s:
            self._publish(self.heartbeat(now))
            self._written_at = now
        seq, name, _, since, in_collective = m.state
        self._note_stall_over(seq, in_collective, since, now)
        if not in_collective:
            self._watch_main_thread(now)
            return
        if self._blocked_warned:  # the raw call returned, and a collective began at ``since``
            self._note_blocked_over(since)
            self._blocked_key, self._blocked_warned = None, False
        if self._warn_then_abort(self._warned_seq == seq, f"#{seq} {name}", seq, since, now,
                                 lambda waited, level: self._report(seq, name, waited, now, level)):
            self._warned_seq, self._warned = seq, (seq, name, since)

    def _warn_then_abort(self, warned: bool, where: str, seq: int | None, since: float,
                         now: float, report: Callable[[float, int], str]) -> bool:
        """``report(waited, level)`` once past warn_s (True: it warned now), and past abort_s
        end the job with the report at CRITICAL: a collective's wait and a raw call's alike."""
        t, waited = self.thresholds, now - since
        warn = bool(t.warn_s and waited >= t.warn_s and not warned)
        if warn:
            report(waited, logging.WARNING)
        if t.abort_s and waited >= t.abort_s and not self._aborting:
            self._aborting = True
            self._end_job(where, seq, waited, since, now, report(waited, logging.CRITICAL))
        return warn

    def _publish(self, record: dict[str, Any]) -> None:
        """Write the heartbeat on a thread of its own; none while the last one still hangs
        (a file system that stopped answering: the peers then see this rank's beat go stale)."""
        if self._writer is not None and self._writer.is_alive():
            return
        self._writer = threading.Thread(target=self._write_quietly, args=(record,),
                                        name="hpcdl-heartbeat-write", daemon=True)
        self._writer.start()

    def wait_published(self, timeout_s: float | None = None) -> bool:
        """Wait for the heartbeat write in flight (a clean stop, tests); True when none is."""
        writer = self._writer
        if writer is not None:
            writer.join(timeout_s)
        return writer is None or not writer.is_alive()

    def _write_quietly(self, record: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):  # a full or gone file system: the next beat retries
            write_heartbeat(self.heartbeat_dir, record)

    def _unanswered_note(self) -> str:
        return (f"\n  (the heartbeat directory {self.heartbeat_dir} did not answer within "
                f"{IO_WAIT_S:g} s: a hung file system? decided without the peers' heartbeats)"
                if self._unanswered else "")

    def _log(self, level: int, text: str) -> None:
        """Log ``text`` (terminal first, then this rank's file), waiting at most IO_WAIT_S:
        a log file on a hung file system blocks its writer, not the watchdog."""
        run_bounded(lambda: logging.getLogger(LOGGER_NAME).log(level, "%s", text), IO_WAIT_S)

    def _watch_main_thread(self, now: float) -> None:
        """Outside the communicator's collectives: is the main thread blocked in a raw MPI
        call (a control Allreduce, a checkpoint's bcast, a user's Barrier) for too long?"""
        frames = current_frames()
        frame = frames.get(self._main_ident)
        key = frame_key(frame)
        moved = (self._file_thread is not None and frame_key(
            frames.get(self._file_thread[0])) != self._file_thread[1]) or (
            self._main_syscall is not None
            and thread_syscall(self._main_native_id) != self._main_syscall)
        if key != self._blocked_key or moved:
            self._note_blocked_over(now)
            self._blocked_key, self._blocked_since = key, now
            self._blocked_what, self._blocked_checked, self._blocked_warned = None, False, False
            self._file_thread, self._main_syscall = None, None
            return
        waited = now - self._blocked_since
        if frame is None or waited < self.quiet_s:
            return
        if not self._blocked_checked:  # once per stop: reading the source is not free
            self._blocked_checked = True
            self._blocked_what = (blocked_call(frame) or self._main_in_file_syscall(frame)
                                  or self._thread_in_file_system(frames))
        del frame, frames
        what = self._blocked_what
        if what is not None and self._warn_then_abort(
                self._blocked_warned, blocked_label(what), None, self._blocked_since, now,
                lambda waited, level: self._report_blocked(what, waited, now, level)):
            self._blocked_warned = True

    def _main_in_file_syscall(self, frame: Any) -> str | None:
        """A label for the main thread inside a file-system system call that its Python frame
        does not name (the kernel's view, Linux x86_64); None otherwise."""
        line = thread_syscall(self._main_native_id)
        what = file_syscall(line)
        if what is None:
            return None
        self._main_syscall = line
        return f"{FILE_PREFIX}{what} at {short_path(frame.f_code)}:{frame.f_lineno}"

    def _thread_in_file_system(self, frames: Mapping[int, Any]) -> str | None:
        """A label for the main thread waiting on another thread (TensorBoard's event writer
        behind ``flush()``, a queue's consumer) that is blocked in a file-system call; None
        when no such thread. The watchdog's own threads do not count."""
        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, frame in frames.items():
            name = names.get(ident)  # None: it ended since ``frames`` was taken
            if ident == self._main_ident or name is None or name in WATCHDOG_THREADS:
                continue
            what = blocked_call(frame)
            if what is not None and what.startswith(FILE_PREFIX):
                self._file_thread = (ident, frame_key(frame))
                return f"{what} on thread {name!r} (the main thread waits for it)"
        return None

    def _note_blocked_over(self, ended: float) -> None:
        """A warned raw MPI call that returned after all: slow, not dead."""
        if self._blocked_warned:
            self._log(logging.WARNING, f"stall over: {blocked_label(self._blocked_what)} "
                                       f"completed after "
                                       f"{ended - self._blocked_since:.1f} s (slow, not dead)")

    def _note_stall_over(self, seq: int, in_collective: bool, since: float, now: float) -> None:
        """A warned collective that completed after all: slow is not dead -- say so."""
        if self._warned is None or (seq == self._warned[0] and in_collective):
            return
        wseq, wname, wsince = self._warned
        self._warned = None
        ended = since if seq == wseq else now  # the monitor stamps the end of each collective
        self._log(logging.WARNING, f"stall over: collective #{wseq} {wname} completed after "
                                   f"{ended - wsince:.1f} s (slow, not dead)")

    def _beats(self, now: float) -> dict[int, dict[str, Any]]:
        """Every rank's heartbeat as far as the directory answers within IO_WAIT_S (else
        only this rank's own, from memory)."""
        m = self.monitor
        found: dict[int, dict[str, Any]] = {}
        if self.heartbeat_dir and not run_bounded(
                lambda: found.update(read_heartbeats(self.heartbeat_dir, m.size, self.job)),
                IO_WAIT_S, "hpcdl-heartbeat-read"):
            found = {}
            self._unanswered = True
        beats = dict(found)
        beats[m.rank] = self.heartbeat(now)  # our own state is always current
        return beats

    def _end_job(self, where: str, seq: int | None, waited: float, since: float, now: float,
                 report: str) -> None:
        """Dump, MPI_Abort on a thread, and -- if that reaches no one -- end this process."""
        m, code = self.monitor, STALL_EXIT_CODE
        verdict = stall_verdict(m.rank, m.size, seq, self._beats(now), self.hosts, now,
                                self.stale_s, since)
        line = (f"stall: aborting the job (MPI_Abort {code}) after {waited:.1f} s > "
                f"HPCDL_STALL_ABORT_S={self.thresholds.abort_s:g} in {where} on rank "
                f"{m.rank} ({self.host}); {verdict}")
        if m.rank != 0:  # (rank 0's logger prints to the terminal)
            self._say(line)
        # In the dump and the rank's log file as well: MPI_Abort may kill the launcher before
        # it has forwarded the last lines of stderr, and the files are what stays -- when
        # their file system answers within IO_WAIT_S.
        run_bounded(lambda: self._write_dump(line, report), IO_WAIT_S, "hpcdl-stall-dump")
        self._log(logging.CRITICAL, line)
        self.reports.append(report)
        if self.exit_process is None:
            self.abort(code)
            return
        # MPICH's MPI_Abort returns once it has told the launcher's local proxy; a proxy that
        # is frozen or cut off from mpiexec kills no one, and another MPI may block in it.
        # Hence a thread, and a deadline.
        threading.Thread(target=self.abort, args=(code,), name="hpcdl-mpi-abort",
                         daemon=True).start()
        time.sleep(self.thresholds.exit_grace_s)
        last = (f"stall: MPI_Abort did not end rank {m.rank} ({self.host}) within "
                f"HPCDL_STALL_EXIT_GRACE_S={self.thresholds.exit_grace_s:g} s (its launcher is "
                f"frozen or out of reach); the rank ends itself with exit {code}")
        self._say(last)
        run_bounded(lambda: self._write_dump(line, report, last), IO_WAIT_S, "hpcdl-stall-dump")
        self._log(logging.CRITICAL, last)
        self.exit_process(code)

    def _say(self, line: str) -> None:
        with contextlib.suppress(Exception):  # a closed stream must not stop the abort
            sys.stderr.write(f"[rank {self.monitor.rank}/{self.monitor.size} {self.host}] "
                             f"{line}\n")
            sys.stderr.flush()

    def _write_dump(self, line: str, report: str, last: str = "") -> None:
        """``rank-XXXX.stall.txt`` next to the heartbeat: the verdict, the report, and every
        thread's Python stack (temporary name, fsync, rename)."""
        if not self.heartbeat_dir:
            return
        path = stall_dump_path(self.heartbeat_dir, self.monitor.rank)
        try:
            with open(f"{path}.tmp", "w", encoding="utf-8") as f:
                f.write(f"{line}\n{last + chr(10) if last else ''}\n{report}\n\n"
                        f"heartbeat: {json.dumps(self.heartbeat())}\n\nstacks:\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(f"{path}.tmp", path)
        except OSError as exc:  # a full or gone file system must not stop the abort
            logging.getLogger(LOGGER_NAME).error("stall: could not write %s: %s", path, exc)

    def _report(self, seq: int, name: str, waited: float, now: float, level: int) -> str:
        m = self.monitor
        beats = self._beats(now)
        if not self.heartbeat_dir:
            text = (f"stall: rank {m.rank} has waited {waited:.1f} s in collective #{seq} {name} "
                    f"(no heartbeat directory: pass run_dir to watch_collectives to learn which "
                    f"ranks are missing)")
        else:
            text = format_stall_report(m.rank, m.size, seq, name, waited, beats, now)
            text += "\n  verdict: " + stall_verdict(m.rank, m.size, seq, beats, self.hosts, now,
                                                   self.stale_s, m.state[3])
            text += self._unanswered_note()
        arrived = [r for r, b in beats.items() if b.get("in_collective") and b["seq"] == seq]
        return self._tell(text, level, arrived)

    def _tell(self, text: str, level: int, waiting: Sequence[int]) -> str:
        """Every waiting rank logs a report to its file; only the lowest of ``waiting`` puts it
        on the terminal, so 2,047 copies do not bury it (rank 0's logger prints there anyway)."""
        self._log(level, text)
        rank = self.monitor.rank
        if rank != 0 and rank == min(waiting, default=rank):
            self._say(text)
        self.reports.append(text)
        return text

    def _report_blocked(self, what: str, waited: float, now: float, level: int) -> str:
        m = self.monitor
        beats = self._beats(now)
        others = [r for r in range(m.size) if r != m.rank]
        lines = [f"stall: rank {m.rank} has waited {waited:.1f} s in {blocked_label(what)} "
                 f"(outside the communicator's collectives)"]
        lines += rank_states(others, beats, now, "the heartbeats")
        lines.append("  verdict: " + stall_verdict(m.rank, m.size, None, beats, self.hosts,
                                                   now, self.stale_s, self._blocked_since))
        blocked = [r for r, b in beats.items() if b.get("blocked_in") or b.get("in_collective")]
        return self._tell("\n".join(lines) + self._unanswered_note(), level, blocked)
