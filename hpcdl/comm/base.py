"""The communicator every backend shares: topology, fusion, the mismatch check, one seam.

A backend (``mpi``, ``ring``, ``shm``, ``gloo``, ``ccl``) implements two methods on one flat,
contiguous, 1-D CPU tensor of a dtype MPI can sum (float32, float64, int32, int64):
``_allreduce(buffer, average)`` and ``_broadcast(buffer, root)``. Everything above that --
fusing many tensors into buckets, reducing bf16/fp16 in fp32, checking that every rank passes
the same shapes -- lives here, so a new algorithm is one file (docs/architecture.md).

Every collective passes through :meth:`Communicator._collective`; that is the one place where
the mismatch check runs and where hpcdl/debug attaches recording and the stall watchdog.
"""
from __future__ import annotations

import atexit
import hashlib
import itertools
import os
import statistics
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from hpcdl.buckets import (
    DEFAULT_BUCKET_MB,
    LAST_BUCKET_BYTES,
    bucket_bounds,
    bucket_bytes,
    check_bucket_bytes,
)
from hpcdl.debug import NULL_MONITOR, abort_on_unshared_error, debug_enabled
from hpcdl.env import env_tristate
from hpcdl.io import Closing
from hpcdl.topology import ranks_per_node_from_env, split_nodes

#: dtypes a backend reduces natively; the rest (bf16, fp16) are reduced in float32.
NATIVE_DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64)
#: Default fusion bucket (hpcdl/buckets.py): the recipes' default ``comm.bucket_mb``.
DEFAULT_BUCKET_BYTES = bucket_bytes(DEFAULT_BUCKET_MB)


class CollectiveMismatchError(RuntimeError):
    """Ranks called the same collective with different shapes, dtypes or arguments."""


def segment_bounds(numel: int, parts: int) -> list[int]:
    """Offsets of ``parts`` near-equal segments (the first ``numel % parts`` one longer)."""
    base, extra = divmod(numel, parts)
    return [0, *itertools.accumulate(base + (1 if j < extra else 0) for j in range(parts))]


def require_thread_multiple() -> None:
    """The reducer issues collectives from a communication thread while the main thread runs
    autograd (and may touch MPI for metrics), so MPI must grant MPI_THREAD_MULTIPLE."""
    if not MPI.Is_initialized():
        raise RuntimeError("hpcdl.comm: MPI is not initialised (import mpi4py.MPI first)")
    provided = MPI.Query_thread()
    if provided < MPI.THREAD_MULTIPLE:
        names = {MPI.THREAD_SINGLE: "SINGLE", MPI.THREAD_FUNNELED: "FUNNELED",
                 MPI.THREAD_SERIALIZED: "SERIALIZED"}
        raise RuntimeError(
            f"hpcdl.comm needs MPI_THREAD_MULTIPLE (gradients are reduced on a communication "
            f"thread) but the MPI library provided MPI_THREAD_{names.get(provided, provided)}. "
            f"Do not set mpi4py.rc.thread_level below 'multiple', and use an MPI built with "
            f"thread support ({MPI.Get_library_version().splitlines()[0].strip()})."
        )


def oversubscribed(local_size: int) -> bool:
    """More ranks on this node than cores: a rank that busy-polls steals its peer's core.
    HPCDL_COMM_YIELD=1/0 forces yielding waits on/off."""
    forced = env_tristate("HPCDL_COMM_YIELD")
    if forced is not None:
        return forced
    return local_size > (os.cpu_count() or 1)


_thread_waits = threading.local()
#: The longest sleep between two tests of a yielding wait while the step waits for it (a
#: collective on the main thread, or the reducer's once ``synchronize`` waits): the wait ends
#: at most this late.
URGENT_WAIT_S = 2e-4
#: The longest sleep while the step's compute runs beside the wait (the reducer's thread
#: during forward and backward). Each wake-up is a test and a sleep, ~37 us of CPU on the
#: development VM, and with one rank per socket that CPU is backward's; the later answer is
#: hidden behind backward. Across two hosts at 2 Gbit/s `ring`'s reducer thread burnt 0.24-0.34
#: s per AlexNet-BN step at 1 ms against 0.34-0.44 s at 200 us (docs/comm.md, "Threads").
PATIENT_WAIT_S = 1e-3

#: Communicators not yet closed, by creation number (weak: one the program dropped is not kept
#: alive).
_open_communicators: weakref.WeakValueDictionary[int, Communicator] = \
    weakref.WeakValueDictionary()
