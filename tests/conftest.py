"""Fixtures shared by the serial and MPI tests: ImageNet-shaped trees (data_prep.synthetic),
tiny shards and the tiny recipe that trains on them, the planner's isolated directories, and a
clean ``hpcdl`` logger for every test."""
from __future__ import annotations

import logging

import pytest

from hpcdl.data_prep.synthetic import TreeInfo, make_imagenet_tree


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
    from hpcdl.data_prep.shard import shard_tree

    root = tmp_path_factory.mktemp("tiny")
    make_imagenet_tree(str(root / "tree"), num_classes=3, train_per_class=8, val_per_class=2,
                       size=(24, 20))
    shard_tree(str(root / "tree"), str(root / "shards"), shards=2, resize=20)
    return str(root / "shards")


TINY_RECIPE = """
name: tiny
model: {name: resnet_small, num_classes: 3, width: 4, layers: [1, 1, 1]}
data: {image_size: 16, workers: 1}
batch: {global: 4, per_rank: 2}
epochs: 2
optimizer: {name: lars, momentum: 0.9, weight_decay: 5.0e-5}
schedule: {name: poly, base_lr: 1.0, warmup_epochs: 0.5}
train: {seed: 1, log_every_steps: 2}
comm: {backend: mpi, bucket_mb: 0.004}
"""


@pytest.fixture(scope="session")
def tiny_recipe(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A LARS recipe for ``tiny_shards`` on 2 ranks (global batch 4): what the end-to-end
    ``mpiexec hpcdl train`` tests run. Read-only."""
    path = tmp_path_factory.mktemp("recipe") / "tiny.yaml"
    path.write_text(TINY_RECIPE)
    return str(path)


@pytest.fixture
def isolated_plan_dirs(tmp_path, monkeypatch):
    """No user config, machine files or cached layer tables leak into the planner (a layer
    table is counted once per test process: hpcdl.plan.layers keeps it in memory)."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("HPCDL_MACHINES_DIR", raising=False)
