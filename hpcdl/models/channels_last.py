"""Which models oneDNN can train in channels_last: the layer that rules it out.

oneDNN's x64 1×1 convolution computes a strided 1×1's weight gradient from a compacted copy of
its input (its "reduce to unit stride" workspace, one slice per thread). In channels_last
(nhwc) the copy is addressed in blocks of ``ic_block`` input channels (8 on AVX2, 16 on
AVX-512) whatever the layer's own count, so a layer with fewer input channels writes past its
slice. Measured with torch 2.13 on AVX2 (docs/results/channels-last-strided-1x1-2026-12-07/):
a 1×1 stride-2 convolution of 2–7 input channels crashed on one thread (SIGSEGV, "free():
invalid next size") and, on two, hung in a oneDNN barrier or returned wrong gradients with no
error; 8 and more matched a float64 reference to float32's rounding on one and two threads.
Upstream, uxlfoundation/oneDNN#6035 reports the same, and on AVX-512 below 16. A model with
such a layer trains in the contiguous layout (hpcdl.cpus.memory_format_name). ImageNet's
models have none (AlexNet no 1×1, ResNet-50's strided 1×1s take 64–1024 channels); a narrow
test member (``resnet_small`` at width 4) has.
"""
from __future__ import annotations

from torch import nn

__all__ = ["ONEDNN_WIDEST_IC_BLOCK", "channels_last_unsafe_layer"]

#: the largest block of input channels oneDNN's x64 1×1 convolutions use (AVX-512; AVX2 uses
#: 8): below it a strided 1×1 layer is unsafe on every CPU, which the ISA oneDNN picks at
#: run time (ONEDNN_MAX_CPU_ISA, not torch's ATEN_CPU_CAPABILITY) cannot change
ONEDNN_WIDEST_IC_BLOCK = 16


def channels_last_unsafe_layer(model: nn.Module) -> str | None:
    """The first strided 1×1 convolution of ``model`` with fewer than
    :data:`ONEDNN_WIDEST_IC_BLOCK` input channels per group, described in one phrase (its
    name, stride and channels); None when the model has none. A frozen one counts too: its
    input's gradient takes the same compacted copy."""
    for name, module in model.named_modules():
        if not isinstance(module, nn.Conv2d):
            continue
        per_group = module.in_channels // module.groups
        if (module.kernel_size == (1, 1) and max(module.stride) > 1
                and per_group < ONEDNN_WIDEST_IC_BLOCK):
            stride = "x".join(str(s) for s in dict.fromkeys(module.stride))  # 2, or 2x1
            return (f"{name or type(model).__name__} (1x1 convolution, stride {stride}, "
                    f"{per_group} input channels)")
    return None
