"""Fixtures shared by the serial and MPI tests: ImageNet-shaped trees (data_prep.synthetic)."""
from __future__ import annotations

import pytest

from data_prep.synthetic import TreeInfo, make_imagenet_tree


@pytest.fixture(scope="session")
def quirky_tree(tmp_path_factory: pytest.TempPathFactory) -> TreeInfo:
    """A tiny tree (40x30 images) with every ILSVRC2012 quirk and a flat val/ labelled by
    LOC_val_solution.csv. Read-only: shard it, do not edit it."""
    root = tmp_path_factory.mktemp("quirky") / "imagenet"
    return make_imagenet_tree(str(root), num_classes=3, train_per_class=8, val_per_class=2,
                              quirks=True, val_layout="flat")


@pytest.fixture(scope="session")
def clean_tree(tmp_path_factory: pytest.TempPathFactory) -> TreeInfo:
    """A tiny tree without defects, val/ in class folders: 4 classes x 10 train, x 3 val."""
    root = tmp_path_factory.mktemp("clean") / "imagenet"
    return make_imagenet_tree(str(root), num_classes=4, train_per_class=10, val_per_class=3)