_created = iter(range(1 << 62))


def release_open_communicators() -> None:
    """At exit (``atexit``: before interpreter finalization and MPI_Finalize), release what
    a communicator left open must not keep past the interpreter's end, newest first: gloo's
    C++ threads take the GIL to drop tensors after ``work.wait()``, and during finalization
    CPython ends such a thread into ``std::terminate`` (docs/debugging.md). Local only, no
    barrier: a rank exiting alone must not wait for peers; MPI_Finalize reclaims the rest."""
    for number in sorted(_open_communicators.keys(), reverse=True):
        comm = _open_communicators.get(number)
        if comm is not None:
            comm._release_at_exit()


atexit.register(release_open_communicators)


def yield_waits_in_this_thread(urgent: Callable[[], bool] | None = None) -> None:
    """Mark the calling thread as one whose collectives overlap compute (the gradient
    reducer's communication thread): its waits test and sleep instead of busy-polling, which
    would take a core from compute (docs/comm.md, "Threads"). ``urgent()``, asked at each
    sleep, says whether the step now waits for this thread (sleeps up to
    :data:`URGENT_WAIT_S`) or still computes beside it (up to :data:`PATIENT_WAIT_S`); None:
    always urgent."""
    _thread_waits.yielding = True
    _thread_waits.urgent = urgent


def waits_yield_in_this_thread() -> bool:
    return getattr(_thread_waits, "yielding", False)


def wait_ceiling_s() -> float:
    """The calling thread's longest sleep between tests now (:func:`yield_waits_in_this_thread`)."""
    urgent = getattr(_thread_waits, "urgent", None)
    return URGENT_WAIT_S if urgent is None or urgent() else PATIENT_WAIT_S


def wait_yielding(request: MPI.Request) -> None:
    """Wait for ``request`` without holding the core: ``Test`` (which drives MPI progress)
    for 50 us, then sleep between tests, backing off from ~50 us to :func:`wait_ceiling_s`
    (asked at each sleep); MPICH's own ``Wait`` busy-polls, spinning while the peer it waits
    for is descheduled."""
    spin_until = time.perf_counter() + 5e-5  # a peer that is running answers within ~50 us
    while not request.Test():
        if time.perf_counter() > spin_until:
            break
    else:
        return
    delay = 2e-5
    while not request.Test():
        time.sleep(delay)
        delay = min(2 * delay, wait_ceiling_s())


def sum_over(mpi_comm: Any, values: Sequence[float] | np.ndarray) -> np.ndarray:
    """The float64 sum over ``mpi_comm``'s ranks of a few control values (flags, losses,
    counts): one small blocking MPI_Allreduce, collective."""
    mine = np.asarray(values, dtype=np.float64)
    total = np.empty_like(mine)
    mpi_comm.Allreduce(mine, total, op=MPI.SUM)
    return total


class SumInFlight:
    """:func:`sum_over` started now and read later (``MPI_Iallreduce``): the training step's
    agreement leaves after forward and travels while backward runs. Collective at start, in
    the same order on every rank; ``result()`` waits without holding the core."""

    def __init__(self, mpi_comm: Any, values: Sequence[float] | np.ndarray) -> None:
        self._mine = np.asarray(values, dtype=np.float64)   # MPI reads it until completion
        self._total = np.empty_like(self._mine)
        self._request = mpi_comm.Iallreduce(self._mine, self._total, op=MPI.SUM)

    def result(self) -> np.ndarray:
        wait_yielding(self._request)
        return self._total


