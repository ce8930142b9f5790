"""hpcdl.comm under a real mpiexec: every backend against a float64 reference sum.

Communicators are built once per module (gloo's TCP rendezvous is slow) and closed at the end.
``shm-nodes`` is the shm backend with ranks_per_node=2, which exercises the across-node paths
on one machine: uniform nodes at p=2 and 4, the unequal-nodes leader path at p=3.
"""
from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from mpi4py import MPI

import hpcdl.comm
import hpcdl.comm.ccl
from hpcdl.comm import CollectiveMismatchError


def oneccl_missing() -> str | None:
    """Why the ``ccl`` backend cannot run here (None: it can). tests/run.sh's ``ccl`` stage
    assembles oneCCL (tests/ccl_env.sh) and sets HPCDL_REQUIRE_CCL=1: there it must run."""
    reason = hpcdl.comm.ccl.missing_reason()
    if reason is not None and os.environ.get("HPCDL_REQUIRE_CCL", "0") not in ("", "0"):
        raise RuntimeError(f"HPCDL_REQUIRE_CCL is set but {reason}")
    return reason


CCL_MISSING = oneccl_missing()
needs_oneccl = pytest.mark.skipif(CCL_MISSING is not None, reason=str(CCL_MISSING))
#: oneCCL's own allreduce, and with bf16 on the wire (summed in bf16 by oneCCL)
CCL_BACKENDS = [pytest.param(name, marks=needs_oneccl) for name in ("ccl", "ccl-bf16wire")]
BACKENDS = ["mpi", "ring", "shm", "shm-nodes", "gloo", "ring-bf16wire", "gloo-bf16wire",
            *CCL_BACKENDS]
EXACT_BACKENDS = ["mpi", "ring", "shm", "shm-nodes", "gloo", CCL_BACKENDS[0]]


def _build(name: str) -> hpcdl.comm.Communicator:
    if name == "shm-nodes":
        return hpcdl.comm.init("shm", ranks_per_node=2)
    if name.endswith("-bf16wire"):
        return hpcdl.comm.init(name.removesuffix("-bf16wire"), wire_dtype=torch.bfloat16)
    return hpcdl.comm.init(name)


@pytest.fixture(scope="module")
def communicators():
    names = [p if isinstance(p, str) else p.values[0] for p in BACKENDS]
    comms = {name: _build(name) for name in names
             if CCL_MISSING is None or not name.startswith("ccl")}
    yield comms
    for comm in comms.values():
        comm.close()


