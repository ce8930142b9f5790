"""Gradient reduction that overlaps backward: fusion buckets on one communication thread.

Horovod's design (Sergeev & Del Balso, arXiv:1802.05799) and DDP's bucketing (Li et al., VLDB
2020): a hook copies each ready gradient into a fusion bucket, and a full bucket is averaged
over the world while autograd computes earlier layers (You et al., ICPP'18, on Xeon clusters).
Each choice with its reason: docs/comm.md, "The gradient reducer" and "Threads".

- Keeping ranks in step: buckets laid out once in reverse registration order and launched
  strictly in bucket order, by one communication thread; a parameter without a gradient this
  step contributes zeros, so no rank waits for a bucket another never sends.
- Keeping the step fast: the first layers get a last bucket of at most ``last_bucket_bytes``
  (1 MiB; DDP caps its first bucket likewise, Li et al. §3.2.3); ``p.grad`` becomes a view of
  the bucket (DDP's ``gradient_as_bucket_view``); the thread's waits sleep between tests.
- ``reduce_scatter=True`` (weight-update sharding, Xu et al. 2020; hpcdl/optim/sharded.py):
  buckets are reduce-scattered, and :meth:`GradientReducer.start_allgather` hands each back for
  its parameter allgather on the same thread, in bucket order.

This module speaks tensors and a communicator only: it never imports a model or an optimizer.
"""
from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from hpcdl.buckets import LAST_BUCKET_BYTES, bucket_bounds, check_bucket_bytes
from hpcdl.comm.base import yield_waits_in_this_thread
from hpcdl.debug import abort_on_unshared_error
from hpcdl.io import Closing

__all__ = ["GradientReducer", "build_reducer", "Bucket", "layout_buckets", "pack_gradient",
           "unpack_gradient", "DEFAULT_LAST_BUCKET_BYTES"]

#: The bucket reduced after backward has finished: small, since nothing hides its reduction.
DEFAULT_LAST_BUCKET_BYTES = LAST_BUCKET_BYTES


@dataclass
class Bucket:
    """One fusion buffer: a contiguous run of parameters in reverse registration order."""

    index: int
    names: list[str]
    params: list[torch.Tensor]
    offsets: list[int]
    numel: int
    dtype: torch.dtype
    buffer: torch.Tensor | None = None
    filled: set[int] = field(default_factory=set)   # positions in ``params`` copied this step
    sources: list[torch.Tensor] | None = None        # where each rank's slice is published
    done: threading.Event = field(default_factory=threading.Event)


def layout_buckets(named_params: list[tuple[str, torch.Tensor]], bucket_bytes: int,
                   wire_dtype: torch.dtype | None = None,
                   last_bucket_bytes: int | None = None) -> list[Bucket]:
    """Group parameters (already in reverse registration order) into buckets by bytes on the
    wire: the boundaries of :func:`hpcdl.buckets.bucket_bounds` (its rule), which ``hpcdl plan``
    costs."""
    sizes = [p.numel() * (wire_dtype or p.dtype).itemsize for _, p in named_params]
    bounds = bucket_bounds(sizes, bucket_bytes, last_bucket_bytes,
                           kinds=[p.dtype for _, p in named_params])
    return [_bucket(index, named_params[start:end], wire_dtype)
            for index, (start, end) in enumerate(bounds)]


def _bucket(index: int, members: list[tuple[str, torch.Tensor]],
            wire_dtype: torch.dtype | None) -> Bucket:
    ends = list(itertools.accumulate(p.numel() for _, p in members))
    return Bucket(index, [n for n, _ in members], [p for _, p in members], [0, *ends[:-1]],
                  ends[-1], wire_dtype or members[0][1].dtype)


def pack_gradient(bucket: Bucket, position: int, grad: torch.Tensor | None) -> None:
    """Copy ``grad`` (of ``bucket.params[position]``) into its place in ``bucket.buffer``:
    zeros when it has none (every rank sends the same bytes), nothing when it already is
    that place. The reducer's and PowerSGD's packing."""
    p = bucket.params[position]
    start = bucket.offsets[position]
    view = bucket.buffer[start:start + p.numel()]
    if grad is None:
        view.zero_()
    elif grad.data_ptr() != view.data_ptr():  # (equal: the gradient is the bucket view)
        view.view_as(grad).copy_(grad)  # casts to the wire dtype when it differs


