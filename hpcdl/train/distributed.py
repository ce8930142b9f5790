"""Your own training loop on hpcdl's pieces: Horovod's three calls, on the overlapped reducer.

    comm = hpcdl.comm.init()                                  # hvd.init()
    log = hpcdl.setup_logging(comm)                           # rank-aware: rank 0 talks
    optimizer = hpcdl.DistributedOptimizer(optimizer, model, comm)
    hpcdl.broadcast_parameters(model, comm)                   # every rank starts from rank 0
    hpcdl.broadcast_optimizer_state(optimizer, comm)
    for images, labels in my_batches:                         # this rank's share of the batch
        optimizer.zero_grad()
        loss_fn(model(images), labels).backward()             # buckets reduced during backward
        optimizer.step()                                      # wait, then the wrapped step

The design is Horovod's PyTorch binding (Sergeev & Del Balso, arXiv:1802.05799): a hook per
gradient launches the reduction when the gradient is ready; ``step()`` waits, then steps, so
LARS's trust ratio is taken on the averaged gradient (You et al., ICPP'18). Accumulation is
DDP's ``no_sync()`` (Li et al., VLDB 2020, §3.2.4). What differs from Horovod and DDP, and why:
docs/own_loop.md.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from hpcdl.comm.reducer import build_reducer
from hpcdl.io import Closing
from hpcdl.optim.wrapper import OptimizerWrapper

__all__ = ["DistributedOptimizer", "broadcast_optimizer_state", "broadcast_parameters",
           "setup_logging"]

NamedTensors = Iterable[tuple[str, torch.Tensor]]


def _named_parameters(model: torch.nn.Module | NamedTensors) -> list[tuple[str, torch.Tensor]]:
    if isinstance(model, torch.nn.Module):
        return list(model.named_parameters())
    named = list(model)
    if not all(isinstance(item, tuple) and len(item) == 2 for item in named):
        raise TypeError("DistributedOptimizer: pass the model, or model.named_parameters() "
                        "((name, tensor) pairs); a bare parameter list has no names to lay "
                        "out the buckets identically on every rank")
    return named


class DistributedOptimizer(OptimizerWrapper, Closing):
    """Wrap ``optimizer`` so that ``step()`` applies the world's average gradient.

    ``model`` is the module (or its ``named_parameters()``) whose gradients are averaged over
    ``comm``; every parameter of ``optimizer`` must be among them. ``bucket_bytes`` (default:
    the communicator's) and ``wire_dtype`` (default: the parameters') shape the buckets;
    ``shard_update=True`` shards the weight update (LARS or SGD only). Attributes the wrapper
    lacks (LARS's ``scale_momentum_``) are the wrapped optimizer's.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module | NamedTensors,
                 comm, *, bucket_bytes: int | None = None,
                 wire_dtype: torch.dtype | None = None, shard_update: bool = False) -> None:
        # No super().__init__: the groups, state and defaults are the wrapped optimizer's own
        # (the properties below), and the base constructor would overwrite them.
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("DistributedOptimizer: the optimizer is already wrapped")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"DistributedOptimizer: expected a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        named = _named_parameters(model)
        _check_covered(optimizer, named)
        self.optimizer = optimizer
        self.comm = comm
        # Registered before the reducer's hooks, so a second backward is refused before the
        # reducer packs anything into buckets that may still be on the wire.
        self._seen: set[int] = set()
        self._guards = [p.register_post_accumulate_grad_hook(self._one_backward_per_step)
                        for _, p in named if p.requires_grad]
        # One rank: the average is the rank's own gradient, nothing to communicate.
        self.reducer = build_reducer(comm, named, bucket_bytes=bucket_bytes,
                                     wire_dtype=wire_dtype, enabled=comm.size > 1,
                                     shard_update=shard_update)
        # shard_update: reduce-scatter, step this rank's slice, allgather (hpcdl/optim/
        # sharded.py); state_dict() then becomes collective (it gathers the slices).
        self._stepper = optimizer
        if self.reducer.reduce_scatter:
            from hpcdl.optim.sharded import ShardedOptimizer

            self._stepper = ShardedOptimizer(optimizer, self.reducer, comm)
        self._syncing = True
        self.reducer.arm(last=True)

    def _delegate(self) -> Any:
        # With shard_update the sharded step answers first (its scale_momentum_ scales the
        # slices), and passes the rest on to the wrapped optimizer.
        return self.__dict__.get("_stepper", self.__dict__.get("optimizer"))

    # -- what the training loop calls ----------------------------------------------------
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Wait for the averaged gradients, then step the wrapped optimizer."""
        if closure is not None:
            # A closure runs forward and backward again inside step: its gradients would be
            # reduced after the step that needs them.
            raise ValueError("DistributedOptimizer.step: closures are not supported; run "
                             "forward and backward before step()")
        self.reducer.synchronize()
        self._seen.clear()
        loss = self._stepper.step()
        self.reducer.arm(last=self._syncing)
        return loss

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate into ``p.grad`` on this rank; the first
        backward after it reduces the accumulated sum (DDP's ``no_sync``)."""
        self._syncing = False
        self.reducer.arm(last=False)
        try:
            yield
        finally:
            self._syncing = True
            self.reducer.arm(last=True)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state (full layout; collective with ``shard_update``)."""
        return self._stepper.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._stepper.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise RuntimeError("DistributedOptimizer: the fusion buckets are laid out once; "
                           "add the parameters to the optimizer before wrapping it")

    def close(self) -> None:
        """Remove the hooks and stop the communication thread (idempotent)."""
        for handle in self._guards:
            handle.remove()
        self._guards = []
        self.reducer.close()

    def _one_backward_per_step(self, p: torch.Tensor) -> None:
        if not self._syncing:
            return
        if id(p) in self._seen:
            raise RuntimeError(
                f"DistributedOptimizer on rank {self.comm.rank}: a second backward() before "
                f"step(); for gradient accumulation run every backward but the last inside "
                f"`with optimizer.no_sync():`")
        self._seen.add(id(p))


def _check_covered(optimizer: torch.optim.Optimizer,
                   named: list[tuple[str, torch.Tensor]]) -> None:
    """Every parameter the optimizer steps must have its gradient averaged: one left out
    would drift apart on each rank, silently."""
    reduced = {id(p) for _, p in named}
    missing = sum(1 for group in optimizer.param_groups for p in group["params"]
                  if id(p) not in reduced)
    if missing:
        raise ValueError(f"DistributedOptimizer: {missing} parameter(s) of the optimizer are "
                         f"not parameters of the model passed; pass the model they belong to")


def _state_tensors(state: torch.nn.Module | Mapping[str, torch.Tensor] | NamedTensors,
                   ) -> list[torch.Tensor]:
    if isinstance(state, torch.nn.Module):
        items = state.state_dict().items()
    elif isinstance(state, Mapping):
        items = state.items()
    else:
        items = list(state)
    return [t for _, t in items if isinstance(t, torch.Tensor) and t.numel() > 0]


def broadcast_parameters(model: torch.nn.Module | Mapping[str, torch.Tensor] | NamedTensors,
                         comm, root: int = 0) -> None:
    """Copy ``root``'s parameters and buffers into every rank's model, in place and bit-exact
    (Horovod's ``broadcast_parameters(model.state_dict(), root_rank=0)``). Accepts a module,
    a ``state_dict()`` or ``named_parameters()``. Collective over ``comm``; models whose
    shapes differ between ranks raise on every rank instead of hanging."""
    comm.broadcast_(_state_tensors(model), root=root)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, comm, root: int = 0) -> None:
    """Give every rank ``root``'s optimizer state and hyperparameters (momentum buffers after
    a resume, the learning rate of each group). Collective over ``comm``; sent pickled, once
    per run, so no effort goes into speed."""
    # Every rank asks: a sharded optimizer's state_dict() is collective (it gathers the
    # momentum slices); for the others it is a dict of references, dropped on non-roots.
    state = optimizer.state_dict()
    state = comm.mpi_comm.bcast(state if comm.rank == root else None, root=root)
    if comm.rank != root:
        optimizer.load_state_dict(state)


def setup_logging(comm, run_dir: str | None = None, level: int | str = "info",
                  name: str = "main") -> logging.Logger:
    """A logger whose lines say ``[rank r/size host]``: rank 0's reach the terminal, the
    other ranks' only when they are errors, and with ``run_dir`` every rank also writes
    ``run_dir/logs/rank-XXXX.log`` (hpcdl/debug/log.py). Returns ``hpcdl.<name>``."""
    from hpcdl.debug import setup_rank_logging

    setup_rank_logging(run_dir, comm.rank, comm.size, level)
    return logging.getLogger(f"hpcdl.{name}")
