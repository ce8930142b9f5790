"""What one image costs a model: its layer table, forward multiply-adds and the gradient to
allreduce.

Units: forward **multiply-accumulates** (MACs, the layer table's sum); a MAC is 2 FLOPs and a
training step counts as 3 forwards (Kaplan et al. 2020, §2.1), so
``train_flops_per_image = 3 × 2 × forward_macs``. Parameters are read from the model built on
PyTorch's ``meta`` device (shapes only).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from hpcdl.plan.cache import cache_key, read_cache
from hpcdl.plan.layers import Layer, layer_table, layers_cache_path, meta_model

FLOPS_PER_MAC = 2
TRAIN_FORWARDS = 3   # forward + backward-data + backward-weights, each ≈ one forward


@dataclass(frozen=True)
class Workload:
    """One model at one image size, as the cost model needs it."""

    model: str
    image_size: int
    forward_macs: float      # per image
    parameters: int          # trainable parameters = gradient elements per allreduce
    source: str
    layers: tuple[Layer, ...] = ()   # the layer table (hpcdl.plan.layers); () = not counted
    #: elements of each trainable parameter in registration order, as GradientReducer buckets
    #: them; () (a workload made by hand): the gradient is one tensor of ``parameters``
    parameter_elements: tuple[int, ...] = ()

    @property
    def train_flops_per_image(self) -> float:
        return TRAIN_FORWARDS * FLOPS_PER_MAC * self.forward_macs


def trainable_elements(model) -> tuple[int, ...]:
    return tuple(p.numel() for p in model.parameters() if p.requires_grad)


@functools.cache
def parameter_elements(model_name: str) -> tuple[int, ...]:
    """Each trainable parameter's elements of ``model_name``, in registration order."""
    return trainable_elements(meta_model(model_name))


def powersgd_compression_ratio(model_name: str, rank: int) -> float:
    """Dense gradient bytes ÷ the bytes hpcdl's PowerSGD sends at ``rank`` for ``model_name``
    (Vogels et al., NeurIPS'19: r·(n+m) per compressed n×m matrix, the rest dense; the same
    tensors as PyTorch's ``powerSGD_hook``): what ``hpcdl plan --compression-ratio`` takes."""
    from hpcdl.comm.powersgd import compressed_bytes

    model = meta_model(model_name)
    if rank < 1:
        raise ValueError(f"PowerSGD rank must be >= 1, got {rank}")
    shapes = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
    return sum(math.prod(s) for s in shapes) * 4 / compressed_bytes(shapes, rank)


def workload(model: str, image_size: int = 224, cache_path: str | None = None) -> Workload:
    """The cost of ``model`` at ``image_size``: its layer table (from the cache at
    ``cache_path``, default hpcdl.plan.layers', or counted once and cached), the forward MACs
    summed over it, and its parameters."""
    if image_size <= 0:
        raise ValueError(f"image size must be > 0, got {image_size}")
    path = cache_path or layers_cache_path()
    cached = cache_key(model, image_size) in read_cache(path)
    layers = layer_table(model, image_size, path)
    elements = parameter_elements(model)
    return Workload(model, image_size, sum(layer.macs for layer in layers), sum(elements),
                    f"cached in {path}" if cached else "hpcdl.models.profile", layers, elements)
