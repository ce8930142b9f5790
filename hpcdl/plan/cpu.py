"""Which CPU a machine file was measured on, and a warning when it is used on another one:
a calibrated file holds rates of *its* CPU (the vector ISA sets the convolution rates, the
memory system the passes), so it records ``lscpu``'s model name, torch's CPU capability and
the flags that move the rates (docs/planner.md, "The CPU a file describes").
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hpcdl.cpus import bf16_native, cpu_capability, cpu_flags, cpu_model_name
from hpcdl.errors import BadInputError
from hpcdl.train.config import resolve_precision

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


def measurable_precision(requested: str, command: str) -> str:
    """The compute dtype ``command`` (``--calibrate``, ``--validate``) measures here for
    ``--precision requested``, resolved as a run resolves ``train.precision`` (``auto``: bf16
    only where :func:`hpcdl.cpus.bf16_native`). bf16 without native bf16 is bad input:
    emulated bf16 runs several times slower than the hardware a bf16 plan is for, so rates or
    steps measured that way would mislead."""
    native = bf16_native()
    precision = resolve_precision(requested, native)
    if precision == "bfloat16" and not native:
        raise BadInputError(
            f"{command} --precision bfloat16: this CPU ({cpu_model_name()}, torch capability "
            f"{cpu_capability()}) has no native bf16 (AVX512-BF16 or AMX with torch at "
            "AVX-512); emulated bf16 rates would mislead: measure bfloat16 on a CPU that has "
            "it (Cooper Lake, Sapphire Rapids, Zen 4), or float32 here")
    return precision
