"""PowerSGD: rank-r gradient compression with error feedback (Vogels, Karimireddy & Jaggi,
"PowerSGD: Practical Low-Rank Gradient Compression for Distributed Optimization", NeurIPS'19).

Per matrix-shaped gradient (a conv weight ``(out, in, kh, kw)`` is reshaped to
``out × in·kh·kw``, the paper's §3), one step of subspace iteration with a warm start
(Algorithm 1 of the paper; the line numbers below are its):

    M ← G + E                         error feedback: add what earlier steps did not send
    P ← M Q;   P ← allreduce_mean(P)  (lines 3-4)
    P̂ ← orthogonalize(P)              (line 5; Householder QR: same P, same P̂ on every rank)
    Q ← Mᵀ P̂;  Q ← allreduce_mean(Q)  (lines 6-7; Q is kept for the next step: warm start)
    G ← P̂ Qᵀ;  E ← M − G              (the decompressed average; the residual stays local)

Vectors and matrices with ``2·r·(n+m) ≥ n·m`` (PyTorch's ``min_compression_rate`` of 2) are
sent dense, fused with the P factors. When ``Σᵢ Mᵢ/P`` has rank ≤ r the result is exact.
``Q`` starts from one seeded draw, identical on every rank (``P`` is averaged). Synchronous,
after backward; same surface as :class:`~hpcdl.comm.reducer.GradientReducer`. The choices
and the check against PyTorch's hook: docs/comm.md, "Consistency policies".
"""
from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from hpcdl.comm.reducer import GradientReducer, layout_buckets, pack_gradient, unpack_gradient
from hpcdl.io import Closing

__all__ = ["PowerSGDReducer", "compressed_bytes", "matrix_shape"]