def timed_allreduce_s(mpi_comm: Any, nbytes: int, repeats: int) -> float:
    """Median over ``repeats`` of the slowest rank's seconds for one in-place MPI_Allreduce
    of ``nbytes`` of float32 (one untimed call first); the same value on every rank.
    Collective."""
    buffer = np.ones(max(1, nbytes // 4), dtype=np.float32)
    mpi_comm.Allreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)
    times = []
    for _ in range(repeats):
        mpi_comm.Barrier()
        start = time.perf_counter()
        mpi_comm.Allreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)
        times.append(mpi_comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
    return statistics.median(times)


def numpy_view(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's memory as a numpy array (zero-copy), what mpi4py's buffer methods take."""
    return tensor.detach().numpy()


def signature_hash(text: str) -> int:
    """A hash that is the same in every process (Python's ``hash`` is salted per process)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little",
                          signed=True)


def describe_meta(name: str, meta: dict[str, Any]) -> str:
    """What must agree across ranks for ``name`` to be well formed (not the bucket id)."""
    keys = ("shapes", "dtype", "dtypes", "numel", "average", "root", "window")
    parts = [f"{k}={meta[k]}" for k in keys if k in meta]
    return f"{name}(" + ", ".join(parts) + ")"


def mismatch_message(name: str, descriptions: Sequence[str]) -> str:
    """Group ranks by what they passed, naming each group's ranks and arguments."""
    groups: dict[str, list[int]] = {}
    for rank, text in enumerate(descriptions):
        groups.setdefault(text, []).append(rank)
    lines = [f"  rank{'s' if len(r) > 1 else ''} {','.join(map(str, r))}: {text}"
             for text, r in groups.items()]
    return (f"{name}: ranks passed different tensors to the same collective (it would hang or "
            f"return garbage). Every rank must pass the same shapes and dtypes in the same "
            f"order:\n" + "\n".join(lines))


class Communicator(Closing):
    """One process's view of a data-parallel world: ranks, nodes, and collectives on tensors.
    Build with :func:`hpcdl.comm.init`; ``world`` (any mpi4py Intracomm) is duplicated, so this
    object's traffic never matches a user's messages on ``mpi_comm``."""

    backend = "base"
    #: whether ``wire_dtype=torch.bfloat16`` is this backend's (ring, shm, gloo, ccl): bf16
    #: sent, summed in fp32 (ccl: by oneCCL, in bf16)
    sends_bf16 = False
    #: hpcdl.debug.watch_collectives(comm, run_dir) installs a live monitor; default no-op.
    _monitor = NULL_MONITOR

    @property
    def monitor(self) -> Any:
        """What :meth:`_collective` enters around every collective (``watch(name, meta)``,
        ``note(text)``, ``close()``); ``hpcdl.debug.NULL_MONITOR`` when nothing watches."""
        return self._monitor

    def set_monitor(self, monitor: Any) -> None:
        """Install ``monitor`` (hpcdl.debug.watch_collectives does); the caller closes the one
        it replaces. Local: call it on every rank for a consistent stall report."""
        self._monitor = monitor

    def __init__(self, world: MPI.Intracomm | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 wire_dtype: torch.dtype | None = None,
                 ranks_per_node: int | None = None) -> None:
        require_thread_multiple()
        self.ranks_per_node = ranks_per_node
        self.mpi_comm: MPI.Intracomm = world if world is not None else MPI.COMM_WORLD
        self.rank = self.mpi_comm.rank
        self.size = self.mpi_comm.size
        self.bucket_bytes = check_bucket_bytes(bucket_bytes, type(self).__name__)
        #: the gradient reducer's first-layers bucket on this communicator (None: none);
        #: ``hpcdl.comm.init(last_bucket_bytes=...)`` sets it
        self.last_bucket_bytes: int | None = LAST_BUCKET_BYTES
        #: the start-up trial that chose this backend and layout (hpcdl/comm/trial.py's
        #: TrialResult), when one did
        self.trial = None
        self.wire_dtype = self._check_wire_dtype(wire_dtype)
        self._comm = self.mpi_comm.Dup()          # our collectives and point-to-point
        self._check_comm = self.mpi_comm.Dup()    # signature checks only
        self._init_topology()
        #: wait with Test+sleep instead of MPI's busy-polling Wait (ring, shm). Agreed by all
        #: ranks: shm issues Iallreduce when yielding and Allreduce otherwise, and a blocking
        #: and a non-blocking collective never match (MPI-3.1 §5.12) -- with nodes of 3 and 1
        #: ranks on 2 cores, one leader yielded and the other blocked: a hang (tests/mpi/
        #: test_nodes.py).
        self.yield_while_waiting = bool(self._comm.allreduce(
            oversubscribed(self.local_size), op=MPI.LOR))
        self._checked: set[int] = set()
        self._staging: dict[torch.dtype, torch.Tensor] = {}
        self._closed = False
        self._number = next(_created)
        _open_communicators[self._number] = self

    # -- topology ------------------------------------------------------------------------
    def _init_topology(self) -> None:
        """Nodes are the groups of ranks that can share memory, or with ``ranks_per_node=k``
        (``HPCDL_RANKS_PER_NODE``) groups of k: hpcdl.topology's rule, shared with staging."""
        if self.ranks_per_node is None:
            self.ranks_per_node = ranks_per_node_from_env()
        self.node_comm = split_nodes(self._comm, self.ranks_per_node)
        self.local_rank = self.node_comm.rank
        self.local_size = self.node_comm.size
        is_leader = self.local_rank == 0
        self.leader_comm = self._comm.Split(0 if is_leader else MPI.UNDEFINED, self.rank)
        ids = (self.leader_comm.rank, self.leader_comm.size) if is_leader else None
        self.node_index, self.num_nodes = self.node_comm.bcast(ids, root=0)
        # the largest and smallest node in one allreduce: O(1) a rank, not every rank's size
        sizes = np.array([self.local_size, -self.local_size], dtype=np.int64)
        self._comm.Allreduce(MPI.IN_PLACE, sizes, op=MPI.MAX)
        self.uniform_nodes = bool(sizes[0] == -sizes[1])

    # -- the seam ------------------------------------------------------------------------
    def _collective(self, name: str, meta: dict[str, Any], fn: Callable[[], Any]) -> Any:
        """Run one collective: ``fn()`` does the communication; ``meta`` describes it.

        ``meta`` keys: ``shapes``, ``dtype``, ``bytes``, ``numel``, ``bucket`` (an id, or None),
        plus arguments that must agree (``average``, ``root``). Every collective passes here
        once, on its issuing thread, in the same order on all ranks; the signature check runs
        first for a layout's first call (every call with HPCDL_DEBUG=1), so a mismatch raises
        instead of hanging (docs/comm.md, "The mismatch check").
        """
        self._check_open()
        self._check_signature(name, meta)
        with self._monitor.watch(name, meta):  # hpcdl.debug: records, stall watchdog
            return fn()

    def _check_signature(self, name: str, meta: dict[str, Any], force: bool = False) -> None:
        """Compare an 8-byte hash of what this rank passed across the ranks; on disagreement,
        gather the descriptions and raise on every rank. Costs one 16-byte Allreduce per new
        layout, whatever the rank count: the largest hash and the largest negated hash are
        equal up to sign only when every rank passed the same hash."""
        text = describe_meta(name, meta)
        digest = signature_hash(text)
        if digest in self._checked and not (force or debug_enabled()):
            return
        half = digest >> 1  # 63 bits: its negation cannot overflow
        extremes = np.array([half, -half], dtype=np.int64)
        with self._monitor.watch(f"signature check of {name}", meta):
            self._check_comm.Allreduce(MPI.IN_PLACE, extremes, op=MPI.MAX)
        if extremes[0] == -extremes[1]:
            self._checked.add(digest)
            return
        raise CollectiveMismatchError(mismatch_message(name, self._check_comm.allgather(text)))

    # -- public collectives --------------------------------------------------------------
    def allreduce_(self, tensors: torch.Tensor | Sequence[torch.Tensor],
                   average: bool = True) -> None:
        """Sum (or average) each tensor over all ranks, in place, fused into flat buckets.

        bf16/fp16 tensors are reduced in float32 and rounded back once (You et al. keep the
        reduction in fp32). Integers are summed exactly; averaging them is an error.
        """
        tensors = self._checked_tensors(tensors, "allreduce_", average=bool(average))
        for dtype, bucket in self._buckets(tensors):
            self._allreduce_bucket(bucket, dtype, average)

    def allreduce_flat_(self, buffer: torch.Tensor, average: bool = True,
                        bucket: int | None = None) -> None:
        """Reduce one contiguous 1-D buffer in place: what the gradient reducer calls.

        A buffer from :meth:`empty` is reduced without copying in (``shm``). Safe to call
        from a communication thread (one thread at a time issues collectives)."""
        self._check_flat(buffer)
        if average and not buffer.is_floating_point():
            raise ValueError(f"allreduce_flat_: cannot average an integer buffer "
                             f"({buffer.dtype}); pass average=False")
        if buffer.dtype in NATIVE_DTYPES:
            meta = self._flat_meta(buffer, bucket, average=bool(average))
            self._collective("allreduce", meta, lambda: self._reduce_native(buffer, average))
            return
        wide = buffer.to(torch.float32)  # bf16/fp16: reduce in fp32, round once
        self.allreduce_flat_(wide, average, bucket)
        buffer.copy_(wide)

    # -- weight-update sharding (Xu et al. 2020): a reduce-scatter, then an allgather ------
    def shard_bounds(self, numel: int) -> list[int]:
        """Offsets of each rank's slice of a flat buffer of ``numel`` elements: rank ``r``
        owns ``[bounds[r], bounds[r + 1])`` after :meth:`reduce_scatter_flat_` and sends it
        in :meth:`allgather_flat_` (near-equal slices, the first ``numel % size`` longer)."""
        return segment_bounds(int(numel), self.size)

    def reduce_scatter_flat_(self, buffer: torch.Tensor, average: bool = True,
                             bucket: int | None = None) -> None:
        """Sum (or average) ``buffer`` over the ranks, leaving only this rank's slice
        (:meth:`shard_bounds`) final, the rest undefined: an allreduce's first half, the
        second being :meth:`allgather_flat_` (Xu et al., arXiv:2004.13336)."""
        self._check_sharded(buffer, "reduce_scatter_flat_")
        meta = self._flat_meta(buffer, bucket, average=bool(average))
        self._collective("reduce_scatter", meta,
                         lambda: self._reduce_scatter(buffer, average) if self.size > 1
                         else None)

    def allgather_flat_(self, buffer: torch.Tensor, bucket: int | None = None) -> None:
        """Every rank's slice (:meth:`shard_bounds`) of ``buffer`` into every rank's
        ``buffer``, in place and bit-exact."""
        self._check_sharded(buffer, "allgather_flat_")
        meta = self._flat_meta(buffer, bucket)
        self._collective("allgather", meta,
                         lambda: self._allgather(buffer) if self.size > 1 else None)

    def publish_flat_(self, buffer: torch.Tensor,
                      bucket: int | None = None) -> list[torch.Tensor]:
        """The allgather without its last copy, where a backend can: afterwards rank k's
        slice (:meth:`shard_bounds`) is readable at the same offsets in ``sources[k]``, until
        every rank has called :meth:`release_flat_` on ``buffer``. Default: an allgather into
        ``buffer`` (every source is ``buffer``); ``shm`` returns views of the peers' window
        regions, so the reader copies each slice once, straight to where it is needed."""
        self.allgather_flat_(buffer, bucket)
        return [buffer] * self.size

    def release_flat_(self, buffer: torch.Tensor) -> None:
        """End a :meth:`publish_flat_`: collective; no rank writes ``buffer`` before it."""

    def _check_sharded(self, buffer: torch.Tensor, what: str) -> None:
        self._check_flat(buffer)
        if buffer.dtype not in NATIVE_DTYPES:
            raise ValueError(f"{what}: rank {self.rank} got a {buffer.dtype} buffer; sharded "
                             f"updates move the parameters themselves, in their own dtype "
                             f"({', '.join(str(d) for d in NATIVE_DTYPES)})")

    def _reduce_scatter(self, buffer: torch.Tensor, average: bool) -> None:
        """MPI_Reduce_scatter into a slice-sized scratch, then into place (MPI forbids the
        receive buffer to alias the send buffer; MPI_IN_PLACE would put the slice at the
        start). Every backend without its own algorithm uses this (ring, gloo, mpi)."""
        array = numpy_view(buffer)
        bounds = self.shard_bounds(buffer.numel())
        counts = [bounds[r + 1] - bounds[r] for r in range(self.size)]
        mine = np.empty(counts[self.rank], dtype=array.dtype)
        self._call(self._comm, "Reduce_scatter", array, mine, counts, op=MPI.SUM)
        if average:
            scale_(mine, self.size)
        array[bounds[self.rank]:bounds[self.rank + 1]] = mine

    def _allgather(self, buffer: torch.Tensor) -> None:
        array = numpy_view(buffer)
        bounds = self.shard_bounds(buffer.numel())
        counts = [bounds[r + 1] - bounds[r] for r in range(self.size)]
        self._call(self._comm, "Allgatherv", MPI.IN_PLACE, [array, (counts, bounds[:-1])])

    def broadcast_(self, tensors: torch.Tensor | Sequence[torch.Tensor], root: int = 0) -> None:
        """Copy ``root``'s tensors to every rank, in place (bit-exact: sent as bytes)."""
        if not 0 <= root < self.size:
            raise ValueError(f"broadcast_: root {root} is not a rank of a world of {self.size}")
        views = [_bytes_of(t) for t in self._checked_tensors(tensors, "broadcast_", root=root)]
        packed = torch.empty(sum(v.numel() for v in views), dtype=torch.uint8)
        pieces = packed.split([v.numel() for v in views])
        if self.rank == root:
            for piece, view in zip(pieces, views, strict=True):
                piece.copy_(view)
        if packed.numel():
            self._collective("broadcast", self._flat_meta(packed, None, root=root),
                             lambda: self._broadcast(packed, root))
        if self.rank != root:
            for piece, view in zip(pieces, views, strict=True):
                view.copy_(piece)

    def barrier(self) -> None:
        self._collective("barrier", {}, self._comm.Barrier)

    def empty(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A flat buffer this backend reduces without copying in; default ``torch.empty``."""
        return torch.empty(int(numel), dtype=dtype)

    def close(self) -> None:
        """Free the duplicated communicators (idempotent). Collective over the world; while
        this rank unwinds an error the others do not share, it aborts the job instead."""
        if self._closed:
            return
        abort_on_unshared_error()
        self._closed = True
        self._staging.clear()
        try:
            # watched: a peer that never reaches close (gone, cut off) is the stall watchdog's
            with self._monitor.watch("close", {}):
                self._close_backend()
            for comm in (self.leader_comm, self.node_comm, self._check_comm, self._comm):
                if comm != MPI.COMM_NULL:
                    comm.Free()
        finally:
            self._monitor.close()
            self._monitor = NULL_MONITOR
            _open_communicators.pop(self._number, None)

    def _release_at_exit(self) -> None:
        """``release_open_communicators``: stop the watchdog, drop what holds threads."""
        self._monitor.close()
        self._monitor = NULL_MONITOR
        self._release_threads()

    def _release_threads(self) -> None:
        """Backends whose library runs its own threads drop them here (local, at exit)."""

    def __repr__(self) -> str:
        return (f"<{type(self).__name__} backend={self.backend} rank={self.rank}/{self.size} "
                f"local={self.local_rank}/{self.local_size} node={self.node_index}/"
                f"{self.num_nodes}>")

    # -- what a backend implements ---------------------------------------------------------
    def _allreduce(self, buffer: torch.Tensor, average: bool) -> None:
        raise NotImplementedError

    def _broadcast(self, buffer: torch.Tensor, root: int) -> None:
        self._comm.Bcast(numpy_view(buffer), root=root)

    def _close_backend(self) -> None:
        pass

    def _staging_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Where fusion packs a bucket; ``shm`` returns window memory (the copy-in is then
        the packing itself)."""
        cached = self._staging.get(dtype)
        if cached is None or cached.numel() < numel:
            cached = torch.empty(max(numel, 1), dtype=dtype)
            self._staging[dtype] = cached
        return cached[:numel]

    def _check_wire_dtype(self, wire_dtype: torch.dtype | None) -> torch.dtype | None:
        if wire_dtype in (None, torch.float32):
            return None
        if self.sends_bf16:
            if wire_dtype == torch.bfloat16:
                return wire_dtype
            raise ValueError(f"{self.backend}: wire_dtype must be float32 or bfloat16, not "
                             f"{wire_dtype}")
        raise ValueError(f"backend {self.backend!r} does not support wire_dtype={wire_dtype}; "
                         f"bf16 on the wire is implemented by backends 'ring', 'shm', 'gloo' "
                         f"and 'ccl'")

    # -- helpers -------------------------------------------------------------------------
    def _reduce_native(self, buffer: torch.Tensor, average: bool) -> None:
        if buffer.numel() == 0:
            return
        if self.size == 1:
            return  # the sum and the average of one rank are the buffer itself
        self._allreduce(buffer, average)

    def _allreduce_bucket(self, bucket: list[torch.Tensor], dtype: torch.dtype,
                          average: bool) -> None:
        if len(bucket) == 1 and bucket[0].dtype == dtype and bucket[0].is_contiguous() \
                and not self._prefers_staging:
            self.allreduce_flat_(bucket[0].view(-1), average)  # nothing to fuse: no copy
            return
        flat = self._staging_buffer(sum(t.numel() for t in bucket), dtype)
        pieces = [piece.view(t.shape) for piece, t in
                  zip(flat.split([t.numel() for t in bucket]), bucket, strict=True)]
        for piece, t in zip(pieces, bucket, strict=True):
            piece.copy_(t)
        self.allreduce_flat_(flat, average)
        for piece, t in zip(pieces, bucket, strict=True):
            t.copy_(piece)

    _prefers_staging = False

    def _buckets(self, tensors: list[torch.Tensor]) -> list[tuple[torch.dtype, list]]:
        """Group tensors by reduction dtype, then cut into buckets of <= bucket_bytes in call
        order (one tensor larger than a bucket gets a bucket of its own)."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(reduction_dtype(t.dtype), []).append(t)
        buckets: list[tuple[torch.dtype, list]] = []
        for dtype, group in by_dtype.items():
            # hpcdl.buckets' greedy rule, the reducer's, without a first-layers bucket
            sizes = [t.numel() * dtype.itemsize for t in group]
            buckets += [(dtype, group[start:end]) for start, end in
                        bucket_bounds(sizes, self.bucket_bytes)]
        return buckets

    def _flat_meta(self, buffer: torch.Tensor, bucket: int | None, **extra: Any) -> dict:
        return {"shapes": [tuple(buffer.shape)], "dtype": str(buffer.dtype).removeprefix(
            "torch."), "numel": buffer.numel(), "bytes": buffer.numel() * buffer.element_size(),
            "bucket": bucket, **extra}

    def _checked_tensors(self, tensors: torch.Tensor | Sequence[torch.Tensor], what: str,
                         **agreed: Any) -> list[torch.Tensor]:
        """``tensors`` as a list of CPU tensors, after the signature check of call ``what``:
        their shapes and dtypes, and the ``agreed`` arguments (average, root)."""
        out = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        for i, t in enumerate(out):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{what}: item {i} is {type(t).__name__}, not a torch.Tensor")
            if t.device.type != "cpu":
                raise ValueError(f"{what}: tensor {i} is on {t.device}; hpcdl.comm reduces CPU "
                                 f"tensors")
        self._check_open()
        self._check_signature(what, {"shapes": [tuple(t.shape) for t in out], "dtypes": [
            str(t.dtype).removeprefix("torch.") for t in out], **agreed})
        return out

    def _check_flat(self, buffer: torch.Tensor) -> None:
        if buffer.device.type != "cpu" or buffer.dim() != 1 or not buffer.is_contiguous():
            raise ValueError(f"allreduce_flat_: rank {self.rank} got a tensor of shape "
                             f"{tuple(buffer.shape)} on {buffer.device} (contiguous="
                             f"{buffer.is_contiguous()}); it needs one contiguous 1-D CPU "
                             f"buffer")

    def _yields(self) -> bool:
        """Waits of this call sleep between tests: oversubscribed node, or a background
        communication thread (:func:`yield_waits_in_this_thread`)."""
        return self.yield_while_waiting or waits_yield_in_this_thread()

    def _call(self, comm: MPI.Intracomm, name: str, *args: Any, **kwargs: Any) -> None:
        """``comm.Name(*args)``; where waits yield (:meth:`_yields`), its non-blocking form
        ``Iname`` and a sleeping wait instead, so that waiting does not spin a core."""
        if self._yields():
            self._wait(getattr(comm, "I" + name.lower())(*args, **kwargs))
        else:
            getattr(comm, name)(*args, **kwargs)

    def _wait(self, request: MPI.Request) -> None:
        if self._yields():
            wait_yielding(request)
        else:
            request.Wait()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")


def reduction_dtype(dtype: torch.dtype) -> torch.dtype:
    """Half precisions are summed in float32 (MPI has no bf16 sum; fp32 keeps the bits)."""
    if dtype in NATIVE_DTYPES:
        return dtype
    if dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    raise TypeError(f"hpcdl.comm reduces float32/float64/bfloat16/float16/int32/int64 "
                    f"tensors, not {dtype}")


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as a flat uint8 view (bf16 included). Conv weights in
    channels_last (train.channels_last) are dense too: viewed in their NHWC storage order."""
    if (tensor.dim() == 4 and not tensor.is_contiguous()
            and tensor.is_contiguous(memory_format=torch.channels_last)):
        tensor = tensor.permute(0, 2, 3, 1)
    if not tensor.is_contiguous():
        raise ValueError(f"broadcast_: tensor of shape {tuple(tensor.shape)} is not contiguous")
    return tensor.detach().reshape(-1).view(torch.uint8)


def scale_(array: np.ndarray, size: int) -> None:
    """Turn a sum over ``size`` ranks into the average, in place (floating buffers only)."""
    np.multiply(array, array.dtype.type(1.0 / size), out=array)
