"""Several nodes on one machine: HPCDL_RANKS_PER_NODE=k makes consecutive ranks act as nodes
of k, and every part that asks "which node am I on" gives the same answer
(docs/architecture.md).

Size-adaptive with k=2: 2 ranks = 1 node; 3 ranks = 2 + 1 (non-uniform); 4 ranks = 2 x 2.
At 4 ranks k=3 adds the non-uniform 3 + 1. Tiny synthetic shards, written once by rank 0."""
from __future__ import annotations

import argparse
import os

import h5py
import numpy as np
import pytest
import torch
from mpi4py import MPI

import hpcdl.comm
from hpcdl.cli.prep import run_stage
from hpcdl.data import ShardedImageNet
from hpcdl.data_prep.shard import MANIFEST, sha256_file, shard_tree
from hpcdl.data_prep.synthetic import make_imagenet_tree
from hpcdl.data_prep.verify import read_manifest
from hpcdl.debug.doctor import collect_rank_info, diagnose
from hpcdl.topology import RANKS_PER_NODE_ENV, node_layout
from hpcdl.train.config import config_from_dict
from hpcdl.train.ltfb import LTFB, LTFBOptions
from hpcdl.train.trainer import TrainOptions

TRAIN_SHARDS = 6


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> str:
    world = MPI.COMM_WORLD
    out = None
    if world.rank == 0:
        base = tmp_path_factory.mktemp("nodes")
        tree = make_imagenet_tree(str(base / "tree"), num_classes=3, train_per_class=12,
                                  val_per_class=2, size=(20, 20))
        out = str(base / "shards")
        shard_tree(tree.root, out, shards=TRAIN_SHARDS, val_shards=2)
    return world.bcast(out, root=0)


@pytest.fixture
def two_per_node(monkeypatch) -> int:
    monkeypatch.setenv(RANKS_PER_NODE_ENV, "2")
    return 2


def expected_place(rank: int, size: int, k: int) -> tuple[int, int, int, int]:
    """(node_index, num_nodes, local_rank, local_size): consecutive ranks fill nodes of k."""
    return rank // k, -(-size // k), rank % k, min(k, size - (rank // k) * k)


def test_switch_sets_the_communicator_topology(world, two_per_node):
    with hpcdl.comm.init("mpi") as comm:
        got = (comm.node_index, comm.num_nodes, comm.local_rank, comm.local_size)
    assert got == expected_place(world.rank, world.size, 2)


def test_node_layout_and_doctor_agree_with_the_communicator(world, two_per_node, shared_tmp):
    with hpcdl.comm.init("shm") as comm:
        topology = (comm.node_index, comm.num_nodes, comm.local_rank, comm.local_size)
    assert node_layout(world) == topology
    info = collect_rank_info(world, shared_tmp)
    assert (info["node_index"], info["num_nodes"], info["local_rank"],
            info["local_size"]) == topology
    findings = diagnose(world.allgather(info))
    assert [f.level for f in findings if f.check == "pretend-nodes"] == ["info"]


def test_a_bad_switch_value_is_refused_naming_it(world, monkeypatch):
    monkeypatch.setenv(RANKS_PER_NODE_ENV, "two")
    with pytest.raises(ValueError, match="HPCDL_RANKS_PER_NODE='two'"):
        node_layout(world)


def reference_average(world, numel: int) -> np.ndarray:
    """The float64 average of every rank's input, computed on each rank from the seeds."""
    inputs = [np.random.default_rng(100 + r).standard_normal(numel).astype(np.float32)
              for r in range(world.size)]
    return np.mean(np.stack(inputs).astype(np.float64), axis=0)


