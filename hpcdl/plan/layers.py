"""A model's layer table: every operator of one training step, classed by how it is costed.

A roofline per operator (Williams, Waterman & Patterson, CACM 2009): dense operators by their
FLOPs at a per-class rate, memory-bound passes by the bytes they move (:data:`PASSES`) at the
stream rate. Each :class:`Layer` holds per image its forward MACs, fp32 activation and
parameter bytes, whether backward computes the input's gradient (not for the first layer)
and, for a convolution, its output positions (its GEMM rows per image: a convolution's rate
follows its rows, not its FLOPs alone). The table is read from the model's profile
(hpcdl.models.profile) and cached per (model, image size) by hpcdl.plan.cache. The classes
and why one fraction of peak cannot cost two models: docs/planner.md, "Compute by operator
class".
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from hpcdl.plan.cache import cache_key, cache_path, read_cache, update_cache

COMPUTE_CLASSES = ("conv_large", "conv_1x1", "conv_3x3", "conv_grouped", "linear")
MEMORY_CLASSES = ("batch_norm", "relu", "add", "pool", "dropout", "lrn")
OP_CLASSES = COMPUTE_CLASSES + MEMORY_CLASSES
BYTES_PER_ELEMENT = 4   # fp32 activations

# Nominal bytes moved, forward + backward, per byte of (input, output) activation of one
# memory-bound operator (torch's CPU kernels, training mode). These fix the *shape* of the
# cost; the machine file's per-class efficiency (calibrated) absorbs what they miss.
#   batch_norm: fwd statistics pass reads x, normalise reads x writes y; bwd reduction pass
#               reads dy and x, then reads dy and x and writes dx          -> 8 x out
#   relu:       fwd reads x writes y; bwd reads dy and y writes dx          -> 5 x out
#   add:        fwd reads a, b writes c; bwd sums the two gradients at the fork -> 6 x out
#   pool (max): fwd reads x writes y and int64 indices (2 floats); bwd zero-fills dx, reads
#               dy and indices -> 2 x in + 6 x out (average pooling reads less; same class)
#   dropout:    fwd writes a bool mask, reads x writes y; bwd reads dy and mask writes dx
#                                                                           -> 4.5 x out
#   lrn:        torch's LocalResponseNorm is ~8 functional passes (square, pad, 3-D average
#               pool, scale, pow, divide) forward and ~twice that backward  -> 24 x out
PASSES: dict[str, tuple[float, float]] = {
    "batch_norm": (0.0, 8.0), "relu": (0.0, 5.0), "add": (0.0, 6.0), "pool": (2.0, 6.0),
    "dropout": (0.0, 4.5), "lrn": (0.0, 24.0),
}
# A linear layer's weight is read forward, read for the input gradient and its gradient
# written backward: the floor on its time at small batch (the weights stream from memory).
LINEAR_WEIGHT_PASSES = 3.0
# That floor's rate is a figure of its own (``compute.linear_weights``), not the stream rate:
# a weight gradient above glibc's 32 MiB mmap ceiling pays first-touch page faults every
# step, and a GEMM of a few rows streams its weight below ``a += b``'s rate.
LINEAR_WEIGHTS = "linear_weights"
# The LARS update after the allreduce (You et al. ICPP'18, Alg. 1), memory-bound: ||w||, ||g||
# read w, g (8 B); the update reads g, w, m (12 B), writes m, w (8 B); the final w -= m re-reads
# them (4 B): ~32 nominal bytes per fp32 parameter, moved at ``compute.optimizer`` (a fraction
# of the stream, calibrated on hpcdl's LARS, which moves more than these nominal bytes).
OPTIMIZER = "optimizer"
OPTIMIZER_BYTES_PER_PARAMETER = 32.0


@dataclass(frozen=True)
class Layer:
    """One operator of the forward pass, per image."""

    name: str
    op_class: str
    macs: float = 0.0            # forward multiply-accumulates
    in_bytes: float = 0.0        # input activation
    out_bytes: float = 0.0       # output activation
    param_bytes: float = 0.0
    input_grad: bool = True      # backward computes the input's gradient
    pixels: float = 0.0          # a convolution's output positions: its GEMM rows per image

    @property
    def train_flops(self) -> float:
        """2 FLOPs per MAC × (forward + weight gradient + input gradient when needed)."""
        return 2.0 * self.macs * (3.0 if self.input_grad else 2.0)

    def memory_bytes(self) -> float:
        """Bytes moved forward + backward by a memory-bound pass (:data:`PASSES`)."""
        per_in, per_out = PASSES[self.op_class]
        return per_in * self.in_bytes + per_out * self.out_bytes


def conv_class(kernel: Sequence[int], in_channels: int, groups: int) -> str:
    """The shape class of a convolution (docs/planner.md's class table)."""
    if groups > 1:
        return "conv_grouped"
    if max(kernel) >= 5 or in_channels <= 4:
        return "conv_large"
    if max(kernel) == 1:
        return "conv_1x1"
    return "conv_3x3"


def module_class(module: Any) -> str | None:
    """The class of a leaf module, or None for modules that cost nothing (Flatten, Identity)."""
    from torch import nn

    if isinstance(module, nn.modules.conv._ConvNd):
        return conv_class(tuple(module.kernel_size), module.in_channels, module.groups)
    table = ((nn.Linear, "linear"), (nn.modules.batchnorm._NormBase, "batch_norm"),
             (nn.LocalResponseNorm, "lrn"), ((nn.ReLU, nn.ReLU6, nn.LeakyReLU), "relu"),
             ((nn.modules.pooling._MaxPoolNd, nn.modules.pooling._AvgPoolNd,
               nn.modules.pooling._AdaptiveAvgPoolNd, nn.modules.pooling._AdaptiveMaxPoolNd),
              "pool"), (nn.modules.dropout._DropoutNd, "dropout"))
    for kinds, op_class in table:
        if isinstance(module, kinds):
            return op_class
    return None


# Functions a model may call outside its leaf modules, and their class.
FUNCTION_CLASSES = {"add": "add", "add_": "add", "__add__": "add", "__iadd__": "add",
                    "__radd__": "add", "relu": "relu", "relu_": "relu",
                    "max_pool2d": "pool", "adaptive_avg_pool2d": "pool", "avg_pool2d": "pool",
                    "dropout": "dropout"}


def count_layers(model: Any, image_size: int, input_shape: Sequence[int] | None = None,
                 input_requires_grad: bool = False) -> list[Layer]:
    """The layer table of ``model`` on one ``image_size`` image, or on one input of
    ``input_shape`` (C, H, W) or (features,) -- calibration's single layers."""
    from hpcdl.models.profile import profile

    shape = tuple(input_shape) if input_shape else (3, image_size, image_size)
    layers: list[Layer] = []
    costed = profile(model, shape, input_requires_grad,
                     leaves=lambda m: module_class(m) is not None)
    for op in costed:
        if op.module is None:
            if op.function in FUNCTION_CLASSES:
                layers.append(Layer(f"{op.function}#{len(layers)}",
                                    FUNCTION_CLASSES[op.function],
                                    in_bytes=float(op.in_elements * BYTES_PER_ELEMENT),
                                    out_bytes=float(op.out_elements * BYTES_PER_ELEMENT)))
            continue
        layers.append(Layer(op.name, module_class(op.module), macs=float(op.macs),
                            in_bytes=float(op.in_elements * BYTES_PER_ELEMENT),
                            out_bytes=float(op.out_elements * BYTES_PER_ELEMENT),
                            param_bytes=float(op.params * BYTES_PER_ELEMENT),
                            input_grad=op.input_grad, pixels=float(op.pixels)))
    return layers


def class_totals(layers: Iterable[Layer]) -> dict[str, dict[str, float]]:
    """Per class: layer count, train FLOPs and memory-pass bytes per image."""
    totals: dict[str, dict[str, float]] = {}
    for layer in layers:
        t = totals.setdefault(layer.op_class, {"layers": 0, "train_flops": 0.0, "bytes": 0.0})
        t["layers"] += 1
        t["train_flops"] += layer.train_flops
        if layer.op_class in PASSES:
            t["bytes"] += layer.memory_bytes()
    return totals


# --------------------------------------------------------------------------- cache
# v2: tables with ``pixels``. A v1 record would load with pixels 0 and silently cost its
# convolutions without their rows, so v2 is a new file, not a new field in the old one.
LAYERS_CACHE_FILE = "layers-v2.json"


def layers_cache_path() -> str:
    return cache_path(LAYERS_CACHE_FILE)


_MEMO: dict[str, tuple[Layer, ...]] = {}   # one process counts a table once


def meta_model(model_name: str) -> Any:
    """``model_name`` from hpcdl.models on PyTorch's meta device: shapes, no memory, no
    weight initialisation."""
    import torch

    from hpcdl.models import create_model, list_models

    if model_name not in list_models():
        raise ValueError(f"unknown model {model_name!r}; known: {list_models()}")
    with torch.device("meta"):
        return create_model(model_name)


def layer_table(model: str, image_size: int, cache_file: str | None = None) -> tuple[Layer, ...]:
    """The layer table of ``model`` at ``image_size``, from the cache or counted once."""
    path = cache_file or layers_cache_path()
    key = cache_key(model, image_size)
    if key in _MEMO:   # counted in this process: a cache file that lacks it gets it too
        if key not in read_cache(path):
            update_cache(path, key, [asdict(layer) for layer in _MEMO[key]])
        return _MEMO[key]
    cached = read_cache(path).get(key)
    if cached:
        with contextlib.suppress(TypeError):   # written by another version: recount
            return tuple(Layer(**dict(record)) for record in cached)
    table = tuple(count_layers(meta_model(model).to_empty(device="cpu"), image_size))
    _MEMO[key] = table
    update_cache(path, key, [asdict(layer) for layer in table])
    return table
