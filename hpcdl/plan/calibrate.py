"""``hpcdl plan --calibrate``: measure this machine into the ``local`` machine file.

Each figure is written with ``source: measured DATE by hpcdl plan --calibrate`` and the
numbers behind it: peak from the CPU flags, stream rates from ``a += b``, the per-class rates
of representative layers (hpcdl.plan.class_rates) on one thread, on all cores as one rank's
threads and as co-running ranks, the CPU (hpcdl.plan.cpu), intra-node α and β fitted to
``mpiexec -n 2 hpcdl bench allreduce``, the loader's decode rate, and across hosts the
network's α and β (Hockney 1994, point to point). The class rates are measured in the compute
precision asked (``--precision``: bf16 under the trainer's autocast, only where bf16 is native)
and kept under that precision's key, beside the other precisions' rates of an earlier
calibration of the same CPU. The file is written atomically to
``--machines-dir`` or the user's config directory (the package may be read-only on a
cluster). What each measurement is and how it is fitted: docs/planner.md, "--calibrate".
"""
from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from typing import Any

import yaml

from hpcdl.cpus import cpu_flags, cpu_mhz
from hpcdl.errors import BadInputError
from hpcdl.host import interface_bytes
from hpcdl.io import atomic_write_text
from hpcdl.mpi_library import launched_world_size
from hpcdl.plan.cpu import cpu_identity, cpu_mismatch, measurable_precision
from hpcdl.plan.layers import COMPUTE_CLASSES
from hpcdl.plan.machine import (
    BASE_PRECISION,
    RATE_SECTIONS,
    parse_machine,
    rate_precisions,
    user_machines_dir,
)

ALLREDUCE_SIZES = (1 << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 22, 1 << 24)
#: Across hosts: 1 KB (latency-bound) to 64 MB (bandwidth-bound; 0.5 s at 1 Gbit/s).
NETWORK_SIZES = (1 << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 22, 1 << 24, 1 << 26)


def flops_per_cycle(flags: set[str]) -> tuple[int, str]:
    """fp32 FLOP/cycle/core from the vector ISA, assuming two FMA pipes (Skylake-SP Gold/
    Platinum, Zen 2+, Haswell+): lanes × 2 FLOP × 2 pipes."""
    if "avx512f" in flags:
        return 64, "CPU flags: avx512f -> 2 FMA x 16 fp32 lanes x 2 = 64 (assumes 2 FMA units)"
    if "avx2" in flags and "fma" in flags:
        return 32, "CPU flags: avx2+fma -> 2 FMA x 8 fp32 lanes x 2 = 32 (assumes 2 FMA units)"
    return 8, "CPU flags: no FMA/AVX2 -> SSE 4 lanes x (add + mul) = 8"


def matmul_flops(threads: int, n: int = 1024, repeats: int = 5) -> float:
    """fp32 GEMM FLOP/s (2n³ per product) with ``threads`` torch threads."""
    import torch

    from hpcdl.plan.class_rates import median_time, torch_threads

    with torch_threads(threads):
        a, b = torch.randn(n, n), torch.randn(n, n)
        return 2 * n ** 3 / median_time(lambda: torch.mm(a, b), repeats)


