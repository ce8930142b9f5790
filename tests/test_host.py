"""The host's facts, each read in one place: /proc/cpuinfo fields (hpcdl/cpus.py) and the
operating system's NIC and thread CPU counters (hpcdl/host.py)."""
import os
import threading

import pytest

from hpcdl import cpus, host

needs_cpuinfo = pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"), reason="no /proc/cpuinfo")


@needs_cpuinfo
def test_cpu_flags_and_clock_come_from_the_first_cpuinfo_entry():
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        lines = f.read().splitlines()
    flags = next((ln for ln in lines if ln.startswith("flags")), "flags :").split(":", 1)[1]
    assert cpus.cpu_flags() == set(flags.split())
    mhz = next((ln for ln in lines if ln.startswith("cpu MHz")), None)
    assert cpus.cpu_mhz() == (float(mhz.split(":", 1)[1]) if mhz else None)
    assert cpus.cpuinfo_field("no such field") is None


def test_interface_bytes_are_each_nics_counters_without_loopback():
    counts = host.interface_bytes()
    assert "lo" not in counts
    for nic, (sent, received) in counts.items():
        assert sent >= 0 and received >= 0 and host.nic_bytes(nic) is not None
    assert host.nic_bytes("no-such-nic0") is None


def test_thread_cpu_s_counts_this_thread_and_skips_unknown_ids():
    assert host.thread_cpu_s([threading.get_native_id()]) > 0
    assert host.thread_cpu_s([2 ** 30]) == 0
