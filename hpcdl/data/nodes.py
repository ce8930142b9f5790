"""Which node a rank is on, the one numbering that staging and the loader share."""
from __future__ import annotations


def node_layout(world=None) -> tuple[int, int, int, int]:
    """(node_index, num_nodes, local_rank, local_size) of this rank.

    Ranks sharing memory form a node (``Split_type(COMM_TYPE_SHARED)``, keyed by world rank);
    nodes are numbered in the order of their lowest world rank. Collective over ``world``
    (default COMM_WORLD).
    """
    from mpi4py import MPI

    world = world or MPI.COMM_WORLD
    local = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.rank)
    try:
        local_rank, local_size = local.rank, local.size
        leader = local.bcast(world.rank, root=0)
    finally:
        local.Free()
    leaders = sorted(set(world.allgather(leader)))
    return leaders.index(leader), len(leaders), local_rank, local_size
