"""hpcdl: large-batch ImageNet training on CPU supercomputers with MPI.

Your own training loop needs four names (docs/own_loop.md)::

    comm = hpcdl.comm.init()
    optimizer = hpcdl.DistributedOptimizer(optimizer, model, comm)
    hpcdl.broadcast_parameters(model, comm)
    hpcdl.broadcast_optimizer_state(optimizer, comm)

They are imported on first use (PEP 562), so ``import hpcdl`` stays free of torch and MPI.
"""
from __future__ import annotations

import importlib
from typing import Any

from hpcdl.mpi_library import set_wheel_mpi_root

__version__ = "0.1.0"

# Before anything imports mpi4py.MPI: the Intel MPI wheel needs I_MPI_ROOT under srun
# (docs/mpi.md). Standard library only: `import hpcdl` stays free of torch and MPI.
set_wheel_mpi_root()

#: public name -> module that defines it, imported when first asked for
_LAZY = {
    "DistributedOptimizer": "hpcdl.train.distributed",
    "broadcast_parameters": "hpcdl.train.distributed",
    "broadcast_optimizer_state": "hpcdl.train.distributed",
    "setup_logging": "hpcdl.train.distributed",
}
_SUBMODULES = {"comm", "data", "models", "optim", "train"}

__all__ = ["__version__", *_LAZY, *sorted(_SUBMODULES)]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"hpcdl.{name}")
    raise AttributeError(f"module 'hpcdl' has no attribute {name!r}")
