"""ShardedImageNet under real ranks: every rank yields the same number of batches (so a
per-batch allreduce cannot hang), ranks read disjoint samples, val covers the data once."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from mpi4py import MPI

from hpcdl.data import ShardedImageNet, read_manifest
from hpcdl.data_prep.shard import shard_tree
from hpcdl.data_prep.synthetic import make_imagenet_tree
from hpcdl.topology import node_layout


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> str:
    """45 train samples in 7 shards (uneven per node at every size), 15 val in 4 shards;
    written once by rank 0 into a directory every rank sees."""
    world = MPI.COMM_WORLD
    out = None
    if world.rank == 0:
        base = str(tmp_path_factory.mktemp("loader_mpi"))
        tree = make_imagenet_tree(os.path.join(base, "tree"), num_classes=5,
                                  train_per_class=9, val_per_class=3)
        out = os.path.join(base, "shards")
        shard_tree(tree.root, out, shards=7, val_shards=4)
    return world.bcast(out, root=0)


def gathered_indices(world, data: ShardedImageNet) -> list[list[int]]:
    mine = [int(i) for b in range(len(data)) for i in data.batch_indices(b)]
    return world.allgather(mine)


@pytest.mark.parametrize("layout", ["rank_per_node", "one_node"])
def test_every_rank_yields_the_same_number_of_full_batches(world, shards, layout):
    if layout == "rank_per_node":
        place = dict(node_index=world.rank, num_nodes=world.size, local_rank=0, local_size=1)
    else:
        place = dict(node_index=0, num_nodes=1, local_rank=world.rank, local_size=world.size)
    data = ShardedImageNet(shards, "train", batch_size=2, image_size=16, workers=2, **place)
    assert len(set(world.allgather(len(data)))) == 1
    batches = 0
    for x, y in data:  # a collective per batch, as the trainer's allreduce: hangs if counts differ
        total = torch.tensor([float(y.sum())])
        world.Allreduce(torch.zeros(1).numpy(), total.numpy())
        assert x.shape == (2, 3, 16, 16)
        batches += 1
    assert batches == len(data) > 0
    parts = gathered_indices(world, data)
    flat = [i for part in parts for i in part]
    assert len(flat) == len(set(flat))


def test_ranks_as_nodes_read_only_their_own_shards(world, shards):
    data = ShardedImageNet(shards, "train", node_index=world.rank, num_nodes=world.size,
                           batch_size=1, image_size=16, workers=0)
    counts = [e["num_samples"] for e in read_manifest(shards)["shards"] if e["split"] == "train"]
    offsets = np.concatenate([[0], np.cumsum(counts)])
    mine = [int(i) for b in range(len(data)) for i in data.batch_indices(b)]
    shard_of = np.searchsorted(offsets, mine, side="right") - 1
    assert all(s % world.size == world.rank for s in shard_of)


def test_val_across_the_world_reads_every_sample_exactly_once(world, shards):
    node_index, num_nodes, local_rank, local_size = node_layout(world)
    data = ShardedImageNet(shards, "val", node_index=node_index, num_nodes=num_nodes,
                           local_rank=local_rank, local_size=local_size, batch_size=2,
                           image_size=16, workers=1)
    assert len(set(world.allgather(len(data)))) == 1
    labels = torch.cat([y for _, y in data]).tolist()
    flat = [i for part in gathered_indices(world, data) for i in part]
    assert sorted(flat) == list(range(15))
    assert sum(world.allgather(len(labels))) == 15


def test_epochs_reshuffle_the_same_node_set(world, shards):
    data = ShardedImageNet(shards, "train", node_index=0, num_nodes=1, local_rank=world.rank,
                           local_size=world.size, batch_size=1, image_size=16, workers=0)
    first = sum(gathered_indices(world, data), [])
    data.set_epoch(1)
    second = sum(gathered_indices(world, data), [])
    assert first != second and len(set(first)) == len(first) == len(second) == len(set(second))
    # The same node set: only the remainder dropped to even out the ranks may differ.
    dropped = 45 - len(first)
    assert len(set(first) ^ set(second)) <= 2 * dropped
    assert set(first) | set(second) <= set(range(45))
