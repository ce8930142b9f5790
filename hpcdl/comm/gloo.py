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


class GlooCommunicator(Communicator):
    backend = "gloo"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._store, self._group = self._make_group(dist.ProcessGroupGloo)

    def _make_group(self, group_class):
        """TCPStore on rank 0 (free port), address broadcast over MPI, then the group."""
        if self.rank == 0:
            host = rendezvous_host()
            store = dist.TCPStore(host, 0, self.size, True, timeout=RENDEZVOUS_TIMEOUT,
                                  wait_for_workers=False)  # they learn the port below
            address = (host, store.port)
        else:
            address = None
        host, port = self._comm.bcast(address, root=0)
        if self.rank != 0:
            store = dist.TCPStore(host, port, self.size, False, timeout=RENDEZVOUS_TIMEOUT)
        return store, group_class(store, self.rank, self.size, RENDEZVOUS_TIMEOUT)

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
