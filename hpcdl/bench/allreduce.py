"""Allreduce bandwidth of every backend against MPI_Allreduce and gloo, measured in one run.

    mpiexec -n P hpcdl bench allreduce --backends mpi,ring,shm,gloo --sizes 1M,16M,100M \\
        --json allreduce.json

Sizes are bytes of fp32 data (decimal: 1M = 10^6). Definitions are nccl-tests'
(docs/PERFORMANCE.md there): ``algbw = bytes / time``, ``busbw = algbw * 2(p-1)/p``,
GB = 10^9; ``time`` is the slowest rank's, the median of ``--repeats`` timed runs after
``--warmup`` untimed ones. Buffers come from ``comm.empty`` and are reduced in place -- the
way the gradient reducer uses a backend -- so ``shm`` reduces window memory with no copy in;
``shm-copyin`` times the same backend on an ordinary tensor (copy into the window and back).
``default`` is whatever ``backend="auto"`` picks, and ``memcpy`` is one core's copy bandwidth
on this machine (the ceiling a memory-bound reduction is judged against).
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

COMMAND = "allreduce"
HELP = "allreduce bandwidth of mpi/ring/shm/gloo vs MPI_Allreduce (nccl-tests busbw)"
COLUMNS = ("backend", "algorithm", "bytes", "ranks", "time_s", "algbw_GBps", "busbw_GBps")
UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9}


def parse_size(text: str) -> int:
    """'16M' -> 16000000 bytes (decimal units, like the MB in the ratios' names)."""
    text = text.strip().upper().removesuffix("B")
    unit = text[-1] if text and text[-1] in UNITS else ""
    try:
        value = float(text[:-1] if unit else text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: use e.g. 1M, 16M, 100M") from None
    return int(value * UNITS[unit])


def size_label(nbytes: int) -> str:
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes}B"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backends", default="mpi,ring,shm,gloo",
                        help="comma-separated backends; 'default' (auto), 'memcpy' and "
                             "'shm-copyin' are always added (default: %(default)s)")
    parser.add_argument("--sizes", default="1M,16M,100M",
                        help="comma-separated bytes of fp32 data (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs (median; >= 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs first")
    parser.add_argument("--json", metavar="FILE", help="write the JSON report here")


def bandwidth_record(backend: str, algorithm: str, nbytes: int, ranks: int,
                     time_s: float) -> dict[str, Any]:
    """nccl-tests' algbw and busbw (GB = 1e9) for one median time."""
    algbw = nbytes / time_s / 1e9 if time_s > 0 else 0.0
    busbw = algbw * 2 * (ranks - 1) / ranks
    return {"backend": backend, "algorithm": algorithm, "bytes": nbytes, "ranks": ranks,
            "time_s": time_s, "algbw_GBps": algbw, "busbw_GBps": busbw}


def time_allreduce(comm, buffer, repeats: int, warmup: int) -> float:
    """Median over runs of the slowest rank's time for one in-place sum of ``buffer``."""
    from mpi4py import MPI

    times = []
    for i in range(warmup + repeats):
        comm.mpi_comm.Barrier()
        start = time.perf_counter()
        comm.allreduce_flat_(buffer, average=False)
        elapsed = comm.mpi_comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
        if i >= warmup:
            times.append(elapsed)
    return statistics.median(times)


def time_memcpy(nbytes: int, repeats: int) -> float:
    """One core copying ``nbytes`` (what a rank does when it copies a bucket in or out)."""
    import torch

    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def measure_backend(name: str, sizes: list[int], repeats: int, warmup: int) -> list[dict]:
    import torch

    import hpcdl.comm

    backend = {"default": "auto", "shm-copyin": "shm"}.get(name, name)
    records = []
    with hpcdl.comm.init(backend) as comm:
        for nbytes in sizes:
            numel = nbytes // 4
            if name == "shm-copyin":
                buffer = torch.empty(numel, dtype=torch.float32)  # not window memory
            else:
                buffer = comm.empty(numel, torch.float32)
            buffer.fill_(comm.rank + 1.0)
            seconds = time_allreduce(comm, buffer, repeats, warmup)
            records.append(bandwidth_record(name, comm.backend, numel * 4, comm.size, seconds))
            del buffer
    return records


def bandwidth_ratios(records: list[dict], sizes: list[int]) -> dict[str, Any]:
    """The issue's headline ratios, at 100 MB / 16 MB (or the largest / a middle size)."""
    busbw = {(r["backend"], r["bytes"]): r["busbw_GBps"] for r in records}
    large = max(sizes)
    medium = 16 * 10**6 if 16 * 10**6 in sizes else sorted(sizes)[len(sizes) // 2]
    ratios: dict[str, Any] = {}

    def ratio(name: str, a: tuple, b: tuple) -> None:
        if busbw.get(a) and busbw.get(b):
            ratios[name] = busbw[a] / busbw[b]

    big, mid = size_label(large), size_label(medium)
    ratio(f"default_vs_mpi_busbw_{big}", ("default", large), ("mpi", large))
    ratio(f"default_vs_gloo_busbw_{big}", ("default", large), ("gloo", large))
    ratio(f"ring_vs_mpi_busbw_{mid}", ("ring", medium), ("mpi", medium))
    ratio(f"default_vs_memcpy_{big}", ("default", large), ("memcpy", large))
    ratio(f"shm_copyin_vs_shm_busbw_{big}", ("shm-copyin", large), ("shm", large))
    defaults = [r["algorithm"] for r in records if r["backend"] == "default"]
    if defaults:
        ratios["default_backend"] = defaults[0]
    return ratios


def run(args: argparse.Namespace) -> int:
    from mpi4py import MPI

    from hpcdl.bench.report import bench_report, emit

    world = MPI.COMM_WORLD
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    if args.repeats < 5:
        raise SystemExit(f"hpcdl bench allreduce: --repeats {args.repeats} < 5 (median of >= 5)")
    names = [b.strip() for b in args.backends.split(",") if b.strip()]
    names += [extra for extra in ("default", "shm-copyin") if extra not in names]
    records = []
    for name in names:
        records += measure_backend(name, sizes, args.repeats, args.warmup)
        if world.rank == 0:
            print(f"measured {name}", flush=True)
    if world.rank == 0:
        seconds = time_memcpy(max(sizes), args.repeats)
        records.append(bandwidth_record("memcpy", "torch copy_, 1 core", max(sizes), 1, seconds))
        # memcpy has no peers: its busbw is the copy bandwidth itself, the comparison point
        records[-1]["busbw_GBps"] = records[-1]["algbw_GBps"]
        report = bench_report("allreduce", records, bandwidth_ratios(records, sizes),
                              ranks=world.size)
        emit(report, COLUMNS, args.json)
    world.Barrier()
    return 0
