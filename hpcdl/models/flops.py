"""Forward multiply-adds of a model, from its profile's conv and linear layers.

ResNet-50 at 224 px counts ≈ 4.1 G (He et al. 2016, Table 1, report 3.8 G for v1; v1.5 moves
the stride into the 3×3 and costs more). Only Conv*d and Linear count: BN, ReLU, pooling and
additions are memory-bound and a rounding error in the total.
"""
from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from hpcdl.models.profile import input_shape, profile

__all__ = ["flops"]


def flops(model: nn.Module, input_size: int | Sequence[int]) -> int:
    """Multiply-adds of one forward pass on one image of ``input_size`` (H = W = input_size,
    or a (C, H, W) / (H, W) sequence; 3 channels unless given), from one traced forward
    (:func:`hpcdl.models.profile.profile`: eval mode, restored after; BN statistics
    untouched)."""
    try:
        shape = input_shape(input_size)
    except ValueError as exc:
        raise ValueError(f"flops: {exc}") from None
    dense = (nn.modules.conv._ConvNd, nn.Linear)
    return sum(op.macs for op in profile(model, shape, leaves=lambda m: isinstance(m, dense)))
