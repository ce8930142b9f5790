"""``shm``: hierarchical allreduce through the node's MPI-3 shared-memory window.

Within a node (``Split_type(COMM_TYPE_SHARED)``) every rank's buffer lives in one shared
window (``Win.Allocate_shared``), so rank ``j`` reduces the ``j``-th ``1/local_size`` slice by
reading the other ranks' memory directly -- a reduce-scatter with no message and no copy in.
Across nodes the ranks with the same ``local_rank`` allreduce their slice (MPI_Allreduce, or
the ``ring`` with ``inter_node="ring"``), so every rank's NIC share is used; each rank then
reads the other slices back from the window. With unequal ranks per node the node leaders
carry the whole buffer across nodes instead.

A bucket from :meth:`empty` already is window memory (nothing copied in); any other buffer
goes through a staging window. Synchronisation is ``Win.Sync`` + ``Barrier`` on the node
communicator (the MPI-3 unified memory model's recipe); nothing spins on flags.
"""
from __future__ import annotations

import numpy as np
import torch
from mpi4py import MPI

from hpcdl.comm.base import Communicator, numpy_view, scale_, segment_bounds
from hpcdl.comm.ring import DEFAULT_CHUNK_BYTES, ring_allreduce

#: Reduce this many bytes of the own slice against every peer before moving on, so the
#: accumulator stays in L2 instead of streaming through memory local_size-1 times.
BLOCK_BYTES = 256 * 2**10
PAGE_BYTES = 4096


