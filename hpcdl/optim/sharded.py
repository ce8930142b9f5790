"""Weight-update sharding: each rank steps only its slice of the parameters.

Xu et al. (arXiv:2004.13336, 2020): an allreduce is a reduce-scatter then an allgather, so the
weight update sits between them. After ``synchronize`` rank r holds the average of its slice
``comm.shard_bounds(numel)[r:r+2]`` of every bucket; LARS's per-layer ‖w‖, ‖g‖ (You et al.,
arXiv:1708.03888, eq. 6) come from one small allreduce of float64 partial sums of squares;
updated slices are allgathered bucket by bucket on the reducer's thread. The path on each
backend, the numerics and what is refused: docs/comm.md, "Weight-update sharding".

- Slices cut through layers: a layer's norm is the root of its pieces' summed squares.
- :meth:`ShardedOptimizer.state_dict` (collective) is in the full layout, so a checkpoint
  resumes unsharded, sharded, or on another rank count.
- With the reducer suspended or disabled the wrapped optimizer steps the whole model.

Supported: :class:`~hpcdl.optim.lars.LARS` (every option) and ``torch.optim.SGD`` (no
dampening); anything else is refused by name.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from hpcdl.optim.lars import LARS, lars_update, local_rates
from hpcdl.optim.wrapper import OptimizerWrapper

__all__ = ["ShardedOptimizer", "sharding_unsupported"]


@dataclass
class _Piece:
    """The part of one parameter that lies in this rank's slice of its bucket."""

    param: Tensor
    group: int          # index of the parameter's group in param_groups
    tensor_index: int   # index among the model's reduced tensors (the norms' position)
    start: int          # first element within the flattened parameter
    stop: int
    bucket: Any
    bucket_start: int   # where that element lies in the bucket


