"""``ring``: the bandwidth-optimal ring allreduce, pipelined in chunks.

Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations"
(JPDC 2009), as used by Baidu's ring-allreduce and Horovod: the buffer is cut into ``p``
segments; a reduce-scatter of ``p-1`` steps leaves rank ``r`` owning the full sum of segment
``r+1``; an allgather of ``p-1`` steps circulates the owned segments. Each rank sends and
receives ``2(p-1)/p`` of the buffer, the lower bound (that factor is nccl-tests' busbw).

Pipelining: each segment travels as ``chunk_bytes`` chunks (``Isend``/``Irecv``), each added
on arrival and forwarded at once, receives posted a step ahead; MPI's non-overtaking rule keeps
chunks in order. ``wire_dtype=torch.bfloat16`` sends bf16, accumulates in fp32, and the owner
rounds its segment before the allgather so every rank ends identical (docs/comm.md).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from mpi4py import MPI

from hpcdl.comm.base import Communicator, numpy_view, scale_, segment_bounds

TAG_REDUCE_SCATTER = 71
TAG_ALLGATHER = 72
#: Chunk of the pipeline. Each chunk is one rendezvous message whose every handshake waits
#: for the next test of a sleeping wait: across two hosts at 2 Gbit/s, 4 MiB chunks burnt
#: less of the reducer thread's CPU per step than 1 MiB and the step ran 1-6% closer to
#: DDP's; on one host at p=4, 256 KiB to 4 MiB timed alike (docs/comm.md, "Threads").
DEFAULT_CHUNK_BYTES = 4 * 2**20


def split_chunks(array: np.ndarray, chunk: int) -> list[np.ndarray]:
    return [array[i:i + chunk] for i in range(0, len(array), chunk)]


class _NativeWire:
    """Send the buffer's own memory (zero-copy)."""

    def __init__(self, dtype: np.dtype) -> None:
        self.dtype = dtype

    def encode(self, chunk: np.ndarray) -> np.ndarray:
        return chunk

    def add(self, dst: np.ndarray, received: np.ndarray) -> None:
        np.add(dst, received, out=dst)

    def decode_into(self, dst: np.ndarray, received: np.ndarray) -> None:
        if received is not dst:
            dst[...] = received

    def round(self, owned: np.ndarray) -> None:
        pass


class _BF16Wire:
    """bf16 bits travel as int16 (numpy has no bf16); sums stay in fp32."""

    dtype = np.dtype(np.int16)

    def encode(self, chunk: np.ndarray) -> np.ndarray:
        return torch.from_numpy(chunk).to(torch.bfloat16).view(torch.int16).numpy()

    def _decode(self, received: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(received).view(torch.bfloat16).to(torch.float32)

    def add(self, dst: np.ndarray, received: np.ndarray) -> None:
        torch.from_numpy(dst).add_(self._decode(received))

    def decode_into(self, dst: np.ndarray, received: np.ndarray) -> None:
        torch.from_numpy(dst).copy_(self._decode(received))

    def round(self, owned: np.ndarray) -> None:
        view = torch.from_numpy(owned)
        view.copy_(view.to(torch.bfloat16))


def ring_allreduce(comm: MPI.Intracomm, array: np.ndarray, average: bool,
                   chunk_bytes: int = DEFAULT_CHUNK_BYTES, bf16_wire: bool = False,
                   wait: Callable[[MPI.Request], None] = MPI.Request.Wait) -> None:
    """Sum ``array`` over ``comm`` in place with the pipelined ring; ``2(p-1)`` steps.

    ``wait`` completes one request (``base.wait_yielding`` when ranks oversubscribe cores)."""
    p, r = comm.size, comm.rank
    if p == 1 or array.size == 0:
        return
    wire = _BF16Wire() if bf16_wire else _NativeWire(array.dtype)
    chunk = max(1, chunk_bytes // array.itemsize)
    right, left = (r + 1) % p, (r - 1) % p
    bounds = segment_bounds(array.size, p)

    def segment(j: int) -> np.ndarray:
        j %= p
        return array[bounds[j]:bounds[j + 1]]

    _reduce_scatter(comm, segment, wire, chunk, right, left, wait)
    owned = segment(r + 1)
    if average:
        scale_(owned, p)  # each rank scales only its 1/p: the average costs n/p multiplies
    wire.round(owned)
    _allgather(comm, segment, wire, chunk, right, left, wait)


def _reduce_scatter(comm, segment, wire, chunk, right, left, wait) -> None:
    p, r = comm.size, comm.rank
    longest = max(len(segment(j)) for j in range(p))
    scratch = [np.empty(longest, dtype=wire.dtype), np.empty(longest, dtype=wire.dtype)]
    in_flight: list[tuple[MPI.Request, np.ndarray]] = []

    def send(piece: np.ndarray) -> None:
        encoded = wire.encode(piece)  # keep it alive until the send completes
        in_flight.append((comm.Isend(encoded, dest=right, tag=TAG_REDUCE_SCATTER), encoded))

    def post_receives(step: int) -> list[tuple[MPI.Request, np.ndarray]]:
        incoming = split_chunks(scratch[step % 2][:len(segment(r - step - 1))], chunk)
        return [(comm.Irecv(c, source=left, tag=TAG_REDUCE_SCATTER), c) for c in incoming]

    for piece in split_chunks(segment(r), chunk):
        send(piece)
    receives = post_receives(0)
    for step in range(p - 1):
        # post the next step's receives now (other scratch half) so no chunk waits unexpected
        upcoming = post_receives(step + 1) if step + 1 < p - 1 else []
        targets = split_chunks(segment(r - step - 1), chunk)
        for (request, received), target in zip(receives, targets, strict=True):
            wait(request)
            wire.add(target, received)
            if step + 1 < p - 1:
                send(target)  # the next step sends exactly what this step reduced
        receives = upcoming
    for request, _ in in_flight:
        wait(request)


def _allgather(comm, segment, wire, chunk, right, left, wait) -> None:
    p, r = comm.size, comm.rank
    in_flight: list[tuple[MPI.Request, np.ndarray]] = []
    for piece in split_chunks(segment(r + 1), chunk):
        encoded = wire.encode(piece)
        in_flight.append((comm.Isend(encoded, dest=right, tag=TAG_ALLGATHER), encoded))
    # every segment lands in its own final place, so all receives can be posted at once
    steps = []
    for step in range(p - 1):
        targets = split_chunks(segment(r - step), chunk)
        landing = [t if wire.dtype == t.dtype else np.empty(len(t), wire.dtype)
                   for t in targets]
        requests = [comm.Irecv(b, source=left, tag=TAG_ALLGATHER) for b in landing]
        steps.append((requests, landing, targets))
    for step, (requests, landing, targets) in enumerate(steps):
        for request, received, target in zip(requests, landing, targets, strict=True):
            wait(request)
            if step + 1 < p - 1:
                in_flight.append((comm.Isend(received, dest=right, tag=TAG_ALLGATHER),
                                  received))
            wire.decode_into(target, received)
    for request, _ in in_flight:
        wait(request)


class RingCommunicator(Communicator):
    backend = "ring"
    chunk_bytes = DEFAULT_CHUNK_BYTES
    sends_bf16 = True

    def _allreduce(self, buffer: torch.Tensor, average: bool) -> None:
        bf16 = self.wire_dtype == torch.bfloat16 and buffer.dtype == torch.float32
        ring_allreduce(self._comm, numpy_view(buffer), average, self.chunk_bytes, bf16,
                       self._wait)
