"""The one JSON convention every ``hpcdl bench NAME --json FILE`` writes, and its table.

    {"bench": NAME, "machine": {cpu, cores, ranks, mpi, torch}, "command": "...",
     "results": [records], "ratios": {name: value}}

docs/performance.md quotes the ratios; the records carry the raw measurements.
"""
from __future__ import annotations

import json
import os
import platform
import shlex
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from hpcdl.cpus import cpu_model_name
from hpcdl.io import atomic_write_text


def cpu_model() -> str:
    """The CPU's model name (``lscpu``, then /proc/cpuinfo; platform's name as a last resort)."""
    return cpu_model_name(fallback=platform.processor() or platform.machine())


def machine_info(ranks: int = 1) -> dict[str, Any]:
    """What a reader needs to compare numbers across machines."""
    import torch

    from hpcdl.train.trainer import bf16_supported

    try:
        from mpi4py import MPI

        mpi = MPI.Get_library_version().splitlines()[0].strip()
    except Exception as exc:  # noqa: BLE001 - report whatever stopped MPI from loading
        mpi = f"unavailable ({exc})"
    return {
        "cpu": cpu_model(),
        # AVX2 vs AVX512 (and bf16) changes every kernel's speed and rounding: always record it.
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "bf16_native": bf16_supported(),   # False: bf16 autocast is emulated (slow) here
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


def check_model_argument(bench: str, name: str) -> None:
    """``--model NAME`` must name a registered model: one line before any work (bad input,
    exit 2), not a traceback after the data is prepared."""
    from hpcdl.models import list_models

    if name not in list_models():
        raise SystemExit(f"hpcdl bench {bench}: --model {name!r} is not a known model; known: "
                         f"{', '.join(list_models())}")
