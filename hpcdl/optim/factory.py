"""Optimizers by name, so a recipe's ``optimizer`` section names one (timm's create_optimizer).

The learning rate comes from the schedule: the trainer builds the optimizer with
``lr = schedule(0)`` and calls ``set_learning_rate(optimizer, schedule(step))`` before every
step, which honours a group's ``lr_mult`` (Caffe's per-blob ``lr_mult``: BVLC AlexNet runs its
biases at twice the weights' rate).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from hpcdl.optim.lars import LARS, norm_layer_params, param_groups

__all__ = ["create_optimizer", "list_optimizers", "apply_momentum_correction",
           "set_learning_rate", "OPTIMIZERS", "steps_tensor_by_tensor", "step_parameters"]

#: Optimizers whose step treats every tensor on its own -- LARS's trust ratio is per tensor
#: (arXiv:1708.03888, eq. 6), momentum SGD has no term across tensors -- so a step taken in
#: parts, one gradient bucket after another, is the same step.
TENSOR_BY_TENSOR = (LARS, torch.optim.SGD)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every group's rate to ``lr`` times the group's ``lr_mult`` (default 1)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)


def _caffe_bias_multipliers(groups: list[dict[str, Any]], model: torch.nn.Module,
                            weight_decay: float, bias_lr_mult: float,
                            bias_decay_mult: float) -> list[dict[str, Any]]:
    """Split the biases of conv/linear layers (not BN's β) out of ``groups`` into groups of
    their own with Caffe's ``lr_mult`` and ``decay_mult`` (BVLC AlexNet train_val.prototxt:
    ``param { lr_mult: 2 decay_mult: 0 }`` on every bias). Unchanged when both are 1."""
    if bias_lr_mult == 1.0 and bias_decay_mult == 1.0:
        return groups
    norm_ids = norm_layer_params(model)
    bias_ids = {id(p) for name, p in model.named_parameters()
                if name.endswith("bias") and id(p) not in norm_ids}
    out = []
    for group in groups:
        rest = [p for p in group["params"] if id(p) not in bias_ids]
        biases = [p for p in group["params"] if id(p) in bias_ids]
        if rest:
            out.append({**group, "params": rest})
        if biases:
            decay = group.get("weight_decay", weight_decay)
            out.append({**group, "params": biases, "lr_mult": bias_lr_mult,
                        "weight_decay": decay * bias_decay_mult})
    return out


def _lars(model: torch.nn.Module, lr: float, weight_decay: float = 0.0, momentum: float = 0.9,
          trust_coefficient: float = 0.001, eps: float = 0.0, nesterov: bool = False,
          trust_clip: bool = False, skip_list: bool = True, trust_ratio_wd: bool = True,
          larc_clip: bool = False, bias_lr_mult: float = 1.0,
          bias_decay_mult: float = 1.0) -> torch.optim.Optimizer:
    """LARS; ``skip_list`` (default) is MLPerf's (BN and biases: no trust ratio, no weight
    decay), ``skip_list: false`` adapts and decays every tensor as the Caffe solvers did.
    ``bias_lr_mult``/``bias_decay_mult``: Caffe's per-bias multipliers (default 1: none)."""
    groups = _caffe_bias_multipliers(param_groups(model, weight_decay, skip_list), model,
                                     weight_decay, bias_lr_mult, bias_decay_mult)
    return LARS(groups, lr=lr, momentum=momentum,
                weight_decay=weight_decay, trust_coefficient=trust_coefficient, eps=eps,
                nesterov=nesterov, trust_clip=trust_clip, trust_ratio_wd=trust_ratio_wd,
                larc_clip=larc_clip)


