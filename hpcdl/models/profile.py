"""A model's profile: what one forward pass does, per image, operator by operator.

One traced forward serves the FLOP count (:func:`flops`), the planner's layer table
(hpcdl/plan/layers.py) and the job renderer's memory estimate (slurm/render.py). The trace is
one eval-mode forward with autograd on, forward hooks on every leaf module and a
``TorchFunctionMode`` for functions called outside leaves (``out + identity``); an empty batch
carries every shape at no arithmetic (one image where an operator rejects it). Counts are per
image: each tensor's elements past its batch dimension.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["Op", "flops", "profile"]


@dataclass(frozen=True)
class Op:
    """One operator of the forward pass, per image: a leaf module (``module`` set) or a torch
    function called outside every leaf module (``function`` set, ``module`` None)."""

    name: str                        # the module's qualified name, or the function's
    module: nn.Module | None = None
    function: str = ""
    macs: int = 0                    # forward multiply-adds (convolutions and linear layers)
    in_elements: int = 0             # the first input's elements
    out_elements: int = 0
    params: int = 0                  # the module's own parameters
    input_grad: bool = False         # the first input requires a gradient
    pixels: int = 0                  # a convolution's output positions (its GEMM rows)


def _per_image(t: Any) -> int:
    """Elements of one image's slice of a batched tensor (the batch may be empty)."""
    return math.prod(t.shape[1:]) if isinstance(t, torch.Tensor) and t.dim() > 0 else 0


def _macs(module: nn.Module, output: Any) -> int:
    if isinstance(module, nn.modules.conv._ConvNd):
        kernel = math.prod(module.kernel_size)
        return _per_image(output) * (module.in_channels // module.groups) * kernel
    if isinstance(module, nn.Linear):
        return _per_image(output) * module.in_features
    return 0


def _pixels(module: nn.Module, output: Any) -> int:
    if isinstance(module, nn.modules.conv._ConvNd) and isinstance(output, torch.Tensor):
        return math.prod(output.shape[2:])
    return 0


def profile(model: nn.Module, shape: Sequence[int], input_requires_grad: bool = False,
            leaves=None) -> list[Op]:
    """The operators of one forward of ``model`` on one input of ``shape`` (C, H, W) or
    (features,), in the order they ran (module docstring). ``leaves`` (a predicate on a leaf
    module; default every leaf) picks the modules recorded: functions called inside a picked
    module are its own and not recorded apart; inside any other module they are."""
    ops: list[Op] = []
    depth = [0]   # > 0 while inside a picked leaf module

    class Outside(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if depth[0] == 0 and isinstance(out, torch.Tensor):
                first = args[0] if args else None
                name = getattr(func, "__name__", "")
                ops.append(Op(name, function=name, in_elements=_per_image(first),
                              out_elements=_per_image(out)))
            return out

    names = {m: n for n, m in model.named_modules()}

    def enter(module: nn.Module, _inputs: tuple) -> None:
        depth[0] += 1

    def leave(module: nn.Module, inputs: tuple, output: Any) -> None:
        depth[0] -= 1
        first = inputs[0] if inputs else None
        ops.append(Op(names.get(module, type(module).__name__), module,
                      macs=_macs(module, output), in_elements=_per_image(first),
                      out_elements=_per_image(output),
                      params=sum(p.numel() for p in module.parameters(recurse=False)),
                      input_grad=bool(getattr(first, "requires_grad", False)),
                      pixels=_pixels(module, output)))

    hooks = []
    for module in model.modules():
        if next(module.children(), None) is None and (leaves is None or leaves(module)):
            hooks.append(module.register_forward_pre_hook(enter))
            hooks.append(module.register_forward_hook(leave))
    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    dtype = first.dtype if first is not None and first.is_floating_point() else torch.float32
    was_training = model.training
    try:
        model.eval()
        for batch in (0, 1):
            ops.clear()
            depth[0] = 0
            try:
                with torch.enable_grad(), Outside():
                    model(torch.zeros(batch, *shape, device=device, dtype=dtype,
                                      requires_grad=input_requires_grad))
                break
            except RuntimeError:
                if batch:
                    raise
    finally:
        model.train(was_training)
        for hook in hooks:
            hook.remove()
    return ops


def flops(model: nn.Module, input_size: int | Sequence[int]) -> int:
    """Multiply-adds of one forward pass on one image of ``input_size`` (H = W = input_size,
    or a (C, H, W) / (H, W) sequence; 3 channels unless given): the profile's convolutions and
    linear layers. BN, ReLU, pooling and additions are memory-bound and a rounding error in
    the total. ResNet-50 at 224 px counts ≈ 4.1 G (He et al. 2016, Table 1, report 3.8 G for
    v1; v1.5 moves the stride into the 3×3 and costs more)."""
    if isinstance(input_size, int):
        shape = (3, input_size, input_size)
    elif len(input_size) == 2:
        shape = (3, *input_size)
    elif len(input_size) == 3:
        shape = tuple(input_size)
    else:
        raise ValueError(f"flops: input_size must be H, (H, W) or (C, H, W), got {input_size}")
    dense = (nn.modules.conv._ConvNd, nn.Linear)
    return sum(op.macs for op in profile(model, shape, leaves=lambda m: isinstance(m, dense)))
