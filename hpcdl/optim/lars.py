"""LARS: layer-wise adaptive rate scaling (You, Gitman & Ginsburg, arXiv:1708.03888, Alg. 1).

Each parameter tensor (a "layer") gets its own local rate, the trust ratio

    λ = η·‖w‖ / (‖g‖ + β·‖w‖ + ε)                       (1708.03888, eq. 6, with ε for safety)

and the momentum update is the form of You et al. and the MLPerf ResNet-50 reference:

    v ← m·v + lr·λ·(g + β·w);   w ← w − v

where η is ``trust_coefficient`` and β ``weight_decay``. λ = 1 when ‖w‖ or ‖g‖ is 0, so a
zero-initialised tensor (the last BN γ of a block with ``zero_init_residual``) still moves.
Groups with ``lars=False`` (BatchNorm and biases, the MLPerf skip list) take the plain momentum
step v ← m·v + lr·(g + wd·w). ``trust_clip=True`` clips the local rate at the global one,
effective rate min(λ·lr, lr).

Variants the published runs used are param-group keys: ``trust_ratio_wd=False`` (NVCaffe's
later ``GetLocalRate``), ``larc_clip=True`` (NVIDIA's LARC "clip", apex and NVCaffe) and
``param_groups(model, wd, skip_list=False)`` (Intel Caffe: every tensor adapted and decayed;
both Caffes' src/caffe/solvers/sgd_solver.cpp); what each computes: docs/recipes.md.

The step is batched (``torch._foreach_norm``, one stacked vector of trust ratios, ``_foreach``
updates): ResNet-50's 161 tensors cost a handful of kernel launches (``hpcdl bench optim``).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

__all__ = ["LARS", "param_groups", "norm_layer_params", "trust_ratios", "local_rates",
           "lars_update"]


def trust_ratios(
    weight_norms: Tensor,
    grad_norms: Tensor,
    trust_coefficient: float,
    weight_decay: float,
    eps: float,
) -> Tensor:
    """λ = η·‖w‖ / (‖g‖ + β·‖w‖ + ε) per tensor; 1 where either norm is 0 (1708.03888, eq. 6)."""
    ratio = trust_coefficient * weight_norms / (grad_norms + weight_decay * weight_norms + eps)
    moving = (weight_norms > 0) & (grad_norms > 0)
    return torch.where(moving, ratio, torch.ones_like(ratio))


def local_rates(group: dict[str, Any], weight_norms: Tensor, grad_norms: Tensor) -> Tensor:
    """lr·λ per tensor of a ``lars=True`` group from its norms ‖w‖, ‖g‖ (1708.03888, eq. 6),
    with the group's clip and denominator options: shared by :class:`LARS` and the sharded
    update (hpcdl/optim/sharded.py), which completes the norms from per-rank partial sums."""
    lr = group["lr"]
    # .get: param groups of a state_dict saved before these keys existed.
    denominator_wd = group["weight_decay"] if group.get("trust_ratio_wd", True) else 0.0
    ratio = trust_ratios(weight_norms, grad_norms, group["trust_coefficient"],
                         denominator_wd, group["eps"])
    if group["trust_clip"]:
        ratio = ratio.clamp(max=1.0)  # effective rate min(λ·lr, lr)
    if group.get("larc_clip", False):
        return ratio.clamp(max=lr)    # LARC clip: effective rate min(λ, lr)
    return lr * ratio


def lars_update(group: dict[str, Any], params: list[Tensor], grads: list[Tensor],
                bufs: list[Tensor], rate_vector: Tensor) -> None:
    """v ← m·v + rate·(g + β·w); w ← w − v (Nesterov: w ← w − (m·v + rate·(g + β·w))), with
    one rate per tensor. ``params``/``grads``/``bufs`` may be slices of the real tensors (the
    sharded update steps each rank's slice with its tensor's rate); ``bufs`` is empty when
    momentum is 0."""
    rates = list(rate_vector.unbind(0))
    momentum, wd = group["momentum"], group["weight_decay"]
    if momentum == 0.0:
        # w ← (1 − rate·β)·w − rate·g: no buffer to keep.
        if wd != 0.0:
            torch._foreach_mul_(params, list((1.0 - wd * rate_vector).unbind(0)))
        torch._foreach_addcmul_(params, grads, rates, value=-1.0)
        return
    # v ← m·v + rate·g + rate·β·w, fused into two multiply-adds with a per-tensor rate.
    # The w term reads w before the update below, as the formula asks.
    torch._foreach_mul_(bufs, momentum)
    torch._foreach_addcmul_(bufs, grads, rates)
    if wd != 0.0:
        torch._foreach_addcmul_(bufs, params, rates, value=wd)
    if group["nesterov"]:
        # w ← w − (m·v + rate·(g + β·w)): the look-ahead step of Sutskever et al.
        step = torch._foreach_mul(bufs, momentum)
        torch._foreach_addcmul_(step, grads, rates)
        if wd != 0.0:
            torch._foreach_addcmul_(step, params, rates, value=wd)
        torch._foreach_sub_(params, step)
    else:
        torch._foreach_sub_(params, bufs)


def _split_by_dtype(params: list[Tensor]) -> list[list[Tensor]]:
    """Lists of parameters of one dtype each: the norms are stacked into one vector per list."""
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(p)
    return list(by_dtype.values())


class LARS(torch.optim.Optimizer):
    """Momentum SGD with a per-tensor trust ratio (You et al., arXiv:1708.03888, Alg. 1).

    Param-group keys: ``lr``, ``momentum``, ``weight_decay``, ``trust_coefficient``, ``eps``,
    ``nesterov``, ``trust_clip``, ``trust_ratio_wd``, ``larc_clip`` and ``lars`` (False: plain
    momentum SGD for that group).
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 0.0,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        trust_coefficient: float = 0.001,
        eps: float = 0.0,
        nesterov: bool = False,
        trust_clip: bool = False,
        trust_ratio_wd: bool = True,
        larc_clip: bool = False,
    ) -> None:
        if lr < 0.0:
            raise ValueError(f"LARS: learning rate must be >= 0, got lr={lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"LARS: momentum must be in [0, 1), got momentum={momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"LARS: weight_decay must be >= 0, got weight_decay={weight_decay}")
        if trust_coefficient <= 0.0:
            raise ValueError(
                f"LARS: trust_coefficient (η) must be > 0, got {trust_coefficient}")
        if eps < 0.0:
            raise ValueError(f"LARS: eps must be >= 0, got eps={eps}")
        if nesterov and momentum == 0.0:
            raise ValueError("LARS: nesterov=True needs momentum > 0")
        if trust_clip and larc_clip:
            raise ValueError("LARS: trust_clip and larc_clip are two clips of the same rate; "
                             "set one of them")
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                        trust_coefficient=trust_coefficient, eps=eps, nesterov=nesterov,
                        trust_clip=trust_clip, trust_ratio_wd=trust_ratio_wd,
                        larc_clip=larc_clip, lars=True)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for same_dtype in _split_by_dtype(params):
                self._step_tensors(group, same_dtype)
        return loss

    def _step_tensors(self, group: dict[str, Any], params: list[Tensor]) -> None:
        grads = [p.grad for p in params]
        if any(g.is_sparse for g in grads):
            raise RuntimeError("LARS does not support sparse gradients")
        rate_vector = self._local_rates(group, params, grads)
        bufs = self._momentum_buffers(params) if group["momentum"] != 0.0 else []
        lars_update(group, params, grads, bufs, rate_vector)

    def _local_rates(self, group: dict[str, Any], params: list[Tensor],
                     grads: list[Tensor]) -> Tensor:
        """lr·λ per tensor (lr alone for lars=False groups), one vector for the whole list."""
        first = params[0]
        if not group["lars"]:
            return torch.full((len(params),), group["lr"], dtype=first.dtype,
                              device=first.device)
        # Trust ratios in at least float32: a bf16 norm has 3 significant digits.
        dtype = torch.promote_types(first.dtype, torch.float32)
        weight_norms = torch.stack(torch._foreach_norm(params)).to(dtype)
        grad_norms = torch.stack(torch._foreach_norm(grads)).to(dtype)
        return local_rates(group, weight_norms, grad_norms)

    def _momentum_buffers(self, params: list[Tensor]) -> list[Tensor]:
        bufs = []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                # v₀ = 0, so the first step is v₁ = lr·λ·(g + β·w), as in the formula.
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            bufs.append(state["momentum_buffer"])
        return bufs

    @torch.no_grad()
    def scale_momentum_(self, factor: float) -> None:
        """Multiply every momentum buffer by ``factor``: Goyal et al.'s momentum correction
        (arXiv:1706.02677, §2.2) when the rate jumps, factor = lr_{t+1}/lr_t, which the
        schedule gives as ``schedule.momentum_correction(step)``. The buffer holds lr·g terms,
        so without it a rate change takes effect only gradually."""
        if factor == 1.0:
            return
        bufs = [s["momentum_buffer"] for s in self.state.values() if "momentum_buffer" in s]
        if bufs:
            torch._foreach_mul_(bufs, factor)


