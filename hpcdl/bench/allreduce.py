"""Allreduce bandwidth of every backend against MPI_Allreduce and gloo, measured in one run.

    mpiexec -n P hpcdl bench allreduce --backends mpi,ring,shm,gloo,ccl --sizes 1M,16M,100M \\
        --json allreduce.json

nccl-tests' definitions (``algbw = bytes / time``, ``busbw = algbw * 2(p-1)/p``, GB = 10^9,
sizes in decimal bytes of fp32), the slowest rank's median time, buffers from ``comm.empty``
reduced in place as the reducer does; ``shm-copyin`` is ``shm`` on an ordinary tensor,
``default`` is ``backend="auto"``, ``memcpy`` one core's copy bandwidth. Driver mode (run
without mpiexec): ``--site-mpi NAME=PREFIX`` also times each site MPI's ``MPI_Allreduce``
under every algorithm its documentation offers (:data:`SITE_TUNINGS`; ratios against its
best), ``--ccl-tunings`` the ``ccl`` backend under each of :func:`ccl_tunings`; one JSON.
docs/performance.md, "Allreduce".
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from typing import Any

from hpcdl.mpi_library import RANK_ENV, WORLD_SIZE_ENV, launched_rank

COMMAND = "allreduce"
HELP = "allreduce bandwidth of mpi/ring/shm/gloo/ccl vs MPI_Allreduce (nccl-tests busbw)"
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


def parse_sizes(text: str) -> list[int]:
    """``--sizes``: positive byte counts, or one line naming the bad one (bad input, exit 2)."""
    sizes = []
    for item in (s for s in text.split(",") if s.strip()):
        try:
            sizes.append(parse_size(item))
        except argparse.ArgumentTypeError as exc:
            raise SystemExit(f"hpcdl bench allreduce: --sizes {text!r}: {exc}") from None
        if sizes[-1] < 4:  # one fp32 element at least
            raise SystemExit(f"hpcdl bench allreduce: --sizes {text!r}: {item.strip()!r} is "
                             f"under one fp32 element (4 bytes); use e.g. 1M, 16M, 100M")
    if not sizes:
        raise SystemExit(f"hpcdl bench allreduce: --sizes {text!r}: name at least one size")
    return sizes


def size_label(nbytes: int) -> str:
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes}B"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backends", default=None,
                        help="comma-separated backends, plus default, shm-copyin and memcpy "
                             "(default: mpi,ring,shm,gloo, and ccl where oneCCL is found)")
    parser.add_argument("--sizes", default="1M,16M,100M",
                        help="comma-separated bytes of fp32 data (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs (median; >= 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs first")
    parser.add_argument("--site-mpi", action="append", default=[], metavar="NAME=PREFIX",
                        help="driver mode: also time MPI_Allreduce of the venv PREFIX, every "
                             f"algorithm; NAME: {', '.join(SITE_TUNINGS)} (repeatable)")
    parser.add_argument("--ccl-tunings", action="store_true",
                        help="driver mode: also time ccl under each oneCCL setting")
    parser.add_argument("--np", type=int, default=2,
                        help="driver mode: ranks of every launch (default: %(default)s)")
    parser.add_argument("--only-listed", action="store_true",
                        help="time only --backends (what the driver asks of a site MPI)")
    parser.add_argument("--json", metavar="FILE", help="write the JSON report here")


# Each MPI's own one-node allreduce choices, from its documentation: Intel MPI Developer
# Reference "I_MPI_ADJUST Family Environment Variables" (1-12 on 2021.x), Open MPI's
# coll/tuned component (0 = its own decision; 1-6 fixed algorithms, dynamic rules on), MPICH's
# CVAR list (MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM). A baseline gets its best, not its default.
SITE_TUNINGS: dict[str, list[dict[str, str]]] = {
    "impi": [{}] + [{"I_MPI_ADJUST_ALLREDUCE": str(k)} for k in range(1, 13)],
    "ompi": [{}] + [{"OMPI_MCA_coll_tuned_use_dynamic_rules": "1",
                     "OMPI_MCA_coll_tuned_allreduce_algorithm": str(k)} for k in range(1, 7)],
    "mpich": [{}] + [{"MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM": name}
                     for name in ("recursive_doubling", "reduce_scatter_allgather", "ring",
                                  "k_reduce_scatter_allgather", "recexch")],
}
# What each needs to start on one node as a user here would start it.
SITE_ENV = {"impi": {"I_MPI_FABRICS": "shm"},
            "ompi": {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"},
            "mpich": {}}


#: oneCCL's own settings and their defaults (the row's ``tuning`` shows each).
CCL_SETTINGS = {"CCL_ATL_TRANSPORT": "ofi", "CCL_ATL_SHM": "0", "CCL_WORKER_COUNT": "1",
                "CCL_WORKER_AFFINITY": "auto", "CCL_WORKER_OFFLOAD": "1", "CCL_YIELD": "pause"}


def ccl_tunings(np: int, cores: int) -> list[dict[str, str]]:
    """The oneCCL settings ``--ccl-tunings`` compares (oneCCL developer guide, "Execution of
    Communication Operations", "Environment Variables"): its defaults (with hpcdl's one-host
    ``CCL_ATL_SHM=1``), OFI without the shm provider, the MPI transport, workers pinned to
    the first cores instead of the last ("auto"), two workers per rank, no worker thread (the
    caller progresses), and workers that sleep instead of spinning with ``pause``."""
    first = ",".join(str(i % cores) for i in range(np))
    two = ",".join(str(i % cores) for i in range(2 * np))
    return [{}, {"CCL_ATL_SHM": "0"}, {"CCL_ATL_TRANSPORT": "mpi"},
            {"CCL_WORKER_AFFINITY": first},
            {"CCL_WORKER_COUNT": "2", "CCL_WORKER_AFFINITY": two},
            {"CCL_WORKER_OFFLOAD": "0"}, {"CCL_YIELD": "sleep"}]


def ccl_settings_label() -> str:
    """The oneCCL settings in effect in this process (after hpcdl's one-host defaults)."""
    return " ".join(f"{k}={os.environ.get(k, v)}" for k, v in CCL_SETTINGS.items())


def default_backends() -> str:
    """mpi,ring,shm,gloo -- and ccl where oneCCL's library is found (else a note why not)."""
    from hpcdl.comm.ccl import missing_reason

    missing = missing_reason()
    if missing is None:
        return "mpi,ring,shm,gloo,ccl"
    if launched_rank() == 0:
        print(f"ccl left out: {missing}", flush=True)
    return "mpi,ring,shm,gloo"


def site_launcher_args(name: str, np: int) -> list[str]:
    """Open MPI refuses more ranks than cores without ``--oversubscribe``, and with it turns on
    yield-when-idle (slower polling): pass it only when the ranks really oversubscribe."""
    return ["--oversubscribe"] if name == "ompi" and np > (os.cpu_count() or 1) else []


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

    from hpcdl.plan.class_rates import median_time

    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    return median_time(lambda: dst.copy_(src), repeats)


def measure_backend(name: str, sizes: list[int], repeats: int, warmup: int) -> list[dict]:
    import torch

    import hpcdl.comm

    backend = {"default": "auto", "shm-copyin": "shm"}.get(name, name)
    records = []
    with hpcdl.comm.init(backend) as comm:
        for nbytes in sizes:
            numel = nbytes // 4
            buffer = (torch.empty(numel, dtype=torch.float32)  # not window memory
                      if name == "shm-copyin" else comm.empty(numel, torch.float32))
            buffer.fill_(comm.rank + 1.0)
            seconds = time_allreduce(comm, buffer, repeats, warmup)
            records.append(bandwidth_record(name, comm.backend, numel * 4, comm.size, seconds))
            if comm.backend == "ccl":
                records[-1]["tuning"] = ccl_settings_label()
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
    ratio(f"ccl_vs_mpi_busbw_{big}", ("ccl", large), ("mpi", large))
    ratio(f"ccl_vs_default_busbw_{big}", ("ccl", large), ("default", large))
    defaults = [r["algorithm"] for r in records if r["backend"] == "default"]
    if defaults:
        ratios["default_backend"] = defaults[0]
    return ratios


def parse_site_mpi(items: list[str]) -> list[tuple[str, str]]:
    """``["impi=/opt/venvs/impi"]`` -> ``[("impi", "/opt/venvs/impi")]``, checked."""
    sites = []
    for item in items:
        name, sep, prefix = item.partition("=")
        name = {"openmpi": "ompi", "intel": "impi"}.get(name.strip().lower(), name.strip().lower())
        if not sep or name not in SITE_TUNINGS:
            raise SystemExit(f"hpcdl bench allreduce: --site-mpi {item!r}: write NAME=PREFIX with"
                             f" NAME one of {', '.join(SITE_TUNINGS)}")
        for tool in ("mpiexec", "python"):
            if not os.access(os.path.join(prefix, "bin", tool), os.X_OK):
                raise SystemExit(f"hpcdl bench allreduce: --site-mpi {item!r}: no "
                                 f"{os.path.join(prefix, 'bin', tool)}; PREFIX is a venv with "
                                 "hpcdl and that MPI (tests/mpi_env.sh builds one)")
        sites.append((name, prefix))
    return sites


def launch_bench(mpiexec: list[str], python: str, np: int, bench_args: list[str],
                 env: dict[str, str]) -> list[dict]:
    """One ``mpiexec -n np python -m hpcdl.cli.main bench allreduce ...``; its records, each
    with the MPI library it ran under."""
    from hpcdl.results import run_bench_json

    try:
        report = run_bench_json(np, ["allreduce", *bench_args], 1800, mpiexec=mpiexec,
                                python=python, env=env)
    except RuntimeError as exc:
        # a failed run, not bad input: exit 1 (hpcdl.cli.main makes a message-only exit 2)
        print(f"hpcdl bench allreduce: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    return [dict(r, mpi=report["machine"]["mpi"]) for r in report["results"]]


def site_ratios(records: list[dict], names: list[str], sizes: list[int]) -> dict[str, Any]:
    """``default_vs_NAME_busbw_100MB`` against each site MPI's best tuning at the largest size."""
    large = max(sizes)
    ours = {r["bytes"]: r["busbw_GBps"] for r in records if r["backend"] == "default"}
    ratios: dict[str, Any] = {}
    for name in names:
        rows = [r for r in records if r["backend"] == name and r["bytes"] == large]
        best = max(rows, key=lambda r: r["busbw_GBps"], default=None)
        if best and best["busbw_GBps"] > 0 and ours.get(large):
            ratios[f"default_vs_{name}_busbw_{size_label(large)}"] = \
                ours[large] / best["busbw_GBps"]
            ratios[f"{name}_best_tuning"] = best["tuning"]
    return ratios


def run_driver(args: argparse.Namespace, sizes: list[int]) -> int:
    """Launch hpcdl's backends, every site MPI's tunings and every oneCCL setting, then
    merge one report."""
    from hpcdl.results import bench_report, emit

    sites = parse_site_mpi(args.site_mpi)
    if args.np < 1:
        raise SystemExit(f"hpcdl bench allreduce: --np {args.np}: launch at least 1 rank")
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        raise SystemExit("hpcdl bench allreduce: no mpiexec on PATH for hpcdl's own run")
    common = ["--sizes", args.sizes, "--repeats", str(args.repeats), "--warmup",
              str(args.warmup)]
    records = launch_bench([mpiexec], sys.executable, args.np,
                           ["--backends", args.backends, *common], {})
    for name, prefix in sites:
        for tuning in SITE_TUNINGS[name]:
            print(f"measuring {name} {tuning or '(its default)'}", flush=True)
            rows = launch_bench(
                [os.path.join(prefix, "bin", "mpiexec"), *site_launcher_args(name, args.np)],
                os.path.join(prefix, "bin", "python"), args.np,
                ["--backends", "mpi", "--only-listed", *common], {**SITE_ENV[name], **tuning})
            label = " ".join(f"{k}={v}" for k, v in tuning.items()) or "default"
            records += [dict(r, backend=name, tuning=label) for r in rows]
    if args.ccl_tunings:
        records += measure_ccl_tunings(mpiexec, args.np, common)
    ratios = {**bandwidth_ratios(records, sizes),
              **site_ratios(records, [name for name, _ in sites], sizes),
              **ccl_tuning_ratios(records, sizes)}
    report = bench_report("allreduce", records, ratios, ranks=args.np)
    emit(report, (*COLUMNS, "tuning"), args.json)
    return 0


def measure_ccl_tunings(mpiexec: str, np: int, common: list[str]) -> list[dict]:
    """``ccl`` alone under each of :func:`ccl_tunings`, one launch each (oneCCL reads its
    settings once, when the library loads); rows ``ccl-tuned``, labelled by setting."""
    records = []
    for tuning in ccl_tunings(np, os.cpu_count() or 1):
        print(f"measuring ccl {tuning or '(defaults)'}", flush=True)
        records += [dict(r, backend="ccl-tuned") for r in launch_bench(
            [mpiexec], sys.executable, np, ["--backends", "ccl", "--only-listed", *common],
            tuning)]
    return records


def ccl_tuning_ratios(records: list[dict], sizes: list[int]) -> dict[str, Any]:
    """The best oneCCL setting at the largest size, against its defaults and MPI_Allreduce."""
    large = max(sizes)
    rows = [r for r in records if r["backend"] == "ccl-tuned" and r["bytes"] == large]
    best = max(rows, key=lambda r: r["busbw_GBps"], default=None)
    if best is None or best["busbw_GBps"] <= 0:
        return {}
    ratios: dict[str, Any] = {"ccl_best_tuning": best["tuning"]}
    for name in ("mpi", "default"):
        base = [r for r in records if r["backend"] == name and r["bytes"] == large]
        if base and base[0]["busbw_GBps"] > 0:
            ratios[f"ccl_best_vs_{name}_busbw_{size_label(large)}"] = \
                best["busbw_GBps"] / base[0]["busbw_GBps"]
    return ratios


def run(args: argparse.Namespace) -> int:
    sizes = parse_sizes(args.sizes)
    if args.backends is None:
        args.backends = default_backends()
    if args.site_mpi or args.ccl_tunings:
        if any(key in os.environ for key in WORLD_SIZE_ENV + RANK_ENV):
            raise SystemExit("hpcdl bench allreduce --site-mpi/--ccl-tunings is a driver that "
                             "launches mpiexec itself: run it without mpiexec, with --np P")
        return run_driver(args, sizes)
    from mpi4py import MPI

    from hpcdl.results import bench_report, emit

    world = MPI.COMM_WORLD
    if args.repeats < 5:
        raise SystemExit(f"hpcdl bench allreduce: --repeats {args.repeats} < 5 (median of >= 5)")
    names = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not args.only_listed:
        names += [extra for extra in ("default", "shm-copyin") if extra not in names]
    records = []
    for name in names:
        records += measure_backend(name, sizes, args.repeats, args.warmup)
        if world.rank == 0:
            print(f"measured {name}", flush=True)
    if world.rank == 0 and not args.only_listed:
        seconds = time_memcpy(max(sizes), args.repeats)
        records.append(bandwidth_record("memcpy", "torch copy_, 1 core", max(sizes), 1, seconds))
        # memcpy has no peers: its busbw is the copy bandwidth itself, the comparison point
        records[-1]["busbw_GBps"] = records[-1]["algbw_GBps"]
    if world.rank == 0:
        report = bench_report("allreduce", records, bandwidth_ratios(records, sizes),
                              ranks=world.size)
        emit(report, (*COLUMNS, "tuning") if any("tuning" in r for r in records) else COLUMNS,
             args.json)
    world.Barrier()
    return 0
