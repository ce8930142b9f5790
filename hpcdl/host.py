"""What the operating system counts for this host and process: each network interface's bytes
(``/sys/class/net/NIC/statistics``) and given threads' CPU seconds (``/proc/self/task/TID``),
read before and after a measured piece of work. The CPU itself: hpcdl/cpus.py.
"""
from __future__ import annotations

import os
from collections.abc import Iterable

NET = "/sys/class/net"


def nic_bytes(nic: str) -> tuple[int, int] | None:
    """(sent, received) bytes of ``nic`` since boot, from this host's sysfs; None without it."""
    base = f"{NET}/{nic}/statistics"
    try:
        with open(f"{base}/tx_bytes") as tx, open(f"{base}/rx_bytes") as rx:
            return int(tx.read()), int(rx.read())
    except (OSError, ValueError):
        return None


def interface_bytes() -> dict[str, tuple[int, int]]:
    """(sent, received) bytes of every interface but loopback, from this host's sysfs."""
    nics = sorted(os.listdir(NET)) if os.path.isdir(NET) else []
    return {nic: sent_received for nic in nics
            if nic != "lo" and (sent_received := nic_bytes(nic)) is not None}


def thread_ids() -> set[int]:
    """The native ids of this process's threads now (``/proc/self/task``; empty without it)."""
    try:
        return {int(tid) for tid in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def thread_cpu_s(native_ids: Iterable[int]) -> float:
    """CPU seconds the threads ``native_ids`` of this process have run: the first field of
    ``/proc/self/task/TID/schedstat`` (nanoseconds on a CPU, proc(5)), else user + system
    time from ``stat`` (fields 14 and 15, in clock ticks). Ticks are 10 ms: a start-up trial
    that times a few milliseconds of another thread's work and scales it to a step's bytes
    would read whole ticks, multiplied by that scale."""
    total = 0.0
    for tid in native_ids:
        try:
            total += _thread_cpu_s(tid)
        except (OSError, IndexError, ValueError):
            continue
    return total


def _thread_cpu_s(tid: int) -> float:
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except FileNotFoundError:  # a kernel without CONFIG_SCHED_INFO: only whole ticks
        pass
    with open(f"/proc/self/task/{tid}/stat") as f:
        # the name (field 2) may hold spaces: fields are counted after its ')'
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
