"""data_prep under real ranks: sharding is byte-identical at any rank count, resumes across
rank counts, and staging copies with one copier per node."""
from __future__ import annotations

import os
import shutil

import pytest
from mpi4py import MPI

from hpcdl.cli.main import main as hpcdl_main
from hpcdl.data_prep.shard import PROGRESS_DIR, shard_tree
from hpcdl.data_prep.synthetic import make_imagenet_tree
from hpcdl.data_prep.verify import verify_shards
from hpcdl.topology import node_layout


def file_bytes(directory: str) -> dict[str, bytes]:
    return {n: open(os.path.join(directory, n), "rb").read() for n in sorted(os.listdir(directory))
            if not n.startswith(".")}


@pytest.fixture(scope="module")
def tree_and_serial(tmp_path_factory):
    """Rank 0 writes a quirky tree and shards it alone (the -n 1 reference), once."""
    world = MPI.COMM_WORLD
    paths = None
    if world.rank == 0:
        base = str(tmp_path_factory.mktemp("prep_mpi"))
        root, serial = os.path.join(base, "tree"), os.path.join(base, "serial")
        make_imagenet_tree(root, num_classes=3, train_per_class=6, val_per_class=2,
                           quirks=True, val_layout="flat")
        shard_tree(root, serial, shards=5, val_shards=2)
        paths = (root, serial)
    return world.bcast(paths, root=0)


def same_on_all_ranks(world, value: bool) -> bool:
    return world.allreduce(int(value)) == world.size


def test_sharding_on_all_ranks_gives_the_bytes_of_one_rank(world, shared_tmp, tree_and_serial):
    root, serial = tree_and_serial
    out = os.path.join(shared_tmp, "parallel")
    manifest = shard_tree(root, out, shards=5, val_shards=2, comm=world)
    assert len(manifest["shards"]) == 7
    same = file_bytes(out) == file_bytes(serial) if world.rank == 0 else True
    assert world.bcast(same, root=0)


def test_a_run_killed_at_one_rank_count_resumes_at_another(world, shared_tmp, tree_and_serial):
    root, serial = tree_and_serial
    out = os.path.join(shared_tmp, "resumed")
    if world.rank == 0:  # what a killed serial run leaves: two finished shards, one temporary
        os.makedirs(os.path.join(out, PROGRESS_DIR))
        for name in ("train-00000-of-00005.h5", "train-00003-of-00005.h5"):
            shutil.copy(os.path.join(serial, name), out)
            shutil.copy(os.path.join(serial, PROGRESS_DIR, name + ".json"),
                        os.path.join(out, PROGRESS_DIR))
        open(os.path.join(out, ".train-00001-of-00005.h5.x1.tmp"), "wb").write(b"partial")
    world.Barrier()
    shard_tree(root, out, shards=5, val_shards=2, comm=world)
    same = file_bytes(out) == file_bytes(serial) if world.rank == 0 else True
    assert world.bcast(same, root=0)
    assert world.bcast(verify_shards(out) == {} if world.rank == 0 else None, root=0)


def test_strict_failure_is_raised_on_every_rank_without_hanging(world, shared_tmp,
                                                                 tree_and_serial):
    root, _ = tree_and_serial
    with pytest.raises(RuntimeError, match="--strict"):
        shard_tree(root, os.path.join(shared_tmp, "strict"), shards=5, strict=True, comm=world)


def test_node_layout_on_one_machine_is_one_node_of_all_ranks(world):
    node_index, num_nodes, local_rank, local_size = node_layout(world)
    assert (node_index, num_nodes, local_size) == (0, 1, world.size)
    assert same_on_all_ranks(world, True)
    assert sorted(world.allgather(local_rank)) == list(range(world.size))


def test_stage_cli_copies_once_per_node(world, shared_tmp, tree_and_serial):
    _, serial = tree_and_serial
    local = os.path.join(shared_tmp, "local")
    assert hpcdl_main(["prep", "stage", "--shards", serial, "--to", local]) == 0
    world.Barrier()
    if world.rank == 0:
        assert set(os.listdir(local)) == {n for n in os.listdir(serial) if not n.startswith(".")}
