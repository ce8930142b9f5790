"""A node's CPUs as the kernel and Slurm write them, how many threads a rank takes, what the
CPU is (model, flags, clock, torch's vector ISA), its bf16 kernels and the heap policy.

The ground floor under both ``hpcdl doctor`` and the trainer's thread set-up: the doctor
predicts the trainer's thread count, so the rule lives below both.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterable, Sequence

__all__ = ["BF16_FLAGS", "affinity_cores", "bf16_native", "bf16_supported", "cpu_capability",
           "cpu_flags", "cpu_mhz", "cpu_model_name", "cpu_socket", "cpuinfo_field",
           "format_cpu_list", "memory_format_name", "online_cpus", "parse_cpu_list",
           "retain_freed_memory", "threads_per_rank"]


def parse_cpu_list(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11] (the kernel's and Slurm's mask syntax)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def format_cpu_list(cpus: Iterable[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    items, out, i = sorted(set(cpus)), [], 0
    while i < len(items):
        j = i
        while j + 1 < len(items) and items[j + 1] == items[j] + 1:
            j += 1
        out.append(str(items[i]) if i == j else f"{items[i]}-{items[j]}")
        i = j + 1
    return ",".join(out)


def affinity_cores() -> frozenset[int]:
    """The cores this process may run on (its MPI binding), or all when unknown."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return frozenset(range(os.cpu_count() or 1))


def online_cpus() -> list[int]:
    """Every logical CPU of the node (not just this process's mask)."""
    try:
        with open("/sys/devices/system/cpu/online", encoding="ascii") as f:
            return parse_cpu_list(f.read())
    except OSError:
        return list(range(os.cpu_count() or 1))


def cpu_socket(cpu: int) -> int:
    """The socket (physical package) of logical CPU ``cpu``; 0 when the kernel does not say."""
    path = f"/sys/devices/system/cpu/cpu{cpu}/topology/physical_package_id"
    try:
        with open(path, encoding="ascii") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 0


def threads_per_rank(mine: frozenset[int], node_masks: Sequence[frozenset[int]],
                     env_limit: int | None = None) -> tuple[int, bool]:
    """(threads for this rank, whether the node is oversubscribed).

    ``node_masks`` are the affinity masks of every rank on this node (this rank's included).
    ``env_limit`` (OMP_NUM_THREADS when the user set it) can only lower the count.
    """
    sharing = sum(1 for mask in node_masks if mask == mine) or 1
    threads = max(1, len(mine) // sharing)
    if env_limit is not None and env_limit >= 1:
        threads = min(threads, env_limit)
    node_cores = frozenset().union(*node_masks) if node_masks else mine
    # Every rank takes the same rule, so the node's total is len(node_masks) * threads at most.
    oversubscribed = len(node_masks) * threads > len(node_cores) or len(mine) < sharing
    return threads, oversubscribed


def cpuinfo_field(key: str) -> str | None:
    """The value of the first /proc/cpuinfo line starting with ``key`` (None without one)."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    return None


def cpu_model_name(fallback: str = "unknown") -> str:
    """``lscpu``'s model name (then /proc/cpuinfo's ``model name``), else ``fallback``: the
    name every measured number records (bench JSON, machine files)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.strip().lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    return cpuinfo_field("model name") or fallback


def cpu_flags() -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo's ``flags``; empty where there is none)."""
    return set((cpuinfo_field("flags") or "").split())


def cpu_mhz() -> float | None:
    """The first core's clock in MHz as /proc/cpuinfo gives it, or None."""
    try:
        return float(cpuinfo_field("cpu MHz") or "")
    except ValueError:
        return None


def cpu_capability() -> str:
    """The vector ISA torch's CPU kernels dispatch to (``DEFAULT``, ``AVX2``, ``AVX512``...):
    it changes every kernel's speed and rounding, so every measurement records it."""
    import torch

    return str(torch.backends.cpu.get_cpu_capability())