@pytest.mark.min_ranks(3)
@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("numel", [1, 1031, 300_007])
def test_hierarchical_allreduce_across_pretend_nodes(world, monkeypatch, k, numel):
    if k >= world.size:
        pytest.skip(f"{k} ranks per node is one node at {world.size} ranks")
    monkeypatch.setenv(RANKS_PER_NODE_ENV, str(k))
    mine = np.random.default_rng(100 + world.rank).standard_normal(numel).astype(np.float32)
    with hpcdl.comm.init("shm") as comm:
        assert comm.num_nodes == -(-world.size // k) > 1
        assert comm.uniform_nodes == (world.size % k == 0)
        buffer = comm.empty(numel)
        buffer.copy_(torch.from_numpy(mine))
        comm.allreduce_flat_(buffer, average=True)
        result = buffer.numpy().copy()  # the buffer is shared-window memory, freed by close
    np.testing.assert_allclose(result, reference_average(world, numel), rtol=1e-5, atol=1e-6)
    everyone = world.allgather(result.tobytes())
    assert all(b == everyone[0] for b in everyone)  # every rank holds the same bits


@pytest.mark.min_ranks(3)
def test_each_node_opens_only_its_own_shards(world, shards, two_per_node, monkeypatch):
    opened: list[str] = []
    real_file = h5py.File

    def recording_file(path, *args, **kwargs):
        opened.append(os.path.basename(path))
        return real_file(path, *args, **kwargs)

    monkeypatch.setattr(h5py, "File", recording_file)
    with hpcdl.comm.init("mpi") as comm:
        data = ShardedImageNet(shards, "train", node_index=comm.node_index,
                               num_nodes=comm.num_nodes, local_rank=comm.local_rank,
                               local_size=comm.local_size, batch_size=2, image_size=16,
                               workers=0)
        for _ in data:
            pass
        data.close()
        node, nodes = comm.node_index, comm.num_nodes
    index = {e["name"]: e["index"] for e in read_manifest(shards)["shards"]}
    assert opened and all(index[name] % nodes == node for name in opened), opened
    by_node: dict[int, set] = {}
    for n, names in world.allgather((node, opened)):
        by_node.setdefault(n, set()).update(names)
    for n, names in by_node.items():  # the node as a whole read all of its shards, no other
        assert {index[name] for name in names} == set(range(n, TRAIN_SHARDS, nodes))


@pytest.mark.min_ranks(3)
def test_prep_stage_copies_each_nodes_shards_into_its_own_directory(world, shards,
                                                                    two_per_node, shared_tmp):
    to = os.path.join(shared_tmp, "local-{node}")
    args = argparse.Namespace(shards=shards, to=to, splits="train,val", all=False)
    assert run_stage(args) == 0
    node, nodes, local_rank, _ = node_layout(world)
    manifest = read_manifest(shards)
    mine = os.path.join(shared_tmp, f"local-{node:02d}")
    expected = {e["name"]: e["sha256"] for e in manifest["shards"] if e["index"] % nodes == node}
    assert sorted(os.listdir(mine)) == sorted([*expected, MANIFEST])
    if local_rank == 0:  # verified: every staged file has the manifest's sha256
        assert {n: sha256_file(os.path.join(mine, n)) for n in expected} == expected
    assert run_stage(args) == 0  # a rerun finds everything present and copies nothing


@pytest.mark.min_ranks(4)
@pytest.mark.max_ranks(4)
def test_ltfb_trainers_on_different_nodes_play_a_tournament(world, shards, two_per_node,
                                                            shared_tmp):
    config = config_from_dict({
        "name": "tiny_ltfb_nodes",
        "model": {"name": "resnet_small", "num_classes": 3, "width": 4, "layers": [1, 1, 1]},
        "data": {"image_size": 16, "workers": 1},
        "batch": {"global": 4, "per_rank": 2},
        "epochs": 1,
        "optimizer": {"name": "lars", "momentum": 0.9},
        "schedule": {"name": "poly", "base_lr": 1.0, "warmup_epochs": 0.5},
        "train": {"seed": 3},
        "comm": {"backend": "auto", "bucket_mb": 0.004}})
    ltfb = LTFB(config, shards, os.path.join(shared_tmp, "ltfb"), world,
                LTFBOptions(trainers=2, interval=1, metric="loss", holdout_fraction=0.25),
                TrainOptions(deterministic=True, progress=False, max_steps=2, evaluate=False,
                             write_files=False))
    try:
        # trainer t is node t: its allreduce stays inside the node (shm, one node of 2)
        node, _, _, _ = node_layout(world)
        assert node == ltfb.index
        assert (ltfb.comm.num_nodes, ltfb.comm.local_size, ltfb.comm.backend) == (1, 2, "shm")
        ltfb.train()
        rounds = ltfb.rounds
    finally:
        ltfb.close()
    assert [r["partner"] for r in rounds] == [1 - ltfb.index] * 2  # across the nodes
    # each trainer judges on its own held-out set; its two ranks (one node) agree
    mine = [(ltfb.index, r["winner"]) for r in rounds]
    assert all(m == mine for i, m in enumerate(world.allgather(mine)) if i // 2 == ltfb.index)