def matrix_shape(shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
    """The paper's reshape: first dimension (output channels) by the product of the rest."""
    return int(shape[0]), math.prod(int(d) for d in shape[1:])


#: PyTorch's ``PowerSGDState.min_compression_rate`` default: a matrix is compressed only when
#: its factors are at most half its size (below that, the approximation error costs more
#: than the bytes it saves).
MIN_COMPRESSION_RATE = 2.0


def compresses(shape: torch.Size | tuple[int, ...], rank: int,
               min_compression_rate: float = MIN_COMPRESSION_RATE) -> bool:
    """Whether a tensor is sent as rank-``rank`` factors: a matrix (≥ 2-D) whose factors
    ``r·(n+m)`` times ``min_compression_rate`` are smaller than ``n·m`` (PyTorch's
    ``_should_compress``, the same test so both compress the same tensors)."""
    if len(shape) < 2:
        return False
    n, m = matrix_shape(shape)
    return rank * (n + m) * min_compression_rate < n * m


def compressed_bytes(shapes: Iterable[tuple[int, ...]], rank: int, element_bytes: int = 4,
                     min_compression_rate: float = MIN_COMPRESSION_RATE) -> int:
    """Bytes one rank passes to allreduce per step: P and Q factors of compressed tensors,
    every element of the others (what :attr:`PowerSGDReducer.bytes_reduced` counts)."""
    total = 0
    for shape in shapes:
        if compresses(shape, rank, min_compression_rate):
            n, m = matrix_shape(shape)
            total += rank * (n + m)
        else:
            total += math.prod(int(d) for d in shape)
    return total * element_bytes


@dataclass
class _Matrix:
    name: str
    param: torch.Tensor
    n: int
    m: int


class PowerSGDReducer(Closing):
    """Average gradients over ``comm`` as rank-``rank`` factors with error feedback.

    Use like :class:`~hpcdl.comm.reducer.GradientReducer`. ``bytes_reduced``: what this rank
    passed to allreduce. An exact resume needs ``state_dict()`` (Q, equal on every rank) and
    ``rank_state_dict()`` (this rank's error buffers).
    """

    def __init__(self, comm, named_params: Iterable[tuple[str, torch.Tensor]], rank: int = 4,
                 enabled: bool = True, seed: int = 0,
                 min_compression_rate: float = MIN_COMPRESSION_RATE) -> None:
        if rank < 1:
            raise ValueError(f"PowerSGDReducer: rank must be >= 1, got {rank} (set "
                             f"comm.powersgd_rank)")
        self.comm = comm
        self.rank = int(rank)
        self.enabled = bool(enabled)
        trainable = [(n, p) for n, p in named_params if p.requires_grad]
        if not trainable:
            raise ValueError("PowerSGDReducer: the model has no parameter that requires grad")
        self.matrices = [_Matrix(n, p, *matrix_shape(p.shape)) for n, p in trainable
                         if compresses(p.shape, self.rank, min_compression_rate)]
        compressed = {id(x.param) for x in self.matrices}
        # The uncompressed gradients travel in flat buffers packed as the gradient reducer
        # packs its buckets (one per dtype: no size limit, they go in one call anyway).
        self.buckets = layout_buckets([(n, p) for n, p in trainable if id(p) not in compressed],
                                      bucket_bytes=2**62)
        for bucket in self.buckets:
            bucket.buffer = torch.empty(bucket.numel, dtype=bucket.dtype)
        generator = torch.Generator().manual_seed(seed)
        # Warm start (Alg. 1): Q persists across steps. The first draw is seeded, so it is
        # the same on every rank without a broadcast.
        self.q = {x.name: torch.randn(x.m, self.rank, generator=generator)
                  for x in self.matrices}
        self.error = {x.name: torch.zeros(x.n, x.m) for x in self.matrices}
        self.comm_wait_s = 0.0
        self.total_comm_wait_s = 0.0
        self.bytes_reduced = 0
        self.steps = 0

    # -- what the training loop calls -----------------------------------------------------
    def arm(self, last: bool = True) -> None:
        """Nothing to do before backward: compression reads the finished gradients."""

    def synchronize(self) -> None:
        """Compress, average and decompress every gradient; ``p.grad`` holds the result."""
        if not self.enabled:
            self.comm_wait_s = 0.0
            return
        start = time.perf_counter()
        ms = [self._with_error(x) for x in self.matrices]
        # Q is orthonormalised before use, as PyTorch's hook does: the same subspace (so the
        # same result in exact arithmetic), but P = M Q then has the condition number of M
        # on that subspace, not its square, which the warm-started Q = Mᵀ P̂ would give.
        ps = [m @ torch.linalg.qr(self.q[x.name]).Q for x, m in zip(self.matrices, ms,
                                                                     strict=True)]
        for bucket in self.buckets:
            for position, p in enumerate(bucket.params):
                pack_gradient(bucket, position, p.grad)
        self._allreduce([b.buffer for b in self.buckets] + ps)
        for bucket in self.buckets:
            for position in range(len(bucket.params)):
                unpack_gradient(bucket, position)
        p_hats = [torch.linalg.qr(p).Q for p in ps]
        qs = [m.T @ p_hat for m, p_hat in zip(ms, p_hats, strict=True)]
        self._allreduce(qs)
        for x, m, p_hat, q in zip(self.matrices, ms, p_hats, qs, strict=True):
            approx = p_hat @ q.T
            self.error[x.name] = m - approx
            self.q[x.name] = q
            x.param.grad = approx.view_as(x.param).to(x.param.dtype)
        self.comm_wait_s = time.perf_counter() - start
        self.total_comm_wait_s += self.comm_wait_s
        self.steps += 1

    #: Within, nothing is communicated and each rank keeps its own gradients.
    suspended = GradientReducer.suspended

    def close(self) -> None:
        """Nothing to release (no hooks, no thread); here for the reducer's surface."""

    # -- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The warm-start Q factors (identical on every rank)."""
        return {"rank": self.rank, "q": {k: v.clone() for k, v in self.q.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["rank"]) != self.rank:
            raise ValueError(f"checkpoint holds PowerSGD rank {state['rank']} factors, this run "
                             f"has comm.powersgd_rank={self.rank}; resume with the same rank")
        self.q = {k: v.clone() for k, v in state["q"].items()}

    def rank_state_dict(self) -> dict[str, Any]:
        """This rank's error-feedback buffers (they differ between ranks)."""
        return {"error": {k: v.clone() for k, v in self.error.items()}}

    def load_rank_state_dict(self, state: dict[str, Any]) -> None:
        self.error = {k: v.clone() for k, v in state["error"].items()}

    # -- helpers -----------------------------------------------------------------------------
    def _with_error(self, x: _Matrix) -> torch.Tensor:
        # A parameter unused this step contributes zeros, so every rank sends the same shapes.
        grad = (x.param.grad.detach().float().reshape(x.n, x.m).clone()
                if x.param.grad is not None else torch.zeros(x.n, x.m))
        return grad.add_(self.error[x.name])

    def _allreduce(self, tensors: list[torch.Tensor]) -> None:
        tensors = [t for t in tensors if t.numel()]
        if not tensors:
            return
        self.bytes_reduced += sum(t.numel() * t.element_size() for t in tensors)
        self.comm.allreduce_(tensors, average=True)
