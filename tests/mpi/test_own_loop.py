"""Your own loop (hpcdl/train/distributed.py, examples/own_loop.py) under real MPI: the wrapped
optimizer keeps every rank's parameters bit-identical, and equal, up to a rounding bound derived
from float32 and float64 references, to one process that trains on the whole global batch with
the plain optimizer (the reference, computed here independently).

Run: mpiexec -n 2 python -m pytest tests/mpi/test_own_loop.py   (also -n 3, -n 4)
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import hpcdl

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "own_loop.py"
GLOBAL_BATCH = 60   # divisible by 2, 3 and 4 ranks
STEPS = 16


def _load_example():
    spec = importlib.util.spec_from_file_location("own_loop_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


example = _load_example()


@pytest.fixture(scope="module")
def comm():
    communicator = hpcdl.comm.init("mpi")
    yield communicator
    communicator.close()


@pytest.fixture(scope="module")
def data():
    images, labels = example.load_fashion_mnist("train")
    return images[:1200], labels[:1200]


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _model(seed: int, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return example.SmallCNN().to(dtype)


def _reference(name: str, lr: float, images, labels,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One process, the whole global batch each step, the unwrapped optimizer: (the final
    parameters, each step's loss), both in float64."""
    model = _model(0, dtype)
    optimizer = example.make_optimizer(name, model, lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: example.warmup_then_decay(step, 2, STEPS))
    losses = []
    for batch in example.global_batches(len(images), GLOBAL_BATCH, STEPS, seed=0):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(images[batch].to(dtype)), labels[batch])
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(float(loss.detach()))
    return _flat(model).double(), torch.tensor(losses, dtype=torch.float64)


def _distributed(comm, name: str, lr: float, images, labels,
                 dtype: torch.dtype) -> tuple[torch.Tensor, list[float]]:
    model = _model(comm.rank, dtype)  # a different start on each rank: the broadcast fixes it
    optimizer = hpcdl.DistributedOptimizer(example.make_optimizer(name, model, lr), model, comm)
    hpcdl.broadcast_parameters(model, comm)
    hpcdl.broadcast_optimizer_state(optimizer, comm)
    try:
        losses = example.train(model, optimizer, images.to(dtype), labels, comm, STEPS,
                               GLOBAL_BATCH, seed=0, warmup_steps=2)
    finally:
        optimizer.close()
    return _flat(model), losses


def _assert_replicas_bit_identical(comm, flat: torch.Tensor) -> None:
    everyone = comm.mpi_comm.allgather(flat.numpy())
    for rank, theirs in enumerate(everyone):
        assert (theirs == everyone[0]).all(), f"rank {rank}'s parameters differ from rank 0's"


# Unit roundoff of float32 and float64 (Higham, "Accuracy and Stability of Numerical
# Algorithms", 2nd ed., sec. 2.1).
U32, U64 = 2.0 ** -24, 2.0 ** -53


@pytest.mark.parametrize("name, lr", [("lars", 2.0), ("sgd", 0.1), ("adamw", 0.005)])
def test_replicas_equal_each_other_and_the_single_process_run(comm, data, name, lr):
    """Every rank ends bit-identical (in float32, the dtype users train in, and in float64),
    and the distributed run is the single-process run up to rounding (checked in float64).

    Why the comparison with one process is made in float64: in float32 it is not a question
    of rounding alone. SmallCNN's max-pools are not differentiable where a 2x2 window's two
    largest values tie, and 16 steps over 60 images pass through some 4.5 million windows;
    the ones whose top two differ by less than float32's rounding (a gap of ~2 ulp was found
    at LARS's second step, lr 2) take their gradient from whichever value rounding made larger.
    The forward for 20 images on one thread (3 ranks, AVX-512 kernels) rounds differently from
    the forward for 60, picks the other value, and the conv gradients change by 2e-4 relative
    in one step; LARS at lr 2 carries that to 0.008 in a parameter after 16 steps (7% of them
    off by more than 1e-5), where AVX2 and the default kernels happened to round alike. In
    float64 such near-ties are 2^29 times rarer, and what is left is rounding.

    The bound, from the computation itself: how far rounding moves this trajectory (lr,
    steps, schedule, the model's conditioning, all included) is measured by running the
    reference in float32 and in float64, S = |ref32 - ref64| / U32 per unit roundoff. The
    distributed float64 run rounds differently (per-rank sums over 60/P images, then the
    allreduce's P - 1 additions and the division by P): at most its own full rounding (S * U64,
    the reference's order replaced by another) plus one more rounding of every gradient
    element for each of those P operations, so |dist64 - ref64| <= (1 + P) * S * U64.
    Measured at -n 2/3/4 under avx512, avx2 and default: 0.02-0.21 of the bound. A wrong
    average (a missing bucket, sum instead of mean) is off by 1e-3 or more, 10^9 bounds away.
    """
    images, labels = data
    flat32, losses32 = _distributed(comm, name, lr, images, labels, torch.float32)
    _assert_replicas_bit_identical(comm, flat32)
    assert sum(losses32[-3:]) < 0.75 * sum(losses32[:3]), losses32  # 0.43-0.56 measured

    flat64, losses64 = _distributed(comm, name, lr, images, labels, torch.float64)
    _assert_replicas_bit_identical(comm, flat64)
    ref64, ref_losses64 = _reference(name, lr, images, labels, torch.float64)
    ref32, ref_losses32 = _reference(name, lr, images, labels, torch.float32)
    sensitivity = torch.linalg.vector_norm(ref32 - ref64) / U32
    bound = (1 + comm.size) * sensitivity * U64
    error = torch.linalg.vector_norm(flat64 - ref64)
    assert error <= bound, f"|distributed - single process| = {error:.3g} > {bound:.3g}"

    # Each step's loss: the same propagated rounding (from the losses' own float32/float64
    # gap), plus the last sum itself: either order of summing N = 60 positive terms is within
    # (N - 1) * U64 * sum|terms| of the exact sum (Higham, sec. 4.2), so the two orders are
    # within twice that; the terms are positive, so sum|terms| / N is the loss.
    loss_sensitivity = (ref_losses32 - ref_losses64).abs().max() / U32
    loss_bound = ((1 + comm.size) * loss_sensitivity * U64
                  + 2 * (GLOBAL_BATCH - 1) * U64 * ref_losses64)
    loss_error = (torch.tensor(losses64, dtype=torch.float64) - ref_losses64).abs()
    assert (loss_error <= loss_bound).all(), (loss_error, loss_bound)


