"""Gradient communication: one communicator, passed explicitly (docs/comm.md).

    comm = hpcdl.comm.init("auto")          # or "mpi", "ring", "shm", "gloo", "ccl"
    comm.allreduce_(grads)                  # averaged in place, fused into flat buckets

``init`` (and MPI_Init when importing this package starts MPI) runs under the start-up bound
(hpcdl/debug/startup.py). It installs fail-fast (hpcdl/debug/faults.py; ``fail_fast=False``
to skip) and the stall watchdog (hpcdl/debug/stall.py; ``watchdog=False``), so every entry
point built on it has them; their defaults and behaviour: docs/debugging.md, sections 4 and 5.

Backends (one algorithm each): ``mpi`` (MPI_Allreduce), ``ring`` (bandwidth-optimal ring,
Patarasuk & Yuan 2009), ``shm`` (hierarchical: node-shared-memory reduce-scatter, then
across nodes), ``gloo`` (a torch.distributed process group) and ``ccl`` (Intel oneCCL).
"""
from __future__ import annotations

import importlib
import time

import torch

from hpcdl.debug import import_mpi_within_bound

MPI = import_mpi_within_bound()  # MPI_Init under the start-up bound (HPCDL_STARTUP_TIMEOUT_S)

from hpcdl.buckets import LAST_BUCKET_BYTES  # noqa: E402
from hpcdl.comm.base import (  # noqa: E402 - after MPI_Init, which they need
    DEFAULT_BUCKET_BYTES,
    CollectiveMismatchError,
    Communicator,
)
from hpcdl.debug import (  # noqa: E402
    injected_pause,
    install_fail_fast,
    startup_bound,
    watch_collectives,
)
from hpcdl.errors import BadInputError  # noqa: E402
from hpcdl.topology import auto_backend_name, split_nodes  # noqa: E402

__all__ = ["BACKENDS", "BackendError", "CollectiveMismatchError", "Communicator",
           "auto_backend", "init", "largest_node"]

#: name -> "module:class"; imported on demand so e.g. gloo costs nothing unless asked for.
BACKENDS = {
    "mpi": "hpcdl.comm.mpi:MPICommunicator",
    "ring": "hpcdl.comm.ring:RingCommunicator",
    "shm": "hpcdl.comm.shm:SharedMemoryCommunicator",
    "gloo": "hpcdl.comm.gloo:GlooCommunicator",
    "ccl": "hpcdl.comm.ccl:CCLCommunicator",
}


class BackendError(BadInputError, ValueError):
    """An unknown backend name or wire dtype (the same on every rank)."""


def largest_node(world: MPI.Intracomm, ranks_per_node: int | None = None) -> int:
    """The most ranks of ``world`` on one node (``ranks_per_node``, else
    HPCDL_RANKS_PER_NODE, else MPI's shared-memory groups). Collective over ``world``."""
    node = split_nodes(world, ranks_per_node)
    try:
        return world.allreduce(node.size, op=MPI.MAX)
    finally:
        node.Free()


def auto_backend(world: MPI.Intracomm, ranks_per_node: int | None = None) -> str:
    """What ``init(backend="auto")`` (or ``"rule"``) opens over ``world``: the rule, without
    timing anything (a recipe's ``comm.backend: auto`` times candidates first,
    hpcdl/comm/trial.py). Collective over ``world``."""
    return auto_backend_name(largest_node(world, ranks_per_node))


def init(backend: str = "auto", world: MPI.Intracomm | None = None,
         bucket_bytes: int = DEFAULT_BUCKET_BYTES,
         wire_dtype: torch.dtype | str | None = None,
         ranks_per_node: int | None = None, fail_fast: bool = True,
         watchdog: bool = True,
         last_bucket_bytes: int | None = LAST_BUCKET_BYTES) -> Communicator:
    """Build the communicator for ``world`` (default COMM_WORLD). Collective over ``world``.

    ``bucket_bytes``: the fusion bucket of :meth:`Communicator.allreduce_`; ``wire_dtype=
    torch.bfloat16`` sends bf16 and sums in fp32. ``last_bucket_bytes``: the gradient
    reducer's first-layers bucket on this communicator (None: none; hpcdl/buckets.py).
    ``ranks_per_node=k``: groups of k consecutive world ranks act as nodes (None:
    ``HPCDL_RANKS_PER_NODE``, else MPI's shared-memory groups).
    ``fail_fast=False`` leaves the excepthooks alone; ``watchdog=False`` installs no stall
    watchdog (``hpcdl.debug.watch_collectives(comm, run_dir)`` replaces the default one).
    Unknown names raise :class:`BackendError`; a backend whose optional library is missing
    raises its own :class:`~hpcdl.errors.BadInputError` saying how to get it.
    """
    world = world if world is not None else MPI.COMM_WORLD
    # Until the communicator exists (a shared window, oneCCL's or gloo's rendezvous, the
    # stall watchdog's own allgather) nothing else watches this rank: bounded here.
    with startup_bound(f"creating the {backend!r} communicator (hpcdl.comm.init)"):
        comm = _init(backend, world, bucket_bytes, wire_dtype, ranks_per_node, fail_fast,
                     watchdog)
    comm.last_bucket_bytes = last_bucket_bytes
    return comm


def _init(backend: str, world: MPI.Intracomm, bucket_bytes: int,
          wire_dtype: torch.dtype | str | None, ranks_per_node: int | None, fail_fast: bool,
          watchdog: bool) -> Communicator:
    _, hold_s = injected_pause(MPI.COMM_WORLD.Get_rank(), "startup")
    if hold_s:  # HPCDL_INJECT=RANK:startup:sleep=S: a rank held at start-up (tests)
        time.sleep(hold_s)
    if fail_fast and MPI.COMM_WORLD.Get_size() > 1:
        # COMM_WORLD, not ``world``: a sub-communicator's abort must still end every rank.
        install_fail_fast(MPI.COMM_WORLD)
    name = backend.lower()
    if name in ("auto", "rule"):
        name = auto_backend(world)
    if name not in BACKENDS:
        raise BackendError(f"unknown comm backend {backend!r}; choose auto or one of "
                         f"rule, {', '.join(BACKENDS)}")
    if isinstance(wire_dtype, str):
        names = {"float32": None, "fp32": None, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
        if wire_dtype.lower() not in names:
            raise BackendError(f"wire_dtype {wire_dtype!r}: use float32 or bfloat16")
        wire_dtype = names[wire_dtype.lower()]
    module_name, class_name = BACKENDS[name].split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    comm = cls(world=world, bucket_bytes=bucket_bytes, wire_dtype=wire_dtype,
               ranks_per_node=ranks_per_node)
    if watchdog:
        watch_collectives(comm)
    return comm