def sharding_unsupported(optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``optimizer`` cannot be sharded, or None."""
    if isinstance(optimizer, LARS):
        return None
    if type(optimizer) is torch.optim.SGD:
        for group in optimizer.param_groups:
            if group.get("dampening", 0.0) or group.get("maximize", False):
                return "torch.optim.SGD with dampening or maximize"
        return None
    return type(optimizer).__name__


class ShardedOptimizer(OptimizerWrapper):
    """Step ``optimizer`` on this rank's slice of every bucket of ``reducer``, then allgather.

    ``reducer``: a :class:`~hpcdl.comm.reducer.GradientReducer` with ``reduce_scatter=True``
    over every parameter of ``optimizer``; ``step()`` after ``reducer.synchronize()``. The
    wrapped optimizer's ``param_groups`` are shared (the schedule sets their rate)."""

    def __init__(self, optimizer: torch.optim.Optimizer, reducer, comm) -> None:
        # No super().__init__: groups and defaults are the wrapped optimizer's.
        why = sharding_unsupported(optimizer)
        if why is not None:
            raise ValueError(f"comm.shard_update: the weight update of {why} cannot be "
                             f"sharded; use optimizer.name lars or sgd, or set "
                             f"comm.shard_update: false")
        if not reducer.reduce_scatter:
            raise ValueError("ShardedOptimizer: the reducer must be built with "
                             "reduce_scatter=True")
        for bucket in reducer.buckets:
            if bucket.buffer is not None and bucket.dtype != bucket.params[0].dtype:
                raise ValueError(f"comm.shard_update: bucket {bucket.index} travels as "
                                 f"{bucket.dtype} but holds {bucket.params[0].dtype} "
                                 f"parameters; the allgather sends the parameters themselves, "
                                 f"so a narrower wire dtype would round the weights: use "
                                 f"float32 on the wire with sharding")
        strided = [tuple(p.shape) for b in reducer.buckets for p in b.params
                   if not p.is_contiguous()]
        if strided:
            raise ValueError(f"comm.shard_update: {len(strided)} parameter(s) are not "
                             f"contiguous (e.g. shape {strided[0]}: train.channels_last, or "
                             f"its auto in a bf16 run on >= 2 threads, lays convolution "
                             f"weights out NHWC) and a slice of one is not a view; "
                             f"set train.channels_last: false or comm.shard_update: false")
        self.optimizer, self.reducer, self.comm = optimizer, reducer, comm
        self._group_of = {id(p): g for g, group in enumerate(optimizer.param_groups)
                          for p in group["params"]}
        reduced = [p for b in reducer.buckets for p in b.params]
        reduced_ids = {id(p) for p in reduced}
        missing = [i for i in self._group_of if i not in reduced_ids]
        if missing:
            raise ValueError(f"ShardedOptimizer: {len(missing)} parameter(s) of the optimizer "
                             f"are not reduced by the reducer; build both from one model")
        self._tensors = [p for p in reduced if id(p) in self._group_of]
        self._pieces = self._my_pieces()
        groups = [self._group_of[id(p)] for p in self._tensors]
        self._tensors_of_group = {g: torch.tensor([i for i, h in enumerate(groups) if h == g])
                                  for g in sorted(set(groups))}
        self._by_bucket: dict[int, list[int]] = {}
        self._by_bucket_group: dict[int, dict[int, list[int]]] = {}
        for i, piece in enumerate(self._pieces):
            self._by_bucket.setdefault(piece.bucket.index, []).append(i)
            self._by_bucket_group.setdefault(piece.bucket.index, {}).setdefault(
                piece.group, []).append(i)
        #: momentum of this rank's pieces, one flat tensor per piece (None before step 1)
        self._momentum: list[Tensor] | None = None

    # -- layout ----------------------------------------------------------------------------
    def _my_pieces(self) -> list[_Piece]:
        index = {id(p): i for i, p in enumerate(self._tensors)}
        pieces = []
        for bucket in self.reducer.buckets:
            bounds = self.comm.shard_bounds(bucket.numel)
            lo, hi = bounds[self.comm.rank], bounds[self.comm.rank + 1]
            for p, offset in zip(bucket.params, bucket.offsets, strict=True):
                start, stop = max(offset, lo), min(offset + p.numel(), hi)
                if start < stop and id(p) in self._group_of:
                    pieces.append(_Piece(p, self._group_of[id(p)], index[id(p)],
                                         start - offset, stop - offset, bucket, start))
        return pieces

    @staticmethod
    def _param_view(piece: _Piece) -> Tensor:
        return piece.param.detach().view(-1)[piece.start:piece.stop]

    @staticmethod
    def _grad_view(piece: _Piece) -> Tensor:
        n = piece.stop - piece.start
        return piece.bucket.buffer[piece.bucket_start:piece.bucket_start + n]

    # -- the step ------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        if closure is not None:
            raise ValueError("ShardedOptimizer.step: closures are not supported; run "
                             "forward and backward before step()")
        if (not self.reducer.reduce_scatter or not self.reducer.enabled
                or self.reducer.buckets[0].buffer is None):
            return self.optimizer.step()   # no_comm ceiling / one rank: the whole update
        if self._momentum is None:
            self._momentum = [torch.zeros(p.stop - p.start, dtype=p.param.dtype)
                              for p in self._pieces]
        # SGD reads its groups' lr itself: only LARS needs the per-tensor rates
        rates = self._piece_rates() if isinstance(self.optimizer, LARS) else None
        # Bucket by bucket: update this rank's slice, hand it to the communication thread's
        # allgather, and update the next bucket while that one travels.
        for bucket in self.reducer.buckets:
            for g, chosen in self._by_bucket_group.get(bucket.index, {}).items():
                self._update(self.param_groups[g], chosen, rates)
            for i in self._by_bucket.get(bucket.index, []):
                piece = self._pieces[i]
                self._grad_view(piece).copy_(self._param_view(piece))
            self.reducer.start_allgather(bucket)
        for bucket in self.reducer.buckets:
            self._unpack_others(bucket, self.reducer.wait_allgather(bucket))
            self.reducer.release(bucket)
        for bucket in self.reducer.buckets:   # before backward packs into them again
            self.reducer.wait_released(bucket)
        return None

    def _piece_rates(self) -> Tensor:
        """The learning rate of each piece: lr·λ of its tensor for LARS groups (norms
        completed by one allreduce of partial sums of squares), lr otherwise."""
        n = len(self._tensors)
        partial = torch.zeros(2, n, dtype=torch.float64)
        lars_groups = {g for g, group in enumerate(self.param_groups) if group.get("lars")}
        if isinstance(self.optimizer, LARS) and lars_groups:
            mine = [p for p in self._pieces if p.group in lars_groups]
            if mine:
                idx = torch.tensor([p.tensor_index for p in mine])
                w = torch.stack(torch._foreach_norm([self._param_view(p) for p in mine]))
                g = torch.stack(torch._foreach_norm([self._grad_view(p) for p in mine]))
                partial[0].index_add_(0, idx, w.double().square())
                partial[1].index_add_(0, idx, g.double().square())
            self.comm.allreduce_(partial, average=False)
        norms = partial.sqrt().float()
        rate = torch.empty(n, dtype=torch.float32)
        for g, sel in self._tensors_of_group.items():
            group = self.param_groups[g]
            if isinstance(self.optimizer, LARS) and group["lars"]:
                rate[sel] = local_rates(group, norms[0, sel], norms[1, sel])
            else:
                rate[sel] = group["lr"]
        return rate

    def _update(self, group: dict[str, Any], chosen: list[int], rates: Tensor | None) -> None:
        pieces = [self._pieces[i] for i in chosen]
        params = [self._param_view(p) for p in pieces]
        grads = [self._grad_view(p) for p in pieces]
        bufs = [self._momentum[i] for i in chosen] if group["momentum"] != 0.0 else []
        if rates is not None:
            lars_update(group, params, grads, bufs,
                        rates[[p.tensor_index for p in pieces]])
            return
        _sgd_update(group, params, grads, bufs)

    def _unpack_others(self, bucket, sources: list[Tensor]) -> None:
        """Copy the other ranks' updated slices of ``bucket`` into the parameters, each
        from where that rank published it (this rank's part is in place already)."""
        bounds = self.comm.shard_bounds(bucket.numel)
        for p, offset in zip(bucket.params, bucket.offsets, strict=True):
            if id(p) not in self._group_of:
                continue   # reduced but not optimized: unchanged, and its slot holds a gradient
            flat = p.detach().view(-1)
            end = offset + p.numel()
            for k, source in enumerate(sources):
                start, stop = max(offset, bounds[k]), min(end, bounds[k + 1])
                if k != self.comm.rank and start < stop:
                    flat[start - offset:stop - offset].copy_(source[start:stop])

    @contextlib.contextmanager
    def unsharded(self) -> Iterator[None]:
        """Within, steps allreduce and run the whole update on every rank, on the same model
        and buffers (``hpcdl bench train``'s ``ours_allreduce``), with the wrapped optimizer's
        own momentum: for timing, not for training."""
        self.reducer.reduce_scatter = False
        try:
            yield
        finally:
            self.reducer.reduce_scatter = True

    # -- state in the full layout -------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's ``state_dict`` with full momentum buffers (allgathered from
        the slices): interchangeable with an unsharded run's. Collective."""
        if self._momentum is None:
            return self.optimizer.state_dict()
        full = self._gather_momentum()
        # Lent to the wrapped optimizer for its state_dict only (the returned dict refers to
        # ``full``'s tensors); whatever a no_comm step left there is put back.
        previous = {p: self.optimizer.state[p].get("momentum_buffer") for p in full}
        for p, buf in full.items():
            self.optimizer.state[p]["momentum_buffer"] = buf
        try:
            state_dict = self.optimizer.state_dict()
            # torch's state_dict shares each parameter's state dict: copy before restoring.
            state_dict["state"] = {k: dict(v) for k, v in state_dict["state"].items()}
            return state_dict
        finally:
            for p, buf in previous.items():
                if buf is None:
                    del self.optimizer.state[p]["momentum_buffer"]
                else:
                    self.optimizer.state[p]["momentum_buffer"] = buf

    def _gather_momentum(self) -> dict[Tensor, Tensor]:
        momentum_groups = {g for g, group in enumerate(self.param_groups)
                           if group["momentum"] != 0.0}
        full: dict[Tensor, Tensor] = {}
        for bucket in self.reducer.buckets:
            flat = torch.zeros(bucket.numel, dtype=bucket.params[0].dtype)
            for i in self._by_bucket.get(bucket.index, []):
                piece, buf = self._pieces[i], self._momentum[i]
                flat[piece.bucket_start:piece.bucket_start + buf.numel()].copy_(buf)
            self.comm.allgather_flat_(flat, bucket=None)
            for p, offset in zip(bucket.params, bucket.offsets, strict=True):
                if id(p) in self._group_of and self._group_of[id(p)] in momentum_groups:
                    full[p] = flat[offset:offset + p.numel()].view_as(p).clone()
        return full

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full-layout state (a sharded or an unsharded run's) and keep this rank's
        slice of each momentum buffer. Not collective."""
        self.optimizer.load_state_dict(state_dict)
        if not any("momentum_buffer" in s for s in self.optimizer.state.values()):
            self._momentum = None
            return
        momentum = []
        for piece in self._pieces:
            state = self.optimizer.state.get(piece.param, {})
            full = state.get("momentum_buffer")
            if full is None:   # a group without momentum, or a tensor not stepped yet
                momentum.append(torch.zeros(piece.stop - piece.start, dtype=piece.param.dtype))
            else:
                momentum.append(full.reshape(-1)[piece.start:piece.stop].clone())
        for state in self.optimizer.state.values():
            state.pop("momentum_buffer", None)
        self._momentum = momentum

    @torch.no_grad()
    def scale_momentum_(self, factor: float) -> None:
        """LARS's momentum correction (Goyal et al. §2.2) on this rank's slices."""
        if factor == 1.0:
            return
        if self._momentum:
            torch._foreach_mul_(self._momentum, factor)
        if isinstance(self.optimizer, LARS):
            self.optimizer.scale_momentum_(factor)   # (buffers of no_comm steps, if any)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise RuntimeError("ShardedOptimizer: the slices are laid out once; add the "
                           "parameters to the optimizer before wrapping it")


def _sgd_update(group: dict[str, Any], params: list[Tensor], grads: list[Tensor],
                bufs: list[Tensor]) -> None:
    """torch.optim.SGD's foreach step on slices (g ← g + wd·w; v ← m·v + g; w ← w − lr·v, or
    Nesterov's w ← w − lr·(g + m·v)); v starts at 0, so its first step gives torch's v = g."""
    wd, momentum, lr = group["weight_decay"], group["momentum"], group["lr"]
    if wd != 0.0:
        grads = torch._foreach_add(grads, params, alpha=wd)
    if momentum != 0.0:
        torch._foreach_mul_(bufs, momentum)
        torch._foreach_add_(bufs, grads)
        if group["nesterov"]:
            grads = torch._foreach_add(grads, bufs, alpha=momentum)
        else:
            grads = bufs
    torch._foreach_add_(params, grads, alpha=-lr)