class SharedWindow:
    """One ``Win.Allocate_shared`` window: this rank's region and views of all peers'."""

    def __init__(self, node_comm: MPI.Intracomm, nbytes: int) -> None:
        self.nbytes = int(nbytes)
        # Regions are contiguous (rank k's follows rank k-1's): pad each to whole pages so
        # every rank's region is aligned for any dtype (an unaligned float64 view is '=d',
        # which MPI cannot map) and no two ranks write the same cache line.
        padded = -(-max(self.nbytes, 1) // PAGE_BYTES) * PAGE_BYTES
        self.win = MPI.Win.Allocate_shared(padded, 1, comm=node_comm)
        self.win.Lock_all(MPI.MODE_NOCHECK)  # passive epoch for Sync() (MPI-3 §11.2.3)
        self.regions = []
        for k in range(node_comm.size):
            memory, _ = self.win.Shared_query(k)
            self.regions.append(np.frombuffer(memory, dtype=np.uint8)[:self.nbytes])
        self.mine = self.regions[node_comm.rank]
        self.address = self.mine.ctypes.data

    def contains(self, address: int, nbytes: int) -> bool:
        return self.address <= address and address + nbytes <= self.address + self.nbytes

    def views(self, offset: int, numel: int, dtype: np.dtype) -> list[np.ndarray]:
        end = offset + numel * dtype.itemsize
        return [region[offset:end].view(dtype) for region in self.regions]

    def free(self) -> None:
        self.win.Unlock_all()
        self.win.Free()


class SharedMemoryCommunicator(Communicator):
    backend = "shm"
    _prefers_staging = True   # fusion packs straight into the staging window
    inter_node = "mpi"        # or "ring": the algorithm across nodes
    sends_bf16 = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._windows: list[SharedWindow] = []
        self._stage: SharedWindow | None = None
        self.cross_comm = (self._comm.Split(self.local_rank, self.node_index)
                           if self.uniform_nodes else MPI.COMM_NULL)

    # -- buffers ---------------------------------------------------------------------------
    def empty(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A flat buffer in a new node-shared window: reduced with no copy in. Collective over
        the node (same ``numel``, ``dtype`` and order on every rank); freed by :meth:`close`."""
        itemsize = torch.empty(0, dtype=dtype).element_size()
        window = SharedWindow(self.node_comm, int(numel) * itemsize)
        self._windows.append(window)
        return _tensor_on(window.mine, dtype, int(numel))

    def _staging_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        itemsize = torch.empty(0, dtype=dtype).element_size()
        nbytes = numel * itemsize
        if self._stage is None or self._stage.nbytes < nbytes:
            if self._stage is not None:
                self._stage.free()
            # grow geometrically so a stream of growing buckets reallocates rarely
            grown = max(nbytes, 2 * self._stage.nbytes if self._stage else 0)
            self._stage = SharedWindow(self.node_comm, grown)
        return _tensor_on(self._stage.mine, dtype, numel)

    def _locate(self, buffer: torch.Tensor) -> tuple[SharedWindow, int] | None:
        address, nbytes = buffer.data_ptr(), buffer.numel() * buffer.element_size()
        for window in [*self._windows, self._stage]:
            if window is not None and window.contains(address, nbytes):
                return window, address - window.address
        return None

    def _flat_meta(self, buffer, bucket, **extra):
        meta = super()._flat_meta(buffer, bucket, **extra)
        located = self._locate(buffer)
        if located is not None:  # every node rank must pass the same window and offset
            window, offset = located
            index = -1 if window is self._stage else self._windows.index(window)
            meta["window"] = (index, offset)
        return meta

    # -- the algorithm -----------------------------------------------------------------------
    def _allreduce(self, buffer: torch.Tensor, average: bool) -> None:
        located = self._locate(buffer)
        if located is not None:
            self._reduce_in_window(*located, buffer.numel(), buffer.dtype, average)
            return
        staged = self._staging_buffer(buffer.numel(), buffer.dtype)  # the copy-in path
        staged.copy_(buffer)
        self._reduce_in_window(self._stage, 0, buffer.numel(), buffer.dtype, average)
        buffer.copy_(staged)

    def _reduce_in_window(self, window: SharedWindow, offset: int, numel: int,
                          dtype: torch.dtype, average: bool) -> None:
        views = window.views(offset, numel, numpy_view(torch.empty(0, dtype=dtype)).dtype)
        me = self.local_rank
        bounds = segment_bounds(numel, self.local_size)
        mine = views[me][bounds[me]:bounds[me + 1]]
        self._node_sync(window)                 # every rank's data is in the window
        self._reduce_slice(views, bounds)
        if self.num_nodes > 1 and not self.uniform_nodes:
            self._leaders_reduce_whole(window, views, bounds, average)
            return
        if self.num_nodes > 1:
            self._across_nodes(self.cross_comm, mine)
        if average:
            scale_(mine, self.size)
        self._gather_slices(window, views, bounds)

    def _gather_slices(self, window: SharedWindow, views: list[np.ndarray],
                       bounds: list[int]) -> None:
        """The second half of an in-window allreduce: once every slice is final, copy the
        other ranks' slices out of their regions into mine."""
        me = self.local_rank
        self._node_sync(window)                 # every slice is final
        for k in range(self.local_size):
            if k != me:
                np.copyto(views[me][bounds[k]:bounds[k + 1]], views[k][bounds[k]:bounds[k + 1]])
        self._node_sync(window)                 # nobody reads my region any more

    def _one_node_views(self, buffer: torch.Tensor
                        ) -> tuple[SharedWindow, list[np.ndarray]] | None:
        """The window holding ``buffer`` and every local rank's view of it, on one node;
        None elsewhere (several nodes, or a buffer outside the window: MPI's collectives)."""
        located = self._locate(buffer) if self.num_nodes == 1 else None
        if located is None:
            return None
        window, offset = located
        return window, window.views(offset, buffer.numel(), numpy_view(buffer[:0]).dtype)

    def _reduce_scatter(self, buffer: torch.Tensor, average: bool) -> None:
        """The first half of :meth:`_reduce_in_window`: rank j sums slice j of every peer's
        region into its own, no copy back (the allgather's job). One node and a window buffer
        only; otherwise MPI's Reduce_scatter."""
        one_node = self._one_node_views(buffer)
        if one_node is None:
            super()._reduce_scatter(buffer, average)
            return
        window, views = one_node
        bounds = self.shard_bounds(buffer.numel())
        self._node_sync(window)                 # every rank's data is in the window
        self._reduce_slice(views, bounds)
        if average:
            scale_(views[self.local_rank][bounds[self.local_rank]:bounds[self.local_rank + 1]],
                   self.size)
        # No closing sync: peers may still read my region's other slices, and I write
        # nothing there before the first sync of the allgather or publish that must follow
        # (my own slice only, which no peer reads in this phase).

    def _allgather(self, buffer: torch.Tensor) -> None:
        """Each rank copies the other slices straight out of its peers' regions."""
        one_node = self._one_node_views(buffer)
        if one_node is None:
            super()._allgather(buffer)
            return
        window, views = one_node
        self._gather_slices(window, views, self.shard_bounds(buffer.numel()))

    def publish_flat_(self, buffer: torch.Tensor,
                      bucket: int | None = None) -> list[torch.Tensor]:
        """One node, a window buffer: one sync, then every peer's region is read in place
        (the allgather's copy into this rank's region is skipped: one pass over memory
        fewer; measured: docs/results/notebook-training-step-2026.md)."""
        one_node = self._one_node_views(buffer)
        if one_node is None:
            return super().publish_flat_(buffer, bucket)
        self._check_sharded(buffer, "publish_flat_")
        window, views = one_node
        meta = self._flat_meta(buffer, bucket)
        self._collective("publish", meta, lambda: self._node_sync(window))
        return [torch.from_numpy(v) for v in views]

    def release_flat_(self, buffer: torch.Tensor) -> None:
        located = self._locate(buffer) if self.num_nodes == 1 else None
        if located is not None:
            window = located[0]
            self._collective("release", self._flat_meta(buffer, None),
                             lambda: self._node_sync(window))

    def _reduce_slice(self, views: list[np.ndarray], bounds: list[int]) -> None:
        """Sum slice ``local_rank`` of every peer's region into mine, block by block."""
        me = self.local_rank
        lo, hi = bounds[me], bounds[me + 1]
        block = max(1, BLOCK_BYTES // views[me].itemsize)
        for start in range(lo, hi, block):
            stop = min(start + block, hi)
            acc = views[me][start:stop]
            for k in range(self.local_size):
                if k != me:
                    np.add(acc, views[k][start:stop], out=acc)

    def _across_nodes(self, comm: MPI.Intracomm, array: np.ndarray) -> None:
        if self.inter_node == "ring":
            bf16 = self.wire_dtype == torch.bfloat16 and array.dtype == np.float32
            ring_allreduce(comm, array, False, DEFAULT_CHUNK_BYTES, bf16, self._wait)
        else:
            self._call(comm, "Allreduce", MPI.IN_PLACE, array, op=MPI.SUM)

    def _leaders_reduce_whole(self, window, views, bounds, average) -> None:
        """Unequal ranks per node: the leader gathers its node's slices, reduces the whole
        buffer with the other leaders, and every rank copies the result back."""
        me = self.local_rank
        self._node_sync(window)
        if me == 0:
            for k in range(1, self.local_size):
                np.copyto(views[0][bounds[k]:bounds[k + 1]], views[k][bounds[k]:bounds[k + 1]])
            whole = views[0]
            self._across_nodes(self.leader_comm, whole)
            if average:
                scale_(whole, self.size)
        self._node_sync(window)
        if me != 0:
            np.copyto(views[me], views[0])
        self._node_sync(window)

    def _node_sync(self, window: SharedWindow) -> None:
        """Make every rank's stores to the window visible to all (MPI-3 unified model)."""
        window.win.Sync()
        self._wait(self.node_comm.Ibarrier())
        window.win.Sync()

    def _close_backend(self) -> None:
        for window in [*self._windows, self._stage]:
            if window is not None:
                window.free()
        self._windows, self._stage = [], None
        if self.cross_comm != MPI.COMM_NULL:
            self.cross_comm.Free()


def _tensor_on(region: np.ndarray, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """A torch tensor over the first ``numel`` elements of a window region (no copy)."""
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    return torch.from_numpy(region[:nbytes]).view(dtype)
