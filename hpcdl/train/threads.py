"""How many compute threads a rank uses: its share of the cores it is bound to.

One MPI rank per socket using that socket's cores (You et al., ICPP'18): a rank takes ``cores
in its mask / ranks of the node with the same mask`` threads, never more than it owns, with or
without binding (docs/training.md, "Threads").
"""
from __future__ import annotations

import logging
import os

from hpcdl.cpus import affinity_cores, format_cpu_list, threads_per_rank

__all__ = ["affinity_cores", "threads_per_rank", "configure_threads"]

log = logging.getLogger("hpcdl.train")


def _env_threads() -> int | None:
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    try:
        return int(value) if value else None
    except ValueError:
        log.warning("OMP_NUM_THREADS=%r is not an integer; ignoring it", value)
        return None


def configure_threads(world) -> int:
    """Set ``torch.set_num_threads`` for this rank from the node's affinity masks; a warning
    when ranks × threads exceed the node's cores. Collective over ``world`` (every rank)."""
    import torch
    from mpi4py import MPI

    # The machine, not the communicator's node: threads compete for the cores of the ranks
    # that really share the machine, also when HPCDL_RANKS_PER_NODE makes them pretend nodes.
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.rank)
    try:
        mine = affinity_cores()
        masks = [frozenset(m) for m in node.allgather(sorted(mine))]
    finally:
        node.Free()
    threads, oversubscribed = threads_per_rank(mine, masks, _env_threads())
    torch.set_num_threads(threads)
    if oversubscribed:
        log.warning("node oversubscribed: %d ranks share %d cores (this rank may use cores %s, "
                    "%d threads); bind one rank per socket (mpiexec --bind-to socket, "
                    "srun --cpu-bind=sockets) or run fewer ranks per node",
                    len(masks), len(frozenset().union(*masks)), format_cpu_list(mine), threads)
    else:
        log.info("compute threads: %d (cores %s, %d rank(s) on this node)", threads,
                 format_cpu_list(mine), len(masks))
    return threads