def _is_norm_layer(module: torch.nn.Module) -> bool:
    return isinstance(module, (torch.nn.modules.batchnorm._NormBase, torch.nn.GroupNorm,
                               torch.nn.LayerNorm))


def param_groups(model: torch.nn.Module, weight_decay: float,
                 skip_list: bool = True) -> list[dict[str, Any]]:
    """Two groups, the MLPerf skip list: BatchNorm weights/biases and every bias get
    ``lars=False`` and ``weight_decay=0``; all other tensors ``lars=True`` with
    ``weight_decay``. Empty groups are left out; each parameter appears once.
    ``skip_list=False``: one group, every tensor adapted and decayed (Intel Caffe / NVCaffe)."""
    skip_ids: set[int] = set()
    for module in model.modules() if skip_list else ():
        for name, p in module.named_parameters(recurse=False):
            if _is_norm_layer(module) or name == "bias":
                skip_ids.add(id(p))
    adapted, skipped = [], []
    for p in model.parameters():
        if p.requires_grad:
            (skipped if id(p) in skip_ids else adapted).append(p)
    groups = [{"params": adapted, "weight_decay": weight_decay, "lars": True},
              {"params": skipped, "weight_decay": 0.0, "lars": False}]
    return [g for g in groups if g["params"]]


def norm_layer_params(model: torch.nn.Module) -> set[int]:
    """ids of the γ/β of every normalisation layer (Goyal et al. §5.1 leave them undecayed)."""
    return {id(p) for m in model.modules() if _is_norm_layer(m)
            for p in m.parameters(recurse=False)}
