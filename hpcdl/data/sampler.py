"""Which samples each rank reads, epoch by epoch, computed without communication.

Node k of K reads shards i with (i + shift) mod K == k (shift = epoch with ``rotate_shards``,
else 0); the ranks of a node split its samples. Everything is a function of the manifest,
(seed, epoch) and the rank's place, so ``num_batches`` agrees on all ranks without a
collective. Assumes the same number of ranks on every node (docs/data.md, "Node assignment").
"""
from __future__ import annotations

import numpy as np


def shard_offsets(counts: list[int]) -> np.ndarray:
    """Global index of each shard's first sample (shards in index order)."""
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


def node_shard_indices(num_shards: int, node_index: int, num_nodes: int, epoch: int,
                       rotate: bool) -> list[int]:
    """Shards node ``node_index`` reads this epoch: i with (i + shift) mod K == node_index."""
    shift = epoch % num_nodes if rotate else 0
    return [i for i in range(num_shards) if (i + shift) % num_nodes == node_index]


def node_samples(counts: list[int], shards: list[int]) -> np.ndarray:
    """Global sample indices of ``shards``, in shard order."""
    offsets = shard_offsets(counts)
    return np.concatenate([np.zeros(0, dtype=np.int64)]
                          + [np.arange(offsets[i], offsets[i + 1]) for i in shards])


def train_num_batches(counts: list[int], num_nodes: int, local_size: int, batch_size: int) -> int:
    """Batches per epoch on every rank: min over nodes and local ranks of samples // batch
    (a node's ranks get n // local_size or more each; rotation leaves the minimum as it is)."""
    per_node = [sum(counts[i] for i in range(k, len(counts), num_nodes)) for k in range(num_nodes)]
    return min(n // local_size for n in per_node) // batch_size


def val_num_batches(counts: list[int], num_nodes: int, local_size: int, batch_size: int) -> int:
    """Batches on every rank for evaluation: enough for the rank with the most samples."""
    per_node = [sum(counts[i] for i in range(k, len(counts), num_nodes)) for k in range(num_nodes)]
    most = -(-max(per_node) // local_size)
    return -(-most // batch_size)


def epoch_order(counts: list[int], node_index: int, num_nodes: int, local_rank: int,
                local_size: int, seed: int, epoch: int, rotate: bool, shuffle: bool) -> np.ndarray:
    """Global sample indices this rank reads this epoch, in order: the node's samples
    (permuted by (seed, epoch, node set) when ``shuffle``) dealt round-robin to local ranks."""
    shards = node_shard_indices(len(counts), node_index, num_nodes, epoch, rotate)
    samples = node_samples(counts, shards)
    if shuffle:
        first = shards[0] if shards else -1
        rng = np.random.default_rng([seed, epoch, first + 1])
        samples = samples[rng.permutation(len(samples))]
    return samples[local_rank::local_size]
