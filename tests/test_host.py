"""The host's facts, each read in one place: /proc/cpuinfo fields (hpcdl/cpus.py) and the
operating system's NIC and thread CPU counters (hpcdl/host.py)."""
import os
import subprocess
import sys
import threading
import time

import pytest
from thread_state import wait_until_asleep  # tests/thread_state.py

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


def test_thread_cpu_s_reads_another_threads_clock_finer_than_a_tick():
    """The reading is the thread's own CPU clock (both are the kernel's time on a CPU), not
    whole clock ticks: what the start-up trial scales up by a step's bytes."""
    if not os.path.exists(f"/proc/self/task/{threading.get_native_id()}/schedstat"):
        pytest.skip("this kernel has no /proc/TID/schedstat (CONFIG_SCHED_INFO)")
    own: list[float] = []
    done, release = threading.Event(), threading.Event()

    def burn() -> None:
        sum(i * i for i in range(20_000))
        own.append(time.thread_time())
        done.set()
        release.wait()

    worker = threading.Thread(target=burn)
    worker.start()
    done.wait()
    wait_until_asleep(worker.native_id)  # in release.wait(): its clock has stopped
    seen = host.thread_cpu_s([worker.native_id])
    release.set()
    worker.join()
    # after its own reading the thread only sets an event and goes to sleep: far less than
    # the 10 ms tick that /proc/TID/stat counts in
    assert own[0] <= seen < own[0] + 1 / os.sysconf("SC_CLK_TCK")


FAULTS_OF_REPEATED_64_MIB = """
import resource, sys, torch
from hpcdl.cpus import retain_freed_memory
if sys.argv[1] == "retain" and not retain_freed_memory():
    print("no mallopt")
    raise SystemExit
if sys.argv[1] == "training process":  # hpcdl train's per-process set-up
    from hpcdl.train.session import setup_run_process
    setup_run_process(None, 0, 1, "warning", None)
torch.manual_seed(0)
layer = torch.nn.Linear(4096, 4096)  # a 64 MiB weight: its gradient is above 32 MiB
x = torch.randn(8, 4096)
def step():
    layer.zero_grad(set_to_none=True)  # the gradient is freed and allocated anew each step
    layer(x).square().sum().backward()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    step()
before = faults()
for _ in range(5):
    step()
print(faults() - before)
"""


def test_retained_memory_serves_a_gradient_above_32_mib_again_without_page_faults():
    """A gradient like AlexNet-BN's fc6 (151 MB), freed and allocated every step: with the
    policy the heap hands the same pages back; glibc's default maps fresh ones and faults
    each in."""
    retained = _faults("retain")
    if retained == "no mallopt":
        pytest.skip("this C library has no mallopt (glibc only)")
    pages = (64 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert int(_faults("default")) >= 5 * pages  # each block mapped and touched anew
    assert int(retained) < 2 * pages  # at most one step's (the heap may still settle)


def test_a_training_process_keeps_freed_memory_unless_told_not_to():
    if _faults("retain") == "no mallopt":
        pytest.skip("this C library has no mallopt (glibc only)")
    pages = (64 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert int(_faults("training process")) < 2 * pages
    assert int(_faults("training process", HPCDL_MALLOC_RETAIN="0")) >= 5 * pages


def _faults(policy: str, **env: str) -> str:
    """Page faults of five steps of a layer with a 64 MiB gradient, after three, in a fresh
    process under ``policy``."""
    return subprocess.run([sys.executable, "-c", FAULTS_OF_REPEATED_64_MIB, policy],
                          capture_output=True, text=True, check=True,
                          env={**os.environ, **env}).stdout.strip()
