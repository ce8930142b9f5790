"""Which node a rank is on: the one rule behind the communicator's topology and staging.

Ranks sharing memory form a node (``Split_type(COMM_TYPE_SHARED)``); nodes are numbered in the
order of their lowest rank. The communicator (:class:`hpcdl.comm.Communicator`: ``node_index``,
``num_nodes``, ``local_rank``, ``local_size``) is built from :func:`split_nodes`, and so is
:func:`node_layout` for the commands that have no communicator yet, so the loader, staging,
doctor, the trainer and LTFB give one answer (docs/architecture.md).

Testing aid: ``HPCDL_RANKS_PER_NODE=k`` (or ``ranks_per_node=k``) makes P ranks on one machine
act as ceil(P/k) nodes: consecutive COMM_WORLD ranks fill nodes of k, the last node holding the
remainder (3 ranks as 2 + 1 with k=2). The rule keys on the COMM_WORLD rank, so a
sub-communicator (an LTFB trainer) sees the same nodes as the world does, as it would on real
nodes. Never set it on a real cluster: ranks of different machines would share a "node".
"""
from __future__ import annotations

from hpcdl.env import env_count

#: The testing switch: pretend every k consecutive world ranks are one node (docs/comm.md).
RANKS_PER_NODE_ENV = "HPCDL_RANKS_PER_NODE"


def ranks_per_node_from_env() -> int | None:
    """``HPCDL_RANKS_PER_NODE`` as a positive int, or None when unset or empty."""
    return env_count(RANKS_PER_NODE_ENV)


def split_nodes(world, ranks_per_node: int | None = None):
    """The communicator of this rank's node within ``world`` (the caller frees it).

    ``ranks_per_node`` None reads :data:`RANKS_PER_NODE_ENV`; still None: the ranks that share
    memory. Collective over ``world``.
    """
    from mpi4py import MPI

    k = ranks_per_node if ranks_per_node is not None else ranks_per_node_from_env()
    if k:
        return world.Split(MPI.COMM_WORLD.rank // k, world.rank)
    return world.Split_type(MPI.COMM_TYPE_SHARED, key=world.rank)


def node_layout(world=None, ranks_per_node: int | None = None) -> tuple[int, int, int, int]:
    """(node_index, num_nodes, local_rank, local_size) of this rank, by :func:`split_nodes`.

    Nodes are numbered in the order of their lowest rank in ``world`` (default COMM_WORLD),
    as the communicator numbers them. Collective over ``world``.
    """
    from mpi4py import MPI

    world = world or MPI.COMM_WORLD
    local = split_nodes(world, ranks_per_node)
    try:
        local_rank, local_size = local.rank, local.size
        # A node's index is the number of leaders (lowest ranks of their node) below its own:
        # an exclusive prefix sum over the world, O(1) a rank where every rank's leader
        # gathered everywhere was O(P).
        is_leader = int(local_rank == 0)
        below = world.exscan(is_leader)  # None on rank 0
        num_nodes = world.allreduce(is_leader)
        node_index = local.bcast(below or 0, root=0)
    finally:
        local.Free()
    return node_index, num_nodes, local_rank, local_size


def node_path(template: str, node_index: int) -> str:
    """``template`` with ``{node}`` replaced by the node index (as ``%02d``): one directory per
    node when pretend nodes share a machine's disk (``--to /tmp/stage-{node}``). A path
    without the placeholder is returned unchanged (real nodes each have their own disk)."""
    return template.replace("{node}", f"{node_index:02d}")
