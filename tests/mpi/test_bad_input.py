"""Ranks that see different things still take one decision (hpcdl.errors.agreed): bad input
found by one rank is raised on every rank, naming that rank, and a clean block stays clean."""
import os
import shutil
import socket

import pytest
from mpi4py import MPI

from hpcdl.data import ShardedImageNet
from hpcdl.errors import BadInputError, agreed


@pytest.fixture(scope="module")
def one_shard_per_rank(tmp_path_factory) -> str:
    """Shards of a tiny tree, one train shard per rank, written by rank 0 where all see it."""
    from hpcdl.data_prep.shard import shard_tree
    from hpcdl.data_prep.synthetic import make_imagenet_tree

    world, out = MPI.COMM_WORLD, None
    if world.rank == 0:
        root = tmp_path_factory.mktemp("agree")
        make_imagenet_tree(str(root / "tree"), num_classes=2, train_per_class=world.size * 2,
                           val_per_class=1, size=(20, 16))
        out = str(root / "shards")
        shard_tree(str(root / "tree"), out, shards=world.size, resize=16)
    return world.bcast(out, root=0)


def test_an_error_on_one_rank_is_raised_on_every_rank_naming_it(world):
    culprit = world.size - 1
    with pytest.raises(BadInputError) as info:
        with agreed(world):
            if world.rank == culprit:
                raise BadInputError(f"bad value on {culprit}")
    assert info.value.agreed
    expected = f"bad value on {culprit}" if world.rank == culprit else \
        f"rank {culprit} of {world.size} on {socket.gethostname()}: bad value on {culprit}"
    assert str(info.value) == expected


def test_the_lowest_failing_rank_is_the_one_reported(world):
    with pytest.raises(BadInputError) as info:
        with agreed(world):
            if world.rank >= 1:
                raise BadInputError(f"rank says {world.rank}")
    if world.rank == 0:
        assert str(info.value) == f"rank 1 of {world.size} on {socket.gethostname()}: rank says 1"


def test_a_clean_block_raises_nowhere(world):
    with agreed(world):
        value = world.rank
    assert value == world.rank


def test_a_truncated_shard_only_one_node_reads_stops_every_rank(world, shared_tmp,
                                                                one_shard_per_rank):
    # Each rank acts as its own node (node k reads shards k, k+P, ...); the last node's
    # shard is truncated, so only that rank sees it.
    data = os.path.join(shared_tmp, "shards")
    bad = f"train-{world.size - 1:05d}-of-{world.size:05d}.h5"
    if world.rank == 0:
        shutil.copytree(one_shard_per_rank, data)
        os.truncate(os.path.join(data, bad), 100)
    world.Barrier()
    with pytest.raises(BadInputError, match=f"shard .*{bad}: 100 bytes") as info:
        with agreed(world):
            ShardedImageNet(data, node_index=world.rank, num_nodes=world.size, batch_size=1,
                            image_size=16, workers=0).close()
    if world.rank != world.size - 1:
        assert str(info.value).startswith(f"rank {world.size - 1} of {world.size} on ")
