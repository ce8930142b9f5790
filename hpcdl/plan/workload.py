"""What one image costs a model: forward multiply-adds and the gradient bytes to allreduce.

Units, once and for all: ``hpcdl.models.flops`` returns forward **multiply-accumulates**
(MACs). One MAC is 2 floating-point operations, and a training step (forward + backward for
activations + backward for weights) is counted as 3 forwards, the usual convention (Kaplan et
al. 2020, §2.1; Goyal et al. 2017 count ResNet-50 as ~4 GMACs "FLOPs" forward), so::

    train_flops_per_image = 3 × 2 × forward_macs

Counting ResNet-50 forward MACs on a real 224 px tensor takes seconds, so results are cached
per (model, image size) in ``~/.cache/hpcdl/flops.json`` (hpcdl.plan.cache); models are
built on PyTorch's ``meta`` device where ``flops`` allows it (no memory, no arithmetic).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

from hpcdl.plan.cache import cache_key, cache_path, read_cache, update_cache
from hpcdl.plan.layers import LAYERS_CACHE_FILE, Layer, layer_table, meta_model

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


def flops_cache_path() -> str:
    return cache_path("flops.json")


def trainable_elements(model) -> tuple[int, ...]:
    return tuple(p.numel() for p in model.parameters() if p.requires_grad)


def _count(model_name: str, image_size: int) -> tuple[float, tuple[int, ...]]:
    """Forward MACs per image and each trainable parameter's elements, from hpcdl.models."""
    from hpcdl.models import create_model, flops

    model = meta_model(model_name)
    try:
        macs = flops(model, image_size)
    except Exception:  # noqa: BLE001 - flops may need real tensors; fall back to CPU memory
        model = create_model(model_name)
        macs = flops(model, image_size)
    return float(macs), trainable_elements(model)


def powersgd_compression_ratio(model_name: str, rank: int) -> float:
    """Dense gradient bytes ÷ the bytes hpcdl's PowerSGD sends at ``rank`` for ``model_name``
    (Vogels et al., NeurIPS'19: r·(n+m) per compressed n×m matrix, the rest dense; the same
    tensors as PyTorch's ``powerSGD_hook``): what ``hpcdl plan --compression-ratio`` takes."""
    import math

    from hpcdl.comm.powersgd import compressed_bytes

    model = meta_model(model_name)
    if rank < 1:
        raise ValueError(f"PowerSGD rank must be >= 1, got {rank}")
    shapes = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
    return sum(math.prod(s) for s in shapes) * 4 / compressed_bytes(shapes, rank)


def workload(model: str, image_size: int = 224, cache_path: str | None = None,
             with_layers: bool = False) -> Workload:
    """The cost of ``model`` at ``image_size``, from the cache or counted once and cached;
    ``with_layers`` adds its layer table (hpcdl.plan.layers, cached beside it), which the
    per-class compute term needs."""
    if image_size <= 0:
        raise ValueError(f"image size must be > 0, got {image_size}")
    work = _totals(model, image_size, cache_path)
    if with_layers:
        layers_path = (os.path.join(os.path.dirname(cache_path), LAYERS_CACHE_FILE)
                       if cache_path else None)
        work = replace(work, layers=layer_table(model, image_size, layers_path))
    return work


def _totals(model: str, image_size: int, cache_path: str | None) -> Workload:
    path = cache_path or flops_cache_path()
    key = cache_key(model, image_size)
    cached = read_cache(path).get(key)
    source = f"cached in {path}"
    if cached and "parameter_elements" not in cached:   # written before the list was kept
        cached = {**cached, "parameter_elements": list(trainable_elements(meta_model(model)))}
        update_cache(path, key, cached)
    if not cached:
        macs, elements = _count(model, image_size)
        cached = {"forward_macs": macs, "parameters": sum(elements),
                  "parameter_elements": list(elements)}
        update_cache(path, key, cached)
        source = "hpcdl.models.flops"
    elements = tuple(int(n) for n in cached["parameter_elements"])
    return Workload(model, image_size, float(cached["forward_macs"]), sum(elements), source,
                    parameter_elements=elements)
