"""AlexNet in its single-tower "one weird trick" form (Krizhevsky, arXiv:1404.5997) and
AlexNet-BN, the variant You et al. trained at 32K batch (arXiv:1708.03888 §5, 1709.05011).

``alexnet`` has torchvision's layout and names (``features.N``, ``classifier.N``) and its
61,100,840 parameters at 1000 classes. ``alexnet_bn`` puts BatchNorm after every convolution
and after fc6 and fc7 and drops LRN: with plain AlexNet, LARS alone did not reach the baseline
accuracy at 8K+, with BN it did (1708.03888, Table 3).
"""
from __future__ import annotations

from collections import OrderedDict

import torch
from torch import Tensor, nn

from hpcdl.models.registry import register_model

__all__ = ["AlexNet", "CaffeAlexNet"]

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


# -- the Caffe networks the papers ran, layer for layer ----------------------------------------
# (out_channels, kernel, stride, padding, groups) of conv1..conv5 in BVLC's two-tower AlexNet
# (BVLC/caffe models/bvlc_alexnet/train_val.prototxt), which NVCaffe's AlexNet-BN keeps.
_CAFFE_CONVS = ((96, 11, 4, 0, 1), (256, 5, 1, 2, 2), (384, 3, 1, 1, 1), (384, 3, 1, 1, 2),
                (256, 3, 1, 1, 2))
# Bias fillers of conv1..conv5, fc6, fc7, fc8 (bvlc_alexnet/train_val.prototxt; NVCaffe's
# alexnet_bn/train_val2.prototxt fills every bias with 0.01 except fc6/fc7's 0.1).
_BVLC_BIASES = (0.0, 0.1, 0.0, 0.1, 0.1, 0.1, 0.1, 0.0)
_NVCAFFE_BIASES = (0.01, 0.01, 0.01, 0.01, 0.01, 0.1, 0.1, 0.01)


def _caffe_bn(channels: int) -> nn.BatchNorm2d:
    """Caffe's BatchNorm with ``scale_bias: false``: normalisation only, no γ/β. eps 1e-4 and
    ``moving_average_fraction: 0.9`` (Caffe keeps 0.9 of the old estimate, torch's momentum is
    the weight of the new one: 1 − 0.9 = 0.1)."""
    return nn.BatchNorm2d(channels, eps=1e-4, momentum=0.1, affine=False)


class CaffeAlexNet(nn.Module):
    """BVLC AlexNet (``lrn=True``) or NVCaffe's AlexNet-BN (``batch_norm=True``) as the
    prototxt lays it out: conv-ReLU[-LRN]-pool, groups of 2 on conv2/4/5, biases on every conv
    and fc, pool5 of 256×6×6 at 227 px, fc6/fc7 4096 with dropout 0.5 after their ReLU, Caffe's
    Gaussian fillers (std 0.01, fc6/fc7 0.005). Names: ``conv1``..``conv5``, ``fc6``..``fc8``,
    ``bn2``..``bn5`` (after pool1, pool2, relu3, relu4, as NVCaffe names them)."""

    def __init__(self, num_classes: int, lrn: bool, batch_norm: bool, biases: tuple[float, ...],
                 dropout: float = 0.5) -> None:
        super().__init__()
        layers: list[tuple[str, nn.Module]] = []
        in_ch = 3
        for i, (out_ch, kernel, stride, pad, groups) in enumerate(_CAFFE_CONVS, start=1):
            layers.append((f"conv{i}", nn.Conv2d(in_ch, out_ch, kernel, stride, pad,
                                                 groups=groups)))
            layers.append((f"relu{i}", nn.ReLU(inplace=True)))
            if lrn and i in (1, 2):
                # torch divides alpha by size as Caffe's ACROSS_CHANNELS LRN does.
                layers.append((f"norm{i}", nn.LocalResponseNorm(5, alpha=1e-4, beta=0.75, k=1.0)))
            if i in (1, 2, 5):
                layers.append((f"pool{i}", nn.MaxPool2d(3, stride=2)))
            if batch_norm and i in (1, 2, 3, 4):
                layers.append((f"bn{i + 1}", _caffe_bn(out_ch)))
            in_ch = out_ch
        self.features = nn.Sequential(OrderedDict(layers))
        # Identity at 227 px (pool5 is 6×6); lets the same net run on smaller test images.
        self.avgpool = nn.AdaptiveAvgPool2d((6, 6))
        self.classifier = nn.Sequential(OrderedDict([
            ("fc6", nn.Linear(256 * 6 * 6, 4096)), ("relu6", nn.ReLU(inplace=True)),
            ("drop6", nn.Dropout(dropout)),
            ("fc7", nn.Linear(4096, 4096)), ("relu7", nn.ReLU(inplace=True)),
            ("drop7", nn.Dropout(dropout)),
            ("fc8", nn.Linear(4096, num_classes))]))
        self._caffe_init(biases)

    def _caffe_init(self, biases: tuple[float, ...]) -> None:
        layers = [m for m in self.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
        for layer, bias in zip(layers, biases, strict=True):
            if layer.weight.is_meta:
                continue  # shapes only (see ResNet._init_weights)
            std = 0.005 if layer in (self.classifier.fc6, self.classifier.fc7) else 0.01
            nn.init.normal_(layer.weight, std=std)
            nn.init.constant_(layer.bias, bias)

    forward = AlexNet.forward  # features -> average pool -> classifier, as AlexNet's


@register_model("alexnet_bvlc")
def alexnet_bvlc(num_classes: int = 1000, dropout: float = 0.5) -> CaffeAlexNet:
    """BVLC AlexNet (Krizhevsky et al. 2012 as in BVLC/caffe models/bvlc_alexnet): LRN after
    relu1/relu2, groups of 2 on conv2/4/5; 60,965,224 parameters at 1000 classes."""
    return CaffeAlexNet(num_classes, lrn=True, batch_norm=False, biases=_BVLC_BIASES,
                        dropout=dropout)


@register_model("alexnet_bn_nvcaffe")
def alexnet_bn_nvcaffe(num_classes: int = 1000, dropout: float = 0.5) -> CaffeAlexNet:
    """The LARS paper's AlexNet-BN (You, Gitman & Ginsburg, arXiv:1708.03888; borisgin/nvcaffe
    models/alexnet_bn/train_val2.prototxt): BVLC widths and groups, no LRN, four BatchNorms
    without scale/shift after pool1, pool2, relu3 and relu4; 60,965,224 parameters."""
    return CaffeAlexNet(num_classes, lrn=False, batch_norm=True, biases=_NVCAFFE_BIASES,
                        dropout=dropout)