def rank_tensor(rank: int, numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Rank ``rank``'s input: every rank can rebuild every other rank's, for the reference."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-(2**20), 2**20, (numel,), generator=g, dtype=dtype)


def reference_sum(size: int, numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    total = torch.zeros(numel, dtype=torch.float64)
    for r in range(size):
        total += rank_tensor(r, numel, dtype, seed).to(torch.float64)
    return total


def sizes_for(p: int) -> dict[str, int]:
    """The edge cases of segmenting a buffer over p ranks."""
    return {"zero": 0, "one": 1, "p_minus_1": p - 1, "not_divisible": 1000 * p + 1}


TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 1e-2}


def assert_matches(result: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype,
                   wire_bf16: bool = False) -> None:
    tol = 2e-2 if wire_bf16 else TOLERANCE[dtype]
    torch.testing.assert_close(result.to(torch.float64), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("average", [True, False], ids=["average", "sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16],
                         ids=["fp32", "fp64", "bf16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_allreduce_equals_float64_reference(communicators, world, backend, dtype, average):
    """Sizes 0, 1, p-1 and one not divisible by p, in one test (each case is ~1 ms)."""
    comm = communicators[backend]
    for size_name, numel in sizes_for(world.size).items():
        tensor = rank_tensor(world.rank, numel, dtype)
        comm.allreduce_(tensor, average=average)
        expected = reference_sum(world.size, numel, dtype) / (world.size if average else 1)
        assert tensor.dtype == dtype and tensor.shape == (numel,), size_name
        assert_matches(tensor, expected, dtype, wire_bf16=backend.endswith("bf16wire"))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("backend", EXACT_BACKENDS)
def test_integer_sum_is_exact(communicators, world, backend, dtype):
    numel = 1000 * world.size + 1
    tensor = rank_tensor(world.rank, numel, dtype)
    communicators[backend].allreduce_(tensor, average=False)
    assert torch.equal(tensor, reference_sum(world.size, numel, dtype).to(dtype))


@pytest.mark.parametrize("backend", BACKENDS)
def test_300_tensors_fused_into_small_buckets(communicators, world, backend):
    comm = communicators[backend]
    shapes = [(i % 5 + 1, i % 3 + 1) for i in range(300)]
    numels = [a * b for a, b in shapes]
    tensors = [t.reshape(shape).clone() for t, shape in zip(
        rank_tensor(world.rank, sum(numels), torch.float32).split(numels), shapes, strict=True)]
    saved, comm.bucket_bytes = comm.bucket_bytes, 256  # many buckets, each several tensors
    try:
        comm.allreduce_(tensors, average=True)
    finally:
        comm.bucket_bytes = saved
    expected = reference_sum(world.size, sum(numels), torch.float32) / world.size
    assert_matches(torch.cat([t.reshape(-1) for t in tensors]), expected, torch.float32,
                   wire_bf16=backend.endswith("bf16wire"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_buffer_from_empty_is_reduced_in_place(communicators, world, backend):
    comm = communicators[backend]
    numel = 5000 * world.size + 3
    buffer = comm.empty(numel, torch.float32)
    buffer.copy_(rank_tensor(world.rank, numel, torch.float32))
    address = buffer.data_ptr()
    comm.allreduce_flat_(buffer, average=True)
    assert buffer.data_ptr() == address
    assert_matches(buffer, reference_sum(world.size, numel, torch.float32) / world.size,
                   torch.float32, wire_bf16=backend.endswith("bf16wire"))


def large_case(comm: hpcdl.comm.Communicator, numel: int) -> None:
    """x_r[i] = (i mod 1024)·(r+1): the sum (i mod 1024)·p(p+1)/2 is exact in fp32 and cheap
    to check at 10^8 elements (a random reference would dominate the test's time)."""
    pattern = torch.arange(1024, dtype=torch.float32).repeat(-(-numel // 1024))[:numel]
    buffer = comm.empty(numel, torch.float32)
    torch.mul(pattern, comm.rank + 1, out=buffer)
    comm.allreduce_flat_(buffer, average=False)
    pattern.mul_(comm.size * (comm.size + 1) // 2)
    assert torch.equal(buffer, pattern)


@pytest.mark.parametrize("backend", ["mpi", "shm"])
def test_10m_elements(communicators, backend):
    large_case(communicators[backend], 10_000_000)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["mpi", "shm"])
def test_100m_elements(communicators, backend):
    """The issue's 100M-element case: 400 MB per rank; slow at -n 4 on 2 cores."""
    large_case(communicators[backend], 100_000_000)


@pytest.mark.parametrize("backend", BACKENDS)
def test_broadcast_from_last_rank(communicators, world, backend):
    root = world.size - 1
    tensors = [torch.full((3, 4), float(world.rank)), torch.arange(7) * (world.rank + 1),
               torch.full((5,), world.rank + 0.5, dtype=torch.bfloat16)]
    communicators[backend].broadcast_(tensors, root=root)
    assert torch.equal(tensors[0], torch.full((3, 4), float(root)))
    assert torch.equal(tensors[1], torch.arange(7) * (root + 1))
    assert torch.equal(tensors[2], torch.full((5,), root + 0.5, dtype=torch.bfloat16))


@pytest.mark.parametrize("backend", BACKENDS)
def test_mismatched_shapes_raise_naming_ranks_and_shapes(communicators, world, backend):
    shape = (world.rank + 2, 3)  # every rank differs
    with pytest.raises(CollectiveMismatchError) as info:
        communicators[backend].allreduce_([torch.ones(shape)])
    message = str(info.value)
    assert "rank 0: allreduce_(shapes=[(2, 3)]" in message
    assert "rank 1: allreduce_(shapes=[(3, 3)]" in message


@pytest.mark.parametrize("backend", ["mpi", "shm"])
def test_mismatched_dtypes_raise(communicators, world, backend):
    dtype = torch.float32 if world.rank == 0 else torch.float64
    with pytest.raises(CollectiveMismatchError, match=r"rank 0: .*float32"):
        communicators[backend].allreduce_flat_(torch.ones(8, dtype=dtype))


def test_debug_mode_checks_a_layout_already_seen(communicators, world, monkeypatch):
    comm = communicators["mpi"]
    comm.allreduce_(torch.ones(11))  # layout seen: without debug it is not checked again
    monkeypatch.setenv("HPCDL_DEBUG", "1")
    numel = 11 if world.rank == 0 else 12
    with pytest.raises(CollectiveMismatchError, match=r"rank 0: .*\(11,\)"):
        comm.allreduce_(torch.ones(numel))


def test_averaging_integers_is_an_error(communicators):
    with pytest.raises(ValueError, match="cannot average an integer"):
        communicators["mpi"].allreduce_(torch.ones(4, dtype=torch.int64), average=True)


@pytest.mark.parametrize("backend", EXACT_BACKENDS)
def test_allreduce_from_a_communication_thread(communicators, world, backend):
    comm = communicators[backend]
    buffer = comm.empty(4099, torch.float64)
    buffer.copy_(rank_tensor(world.rank, 4099, torch.float64))
    failures = []

    def reduce_on_thread() -> None:
        try:
            comm.allreduce_flat_(buffer, average=False, bucket=0)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the main thread
            failures.append(exc)

    thread = threading.Thread(target=reduce_on_thread, name="hpcdl-comm")
    thread.start()
    thread.join()
    assert not failures, failures
    assert_matches(buffer, reference_sum(world.size, 4099, torch.float64), torch.float64)


@pytest.mark.parametrize("backend", ["ring-bf16wire", "gloo-bf16wire"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bf16_wire_gives_identical_results_on_every_rank(communicators, world, backend, dtype):
    tensor = rank_tensor(world.rank, 3001, dtype)
    communicators[backend].allreduce_(tensor, average=True)
    everyone = world.allgather(tensor.view(torch.uint8).numpy().tobytes())
    assert all(b == everyone[0] for b in everyone)


@pytest.mark.parametrize("average", [True, False], ids=["average", "sum"])
def test_gloo_bf16_wire_reduces_a_bf16_bucket_of_any_size(communicators, world, average):
    """The reducer's path: a bf16 buffer handed to ``allreduce_flat_`` travels in bf16 (not
    through the fp32 staging of ``allreduce_``), at the sizes that leave ranks with no slice
    or uneven slices; the result matches the float64 sum and is the same on every rank."""
    comm = communicators["gloo-bf16wire"]
    for size_name, numel in sizes_for(world.size).items():
        buffer = rank_tensor(world.rank, numel, torch.bfloat16)
        comm.allreduce_flat_(buffer, average=average)
        expected = reference_sum(world.size, numel, torch.bfloat16) / (
            world.size if average else 1)
        assert buffer.dtype == torch.bfloat16 and buffer.shape == (numel,), size_name
        assert_matches(buffer, expected, torch.bfloat16, wire_bf16=True)
        everyone = world.allgather(buffer.view(torch.uint8).numpy().tobytes())
        assert all(b == everyone[0] for b in everyone), size_name


@pytest.mark.parametrize("extra", [1, 0], ids=["unequal_slices", "equal_slices"])
def test_gloo_bf16_wire_sums_in_fp32_and_rounds_once(communicators, world, extra):
    """Rank 0 sends 1, every other rank 2⁻⁸ (half a bf16 step at 1): summed in fp32 and
    rounded once, p ≥ 3 ranks give 1 + (p−1)·2⁻⁸ rounded; summed in bf16 step by step, every
    addition would round back to 1 (ties to even) -- gloo's own bf16 allreduce, and the
    ring's partial sums, which travel rounded hop by hop."""
    numel = 1000 * world.size + extra
    tensor = torch.full((numel,), 1.0 if world.rank == 0 else 2.0 ** -8, dtype=torch.bfloat16)
    communicators["gloo-bf16wire"].allreduce_flat_(tensor, average=False)
    once = torch.tensor(1.0 + (world.size - 1) * 2.0 ** -8).to(torch.bfloat16)
    assert torch.equal(tensor, once.expand(numel)), (tensor[:4], once)


def test_topology_of_one_machine(communicators, world):
    comm = communicators["mpi"]
    assert (comm.rank, comm.size) == (world.rank, world.size)
    assert (comm.local_rank, comm.local_size) == (world.rank, world.size)
    assert (comm.node_index, comm.num_nodes) == (0, 1)


def test_topology_with_two_ranks_per_node(communicators, world):
    comm = communicators["shm-nodes"]
    assert comm.local_rank == world.rank % 2
    assert comm.node_index == world.rank // 2
    assert comm.num_nodes == (world.size + 1) // 2
    assert comm.local_size == min(2, world.size - 2 * comm.node_index)


def test_auto_picks_shm_when_ranks_share_a_node(world):
    with hpcdl.comm.init("auto") as comm:
        assert comm.backend == "shm"


@pytest.mark.parametrize("backend", ["mpi", "shm", CCL_BACKENDS[0]])
def test_sub_communicator_reduces_within_it(world, backend):
    """LTFB: each trainer is a sub-communicator; its allreduce must not mix trainers."""
    sub = world.Split(world.rank % 2, world.rank)
    try:
        with hpcdl.comm.init(backend, world=sub) as comm:
            assert comm.size == sub.size and comm.mpi_comm is sub
            tensor = torch.full((10,), float(world.rank))
            comm.allreduce_(tensor, average=False)
            expected = sum(r for r in range(world.size) if r % 2 == world.rank % 2)
            assert torch.equal(tensor, torch.full((10,), float(expected)))
    finally:
        sub.Free()


@needs_oneccl
@pytest.mark.parametrize("backend", ["ccl", "ccl-bf16wire"])
def test_ccl_gives_identical_results_on_every_rank(communicators, world, backend):
    """Replicas stay identical only if every rank gets the same bits, not just close ones."""
    tensor = rank_tensor(world.rank, 3001 * world.size + 1, torch.float32)
    communicators[backend].allreduce_(tensor, average=True)
    everyone = world.allgather(tensor.numpy().tobytes())
    assert all(b == everyone[0] for b in everyone)


@needs_oneccl
def test_ccl_bf16_wire_sums_in_bf16(communicators, world):
    """1 + 2^-10 is 1 in bf16 (8 bits of mantissa): a sum of exactly p proves the bf16 wire."""
    tensor = torch.full((257,), 1 + 2**-10, dtype=torch.float32)
    communicators["ccl-bf16wire"].allreduce_(tensor, average=False)
    assert torch.equal(tensor, torch.full((257,), float(world.size)))
    communicators["ccl"].allreduce_(tensor.fill_(1 + 2**-10), average=False)
    assert torch.equal(tensor, torch.full((257,), world.size * (1 + 2**-10)))


@needs_oneccl
def test_ccl_barrier_and_the_library_version(communicators):
    communicators["ccl"].barrier()
    assert hpcdl.comm.ccl.oneccl_version().startswith("202")


@needs_oneccl
def test_ccl_constants_match_the_installed_header():
    """ctypes has no header: the enum values hpcdl passes must be oneapi/ccl/v2/types.h's."""
    header = Path(hpcdl.comm.ccl.find_library()).parents[1] / "include/oneapi/ccl/v2/types.h"
    if not header.is_file():
        pytest.skip(f"no {header} (a runtime-only oneCCL install)")
    enum = dict(re.findall(r"^\s*(oneccl\w+)\s*=\s*(\d+)\s*,", header.read_text(), re.M))
    names = {torch.uint8: "onecclUint8", torch.int32: "onecclInt32", torch.int64: "onecclInt64",
             torch.float16: "onecclFloat16", torch.float32: "onecclFloat32",
             torch.float64: "onecclFloat64", torch.bfloat16: "onecclBfloat16"}
    assert {d: int(enum[n]) for d, n in names.items()} == hpcdl.comm.ccl.DATATYPES
    assert int(enum["onecclSum"]) == hpcdl.comm.ccl.ONECCL_SUM
    assert int(enum["onecclSuccess"]) == hpcdl.comm.ccl.ONECCL_SUCCESS
    assert re.search(rf"#define ONECCL_UNIQUE_ID_BYTES {hpcdl.comm.ccl.UNIQUE_ID_BYTES}\b",
                     header.read_text())


@contextlib.contextmanager
def one_host_env_kept() -> Iterator[None]:
    """The oneCCL one-host defaults `hpcdl.comm.init("ccl")` may set, as they were before."""
    saved = {key: os.environ.get(key) for key in hpcdl.comm.ccl.ONE_HOST_DEFAULTS}
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


#: the same on every rank (tmp_path is not): the message every rank raises is rank 0's
NO_ONECCL = "/nonexistent/oneccl-root"


def test_ccl_without_oneccl_names_what_is_missing(world, monkeypatch):
    """A site without oneCCL: one message, the same on every rank, naming the library, where
    it was looked for and how to get it (hpcdl train turns it into exit 2)."""
    monkeypatch.setattr(hpcdl.comm.ccl, "_library", None)  # as in a fresh process
    monkeypatch.setenv("CCL_ROOT", NO_ONECCL)
    with one_host_env_kept(), pytest.raises(hpcdl.comm.ccl.CCLUnavailableError) as info:
        hpcdl.comm.init("ccl")
    message = str(info.value)
    assert "\n" not in message
    assert f"CCL_ROOT={NO_ONECCL}" in message and "libccl.so.2" in message
    assert "module load ccl" in message and "tests/ccl_env.sh" in message


@needs_oneccl
@pytest.mark.min_ranks(2)
def test_ccl_missing_on_one_rank_fails_every_rank_naming_it(world, monkeypatch):
    """Rank 1's host lacks oneCCL: the others must not wait for it in onecclCommInitRank."""
    monkeypatch.setattr(hpcdl.comm.ccl, "_library", None)
    if world.rank == 1:
        monkeypatch.setenv("CCL_ROOT", NO_ONECCL)
    with one_host_env_kept(), pytest.raises(hpcdl.comm.ccl.CCLUnavailableError) as info:
        hpcdl.comm.init("ccl")
    assert "libccl.so.2" in str(info.value)
    if world.rank != 1:
        assert str(info.value).startswith(f"rank 1 of {world.size}")


def test_mpi_grants_thread_multiple():
    assert MPI.Query_thread() == MPI.THREAD_MULTIPLE