def bf16_supported() -> bool:
    """Whether oneDNN has bf16 kernels on this CPU: native with AVX512-BF16/AMX, emulated on
    other AVX-512 CPUs (:func:`bf16_native` tells the two apart)."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


#: /proc/cpuinfo flags of bf16 arithmetic in hardware: AVX512-BF16 (Cooper Lake, Zen 4 and
#: later) and AMX-BF16 (Sapphire Rapids and later)
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def bf16_native(flags: set[str] | None = None, capability: str | None = None) -> bool:
    """Whether bf16 compute is native here: the CPU has AVX512-BF16 or AMX-BF16 *and* torch
    dispatches its vector kernels at AVX-512, the ISA those instructions extend.

    ``ATEN_CPU_CAPABILITY=default`` or ``avx2`` (how a job reproduces the AVX2 numeric path)
    keeps the flags but lowers torch's own kernels to code without them: the elementwise and
    normalisation passes of a bf16 step then convert in software, so that is not native
    either. :func:`bf16_supported` is a weaker fact: oneDNN has bf16 kernels on any AVX-512
    CPU, emulated with AVX512-BW where the instructions are missing (Skylake, Cascade Lake).
    ``flags`` and ``capability`` default to this machine's (:func:`cpu_flags`,
    :func:`cpu_capability`); tests pass another CPU's."""
    flags = cpu_flags() if flags is None else flags
    if not BF16_FLAGS & set(flags):
        return False
    capability = cpu_capability() if capability is None else capability
    return capability.upper().startswith("AVX512")


def memory_format_name(channels_last: bool | str, threads: int,
                       precision: str = "float32", unsafe_layer: str | None = None) -> str:
    """The activation layout a step really uses, from ``train.channels_last`` (true, false or
    ``auto``), the rank's threads, the resolved compute dtype and the model's layer that
    oneDNN cannot train in channels_last (:func:`hpcdl.models.channels_last_unsafe_layer`).

    ``channels_last`` only for a model without such a layer (it corrupts memory: a crash, a
    hang or wrong gradients), and with two or more threads. The thread rule came first, from a
    crash on one thread that was that layer's (``resnet_small`` at width 4); one thread was
    exact above it (docs/results/channels-last-strided-1x1-2026-12-07/), but ``auto``'s
    one-thread bench runs were measured and are labelled under the thread rule, so it stays
    until they are measured again. ``auto`` is channels_last for a bfloat16 step and contiguous
    for float32: oneDNN's bf16 convolutions ran 1.33x (ResNet-50) and 1.14x (AlexNet-BN)
    faster per step in channels_last on 2 threads
    (docs/results/bf16-step-vs-plain-torch-2026-12-02/, docs/performance.md "bf16"), and a
    float32 step keeps the layout it always had. The trainer and the bench's baselines all
    follow this rule, so they train the same layout."""
    wanted = precision == "bfloat16" if channels_last == "auto" else bool(channels_last)
    return "channels_last" if wanted and threads > 1 and unsafe_layer is None else "contiguous"


def retain_freed_memory() -> bool:
    """Ask glibc to keep every freed block in the heap and never trim it, so each step's
    activations and gradients reuse memory instead of mmap/munmap and first-touch page faults:
    blocks up to 32 MiB (its largest mmap threshold on 64-bit) by the threshold, larger ones
    only with mmap off for heap blocks (``M_MMAP_MAX`` 0; AlexNet-BN's fc6 weight gradient,
    151 MB, was otherwise a fresh mapping and about 37k page faults every step). The
    environment's ``MALLOC_*_`` variables do the same. False without mallopt."""
    import ctypes
    import ctypes.util

    m_trim_threshold, m_mmap_threshold, m_mmap_max = -1, -3, -4  # <malloc.h>
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(m_mmap_threshold, 32 << 20)
                    and libc.mallopt(m_trim_threshold, 2 ** 31 - 1)
                    and libc.mallopt(m_mmap_max, 0))
    except (OSError, AttributeError):
        return False
