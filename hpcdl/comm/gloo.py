"""``gloo``: torch.distributed's Gloo allreduce, rendezvous carried over MPI.

What a PyTorch user would pick on CPUs without MPI (``init_process_group("gloo")``). Rank 0
opens a TCPStore on a free port the OS chooses (port 0) and broadcasts host and port over
MPI, so nobody sets MASTER_ADDR/MASTER_PORT by hand. The process group is private to this
communicator (no global default group), so several communicators -- e.g. one per LTFB
trainer -- coexist.
"""
from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist

from hpcdl.comm.base import Communicator

#: Matches MPI's own patience for a slow rank; a real hang is the watchdog's job.
RENDEZVOUS_TIMEOUT = datetime.timedelta(minutes=10)


def rendezvous_host() -> str:
    """An address of this host the other ranks can reach (its resolved hostname)."""
    name = socket.gethostname()
    try:
        return socket.gethostbyname(name)
    except OSError:
        return name


def mpi_tcp_store(mpi_comm, timeout: datetime.timedelta = RENDEZVOUS_TIMEOUT) -> dist.TCPStore:
    """A TCPStore every rank of ``mpi_comm`` (an mpi4py communicator) holds: rank 0 serves it
    on a free port the OS chooses (port 0) and broadcasts host and port over MPI. Rank 0's
    store must outlive every peer's last use of it (a barrier before dropping it)."""
    if mpi_comm.rank == 0:
        host = rendezvous_host()
        # wait_for_workers=False: the workers learn the port only from the broadcast below.
        store = dist.TCPStore(host, 0, mpi_comm.size, True, timeout=timeout,
                              wait_for_workers=False)
        address = (host, store.port)
    else:
        address = None
    host, port = mpi_comm.bcast(address, root=0)
    if mpi_comm.rank != 0:
        store = dist.TCPStore(host, port, mpi_comm.size, False, timeout=timeout)
    return store


def init_process_group_over_mpi(mpi_comm) -> dist.TCPStore:
    """``init_process_group("gloo")`` (torch's default group) over :func:`mpi_tcp_store`, so
    nobody sets MASTER_ADDR/MASTER_PORT; returns the store, which the caller keeps until every
    rank is done with the group."""
    store = mpi_tcp_store(mpi_comm)
    dist.init_process_group("gloo", store=store, rank=mpi_comm.rank, world_size=mpi_comm.size,
                            timeout=RENDEZVOUS_TIMEOUT)
    return store


class GlooCommunicator(Communicator):
    backend = "gloo"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._store = mpi_tcp_store(self._comm)
        self._group = dist.ProcessGroupGloo(self._store, self.rank, self.size, RENDEZVOUS_TIMEOUT)

    def _allreduce(self, buffer: torch.Tensor, average: bool) -> None:
        self._group.allreduce([buffer]).wait()
        if average:
            buffer.div_(self.size)

    def _broadcast(self, buffer: torch.Tensor, root: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        self._group.broadcast([buffer], opts).wait()

    def _close_backend(self) -> None:
        # the rank-0 store must outlive every peer's last use of it
        self._comm.Barrier()
        self._group, self._store = None, None

    def _release_threads(self) -> None:
        # At exit, without the barrier: the group's worker threads are joined now, while they
        # can still take the GIL (hpcdl/comm/base.py release_open_communicators); the store's
        # server needs no GIL and stays until the process ends, for any peer still using it.
        self._group = None
