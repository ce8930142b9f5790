"""The run's compute dtype and the gradients' dtype on the wire, decided once at start and
agreed by every rank (Kalamkar et al., "A Study of BFLOAT16 for Deep Learning Training",
arXiv:1905.12322: master weights, gradients and optimizer state stay float32). The rules, the
measured speed-ups and why ``ccl`` sends bf16 only when asked: docs/training.md, "Precision".
"""
from __future__ import annotations

from typing import Any

from hpcdl.cpus import bf16_native, cpu_capability, cpu_model_name
from hpcdl.train.config import CommConfig, resolve_precision

__all__ = ["BF16_WIRE_BACKENDS", "agreed_precision", "describe", "planned_wire_dtype",
           "run_wire_dtype", "wire_dtype_for"]

#: backends that send bf16 and sum in float32 (docs/comm.md)
BF16_WIRE_BACKENDS = ("ring", "shm", "gloo")


def agreed_precision(requested: str, mpi_comm: Any = None,
                     native: bool | None = None) -> str:
    """``train.precision`` resolved on every rank of ``mpi_comm`` to the same dtype name
    (collective when ``requested`` is ``auto`` and ``mpi_comm`` is given). ``native``: this
    rank's fact (default :func:`hpcdl.cpus.bf16_native`; tests pass another CPU's)."""
    if requested != "auto":
        return requested
    mine = bf16_native() if native is None else native
    if mpi_comm is not None:
        from mpi4py import MPI

        mine = bool(mpi_comm.allreduce(int(mine), op=MPI.MIN))
    return resolve_precision(requested, mine)


def describe(requested: str, precision: str, native: bool | None = None) -> str:
    """The line the run logs at start: what was asked, what it is, and why."""
    native = bf16_native() if native is None else native
    cpu = f"{cpu_model_name()}, torch kernels {cpu_capability()}"
    if precision == "float32":
        why = ("every rank's CPU computes bf16 natively, but train.precision says float32"
               if native and requested == "float32" else
               "no native bf16 (AVX512-BF16 or AMX with torch at AVX-512) on every rank"
               if requested == "auto" else "train.precision says so")
    elif native:
        why = "native bf16 on every rank" if requested == "auto" else "train.precision says so"
    else:
        why = "train.precision: bfloat16 without native bf16 here: emulated, several times slower"
    return f"precision: {precision} ({requested}: {why}; {cpu}); master weights float32"


def wire_dtype_for(section: CommConfig, precision: str, backend: str) -> str:
    """``comm.wire_dtype`` (the recipe's ``comm`` section) resolved for a run computing in
    ``precision`` on ``backend``."""
    wire = section.wire_dtype
    if wire != "auto":
        return wire
    follows = (precision == "bfloat16" and section.algorithm == "sync"
               and not section.shard_update and backend in BF16_WIRE_BACKENDS)
    return "bfloat16" if follows else "float32"


def planned_wire_dtype(section: CommConfig, precision: str, ranks_per_node: int) -> str:
    """:func:`wire_dtype_for` without a running world (what ``hpcdl plan`` costs): a run
    computing in ``precision`` whose fullest node holds ``ranks_per_node`` ranks, its
    ``backend: auto`` named by the rule hpcdl.comm.auto_backend applies to a running world
    (hpcdl.topology.auto_backend_name)."""
    from hpcdl.topology import auto_backend_name

    backend = section.backend.lower()
    if backend == "auto":
        backend = auto_backend_name(ranks_per_node)
    return wire_dtype_for(section, precision, backend)


def run_wire_dtype(section: CommConfig, requested_precision: str, mpi_comm: Any,
                   backend: str | None = None) -> str:
    """The wire dtype to build the run's communicator with, for a run whose
    ``train.precision`` is ``requested_precision``, on ``backend`` (default the section's;
    ``auto`` and ``rule`` are asked of hpcdl.comm.auto_backend only when it matters; a
    recipe's ``auto`` passes the backend its trial chose). Collective."""
    if section.wire_dtype != "auto":
        return section.wire_dtype
    precision = agreed_precision(requested_precision, mpi_comm)
    backend = (backend or section.backend).lower()
    if precision == "bfloat16" and backend in ("auto", "rule"):
        from hpcdl.comm import auto_backend

        backend = auto_backend(mpi_comm)
    return wire_dtype_for(section, precision, backend)