def unpack_gradient(bucket: Bucket, position: int) -> None:
    """Set ``p.grad`` of ``bucket.params[position]`` to its averaged place in the buffer: a
    view when dtype and layout allow (nothing copied), else a copy in ``p``'s own."""
    p = bucket.params[position]
    start = bucket.offsets[position]
    averaged = bucket.buffer[start:start + p.numel()].view(p.shape)
    if averaged.dtype == p.dtype and p.is_contiguous():
        p.grad = averaged       # a view: nothing copied (a no-op when it already is)
        return
    if p.grad is None:
        p.grad = torch.empty_like(p)  # the parameter's dtype and memory layout
    p.grad.copy_(averaged)


class GradientReducer(Closing):
    """Average gradients over ``comm`` while backward runs; ``synchronize()`` before the step.

    Use::

        reducer = build_reducer(comm, model.named_parameters())
        for i, micro_batch in enumerate(micro_batches):
            reducer.arm(last=(i == len(micro_batches) - 1))   # accumulation: reduce once
            loss(model(x)).backward()
        reducer.synchronize()          # p.grad now holds the world's average
        optimizer.step()

    ``enabled=False`` keeps the hooks but never communicates (the compute-only ceiling).
    ``wire_dtype`` is the fusion buffers' dtype; ``last_bucket_bytes`` caps the first layers'
    bucket (None: no cap); ``comm_wait_s`` is the main thread's wait in the last
    ``synchronize``. A ``p.grad`` of the bucket's dtype is then a view into the bucket until
    the next reduction (``close`` gives each its own memory).
    """

    def __init__(self, comm, named_params: Iterable[tuple[str, torch.Tensor]],
                 bucket_bytes: int, wire_dtype: torch.dtype | None = None,
                 enabled: bool = True,
                 last_bucket_bytes: int | None = DEFAULT_LAST_BUCKET_BYTES,
                 reduce_scatter: bool = False) -> None:
        bucket_bytes = check_bucket_bytes(bucket_bytes, "GradientReducer")
        self.comm = comm
        #: where gradient buckets are averaged: ``comm``, or a node's sub-communicator
        #: (hierarchical local SGD, hpcdl/comm/policy.py). Set between steps only.
        self.gradient_comm = comm
        self.enabled = bool(enabled)
        #: weight-update sharding (hpcdl/optim/sharded.py): each bucket is reduce-scattered,
        #: only this rank's slice (``comm.shard_bounds``) holds the average after
        #: ``synchronize``, and ``p.grad`` is left as this rank's own gradient
        self.reduce_scatter = bool(reduce_scatter)
        #: bytes of gradient buckets this rank passed to allreduce (wire dtype)
        self.bytes_reduced = 0
        trainable = [(n, p) for n, p in named_params if p.requires_grad]
        if not trainable:
            raise ValueError("GradientReducer: the model has no parameter that requires grad")
        # Reverse registration order: the last layer's gradients are ready first.
        self.buckets = layout_buckets(trainable[::-1], bucket_bytes, wire_dtype,
                                      last_bucket_bytes)
        self._where: dict[int, tuple[Bucket, int]] = {}
        for bucket in self.buckets:
            bucket.buffer = comm.empty(bucket.numel, bucket.dtype) if self.enabled else None
            for position, p in enumerate(bucket.params):
                self._where[id(p)] = (bucket, position)
        self._armed = False
        self._next_launch = 0
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        #: set while the main thread waits for the communication thread (see _wait_for)
        self._draining = threading.Event()
        self.comm_wait_s = 0.0
        self.total_comm_wait_s = 0.0
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                         for _, p in trainable]
        self._queue: queue.Queue[tuple[Bucket, object, bool] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        if self.enabled:
            self._thread = threading.Thread(target=self._communicate, name="hpcdl-reducer",
                                            daemon=True)
            self._thread.start()

    # -- what the training loop calls ------------------------------------------------------
    def arm(self, last: bool = True) -> None:
        """Say whether the next backward is the last micro-batch of the step (gradient
        accumulation sums micro-batches locally and reduces once, on the last)."""
        self._armed = bool(last) and self.enabled

    def synchronize(self) -> None:
        """Launch buckets not yet launched (unused parameters: zeros), wait for every
        bucket, and copy the averaged gradients back into ``p.grad``."""
        self._draining.set()   # nothing computes between the buckets' waits here
        try:
            for _ in self.reduced_buckets():
                pass
        finally:
            self._draining.clear()

    def reduced_buckets(self) -> Iterator[list[torch.Tensor]]:
        """:meth:`synchronize` one bucket at a time: yields each bucket's parameters, in
        bucket order (the last layers' first), as soon as their ``p.grad`` holds the world's
        average, while later buckets are still on the wire, so the caller can update them
        meanwhile (the Trainer's overlapped update). Disabled: every parameter at once.
        ``comm_wait_s`` sums the waits; a caller that stops early still waits for the rest
        when the generator closes, so the next backward never packs into a bucket in flight."""
        if not self.enabled:
            self.comm_wait_s = 0.0
            self._armed = False
            yield [p for bucket in self.buckets for p in bucket.params]
            return
        start = time.perf_counter()
        with self._lock:
            for bucket in self.buckets[self._next_launch:]:
                self._fill_missing(bucket)
            self._launch_ready(force=True)
        self._armed = False
        self._next_launch = 0
        waited = time.perf_counter() - start
        pending = list(self.buckets)
        try:
            while pending:
                bucket = pending[0]
                began = time.perf_counter()
                self._wait_for([bucket])
                waited += time.perf_counter() - began
                pending.pop(0)
                if self._error is not None:
                    # The thread skips what is queued only while the error stands: let it
                    # skip every bucket of this step before raising clears it, or the next
                    # bucket's collective would start on this rank alone.
                    self._wait_for(pending)
                self._raise_failure("gradient allreduce")
                if not self.reduce_scatter:
                    # Every rank sets p.grad, even for a parameter it did not use, so the
                    # optimizer takes the same step on every rank.
                    for position in range(len(bucket.params)):
                        unpack_gradient(bucket, position)
                bucket.filled.clear()
                bucket.done.clear()
                yield bucket.params
        finally:
            self._wait_for(pending)
            for bucket in pending:
                bucket.filled.clear()
                bucket.done.clear()
            self.comm_wait_s = waited
            self.total_comm_wait_s += waited

    def average_parameters(self, comm=None) -> int:
        """Replace every parameter by its average over ``comm`` (default the reducer's):
        local SGD's model average (Lin et al., ICLR'20, Alg. 1) through the fusion buckets,
        in bucket order, between steps; in the parameter's dtype where the wire's differs
        (rounded weights would drift). Returns the bytes this rank passed to allreduce."""
        comm = comm if comm is not None else self.comm
        if self._thread is None:  # built disabled (one rank, --no-comm): nothing to average
            return 0
        nbytes = 0
        wide = [p for b in self.buckets if b.dtype != b.params[0].dtype for p in b.params]
        same = [b for b in self.buckets if b.dtype == b.params[0].dtype]
        for bucket in same:
            for position, p in enumerate(bucket.params):
                pack_gradient(bucket, position, p.detach())
            self._queue.put((bucket, comm, "parameters"))
            nbytes += bucket.buffer.numel() * bucket.buffer.element_size()
        self._wait_for(same)
        for bucket in same:
            bucket.done.clear()
        self._raise_failure("model average")
        with torch.no_grad():
            for bucket in same:
                for position, p in enumerate(bucket.params):
                    start = bucket.offsets[position]
                    p.copy_(bucket.buffer[start:start + p.numel()].view(p.shape))
            if wide:
                comm.allreduce_([p.data for p in wide], average=True)
                nbytes += sum(p.numel() * p.element_size() for p in wide)
        return nbytes

    def start_allgather(self, bucket: Bucket) -> None:
        """Weight-update sharding: publish ``bucket`` (every rank's slice, now holding its
        updated parameters) on the communication thread, overlapping the next bucket's update.
        In bucket order on every rank; then :meth:`wait_allgather`, read, :meth:`release`."""
        self._queue.put((bucket, self.gradient_comm, "allgather"))

    def wait_allgather(self, bucket: Bucket) -> list[torch.Tensor]:
        """Wait for :meth:`start_allgather`; returns where each rank's slice can be read."""
        self._wait_done(bucket, "parameter allgather")
        return bucket.sources

    def release(self, bucket: Bucket) -> None:
        """This rank has read the published slices of ``bucket`` (collective, queued)."""
        self._queue.put((bucket, self.gradient_comm, "release"))

    def wait_released(self, bucket: Bucket) -> None:
        """After it no rank reads ``bucket`` any more: backward may pack into it again."""
        self._wait_done(bucket, "parameter allgather release")
        bucket.sources = None

    def _wait_done(self, bucket: Bucket, what: str) -> None:
        self._wait_for([bucket])
        bucket.done.clear()
        self._raise_failure(what)

    def _wait_for(self, buckets: Iterable[Bucket]) -> None:
        """Wait on this (the main) thread until ``buckets`` are done; meanwhile the
        communication thread's waits answer as soon as they can (``URGENT_WAIT_S``): nothing
        computes beside them any more."""
        draining = self._draining.is_set()
        self._draining.set()
        try:
            for bucket in buckets:
                bucket.done.wait()
        finally:
            if not draining:
                self._draining.clear()

    def _raise_failure(self, what: str) -> None:
        """Raise here what the communication thread caught (once), naming ``what`` failed."""
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"{what} failed on rank {self.comm.rank}: {error}") from error

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Within, steps communicate nothing and each rank keeps its own gradients: the
        compute-only ceiling measured on the very model, optimizer and buffers of the real
        step (``hpcdl bench train``)."""
        enabled, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = enabled

    def close(self) -> None:
        """Remove the hooks, stop the communication thread, and give each gradient that
        views a bucket its own memory (idempotent). Unwinding an error the other ranks do
        not share, it aborts the job first: the thread may wait in a collective for them."""
        if self._thread is not None:
            abort_on_unshared_error()
        for bucket in self.buckets:
            if bucket.buffer is not None:
                for p in bucket.params:
                    if p.grad is not None and _aliases(p.grad, bucket.buffer):
                        p.grad = p.grad.clone()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    # -- hooks and the thread --------------------------------------------------------------
    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if not self._armed:
            return
        bucket, position = self._where[id(p)]
        pack_gradient(bucket, position, p.grad)
        with self._lock:
            bucket.filled.add(position)
            self._launch_ready(force=False)

    def _fill_missing(self, bucket: Bucket) -> None:
        for position, p in enumerate(bucket.params):
            if position not in bucket.filled:
                # Not armed (a caller that forgot arm()) or unused this step: send what
                # p.grad holds, zeros when it has none.
                pack_gradient(bucket, position, p.grad)
                bucket.filled.add(position)

    def _launch_ready(self, force: bool) -> None:
        """Enqueue full buckets in bucket order, never skipping one that is not full."""
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if not force and len(bucket.filled) < len(bucket.params):
                return
            self._queue.put((bucket, self.gradient_comm, "gradients"))
            self._next_launch += 1

    def _communicate(self) -> None:
        yield_waits_in_this_thread(urgent=self._draining.is_set)
        while True:
            item = self._queue.get()
            if item is None:
                return
            bucket, comm, what = item
            counted = what == "gradients"
            try:
                if self._error is not None:
                    pass
                elif what == "allgather":
                    bucket.sources = comm.publish_flat_(bucket.buffer, bucket=bucket.index)
                elif what == "release":
                    comm.release_flat_(bucket.buffer)
                elif self.reduce_scatter and counted:
                    comm.reduce_scatter_flat_(bucket.buffer, average=True, bucket=bucket.index)
                    self.bytes_reduced += bucket.buffer.numel() * bucket.buffer.element_size()
                else:
                    comm.allreduce_flat_(bucket.buffer, average=True)
                    if counted:
                        self.bytes_reduced += bucket.buffer.numel() * bucket.buffer.element_size()
            except BaseException as exc:  # noqa: BLE001 - re-raised in synchronize
                self._error = exc
            finally:
                bucket.done.set()


def _aliases(tensor: torch.Tensor, buffer: torch.Tensor) -> bool:
    """Whether ``tensor``'s memory lies inside ``buffer``'s."""
    start = buffer.data_ptr()
    end = start + buffer.numel() * buffer.element_size()
    return start <= tensor.data_ptr() < end


def build_reducer(comm, named_params: Iterable[tuple[str, torch.Tensor]], *,
                  bucket_bytes: int | None = None, wire_dtype: torch.dtype | None = None,
                  enabled: bool = True, shard_update: bool = False) -> GradientReducer:
    """The one way hpcdl builds a gradient reducer (the consistency policies and
    ``DistributedOptimizer``). ``bucket_bytes`` None: the communicator's own. ``enabled=False``
    communicates nothing; ``shard_update`` reduce-scatters (hpcdl/optim/sharded.py). The
    first layers' bucket is the communicator's ``last_bucket_bytes`` (a start-up trial may
    have chosen none, hpcdl/comm/trial.py)."""
    return GradientReducer(comm, named_params,
                           comm.bucket_bytes if bucket_bytes is None else bucket_bytes,
                           wire_dtype, enabled=enabled, reduce_scatter=shard_update and enabled,
                           last_bucket_bytes=getattr(comm, "last_bucket_bytes",
                                                     DEFAULT_LAST_BUCKET_BYTES))