def stream_Bps(threads: int, nbytes: int = 64 << 20, repeats: int = 5) -> float:
    """Bytes/s moved by ``a += b`` (read a, read b, write a) with ``threads`` torch threads."""
    import torch

    from hpcdl.plan.class_rates import median_time, torch_threads

    with torch_threads(threads):
        a, b = torch.ones(nbytes // 4), torch.ones(nbytes // 4)
        return 3 * nbytes / median_time(lambda: a.add_(b), repeats)


def decode_images_per_s(image_size: int = 224, images: int = 64) -> float:
    """One thread's rate of the loader's per-image work on a 256 x 341 JPEG."""
    import numpy as np
    import simplejpeg
    import torch

    from hpcdl.data.augment import crop_resize, random_resized_crop_boxes, sample_uniforms
    from hpcdl.plan.class_rates import median_time, torch_threads

    rng = np.random.default_rng(0)
    # A smooth image with noise compresses like a photograph (pure noise would not).
    yy, xx = np.mgrid[0:256, 0:341]
    base = np.stack([(xx * 0.7) % 256, (yy * 0.9) % 256, ((xx + yy) * 0.4) % 256], axis=-1)
    rgb = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
    jpeg = np.frombuffer(simplejpeg.encode_jpeg(rgb, quality=90), dtype=np.uint8)
    boxes = random_resized_crop_boxes(np.full(images, 256), np.full(images, 341),
                                      sample_uniforms(0, 0, np.arange(images)))   # the loader's
    out = torch.empty(3, image_size, image_size, dtype=torch.uint8)   # one batch slot

    def work() -> None:
        for i, box in enumerate(boxes):
            crop_resize(jpeg, (256, 341, 3), "jpeg", box, image_size, i % 2 == 0, out=out)

    with torch_threads(1):   # a rate per core
        return images / median_time(work, 3)


# --------------------------------------------------------------------------- allreduce fit
def fit_alpha_beta(records: Sequence[Mapping[str, Any]], gamma: float,
                   backends: Sequence[str] = ("mpi", "default")) -> dict[str, float]:
    """Least-squares T(n) = c0 + c1·n over ``hpcdl bench allreduce`` records of the MPI
    backend at 2 ranks; α = c0/2, β = c1 − γ/2 (p = 2: T = 2α + nβ + (n/2)γ)."""
    import numpy as np

    points: list[tuple[float, float]] = []
    for backend in backends:   # the first backend with enough records: never a mix
        points = [(float(r["bytes"]), float(r["time_s"])) for r in records
                  if str(r.get("backend", "")) == backend and int(r.get("ranks", 2)) == 2
                  and "bytes" in r and "time_s" in r]
        if len(points) >= 2:
            break
    if len(points) < 2:
        raise ValueError(f"need >= 2 allreduce records of backend {list(backends)} at 2 ranks, "
                         f"got {len(points)} (of {len(records)} records)")
    x = np.array([p[0] for p in points])
    t = np.array([p[1] for p in points])
    design = np.stack([np.ones_like(x), x], axis=1)
    (c0, c1), *_ = np.linalg.lstsq(design, t, rcond=None)
    alpha = max(float(c0) / 2, 1e-7)   # a negative intercept is noise around ~0
    beta = float(c1) - gamma / 2
    if beta <= 0:                      # the fit cannot separate β from γ: give β the slope
        beta = float(c1) / 2
    return {"alpha_s": alpha, "beta_s_per_byte": beta, "intercept_s": float(c0),
            "slope_s_per_byte": float(c1), "points": len(points)}


def allreduce_records(timeout_s: float = 600) -> list[dict]:
    """Run ``hpcdl bench allreduce`` at 2 ranks (the mpi backend: the one the fit reads) and
    return its result records."""
    from hpcdl.results import run_bench_json

    sizes = ",".join(str(s) for s in ALLREDUCE_SIZES)
    report = run_bench_json(2, ("allreduce", "--sizes", sizes, "--backends", "mpi"), timeout_s)
    return list(report.get("results", []))


# --------------------------------------------------------------------------- across hosts
def sleeping_barrier(comm, poll_s: float = 0.05) -> None:
    """A barrier whose waiting ranks sleep (MPI_Barrier spins a core: on a shared node it would
    slow the rank being waited for)."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(poll_s)


def ping_pong_s(comm, nbytes: int, repeats: int) -> float | None:
    """Median one-way seconds of ``nbytes`` between ranks 0 and 1 of ``comm`` (half the round
    trip); None on ranks other than 0."""
    import numpy as np

    buffer = np.zeros(max(1, nbytes), dtype=np.uint8)
    times = []
    for _ in range(repeats + 1):
        comm.Barrier()
        start = time.perf_counter()
        if comm.rank == 0:
            comm.Send(buffer, dest=1)
            comm.Recv(buffer, source=1)
        elif comm.rank == 1:
            comm.Recv(buffer, source=0)
            comm.Send(buffer, dest=0)
        times.append((time.perf_counter() - start) / 2)
    return statistics.median(times[1:]) if comm.rank == 0 else None


def fit_network(points: Sequence[tuple[float, float]], hosts: int, gamma: float,
                min_bytes: float = 1 << 22) -> dict[str, float]:
    """The planner's ring cost at ``hosts`` (N) hosts fitted to allreduce (bytes, seconds)
    points of at least ``min_bytes`` (bandwidth-bound: past a shaper's burst):
    T(n) = 2(N−1)α + 2(N−1)/N·nβ + (N−1)/N·nγ (hpcdl.plan.model.ring_allreduce_s), least
    squares on T − (N−1)/N·nγ. The allreduce's *effective* figures, recorded beside the
    point-to-point ones the machine file takes."""
    import numpy as np

    if hosts < 2:
        raise ValueError(f"a network fit needs >= 2 hosts, got {hosts}")
    large = [p for p in points if p[0] >= min_bytes]
    if len(large) < 2:
        raise ValueError(f"need >= 2 allreduce sizes of >= {min_bytes:.0f} B across hosts, "
                         f"got {len(large)}")
    n = np.array([p[0] for p in large], dtype=float)
    t = np.array([p[1] for p in large], dtype=float)
    steps = 2 * (hosts - 1)
    share = 2 * (hosts - 1) / hosts
    target = t - (hosts - 1) / hosts * n * gamma
    design = np.stack([np.full_like(n, steps), share * n], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(design, target, rcond=None)
    if beta <= 0:
        raise ValueError(f"the allreduce times do not grow with size (bytes {n.tolist()}, "
                         f"seconds {t.tolist()}): no bandwidth to fit")
    predicted = steps * alpha + share * n * beta + (hosts - 1) / hosts * n * gamma
    return {"alpha_s": float(alpha), "beta_s_per_byte": float(beta),
            "gamma_s_per_byte": float(gamma), "hosts": hosts,
            "points": [[float(a), float(b)] for a, b in zip(n, t, strict=True)],
            "max_relative_residual": float(np.max(np.abs(predicted - t) / t))}


def allreduce_fit_or_reason(points: Sequence[tuple[float, float]], hosts: int,
                            gamma: float) -> dict[str, Any]:
    """:func:`fit_network`, or ``{"error": why}``: the allreduce fit is a cross-check kept
    beside the point-to-point figures, and must not cost them."""
    try:
        return fit_network(points, hosts, gamma)
    except ValueError as exc:
        return {"error": str(exc)}


def hockney_figures(latency_s: float, large_bytes: float, large_s: float) -> dict[str, float]:
    """α and β of T(n) = α + nβ (Hockney 1994) from the one-way time of a tiny message
    (α) and of a large one (β = (T − α) / n)."""
    if latency_s <= 0 or large_s <= latency_s or large_bytes <= 0:
        raise ValueError(f"point-to-point times do not fit T = a + nb: {latency_s} s at 8 B, "
                         f"{large_s} s at {large_bytes:.0f} B")
    return {"alpha_s": latency_s, "beta_s_per_byte": (large_s - latency_s) / large_bytes,
            "large_bytes": large_bytes}


def network_calibration(gamma: float, sizes: Sequence[int] = NETWORK_SIZES,
                        repeats: int = 5, log: Callable[[str], None] = print) -> dict | None:
    """Across hosts: α and β of the network (see the module docstring). Collective over
    COMM_WORLD; returns the measurements on world rank 0, None elsewhere."""
    from mpi4py import MPI

    from hpcdl.comm.base import timed_allreduce_s
    from hpcdl.topology import split_nodes

    world = MPI.COMM_WORLD
    node = split_nodes(world)
    leaders = world.Split(0 if node.rank == 0 else MPI.UNDEFINED, world.rank)
    node.Free()
    result = None
    if leaders != MPI.COMM_NULL:
        hosts = leaders.size
        names = leaders.gather(MPI.Get_processor_name(), root=0)
        if leaders.rank == 0:
            log(f"network: ping-pong between {names[0]} and {names[1]}, then MPI_Allreduce "
                f"across {hosts} hosts ({', '.join(names)}), {len(sizes)} sizes x {repeats}")
        before = interface_bytes()
        latency = ping_pong_s(leaders, 8, repeats)
        large = ping_pong_s(leaders, max(sizes), repeats)
        times = [[float(n), timed_allreduce_s(leaders, int(n), repeats)] for n in sizes]
        after = interface_bytes()
        moved = {nic: [after[nic][0] - sent, after[nic][1] - received]
                 for nic, (sent, received) in before.items() if nic in after}
        everyone = leaders.gather(moved, root=0)
        if leaders.rank == 0:
            result = {"hosts": names, "repeats": repeats,
                      "point_to_point": hockney_figures(latency, float(max(sizes)), large),
                      "ping_pong_8B_one_way_s": latency,
                      "ping_pong_large_one_way_s": large, "allreduce_times": times,
                      "allreduce_fit": allreduce_fit_or_reason(times, hosts, gamma),
                      "interface_bytes": dict(zip(names, everyone, strict=True))}
        leaders.Free()
    return result


# --------------------------------------------------------------------------- the file
# Co-running processes of the contention measurement, at most: each holds ~1 GB of samples
# (the 134 MB linear layer, the optimizer's 25 M parameters); a larger node's contention is
# taken as at this count (hpcdl.plan.machine.Machine.contention_factor).
CORUN_MAX_RANKS = 16


def _fig(value: float, source: str) -> dict[str, Any]:
    return {"value": float(value), "source": source}


def _load_text(m: Mapping[str, Any]) -> str:
    return (f"load average {m['load_average_before']:.1f} -> {m['load_average_after']:.1f}"
            if "load_average_after" in m else "load average not recorded")


def _dtype_text(m: Mapping[str, Any]) -> str:
    """How a rate's source names a precision other than float32 (float32's say nothing, as
    before precisions)."""
    precision = m.get("precision", BASE_PRECISION)
    return "" if precision == BASE_PRECISION else f" in {precision} (autocast)"


def measure(quick: bool = False, batch: int = 8,
            log: Callable[[str], None] = print, allreduce: bool = True,
            precision: str = BASE_PRECISION) -> dict:
    """Every measurement calibration makes, as raw numbers (``allreduce=False``: not the
    intra-node allreduce, which launches its own mpiexec); the class rates computing in
    ``precision`` (hpcdl.plan.class_rates.time_layer), the rest is the same in every one."""
    from hpcdl.plan.class_rates import (
        contention,
        corun_samples,
        fit_rates,
        measure_samples,
        overhead_s,
        rate_curves,
        thread_speedups,
    )

    cores = os.cpu_count() or 1
    reps = 3 if quick else 5   # odd: the median is one real call
    m: dict[str, Any] = {"cores": cores, "cpu_mhz": cpu_mhz(), "cpu": cpu_identity(),
                         "load_average_before": os.getloadavg()[0], "precision": precision}
    m["flops_per_cycle"], m["flops_per_cycle_source"] = flops_per_cycle(cpu_flags())
    log("matmul FLOP/s ...")
    m["matmul_flops_1_thread"] = matmul_flops(1, repeats=reps)
    m["matmul_flops_all_cores"] = matmul_flops(cores, repeats=reps)
    log("memory stream ...")
    m["stream_Bps_1_thread"] = stream_Bps(1, repeats=reps)
    m["stream_Bps_all_cores"] = stream_Bps(cores, repeats=reps)
    log(f"per-class rates: representative layers, batch {batch}, 1 thread, {precision} ...")
    # The same allocator policy as `hpcdl bench train` (its default --malloc retain): without
    # it each 25 MB activation is a fresh mmap with first-touch page faults, which the steps
    # being predicted do not pay.
    from hpcdl.cpus import retain_freed_memory

    m["malloc_retain"] = retain_freed_memory()
    m["class_batch"] = batch
    m["layer_overhead_s"] = overhead_s(precision=precision)
    samples = measure_samples(batch, reps, log=log, precision=precision)
    m["class_samples"] = [asdict(x) for x in samples]
    m["class_rates"] = fit_rates(samples, m["layer_overhead_s"])
    m["class_curves"] = rate_curves(samples, m["layer_overhead_s"])
    if cores > 1:
        # The same layers as one rank's `cores` threads (np = 1 on this node): each class's
        # thread speedup is measured, not assumed.
        log(f"per-class rates on {cores} threads of one rank ...")
        samples_t = measure_samples(batch, reps, threads=cores, log=log, precision=precision)
        m["class_threads"] = cores
        m["class_samples_threads"] = [asdict(x) for x in samples_t]
        m["class_rates_threads"] = fit_rates(samples_t, m["layer_overhead_s"])
        m["thread_speedups"] = thread_speedups(m["class_rates"], m["class_rates_threads"],
                                               threads=cores)
        # The same layers in `cores` single-threaded processes at once: mpiexec -n cores.
        corun_ranks = min(cores, CORUN_MAX_RANKS)
        log(f"per-class rates with {corun_ranks} single-threaded ranks running at once ...")
        corun = corun_samples(batch, reps, corun_ranks, precision=precision)
        m["corun_ranks"] = corun_ranks
        m["class_rates_corun"] = fit_rates(corun, m["layer_overhead_s"])
        m["contention"] = contention(m["class_rates"], m["class_rates_corun"])
    log("JPEG decode + augment ...")
    try:
        m["decode_images_per_s_1_thread"] = decode_images_per_s(images=32 if quick else 64)
    except Exception as exc:  # noqa: BLE001 - a loader change must not cost the other figures
        m["decode_error"] = f"{type(exc).__name__}: {exc}"
        log(f"decode measurement failed ({m['decode_error']}); an assumption is written")
    log("allreduce alpha/beta (mpiexec -n 2 hpcdl bench allreduce) ..." if allreduce else
        "intra-node allreduce not measured (launched under mpiexec: no nested launcher)")
    try:
        if not allreduce:
            raise RuntimeError("not measured: hpcdl plan --calibrate ran under mpiexec "
                               "(measure it with a one-node hpcdl plan --calibrate)")
        m["allreduce"] = fit_alpha_beta(allreduce_records(), 3.0 / m["stream_Bps_1_thread"])
    except (RuntimeError, ValueError, OSError, subprocess.TimeoutExpired) as exc:
        m["allreduce_error"] = str(exc)
        log(f"allreduce calibration failed: {exc}")
    m["load_average_after"] = os.getloadavg()[0]
    return m


def machine_document(m: Mapping[str, Any], previous: Mapping[str, Any] | None = None) -> dict:
    """The ``local`` machine file from measurements ``m`` (allreduce figures from ``previous``
    when the allreduce bench could not run), its class rates under ``m``'s precision, and the
    other precisions' rates of ``previous`` where it describes this CPU (:func:`kept_rates`)."""
    stamp = f"measured {datetime.date.today().isoformat()} by hpcdl plan --calibrate"
    cores = m["cores"]
    cpu = dict(m.get("cpu") or cpu_identity())
    mhz = m.get("cpu_mhz") or 2000.0
    freq_src = (f"/proc/cpuinfo cpu MHz = {mhz:g} ({stamp})" if m.get("cpu_mhz")
                else "assumption: 2 GHz (/proc/cpuinfo has no cpu MHz)")
    core_peak = mhz * 1e6 * m["flops_per_cycle"]
    gamma = 3.0 / m["stream_Bps_1_thread"]
    doc: dict[str, Any] = {
        "name": "local",
        "calibrated": True,
        "description": f"this machine ({cpu['model_name']}, {cores} cores), one node",
        "node": {
            "sockets": _fig(1, f"one node as seen by os.cpu_count() ({stamp})"),
            "cores_per_socket": _fig(cores, f"os.cpu_count() = {cores} ({stamp})"),
            "frequency_hz": _fig(mhz * 1e6, freq_src),
            "flops_per_cycle_per_core": _fig(m["flops_per_cycle"], m["flops_per_cycle_source"]),
            "memory_bandwidth_Bps": _fig(
                max(m["stream_Bps_all_cores"], m["stream_Bps_1_thread"]),
                f"{stamp}: a += b on 64 MB, all cores "
                f"({m['stream_Bps_all_cores'] / 1e9:.3g} GB/s; 1 thread "
                f"{m['stream_Bps_1_thread'] / 1e9:.3g} GB/s; the larger is kept: a node has at "
                "least one core's bandwidth, a lower all-core figure is contention)"),
            "core_stream_Bps": _fig(m["stream_Bps_1_thread"],
                                    f"{stamp}: a += b on 64 MB, 1 thread"),
            "ranks_per_node": _fig(1, "convention: one rank per machine unless --procs-per-node"),
        },
        "data": {
            "decode_images_per_s_per_core": (
                _fig(m["decode_images_per_s_1_thread"], (
                    f"{stamp}: hpcdl.data.augment.crop_resize (simplejpeg decode + random-resized"
                    " crop to 224 + flip) of a 256x341 JPEG, 1 thread"))
                if "decode_images_per_s_1_thread" in m else
                _fig(300, f"assumption: measurement failed ({m.get('decode_error')})")),
            "loader_cores_per_node": _fig(1, "assumption: one core's worth of loader threads"),
        },
    }
    if "allreduce" in m:
        fit = m["allreduce"]
        src = (f"{stamp}: least squares over {fit['points']} sizes of mpiexec -n 2 hpcdl bench "
               f"allreduce (mpi backend): T = {fit['intercept_s']:.3g} s + "
               f"{fit['slope_s_per_byte']:.3g} s/B x n; p=2: T = 2a + nb + (n/2)g")
        intra = {"latency_s": _fig(fit["alpha_s"], src + " -> a = c0/2"),
                 "bandwidth_Bps": _fig(1 / fit["beta_s_per_byte"], src + " -> b = c1 - g/2")}
    elif previous and "intra_node" in previous:
        intra = dict(previous["intra_node"])
    else:
        intra = {"latency_s": _fig(1e-6, "assumption: allreduce bench unavailable; ~1 us shm"),
                 "bandwidth_Bps": _fig(5e9, "assumption: allreduce bench unavailable; ~5 GB/s")}
    doc["intra_node"] = intra
    doc["network"] = {k: {"value": v["value"],
                          "source": f"single node: no network; same as intra_node ({v['source']})"}
                      for k, v in intra.items()}
    precision = m.get("precision", BASE_PRECISION)
    rates = kept_rates(previous, cpu, core_peak, m["stream_Bps_1_thread"])
    rates[precision] = rate_sections(m, core_peak, stamp)
    place_rates(doc, rates)
    doc["cpu"] = cpu
    measured = {k: v for k, v in m.items() if not isinstance(v, dict | list)}
    if "allreduce" in m:
        measured["allreduce_fit"] = m["allreduce"]
    measured["gamma_s_per_byte"] = gamma
    doc["measured"] = measured | {k: m[k] for k in RAW_SAMPLES if k in m}
    return doc


def rate_sections(m: Mapping[str, Any], core_peak: float, stamp: str) -> dict[str, Any]:
    """One precision's rate sections (hpcdl.plan.machine.RATE_SECTIONS) from ``m``."""
    return {"compute": compute_section(m, core_peak, stamp),
            **({"rate_curves": curves_section(m, core_peak, stamp)} if m.get("class_curves")
               else {}),
            **({"thread_scaling": thread_section(m, stamp)} if "thread_speedups" in m else {}),
            **({"contention": contention_section(m, stamp)} if "contention" in m else {})}


def place_rates(doc: dict[str, Any], rates: Mapping[str, Mapping[str, Any]]) -> None:
    """Each precision's sections where a machine file keeps them: float32's at the top level
    (after ``node``, as every file before precisions), the others' under ``rates``."""
    data = {k: doc.pop(k) for k in list(doc) if k not in ("name", "calibrated", "description",
                                                          "node")}
    doc.update(rates.get(BASE_PRECISION, {}))
    doc.update(data)
    others = {p: dict(sections) for p, sections in rates.items() if p != BASE_PRECISION}
    if others:
        doc["rates"] = others


def kept_rates(previous: Mapping[str, Any] | None, cpu: Mapping[str, Any], core_peak: float,
               core_stream: float) -> dict[str, dict[str, Any]]:
    """Every precision's rate sections of ``previous`` (the machine file being replaced) when
    it was calibrated on this ``cpu``; nothing otherwise (another CPU's rates would describe
    that CPU). A fraction is of the file's one-core peak or stream, both measured again now:
    each is rescaled so that it stands for the same absolute rate."""
    if not previous or not previous.get("calibrated") or not previous.get("cpu") \
            or cpu_mismatch(previous["cpu"], cpu) is not None:
        return {}
    node = previous.get("node") or {}
    try:
        old_peak = (float(node["frequency_hz"]["value"])
                    * float(node["flops_per_cycle_per_core"]["value"]))
        old_stream = float(node["core_stream_Bps"]["value"])
    except (KeyError, TypeError, ValueError):
        return {}
    scale = {"peak": old_peak / core_peak, "stream": old_stream / core_stream}
    kept = {}
    for precision in rate_precisions(previous, "<previous calibration>"):
        block = previous if precision == BASE_PRECISION else previous["rates"][precision]
        kept[precision] = rescaled_sections(block, scale)
    return kept


def rescaled_sections(block: Mapping[str, Any], scale: Mapping[str, float]) -> dict[str, Any]:
    """The rate sections of ``block`` with each fraction × ``scale['peak']`` (dense classes)
    or × ``scale['stream']`` (memory passes); speedups, contention and the overhead as they
    were."""
    def factor(op_class: str) -> float:
        if op_class == "layer_overhead_s":
            return 1.0
        return scale["peak"] if op_class in COMPUTE_CLASSES else scale["stream"]

    note = "; kept from the previous calibration of this CPU, rescaled to this file's peak " \
           "and stream (the same absolute rate)"
    out: dict[str, Any] = {k: block[k] for k in RATE_SECTIONS if k in block}
    if "compute" in out:
        out["compute"] = {c: _fig(float(f["value"]) * factor(c), f"{f['source']}{note}")
                          for c, f in block["compute"].items()}
    if "rate_curves" in out:
        out["rate_curves"] = {
            c: {**curve, "points": [[float(x), float(v) * factor(c)] for x, v in curve["points"]],
                "source": f"{curve['source']}{note}"}
            for c, curve in block["rate_curves"].items()}
    return out


#: the per-class measurements kept under ``measured`` as they were taken
RAW_SAMPLES = ("class_samples", "class_samples_threads", "class_rates", "class_rates_threads",
               "thread_speedups", "class_curves", "class_rates_corun", "contention")


def with_network(doc: Mapping[str, Any], net: Mapping[str, Any]) -> dict:
    """``doc`` with its ``network`` figures measured across hosts (:func:`network_calibration`)
    and the raw numbers under ``measured.network``."""
    stamp = f"measured {datetime.date.today().isoformat()} by hpcdl plan --calibrate"
    p2p = net["point_to_point"]
    hosts = net["hosts"]
    fit = net["allreduce_fit"]
    cross_check = (f"MPI_Allreduce of >= 4 MB fitted to the ring cost gives a = "
                   f"{fit['alpha_s']:.3g} s, 1/b = {1 / fit['beta_s_per_byte']:.4g} B/s"
                   if "error" not in fit else f"MPI_Allreduce fit: {fit['error']}")
    carried = {host: {nic: b for nic, b in nics.items() if b[0] > 0}
               for host, nics in net["interface_bytes"].items()}
    src = (f"{stamp} across {len(hosts)} hosts ({', '.join(hosts)}), one rank each, "
           f"MPI point to point between {hosts[0]} and {hosts[1]} (half a ping-pong's round "
           f"trip, median of {net['repeats']}): 8 B one way in {p2p['alpha_s']:.3g} s, "
           f"{p2p['large_bytes']:.3g} B in {net['ping_pong_large_one_way_s']:.3g} s; "
           f"{cross_check} (measured.network); bytes sent per interface: {carried}")
    out = dict(doc)
    out["network"] = {"latency_s": _fig(p2p["alpha_s"], src + " -> a: 8 B one way"),
                      "bandwidth_Bps": _fig(1 / p2p["beta_s_per_byte"],
                                            src + " -> 1/b = n / (T(n) - a)")}
    out["description"] = (f"{doc.get('description', 'this machine')}; network measured across "
                          f"{len(hosts)} hosts")
    measured = dict(doc.get("measured") or {})
    measured["network"] = dict(net)
    out["measured"] = measured
    return out


def node_gamma(doc: Mapping[str, Any], ranks_per_node: int) -> float:
    """γ as the planner prices it for ``doc`` (hpcdl.plan.model.reduction_gamma)."""
    from hpcdl.plan.model import reduction_gamma

    return reduction_gamma(parse_machine(doc, "<calibration>",
                                         first_precision(doc, "<calibration>")), ranks_per_node)


def first_precision(doc: Mapping[str, Any], path: str) -> str:
    """A precision ``doc`` holds rates for (float32 first), to read its figures by; float32
    where it holds none (reading then says what is missing)."""
    held = rate_precisions(doc, path)
    return held[0] if held else BASE_PRECISION


def compute_section(m: Mapping[str, Any], core_peak: float, stamp: str) -> dict[str, Any]:
    """The ``compute`` figures from the fitted class rates (hpcdl.plan.class_rates)."""
    from hpcdl.plan.class_rates import class_fractions

    fractions = class_fractions(m["class_rates"], core_peak, m["stream_Bps_1_thread"])
    load = _load_text(m)
    counts = Counter(sample["op_class"] for sample in m.get("class_samples", []))
    section = {}
    for op_class, fraction in fractions.items():
        rate = m["class_rates"][op_class]
        what = (f"{rate / 1e9:.4g} GFLOP/s / one core's peak {core_peak / 1e9:.4g} GFLOP/s"
                if op_class in COMPUTE_CLASSES else
                f"{rate / 1e9:.4g} GB/s nominal passes / one core's stream "
                f"{m['stream_Bps_1_thread'] / 1e9:.4g} GB/s")
        section[op_class] = _fig(fraction, (
            f"{stamp}: {counts.get(op_class, 0)} representative {op_class} layers "
            f"(hpcdl.plan.class_rates), forward + backward{_dtype_text(m)}, batch "
            f"{m['class_batch']}, 1 thread, "
            f"less the per-layer overhead: {what}; {load}"))
    section["layer_overhead_s"] = _fig(m["layer_overhead_s"], (
        f"{stamp}: forward + backward of a one-element ReLU (dispatch + autograd), 1 thread; "
        f"{load}"))
    return section


def curves_section(m: Mapping[str, Any], core_peak: float, stamp: str) -> dict[str, Any]:
    """The ``rate_curves`` section: per class of hpcdl.plan.class_rates.RATE_CURVE_CLASSES,
    ``[x, fraction]`` points (fractions as in ``compute``), x on the class's ``axis``."""
    from hpcdl.plan.class_rates import ROWS_AXIS, class_fractions, curve_axis

    section = {}
    for op_class, points in m["class_curves"].items():
        fractions = [[x, class_fractions({op_class: rate}, core_peak,
                                         m["stream_Bps_1_thread"])[op_class]]
                     for x, rate in points]
        axis = curve_axis(op_class)
        what = ("GEMM rows of one call: batch x output positions" if axis == ROWS_AXIS
                else "work of one call: FLOPs or nominal bytes")
        section[op_class] = {"points": fractions, "axis": axis, "source": (
            f"{stamp}: the representative {op_class} layers one by one ({what}, at batch "
            f"{m['class_batch']}), 1 thread, less the per-layer overhead; the planner "
            "interpolates in log-log between them")}
    return section


def ratio_section(count_key: str, count: float, count_source: str,
                  ratios: Mapping[str, float], source: Callable[[str], str]) -> dict[str, Any]:
    """A section of per-class ratios measured at ``count`` (threads or ranks): the count's
    figure, then each class's ratio with ``source(op_class)``."""
    return {count_key: _fig(count, count_source),
            **{op_class: _fig(ratio, source(op_class)) for op_class, ratio in ratios.items()}}


def thread_section(m: Mapping[str, Any], stamp: str) -> dict[str, Any]:
    """The ``thread_scaling`` figures: per class, the rate of one rank on ``class_threads``
    threads over its one-thread rate (hpcdl.plan.class_rates.thread_speedups)."""
    threads = m["class_threads"]
    load = _load_text(m)
    return ratio_section(
        "threads", threads, f"{stamp}: os.cpu_count() = {threads}, the threads of one rank "
        "alone on this node", m["thread_speedups"],
        lambda c: (f"{stamp}: the representative {c} layers on {threads} threads of one rank, "
                   f"{m['class_rates_threads'][c] / 1e9:.4g} G/s, over the same on 1 thread, "
                   f"{m['class_rates'][c] / 1e9:.4g} G/s (FLOP/s or nominal bytes/s); {load}"))


def contention_section(m: Mapping[str, Any], stamp: str) -> dict[str, Any]:
    """The ``contention`` figures: per class, a single-threaded rank's rate among ``ranks``
    co-running ones over its rate alone (hpcdl.plan.class_rates.contention)."""
    ranks = m.get("corun_ranks", m["cores"])
    return ratio_section(
        "ranks", ranks, f"{stamp}: {ranks} single-threaded processes (os.cpu_count() = "
        f"{m['cores']}, at most {CORUN_MAX_RANKS}) timing "
        "each layer at the same moment", m["contention"],
        lambda c: (f"{stamp}: the representative {c} layers in {ranks} processes at once, "
                   f"{m['class_rates_corun'][c] / 1e9:.4g} G/s per rank, over one alone, "
                   f"{m['class_rates'][c] / 1e9:.4g} G/s"))


def write_machine(doc: Mapping[str, Any], directory: str) -> str:
    """Validate and write ``directory/NAME.yaml`` atomically; returns the path."""
    path = os.path.join(directory, f"{doc['name']}.yaml")
    parse_machine(doc, path, first_precision(doc, path))   # never write a file the planner
                                                           # would reject (every precision)
    header = ("# Written by `hpcdl plan --calibrate`: every figure is a measurement on this\n"
              "# machine (or a stated assumption); `measured:` keeps the raw numbers.\n")
    atomic_write_text(path, header + yaml.safe_dump(dict(doc), sort_keys=False, width=100))
    return path


def calibrate_across_hosts(args: argparse.Namespace, directory: str,
                           precision: str = BASE_PRECISION) -> int:
    """``hpcdl plan --calibrate`` launched across hosts: the node's figures from the file
    already in ``directory`` (or measured by world rank 0 while the others sleep), the network
    measured by one rank per host; world rank 0 writes the file."""
    from mpi4py import MPI

    from hpcdl.topology import split_nodes

    world = MPI.COMM_WORLD
    node = split_nodes(world)
    ranks_per_node = world.allreduce(node.size, op=MPI.MAX)
    hosts = world.allreduce(1 if node.rank == 0 else 0)
    node.Free()
    if hosts < 2:
        if world.rank == 0:
            print(f"hpcdl plan --calibrate: the {world.size} ranks share one host; run it "
                  "without mpiexec on one node, or across hosts (one rank per host) to "
                  "measure the network", file=sys.stderr)
        return 2
    old = os.path.join(directory, "local.yaml")
    previous = kept_machine_doc(directory) if world.rank == 0 else None
    if previous is not None:
        print(f"node figures kept from {old}; measuring the network", flush=True)
    base = world.bcast(previous, root=0)
    if base is None:   # every rank: rank 0 measures the node, the others sleep until it has
        if world.rank == 0:
            print(f"no {old}: measuring this node first (the other ranks wait)", flush=True)
            base = machine_document(measure(quick=args.quick, batch=args.batch_per_rank,
                                            allreduce=False, precision=precision), None)
        sleeping_barrier(world)
        base = world.bcast(base, root=0)
    net = network_calibration(node_gamma(base, ranks_per_node),
                              repeats=3 if args.quick else 5)
    if world.rank != 0:
        return 0
    return write_and_show(with_network(base, net), directory, ("network",))


def write_and_show(doc: dict, directory: str, shown: Sequence[str]) -> int:
    """Write the machine file and print its ``shown`` sections: 0, or 2 after one line saying
    why it could not be written."""
    try:
        path = write_machine(doc, directory)
    except OSError as exc:
        print(f"hpcdl plan --calibrate: cannot write {directory}: {exc}; use --machines-dir",
              file=sys.stderr)
        return 2
    print(yaml.safe_dump({k: doc[k] for k in shown}, sort_keys=False, width=100))
    print(f"wrote {path}")
    return 0


def check_calibrate_inputs(args: argparse.Namespace, directory: str) -> str:
    """What ``--calibrate`` would otherwise find bad after minutes of measuring: the batch, the
    precision (hpcdl.plan.cpu.measurable_precision, returned resolved), the directory it
    writes (on one node) and the machine file it keeps figures from."""
    precision = measurable_precision(getattr(args, "precision", None) or BASE_PRECISION,
                                     "--calibrate")
    if args.batch_per_rank < 1:
        raise BadInputError(f"--calibrate: --batch-per-rank {args.batch_per_rank}: need at "
                            f"least 1 image per rank")
    if launched_world_size() <= 1:
        try:
            os.makedirs(directory, exist_ok=True)
            with tempfile.TemporaryFile(dir=directory):
                pass
        except OSError as exc:
            raise BadInputError(f"--calibrate: cannot write {directory} ({exc}); use "
                                f"--machines-dir DIR") from None
    kept_machine_doc(directory)
    return precision


def kept_machine_doc(directory: str) -> dict | None:
    """``directory/local.yaml`` as a mapping (the figures a calibration keeps), None when
    there is none; unreadable or not a mapping is bad input."""
    old = os.path.join(directory, "local.yaml")
    if not os.path.exists(old):
        return None
    try:
        with open(old, encoding="utf-8") as f:
            kept = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as exc:
        raise BadInputError(f"--calibrate: {old} is unreadable ({exc}); move it away to "
                            f"measure afresh") from None
    if not isinstance(kept, dict):
        raise BadInputError(f"--calibrate: {old} is not a machine file (a YAML mapping); "
                            f"move it away to measure afresh")
    return kept


def calibrate_command(args: argparse.Namespace) -> int:
    directory = args.machines_dir or user_machines_dir()
    precision = check_calibrate_inputs(args, directory)
    if launched_world_size() > 1:
        return calibrate_across_hosts(args, directory, precision)
    previous = kept_machine_doc(directory)
    if shutil.which("mpiexec") is None:
        print("hpcdl plan --calibrate: mpiexec not found; allreduce figures are kept or assumed",
              file=sys.stderr)
    m = measure(quick=args.quick, batch=args.batch_per_rank, precision=precision)
    doc = machine_document(m, previous)
    written = write_and_show(doc, directory, [k for k in ("node", "compute", "rates",
                                                          "intra_node", "data", "cpu")
                                              if k in doc])
    if written == 0 and "allreduce" not in m:
        print("hpcdl plan --calibrate: warning: allreduce figures not measured (see above)",
              file=sys.stderr)
    return written
