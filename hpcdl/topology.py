"""Which node a rank is on: the one rule behind the communicator's topology and staging.

Ranks sharing memory form a node (``Split_type(COMM_TYPE_SHARED)``), numbered in the order of
their lowest rank. The communicator and :func:`node_layout` (for commands without one) both use
:func:`split_nodes`, so loader, staging, doctor, trainer and LTFB agree.

Testing aid: ``HPCDL_RANKS_PER_NODE=k`` makes consecutive COMM_WORLD ranks nodes of k (the last
holds the remainder), keyed on the world rank so sub-communicators see the same nodes
(docs/data.md, "Several nodes on one machine"). Never set it on a real cluster.
"""
from __future__ import annotations

from hpcdl.env import env_count

#: The testing switch: pretend every k consecutive world ranks are one node (docs/comm.md).
RANKS_PER_NODE_ENV = "HPCDL_RANKS_PER_NODE"


def ranks_per_node_from_env() -> int | None:
    """``HPCDL_RANKS_PER_NODE`` as a positive int, or None when unset or empty."""
    return env_count(RANKS_PER_NODE_ENV)


def auto_backend_name(most_ranks_on_a_node: int) -> str:
    """The communicator ``backend="auto"`` builds (docs/comm.md, "The auto rule"): ``shm``
    whenever some node holds more than one rank, else ``mpi`` (the vendor's allreduce)."""
    return "shm" if most_ranks_on_a_node > 1 else "mpi"


def split_nodes(world, ranks_per_node: int | None = None):
    """The communicator of this rank's node within ``world`` (the caller frees it); nodes of
    ``ranks_per_node`` (None: :data:`RANKS_PER_NODE_ENV`, else shared memory). Collective."""
    from mpi4py import MPI

    k = ranks_per_node if ranks_per_node is not None else ranks_per_node_from_env()
    if k:
        return world.Split(MPI.COMM_WORLD.rank // k, world.rank)
    return world.Split_type(MPI.COMM_TYPE_SHARED, key=world.rank)


def node_layout(world=None, ranks_per_node: int | None = None) -> tuple[int, int, int, int]:
    """(node_index, num_nodes, local_rank, local_size) of this rank, by :func:`split_nodes`,
    numbered as the communicator numbers them. Collective over ``world`` (default COMM_WORLD)."""
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