def test_broadcast_parameters_copies_rank_0s_parameters_and_buffers(comm):
    torch.manual_seed(comm.rank)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    model[1].running_mean.fill_(float(comm.rank + 1))
    hpcdl.broadcast_parameters(model, comm)
    torch.manual_seed(0)
    expected = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    torch.testing.assert_close(model[0].weight, expected[0].weight, rtol=0, atol=0)
    assert (model[1].running_mean == 1.0).all()


def test_broadcast_optimizer_state_gives_every_rank_rank_0s_momentum_and_rate(comm):
    model = torch.nn.Linear(3, 2)
    hpcdl.broadcast_parameters(model, comm)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1 * (comm.rank + 1), momentum=0.9)
    if comm.rank == 0:  # only rank 0 has taken a step (as after loading a checkpoint)
        model(torch.ones(1, 3)).sum().backward()
        optimizer.step()
    hpcdl.broadcast_optimizer_state(optimizer, comm)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1)
    buffer = optimizer.state[model.weight]["momentum_buffer"]
    torch.testing.assert_close(buffer, torch.ones(2, 3), rtol=0, atol=0)


def test_no_sync_accumulates_locally_and_reduces_the_sum_once(comm, data):
    """Two half batches (the first inside no_sync) give the gradient of the whole global
    batch averaged over the world: DDP's accumulation idiom."""
    images, labels = data
    model = _model(0)
    optimizer = hpcdl.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                           model, comm)
    per_rank = GLOBAL_BATCH // comm.size
    mine = torch.arange(comm.rank * per_rank, (comm.rank + 1) * per_rank)
    halves = [mine[: per_rank // 2], mine[per_rank // 2:]]
    weights = [len(h) / per_rank for h in halves]   # uneven halves when per_rank is odd
    try:
        optimizer.zero_grad()
        with optimizer.no_sync():
            (weights[0] * F.cross_entropy(model(images[halves[0]]), labels[halves[0]])).backward()
        (weights[1] * F.cross_entropy(model(images[halves[1]]), labels[halves[1]])).backward()
        optimizer.step()
        averaged = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    finally:
        optimizer.close()
    reference = _model(0)
    F.cross_entropy(reference(images[:GLOBAL_BATCH]), labels[:GLOBAL_BATCH]).backward()
    expected = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
    torch.testing.assert_close(averaged, expected, rtol=1e-4, atol=1e-6)


def test_a_second_backward_before_step_raises_on_every_rank(comm):
    model = torch.nn.Linear(3, 2)
    optimizer = hpcdl.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           model, comm)
    try:
        model(torch.ones(1, 3)).sum().backward()
        with pytest.raises(RuntimeError, match="no_sync"):
            model(torch.ones(1, 3)).sum().backward()
    finally:
        optimizer.close()


def test_parameters_outside_the_model_are_refused(comm):
    model, other = torch.nn.Linear(3, 2), torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD([*model.parameters(), *other.parameters()], lr=0.1)
    with pytest.raises(ValueError, match="2 parameter"):
        hpcdl.DistributedOptimizer(optimizer, model, comm)


def test_the_wrapped_optimizer_is_a_torch_optimizer_sharing_groups_and_state(comm):
    model = torch.nn.Linear(3, 2)
    inner = hpcdl.optim.LARS(model.parameters(), lr=1.0)
    optimizer = hpcdl.DistributedOptimizer(inner, model, comm)
    try:
        assert isinstance(optimizer, torch.optim.Optimizer)
        optimizer.param_groups[0]["lr"] = 0.5
        assert inner.param_groups[0]["lr"] == 0.5
        assert optimizer.scale_momentum_ == inner.scale_momentum_   # LARS's own method
        assert optimizer.state_dict()["param_groups"][0]["lr"] == 0.5
    finally:
        optimizer.close()
