"""Which CPU a machine file was measured on, and a warning when it is used on another one:
a calibrated file holds rates of *its* CPU (the vector ISA sets the convolution rates, the
memory system the passes), so it records ``lscpu``'s model name, torch's CPU capability and
the flags that move the rates (docs/planner.md, "The CPU a file describes").
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hpcdl.cpus import cpu_capability, cpu_flags, cpu_model_name

#: CPU flags that change the rates a calibration measures.
RELEVANT_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16",
                  "amx_tile")


def cpu_identity() -> dict[str, Any]:
    """This CPU as a machine file records it."""
    flags = cpu_flags()
    return {"model_name": cpu_model_name(), "capability": cpu_capability(),
            "flags": [f for f in RELEVANT_FLAGS if f in flags]}


def cpu_mismatch(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> str | None:
    """What differs between the CPU a file was measured on and ``current``; None if nothing."""
    diffs = []
    for key, label in (("model_name", "model"), ("capability", "torch CPU capability")):
        if recorded.get(key) and str(recorded[key]) != str(current.get(key)):
            diffs.append(f"{label} {recorded[key]!r} vs {current.get(key)!r} here")
    if "flags" in recorded:
        was, now = set(recorded.get("flags") or []), set(current.get("flags") or [])
        if was != now:
            gained, lost = sorted(now - was), sorted(was - now)
            diffs.append("flags " + ", ".join([f"+{f}" for f in gained] + [f"-{f}" for f in lost])
                         + " here")
    return "; ".join(diffs) or None


def cpu_warning(machine: Any) -> str | None:
    """A warning when a calibrated machine file describes another CPU than this one."""
    if not machine.calibrated:
        return None
    if not machine.cpu:
        return (f"warning: {machine.path} records no CPU; its rates may be another machine's: "
                "recalibrate with `hpcdl plan --calibrate`")
    diff = cpu_mismatch(machine.cpu, cpu_identity())
    if diff is None:
        return None
    return (f"warning: {machine.path} was calibrated on another CPU ({diff}); its rates "
            "describe that CPU: recalibrate here with `hpcdl plan --calibrate`")
