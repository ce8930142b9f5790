"""AlexNet in its single-tower "one weird trick" form (Krizhevsky, arXiv:1404.5997) and
AlexNet-BN, the variant You et al. trained at 32K batch (arXiv:1708.03888 §5, 1709.05011).

``alexnet`` has torchvision's layout and names (``features.N``, ``classifier.N``) and its
61,100,840 parameters at 1000 classes. ``alexnet_bn`` puts BatchNorm after every convolution
and after fc6 and fc7 and drops LRN: with plain AlexNet, LARS alone did not reach the baseline
accuracy at 8K+, with BN it did (1708.03888, Table 3).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from hpcdl.models.registry import register_model

__all__ = ["AlexNet"]

# (out_channels, kernel, stride, padding, max-pool after) for conv1..conv5 (1404.5997).
_ALEXNET_CONVS = ((64, 11, 4, 2, True), (192, 5, 1, 2, True), (384, 3, 1, 1, False),
                  (256, 3, 1, 1, False), (256, 3, 1, 1, True))


def _features(convs: tuple[tuple[int, int, int, int, bool], ...], batch_norm: bool,
              pool: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    in_ch = 3
    for out_ch, kernel, stride, padding, pooled in convs:
        # A conv followed by BN needs no bias: BN's β plays its part.
        layers.append(nn.Conv2d(in_ch, out_ch, kernel, stride=stride, padding=padding,
                                bias=not batch_norm))
        if batch_norm:
            layers.append(nn.BatchNorm2d(out_ch))
        layers.append(nn.ReLU(inplace=True))
        if pooled:
            layers.append(nn.MaxPool2d(pool, stride=2))
        in_ch = out_ch
    return nn.Sequential(*layers)


def _classifier(in_features: int, hidden: int, num_classes: int, batch_norm: bool,
                dropout: float) -> nn.Sequential:
    layers: list[nn.Module] = []
    for fan_in in (in_features, hidden):  # fc6, fc7
        if dropout > 0:
            layers.append(nn.Dropout(dropout))
        layers.append(nn.Linear(fan_in, hidden, bias=not batch_norm))
        if batch_norm:
            layers.append(nn.BatchNorm1d(hidden))
        layers.append(nn.ReLU(inplace=True))
    layers.append(nn.Linear(hidden, num_classes))  # fc8
    return nn.Sequential(*layers)


class AlexNet(nn.Module):
    """features → adaptive average pool to ``pooled``×``pooled`` → classifier."""

    def __init__(self, convs: tuple[tuple[int, int, int, int, bool], ...], hidden: int,
                 num_classes: int, batch_norm: bool, dropout: float, pooled: int = 6,
                 pool: int = 3) -> None:
        super().__init__()
        self.features = _features(convs, batch_norm, pool)
        self.avgpool = nn.AdaptiveAvgPool2d((pooled, pooled))
        self.classifier = _classifier(convs[-1][0] * pooled * pooled, hidden, num_classes,
                                      batch_norm, dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


@register_model("alexnet")
def alexnet(num_classes: int = 1000, dropout: float = 0.5) -> AlexNet:
    """AlexNet, one tower (arXiv:1404.5997): 61,100,840 parameters at 1000 classes."""
    return AlexNet(_ALEXNET_CONVS, 4096, num_classes, batch_norm=False, dropout=dropout)


@register_model("alexnet_bn")
def alexnet_bn(num_classes: int = 1000, dropout: float = 0.5) -> AlexNet:
    """AlexNet-BN (You et al., arXiv:1708.03888): BN after conv1–5, fc6 and fc7, no LRN."""
    return AlexNet(_ALEXNET_CONVS, 4096, num_classes, batch_norm=True, dropout=dropout)


@register_model("alexnet_bn_small")
def alexnet_bn_small(num_classes: int = 10, width: int = 32, dropout: float = 0.0) -> AlexNet:
    """AlexNet-BN's shape for 28–64 px: five 3×3 convs of width ``width``·(1, 2, 3, 3, 2),
    2×2 max-pools after conv1, conv2 and conv5, pooled to 2×2, fc6/fc7 of 8·``width``."""
    convs = ((width, 3, 1, 1, True), (2 * width, 3, 1, 1, True), (3 * width, 3, 1, 1, False),
             (3 * width, 3, 1, 1, False), (2 * width, 3, 1, 1, True))
    return AlexNet(convs, 8 * width, num_classes, batch_norm=True, dropout=dropout, pooled=2,
                   pool=2)
