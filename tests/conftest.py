"""Fixtures shared by the serial and MPI tests: ImageNet-shaped trees (data_prep.synthetic),
and a clean ``hpcdl`` logger for every test."""
from __future__ import annotations

import logging

import pytest

from data_prep.synthetic import TreeInfo, make_imagenet_tree


@pytest.fixture(autouse=True)
def _fresh_hpcdl_logger():
    """setup_rank_logging gives the ``hpcdl`` logger its own handlers and stops propagation
    (as a run wants); undo that after each test so caplog sees the next test's messages."""
    yield
    logger = logging.getLogger("hpcdl")
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    logger.propagate = True
    logger.setLevel(logging.NOTSET)


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


@pytest.fixture(scope="session")
def tiny_shards(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Shards of a tiny clean tree (3 classes x 8 train / 2 val, 24x20, 2 shards) for tests
    that launch a whole `mpiexec hpcdl train`; built once per session. Read-only."""
    from data_prep.shard import shard_tree

    root = tmp_path_factory.mktemp("tiny")
    make_imagenet_tree(str(root / "tree"), num_classes=3, train_per_class=8, val_per_class=2,
                       size=(24, 20))
    shard_tree(str(root / "tree"), str(root / "shards"), shards=2, resize=20)
    return str(root / "shards")
