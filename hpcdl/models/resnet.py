"""ResNet-50 v1 / v1.5 / v2 (He et al., CVPR'16 and ECCV'16) and small members for tests.

Parameter names follow torchvision's ResNet state_dict, so weights move between the two by
``load_state_dict``. The versions differ only inside the bottleneck: v1 (He et al. 2016) has a
down-sampling block's stride in the first 1×1, v1.5 (torchvision, MLPerf) in the 3×3, v2
("Identity Mappings", ECCV'16) is pre-activation with a final BN-ReLU (``bn_final``) and a
conv-only projection shortcut. ``zero_init_residual=True`` zeroes each residual branch's last
BN γ, so every block starts as the identity (Goyal et al., arXiv:1706.02677 §5.1).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from hpcdl.models.registry import register_model

__all__ = ["ResNet", "Bottleneck", "PreActBottleneck", "BasicBlock"]


def conv3x3(in_ch: int, out_ch: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False)


def conv1x1(in_ch: int, out_ch: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """Two 3×3 convs (ResNet-18/34 block), used by the small members."""

    expansion = 1

    def __init__(self, in_ch: int, width: int, stride: int = 1,
                 downsample: nn.Module | None = None, stride_in_1x1: bool = False) -> None:
        super().__init__()
        self.conv1 = conv3x3(in_ch, width, stride)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = conv3x3(width, width)
        self.bn2 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def last_bn(self) -> nn.BatchNorm2d:
        return self.bn2

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    """1×1 → 3×3 → 1×1 (×4 channels); the stride sits in the 3×3 (v1.5) or the first 1×1 (v1)."""

    expansion = 4

    def __init__(self, in_ch: int, width: int, stride: int = 1,
                 downsample: nn.Module | None = None, stride_in_1x1: bool = False) -> None:
        super().__init__()
        out_ch = width * self.expansion
        self.conv1 = conv1x1(in_ch, width, stride if stride_in_1x1 else 1)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = conv3x3(width, width, 1 if stride_in_1x1 else stride)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = conv1x1(width, out_ch)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def last_bn(self) -> nn.BatchNorm2d:
        return self.bn3

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class PreActBottleneck(nn.Module):
    """Pre-activation bottleneck (He et al., ECCV'16, Fig. 4e): BN-ReLU-conv three times; the
    projection shortcut reads the pre-activated input."""

    expansion = 4

    def __init__(self, in_ch: int, width: int, stride: int = 1,
                 downsample: nn.Module | None = None, stride_in_1x1: bool = False) -> None:
        super().__init__()
        out_ch = width * self.expansion
        self.bn1 = nn.BatchNorm2d(in_ch)
        self.conv1 = conv1x1(in_ch, width)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv2 = conv3x3(width, width, stride)
        self.bn3 = nn.BatchNorm2d(width)
        self.conv3 = conv1x1(width, out_ch)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def last_bn(self) -> nn.BatchNorm2d:
        # γ = 0 here zeroes the input of conv3, so the branch starts at 0 as in v1.
        return self.bn3

    def forward(self, x: Tensor) -> Tensor:
        preact = self.relu(self.bn1(x))
        identity = x if self.downsample is None else self.downsample(preact)
        out = self.conv1(preact)
        out = self.conv2(self.relu(self.bn2(out)))
        out = self.conv3(self.relu(self.bn3(out)))
        return out + identity


class ResNet(nn.Module):
    """A ResNet: stem, four (or fewer) stages of blocks, global average pool, ``fc``.

    ``small_stem=True`` replaces the 7×7/2 conv and 3×3/2 max-pool by one 3×3/1 conv, for
    28–64 px inputs (as in He et al.'s CIFAR networks)."""

    def __init__(self, block: type[nn.Module], layers: Sequence[int], num_classes: int = 1000,
                 width: int = 64, stride_in_1x1: bool = False, zero_init_residual: bool = False,
                 small_stem: bool = False) -> None:
        super().__init__()
        self.preact = block is PreActBottleneck
        self.in_ch = width
        if small_stem:
            self.conv1 = conv3x3(3, width)
        else:
            self.conv1 = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.Identity() if small_stem else nn.MaxPool2d(3, stride=2, padding=1)
        for i, blocks in enumerate(layers):
            stage = self._make_stage(block, width * 2 ** i, blocks, 1 if i == 0 else 2,
                                     stride_in_1x1)
            setattr(self, f"layer{i + 1}", stage)
        self.num_stages = len(layers)
        self.bn_final = nn.BatchNorm2d(self.in_ch) if self.preact else None
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(self.in_ch, num_classes)
        self._init_weights(zero_init_residual)

    def _make_stage(self, block: type[nn.Module], width: int, blocks: int, stride: int,
                    stride_in_1x1: bool) -> nn.Sequential:
        out_ch = width * block.expansion
        downsample = None
        if stride != 1 or self.in_ch != out_ch:
            if self.preact:
                downsample = nn.Sequential(conv1x1(self.in_ch, out_ch, stride))
            else:
                downsample = nn.Sequential(conv1x1(self.in_ch, out_ch, stride),
                                           nn.BatchNorm2d(out_ch))
        layers = [block(self.in_ch, width, stride, downsample, stride_in_1x1)]
        self.in_ch = out_ch
        layers += [block(out_ch, width) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def _init_weights(self, zero_init_residual: bool) -> None:
        # He et al. (ICCV'15) normal init for convs, BN as identity: torchvision's choice.
        for m in self.modules():
            if isinstance(m, nn.Conv2d) and m.weight.is_meta:
                # A meta model (shapes, names, counts) has no values to draw; torch's normal_
                # on meta goes through a Python decomposition that takes seconds to import.
                continue
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        if zero_init_residual:
            for m in self.modules():
                if isinstance(m, (BasicBlock, Bottleneck, PreActBottleneck)):
                    nn.init.zeros_(m.last_bn().weight)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for i in range(self.num_stages):
            x = getattr(self, f"layer{i + 1}")(x)
        if self.bn_final is not None:
            x = self.relu(self.bn_final(x))
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)


_RESNET50_LAYERS = (3, 4, 6, 3)


@register_model("resnet50")
def resnet50(num_classes: int = 1000, zero_init_residual: bool = False) -> ResNet:
    """ResNet-50 v1.5 (stride in the 3×3), 25,557,032 parameters: torchvision's, MLPerf's."""
    return ResNet(Bottleneck, _RESNET50_LAYERS, num_classes,
                  zero_init_residual=zero_init_residual)


@register_model("resnet50_v1")
def resnet50_v1(num_classes: int = 1000, zero_init_residual: bool = False) -> ResNet:
    """ResNet-50 v1 (He et al. 2016): stride in the first 1×1 of a down-sampling block."""
    return ResNet(Bottleneck, _RESNET50_LAYERS, num_classes, stride_in_1x1=True,
                  zero_init_residual=zero_init_residual)


@register_model("resnet50_v2")
def resnet50_v2(num_classes: int = 1000, zero_init_residual: bool = False) -> ResNet:
    """ResNet-50 v2, pre-activation (He et al., "Identity Mappings in Deep Residual Networks")."""
    return ResNet(PreActBottleneck, _RESNET50_LAYERS, num_classes,
                  zero_init_residual=zero_init_residual)


@register_model("resnet_small")
def resnet_small(num_classes: int = 10, width: int = 16, layers: Sequence[int] = (1, 1, 1),
                 zero_init_residual: bool = False) -> ResNet:
    """A narrow, shallow ResNet for 28–64 px images, tests and the demo: 3×3 stem, no
    max-pool, basic blocks, stages of width ``width``·(1, 2, 4) at strides (1, 2, 2)."""
    return ResNet(BasicBlock, layers, num_classes, width=width, small_stem=True,
                  zero_init_residual=zero_init_residual)


@register_model("resnet50_small")
def resnet50_small(num_classes: int = 10, width: int = 8, layers: Sequence[int] = (1, 1, 1, 1),
                   zero_init_residual: bool = False) -> ResNet:
    """ResNet-50's bottleneck code at small width and depth, for fast tests of the same path."""
    return ResNet(Bottleneck, layers, num_classes, width=width, small_stem=True,
                  zero_init_residual=zero_init_residual)