def _sgd(model: torch.nn.Module, lr: float, weight_decay: float = 0.0, momentum: float = 0.9,
         nesterov: bool = False, bn_weight_decay: bool = True, bias_lr_mult: float = 1.0,
         bias_decay_mult: float = 1.0) -> torch.optim.Optimizer:
    """Momentum SGD (Goyal et al., arXiv:1706.02677); weight decay on every parameter, or, with
    ``bn_weight_decay: false``, not on BN's γ and β (Goyal et al. §5.1). ``bias_lr_mult`` and
    ``bias_decay_mult`` are Caffe's multipliers for conv/fc biases (BVLC AlexNet: 2 and 0).
    torch's v ← m·v + g; w ← w − lr·v needs no momentum correction (Goyal et al. §2.2)."""
    params = list(model.parameters())
    groups: list[dict[str, Any]] = [{"params": params, "weight_decay": weight_decay}]
    if not bn_weight_decay:
        norm_ids = norm_layer_params(model)
        groups = [{"params": [p for p in params if id(p) not in norm_ids],
                   "weight_decay": weight_decay},
                  {"params": [p for p in params if id(p) in norm_ids], "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
    groups = _caffe_bias_multipliers(groups, model, weight_decay, bias_lr_mult, bias_decay_mult)
    return torch.optim.SGD(groups, lr=lr, momentum=momentum,
                           weight_decay=weight_decay, nesterov=nesterov, foreach=True)


OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {"lars": _lars, "sgd": _sgd}

_KEYS = {
    "lars": {"momentum", "weight_decay", "trust_coefficient", "eps", "nesterov", "trust_clip",
             "skip_list", "trust_ratio_wd", "larc_clip", "bias_lr_mult", "bias_decay_mult"},
    "sgd": {"momentum", "weight_decay", "nesterov", "bn_weight_decay", "bias_lr_mult",
            "bias_decay_mult"},
}


def list_optimizers() -> list[str]:
    return sorted(OPTIMIZERS)


def create_optimizer(cfg: Mapping[str, Any], model: torch.nn.Module,
                     lr: float | None = None) -> torch.optim.Optimizer:
    """An optimizer from a recipe's ``optimizer`` section (``name`` plus that optimizer's keys).
    ``lr``: the initial rate, schedule(0), or ``cfg["lr"]``; default 0 (set before each step)."""
    name = cfg.get("name")
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer.name={name!r} is not one of {list_optimizers()}")
    kwargs = {k: v for k, v in cfg.items() if k not in ("name", "lr")}
    unknown = set(kwargs) - _KEYS[name]
    if unknown:
        raise ValueError(f"optimizer ({name}): unknown keys {sorted(unknown)}; "
                         f"known: {sorted(_KEYS[name])}")
    if lr is None:
        lr = float(cfg.get("lr", 0.0))
    optimizer = OPTIMIZERS[name](model, lr=float(lr), **kwargs)
    set_learning_rate(optimizer, float(lr))  # the groups with an lr_mult start at theirs
    return optimizer


def apply_momentum_correction(optimizer: torch.optim.Optimizer, factor: float) -> None:
    """Goyal et al.'s momentum correction for optimizers whose buffer holds lr·g (LARS);
    torch's SGD keeps lr out of its buffer, so it needs none and this leaves it alone."""
    # (a wrapper -- hpcdl.DistributedOptimizer, the sharded update -- holds it as .optimizer)
    if isinstance(getattr(optimizer, "optimizer", optimizer), LARS):
        optimizer.scale_momentum_(factor)


def steps_tensor_by_tensor(optimizer: torch.optim.Optimizer) -> bool:
    """Whether :func:`step_parameters` over disjoint parts equals one ``optimizer.step()``:
    LARS and torch's SGD themselves, not a wrapper or a subclass that may couple tensors."""
    return type(optimizer) in TENSOR_BY_TENSOR


def step_parameters(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """``optimizer.step()`` for ``params`` only, in their groups (rates, decay, LARS or not):
    each group's list narrowed for the call, so per-parameter state and the groups' keys are
    the optimizer's own. Stepping disjoint parts that cover every parameter equals one step
    where :func:`steps_tensor_by_tensor` says so."""
    chosen = {id(p) for p in params}
    groups = optimizer.param_groups
    full = [group["params"] for group in groups]
    try:
        for group, members in zip(groups, full, strict=True):
            group["params"] = [p for p in members if id(p) in chosen]
        optimizer.step()
    finally:
        for group, members in zip(groups, full, strict=True):
            group["params"] = members
