"""The pieces of an LTFB tournament (Jacobs et al., MLHPC'17; docs/ltfb.md), each usable and
testable alone: ``split_world`` (K trainer and "peer" communicators), ``tournament_partners``
(a round's pairs from a shared seed), ``partition_samples`` (each trainer's shards and held-out
samples), ``PartitionLoader`` (ShardedImageNet over one trainer's pool), ``flatten_state`` /
``load_flat_state`` / ``exchange_flat`` (a state as one byte vector, swapped over the peer
communicator) and ``score_model`` (loss and top-1 summed over the trainer's ranks).
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from hpcdl.comm.base import sum_over
from hpcdl.data.loader import ShardedImageNet
from hpcdl.data.sampler import node_samples, val_num_batches

__all__ = ["TrainerLayout", "split_world", "tournament_partners", "partition_samples",
           "PartitionLoader", "state_tensors", "flatten_state", "load_flat_state",
           "exchange_flat", "slice_counts", "score_model", "better"]

#: Tag of the peer exchange's point-to-point messages (distinct from anything else on the peer
#: communicator, which carries nothing else anyway).
EXCHANGE_TAG = 0x17FB
#: Salt of the holdout draw, so it is independent of the epoch permutations.
HOLDOUT_SALT = 0x70C4


# -- communicators ----------------------------------------------------------------------------
@dataclass
class TrainerLayout:
    """Where this rank sits: trainer ``index`` of ``trainers``, rank ``trainer_rank`` of
    ``trainer_size`` within it. ``trainer_comm``: one trainer's ranks; ``peer_comm``: rank
    ``trainer_rank`` of every trainer, ranked by trainer index (a partner's index is its rank)."""

    trainers: int
    index: int
    trainer_rank: int
    trainer_size: int
    trainer_comm: MPI.Intracomm
    peer_comm: MPI.Intracomm

    def free(self) -> None:
        for c in (self.trainer_comm, self.peer_comm):
            if c != MPI.COMM_NULL:
                c.Free()


def split_world(world: MPI.Intracomm, trainers: int) -> TrainerLayout:
    """Split ``world`` into ``trainers`` trainers of consecutive ranks (few nodes each: theirs
    is the every-step allreduce) and the peer communicators. Collective; ValueError naming the
    sizes when ``trainers`` does not divide the world."""
    if trainers < 1:
        raise ValueError(f"--trainers {trainers}: need at least 1")
    if world.size % trainers:
        raise ValueError(f"--trainers {trainers} does not divide the {world.size} MPI ranks: "
                         f"every trainer needs the same number of ranks (use a divisor of "
                         f"{world.size}, or launch a multiple of {trainers} ranks)")
    size = world.size // trainers
    index, trainer_rank = divmod(world.rank, size)
    trainer_comm = world.Split(color=index, key=trainer_rank)
    peer_comm = world.Split(color=trainer_rank, key=index)
    return TrainerLayout(trainers, index, trainer_rank, size, trainer_comm, peer_comm)


# -- pairing ----------------------------------------------------------------------------------
def tournament_partners(seed: int, round_index: int, trainers: int) -> list[int | None]:
    """``partners[t]``: the trainer t meets in round ``round_index``, or None (the odd one out).
    Consecutive entries of a permutation drawn from (seed, round) pair up: the same on every
    rank without a message, new each round (Jacobs et al. 2017, Sec. 3: random pairs)."""
    order = np.random.default_rng([seed, round_index, EXCHANGE_TAG]).permutation(trainers)
    partners: list[int | None] = [None] * trainers
    for a, b in zip(order[0::2], order[1::2], strict=False):
        partners[int(a)], partners[int(b)] = int(b), int(a)
    return partners


# -- data -------------------------------------------------------------------------------------
def partition_samples(counts: Sequence[int], trainers: int, holdout_fraction: float,
                      seed: int, min_holdout: int = 1) -> list[tuple[np.ndarray, np.ndarray]]:
    """For each trainer t, (training samples, tournament samples): the global indices of
    training shards i with i mod K == t, a seeded ``holdout_fraction`` (at least
    ``min_holdout``) held out, never trained on. A pure function of counts and seed."""
    if len(counts) < trainers:
        raise ValueError(f"the training split has {len(counts)} shards, fewer than the "
                         f"{trainers} trainers: re-shard with at least {trainers} shards "
                         f"(hpcdl prep shard --shards N)")
    if not 0.0 <= holdout_fraction < 1.0:
        raise ValueError(f"tournament holdout fraction {holdout_fraction}: use 0 <= f < 1")
    parts = []
    for t in range(trainers):
        pool = node_samples(list(counts), list(range(t, len(counts), trainers)))
        held = max(min_holdout, int(round(holdout_fraction * len(pool)))) if trainers > 1 else 0
        if held >= len(pool):
            raise ValueError(f"trainer {t}: {len(pool)} training samples cannot hold out "
                             f"{held} for tournaments")
        rng = np.random.default_rng([seed, t, HOLDOUT_SALT])
        chosen = np.zeros(len(pool), dtype=bool)
        chosen[rng.choice(len(pool), size=held, replace=False)] = True
        parts.append((pool[~chosen], pool[chosen]))
    return parts


class PartitionLoader(ShardedImageNet):
    """ShardedImageNet over an explicit pool of training samples (one trainer's partition, or
    its tournament set), dealt round-robin to the ``local_size`` ranks of the trainer.

    ``train=True``: permuted by (seed, epoch, trainer) each epoch, augmented, ``batches`` per
    epoch (the same in every trainer: they meet at the same steps). ``train=False``: in order,
    centre crops, every sample once. Every rank of the trainer must read the pool's shards.
    """

    def __init__(self, shard_dir: str, pool: np.ndarray, trainer_index: int, local_rank: int,
                 local_size: int, batch_size: int, train: bool, batches: int | None = None,
                 **loader_kw: Any) -> None:
        self.pool = np.asarray(pool, dtype=np.int64)
        self.trainer_index = trainer_index
        self._train_pool = train
        self._batches = batches
        super().__init__(shard_dir, split="train", node_index=0, num_nodes=1,
                         local_rank=local_rank, local_size=local_size, batch_size=batch_size,
                         rotate_shards=False, **loader_kw)

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.train = self._train_pool
        pool = self.pool
        if self.train:
            self.num_batches = self._batches if self._batches is not None else \
                len(pool) // self.local_size // self.batch_size
            rng = np.random.default_rng([self.seed, epoch, self.trainer_index + 1])
            pool = pool[rng.permutation(len(pool))]
        else:  # enough batches for the rank with the most samples
            self.num_batches = val_num_batches([len(pool)], 1, self.local_size, self.batch_size)
        if not 0 <= start_batch <= self.num_batches:
            raise ValueError(f"start_batch={start_batch} outside 0..{self.num_batches}")
        self.epoch, self.start_batch = epoch, start_batch
        self.order = pool[self.local_rank::self.local_size]
        self.data_wait_s = 0.0


# -- model state as bytes ---------------------------------------------------------------------
def state_tensors(model: torch.nn.Module,
                  optimizer: torch.optim.Optimizer | None = None) -> list[torch.Tensor]:
    """The tensors a tournament exchanges, in an order both sides derive alike: the model's
    state_dict (parameters and BN statistics), then, when ``optimizer`` is given, each
    parameter's optimizer state tensors (momentum buffers) by parameter and key order."""
    tensors = [t for t in model.state_dict().values() if t.numel() > 0]
    if optimizer is not None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state.get(p, {})
                tensors += [state[k] for k in sorted(state) if torch.is_tensor(state[k])]
    return tensors


def flatten_state(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """One uint8 vector of the tensors' bytes in logical (contiguous) order: exact for every
    dtype, and independent of memory format (channels_last)."""
    parts = [t.detach().contiguous().view(-1).view(torch.uint8) for t in tensors]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)


def load_flat_state(tensors: Iterable[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy ``flat`` (from :func:`flatten_state` of a same-shaped state) into ``tensors``."""
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel() * t.element_size()
            # clone: a fresh, aligned buffer to reinterpret as the tensor's dtype
            chunk = flat[offset:offset + n].clone().view(t.dtype).view(t.shape)
            t.copy_(chunk)
            offset += n
    if offset != flat.numel():
        raise ValueError(f"model state of {offset} bytes, but {flat.numel()} were received")


def slice_counts(nbytes: int, parts: int) -> tuple[list[int], list[int]]:
    """Byte counts and displacements of ``parts`` near-equal consecutive slices."""
    counts = [nbytes // parts + (1 if i < nbytes % parts else 0) for i in range(parts)]
    displs = [0] + list(np.cumsum(counts[:-1]).tolist())
    return counts, displs


def exchange_flat(flat: torch.Tensor, layout: TrainerLayout, partner: int) -> torch.Tensor:
    """Swap a flat state with trainer ``partner``; returns the partner's full vector.

    Rank i swaps slice i with rank i of the partner (peer communicator), so each rank moves
    1/trainer_size of the model; an allgather within the trainer rebuilds the whole vector
    (Jacobs et al. 2017: pairwise, never a global collective).
    """
    peer, group = layout.peer_comm, layout.trainer_comm
    nbytes = int(flat.numel())
    theirs = peer.sendrecv(nbytes, dest=partner, sendtag=EXCHANGE_TAG, source=partner,
                           recvtag=EXCHANGE_TAG)
    if theirs != nbytes:
        raise RuntimeError(f"trainer {layout.index} rank {layout.trainer_rank}: model state of "
                           f"{nbytes} bytes but trainer {partner} holds {theirs}: trainers "
                           f"must run the same recipe (model, optimizer)")
    counts, displs = slice_counts(nbytes, layout.trainer_size)
    r = layout.trainer_rank
    mine = flat.numpy()[displs[r]:displs[r] + counts[r]]
    received = np.empty(counts[r], dtype=np.uint8)
    peer.Sendrecv([mine, MPI.BYTE], dest=partner, sendtag=EXCHANGE_TAG,
                  recvbuf=[received, MPI.BYTE], source=partner, recvtag=EXCHANGE_TAG)
    full = np.empty(nbytes, dtype=np.uint8)
    group.Allgatherv([received, MPI.BYTE], [full, (counts, displs), MPI.BYTE])
    return torch.from_numpy(full)


# -- scoring ----------------------------------------------------------------------------------
def score_model(model: torch.nn.Module, loader, comm: MPI.Intracomm,
                memory_format: torch.memory_format = torch.contiguous_format) -> dict[str, float]:
    """Mean loss and top-1 of ``model`` (eval mode, no BN updates) on this rank's part of
    ``loader``, summed over ``comm``: every rank of the trainer gets the same numbers."""
    from hpcdl.data import normalize

    was_training = model.training
    model.eval()
    sums = np.zeros(3, dtype=np.float64)  # loss·n, top-1 correct, n
    with torch.no_grad():
        loader.set_epoch(0)
        for images, labels in loader:
            if labels.numel() == 0:
                continue
            x = normalize(images) if images.dtype == torch.uint8 else images
            logits = model(x.contiguous(memory_format=memory_format)).float()
            sums += [float(torch.nn.functional.cross_entropy(logits, labels, reduction="sum")),
                     float(logits.argmax(dim=1).eq(labels).sum()), labels.numel()]
    total = sum_over(comm, sums)
    model.train(was_training)
    n = max(total[2], 1.0)
    return {"loss": float(total[0] / n), "top1": float(total[1] / n), "samples": int(total[2])}


def better(metric: str, partner_score: float, local_score: float) -> bool:
    """Whether the partner's model beats the local one. Ties keep the local model; a
    non-finite score loses to a finite one (a diverged model is replaced, never spread)."""
    if not math.isfinite(partner_score):
        return False
    if not math.isfinite(local_score):
        return True
    if metric == "top1":
        return partner_score > local_score
    if metric == "loss":
        return partner_score < local_score
    raise ValueError(f"tournament metric {metric!r}: use top1 or loss")
