"""Which images an elastic resume reads in the interrupted epoch (docs/training.md).

The loader's order is a pure function of (manifest, seed, epoch, node layout), and the trainer
resumes epoch ``e`` at batch ``(step % steps_per_epoch) * accumulation``; so the images one
epoch consumes across a change of rank count are computed here exactly as the ranks would,
without MPI. Demo-sized: 6,000 images in 4 shards, global batch 256, 23 steps per epoch,
interrupted after 10 steps."""
from dataclasses import dataclass

import pytest

from hpcdl.data.sampler import epoch_order, train_num_batches
from hpcdl.train.config import BatchConfig, elastic_batch

COUNTS = [1500, 1500, 1500, 1500]
GLOBAL = 256
SEED, EPOCH, STOP = 0, 3, 10


@dataclass
class Layout:
    nodes: int
    per_node: int
    per_rank: int = 0
    accumulation: int = 1

    def __post_init__(self):
        ranks = self.nodes * self.per_node
        if not self.per_rank:
            self.per_rank, self.accumulation = elastic_batch(
                BatchConfig(global_=GLOBAL, per_rank=None), ranks)

    def steps_per_epoch(self) -> int:
        return train_num_batches(COUNTS, self.nodes, self.per_node,
                                 self.per_rank) // self.accumulation

    def consumed(self, first_step: int, last_step: int) -> list[int]:
        """Global sample indices every rank reads in steps [first_step, last_step)."""
        out = []
        b = self.per_rank
        lo, hi = first_step * self.accumulation, last_step * self.accumulation
        for node in range(self.nodes):
            for local in range(self.per_node):
                order = epoch_order(COUNTS, node, self.nodes, local, self.per_node, SEED, EPOCH,
                                    rotate=False, shuffle=True)
                out.extend(order[lo * b:hi * b].tolist())
        return out


def interrupted_epoch(before: Layout, after: Layout) -> tuple[int, int]:
    """(repeated, skipped) images of an epoch run STOP steps on ``before``, then the rest on
    ``after``, against the uninterrupted epoch on ``before``."""
    steps = before.steps_per_epoch()
    seen = before.consumed(0, STOP) + after.consumed(STOP, steps)
    assert len(seen) == steps * GLOBAL  # the same number of images either way
    repeated = len(seen) - len(set(seen))
    skipped = len(set(before.consumed(0, steps)) - set(seen))
    return repeated, skipped


@pytest.mark.parametrize("before,after", [
    (Layout(1, 4), Layout(1, 2)),                  # 4 -> 2 ranks, per-rank batch 64 -> 128
    (Layout(1, 2), Layout(1, 4)),                  # and back
    (Layout(1, 4), Layout(1, 2, 64, 2)),           # per-rank 64 kept, accumulation 2
    (Layout(2, 2), Layout(2, 1)),                  # 2 nodes stay 2 nodes, fewer ranks each
    (Layout(1, 4), Layout(1, 1)),                  # one rank, accumulation-free
])
def test_same_node_count_repeats_and_skips_nothing(before, after):
    assert before.steps_per_epoch() == after.steps_per_epoch() == 23
    assert interrupted_epoch(before, after) == (0, 0)


@pytest.mark.parametrize("before,after", [
    (Layout(2, 2), Layout(1, 2)),   # 2 nodes -> 1 node: the node-local shard sets change
    (Layout(1, 4), Layout(2, 1)),
])
def test_a_new_node_count_deviates_by_the_documented_fraction(before, after):
    repeated, skipped = interrupted_epoch(before, after)
    fraction = repeated / (23 * GLOBAL)
    print(f"{before} -> {after}: {repeated} repeated, {skipped} skipped of {23 * GLOBAL} "
          f"({fraction:.1%})")
    # Each new node reads the rest of its epoch from a fresh permutation of its own shards:
    # an image already read turns up again with probability f (the fraction of the epoch
    # done, 10/23), so about f(1 - f) of the epoch repeats (24.6%), and about as many are skipped.
    f = STOP / 23
    assert abs(fraction - f * (1 - f)) < 0.04
    assert abs(skipped / (23 * GLOBAL) - f * (1 - f)) < 0.04
