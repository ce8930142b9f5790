"""``gloo``: torch.distributed's Gloo allreduce, rendezvous carried over MPI.

What a PyTorch user would pick on CPUs without MPI (``init_process_group("gloo")``). Rank 0
opens a TCPStore on a free port the OS chooses (port 0) and broadcasts host and port over
MPI, so nobody sets MASTER_ADDR/MASTER_PORT by hand. The process group is private to this
communicator (no global default group), so several communicators -- e.g. one per LTFB
trainer -- coexist.

``wire_dtype=torch.bfloat16``: a bf16 bucket is reduce-scattered as an all-to-all of its bf16
slices, each rank sums its slice of every rank's in fp32 and rounds once, and the bf16 slices
are allgathered: half the bytes of fp32, one rounding (gloo's own allreduce of bf16 would
round after every addition, and the ring rounds each partial sum it forwards).
"""
from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist

from hpcdl.comm.base import Communicator, segment_bounds

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
    sends_bf16 = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._store = mpi_tcp_store(self._comm)
        self._group = dist.ProcessGroupGloo(self._store, self.rank, self.size, RENDEZVOUS_TIMEOUT)

    def _allreduce(self, buffer: torch.Tensor, average: bool) -> None:
        self._group.allreduce([buffer]).wait()
        if average:
            buffer.div_(self.size)

    def allreduce_flat_(self, buffer: torch.Tensor, average: bool = True,
                        bucket: int | None = None) -> None:
        """A bf16 buffer on a bf16 wire (the reducer's buckets) is reduced as it is, in
        bf16 on the wire and fp32 in the sum (:meth:`_allreduce_bf16`); anything else as
        every backend reduces it."""
        if buffer.dtype != torch.bfloat16 or self.wire_dtype != torch.bfloat16:
            super().allreduce_flat_(buffer, average, bucket)
            return
        self._check_flat(buffer)
        meta = self._flat_meta(buffer, bucket, average=bool(average))
        self._collective("allreduce", meta, lambda: self._allreduce_bf16(buffer, average))

    def _allreduce_bf16(self, buffer: torch.Tensor, average: bool) -> None:
        """Sum (or average) a bf16 ``buffer``: all-to-all of the ranks' slices
        (:func:`segment_bounds`), this rank's slice summed over the ranks in fp32 in rank
        order and rounded once, then the slices allgathered -- a reduce-scatter and an
        allgather, each (P-1)/P of the buffer on the wire, as a ring's."""
        if self.size == 1 or buffer.numel() == 0:
            return
        bounds = segment_bounds(buffer.numel(), self.size)
        lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        mine = lengths[self.rank]
        received = torch.empty(self.size * mine, dtype=torch.bfloat16)
        self._group.alltoall_base(received, buffer, [mine] * self.size, lengths).wait()
        total = received.view(self.size, mine).to(torch.float32).sum(0)
        if average:
            total.div_(self.size)
        longest = lengths[0]   # the first numel % P slices are one longer
        if longest * self.size == buffer.numel():   # equal slices: gather into the buffer
            slices = list(buffer.view(self.size, longest).unbind(0))
            sent = slices[self.rank]
            sent.copy_(total)
        else:
            slices = [torch.empty(longest, dtype=torch.bfloat16) for _ in range(self.size)]
            sent = torch.zeros(longest, dtype=torch.bfloat16)
            sent[:mine] = total
        self._group.allgather([slices], [sent]).wait()
        if slices[0].data_ptr() != buffer.data_ptr():
            for start, length, piece in zip(bounds[:-1], lengths, slices, strict=True):
                buffer[start:start + length] = piece[:length]

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
