"""The one JSON convention for measured results, and its table: what every ``hpcdl bench NAME
--json FILE`` writes and ``hpcdl plan --validate`` writes and reads back (it reads bench results
only as this JSON, never by importing the bench).

    {"bench": NAME, "machine": {cpu, cores, ranks, mpi, torch}, "command": "...",
     "results": [records], "ratios": {name: value}}

The records carry the raw measurements; the docs' measured tables are generated from the files
kept in docs/results/ (``hpcdl bench report --docs``, :mod:`hpcdl.figures`), never typed.
"""
from __future__ import annotations

import contextlib
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from hpcdl.cpus import bf16_native, cpu_capability, cpu_model_name
from hpcdl.io import atomic_write, atomic_write_text

#: The planner's goal: predicted ÷ measured step time inside this band (``hpcdl plan
#: --validate``'s ``within_15_percent``, the docs' planner tables).
PLAN_BAND = (0.85, 1.15)


def in_band(ratio: float) -> bool:
    return PLAN_BAND[0] <= ratio <= PLAN_BAND[1]


def machine_info(ranks: int = 1) -> dict[str, Any]:
    """What a reader needs to compare numbers across machines."""
    import torch

    try:
        from mpi4py import MPI

        mpi = MPI.Get_library_version().splitlines()[0].strip()
    except Exception as exc:  # noqa: BLE001 - report whatever stopped MPI from loading
        mpi = f"unavailable ({exc})"
    return {
        "cpu": cpu_model_name(fallback=platform.processor() or platform.machine()),
        # AVX2 vs AVX512 (and bf16) changes every kernel's speed and rounding: always record it.
        "cpu_capability": cpu_capability(),
        "bf16_native": bf16_native(),   # False: bf16 autocast is emulated (slow) here
        "cores": os.cpu_count(),
        "ranks": ranks,
        "mpi": mpi,
        "torch": torch.__version__,
        "host": platform.node(),
        "python": platform.python_version(),
    }


def command_line() -> str:
    """The command as the user typed it, for copying into docs/performance.md."""
    argv = [os.path.basename(sys.argv[0])] + sys.argv[1:]
    return " ".join(shlex.quote(a) for a in argv)


def bench_report(
    bench: str,
    results: Sequence[Mapping[str, Any]],
    ratios: Mapping[str, Any],
    ranks: int = 1,
) -> dict[str, Any]:
    return {
        "bench": bench,
        "machine": machine_info(ranks),
        "command": command_line(),
        "results": [dict(r) for r in results],
        "ratios": dict(ratios),
    }


def write_json(path: str, report: Mapping[str, Any]) -> None:
    atomic_write_text(path, json.dumps(report, indent=2, sort_keys=False) + "\n")


def format_table(records: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
    """A plain fixed-width table: floats to 4 significant digits, one record a row."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        return str(value)

    rows = [[cell(r.get(c, "")) for c in columns] for r in records]
    widths = [max(len(c), *(len(row[i]) for row in rows)) if rows else len(c)
              for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(lines)


def emit(report: Mapping[str, Any], columns: Sequence[str], json_path: str | None) -> None:
    """Print the table and ratios (call on rank 0 only) and write the JSON if asked."""
    print(format_table(report["results"], columns))
    for name, value in report["ratios"].items():
        print(f"{name}: {value:.4g}" if isinstance(value, float) else f"{name}: {value}")
    if json_path:
        write_json(json_path, report)
        print(f"wrote {json_path}")


def run_bench_json(procs: int, bench_args: Sequence[str], timeout_s: float, *,
                   mpiexec: Sequence[str] = ("mpiexec",), python: str = sys.executable,
                   env: Mapping[str, str] | None = None,
                   announce: bool = False) -> dict[str, Any]:
    """``MPIEXEC -n PROCS PYTHON -m hpcdl.cli.main bench BENCH_ARGS --json F`` in a temporary
    directory (``env`` over this process's environment), F parsed; a failed run is a
    RuntimeError with its exit status and the tail of its output."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bench.json")
        cmd = [*mpiexec, "-n", str(procs), python, "-m", "hpcdl.cli.main", "bench",
               *bench_args, "--json", out]
        if announce:
            print("running:", " ".join(cmd), flush=True)
        proc = subprocess.run(cmd, env={**os.environ, **(env or {})}, capture_output=True,
                              text=True, timeout=timeout_s)
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}): "
                               f"{(proc.stderr or proc.stdout)[-1000:]}")
        with open(out, encoding="utf-8") as f:
            return json.load(f)


@contextlib.contextmanager
def png_axes(path: str, figsize: tuple[float, float], dpi: int = 110,
             ncols: int = 1) -> Iterator[Any]:
    """Matplotlib axes (Agg: batch and login nodes have no display; ``ncols`` > 1: a row of
    them) whose figure is laid out and written to ``path`` as a PNG, atomically, when the
    block ends."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, ncols, figsize=figsize)
    try:
        yield ax
        fig.tight_layout()
        atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=dpi))
    finally:
        plt.close(fig)
