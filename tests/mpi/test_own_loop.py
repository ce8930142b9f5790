"""Your own loop (hpcdl/train/distributed.py, examples/own_loop.py) under real MPI: the wrapped
optimizer keeps every rank's parameters bit-identical, and equal to one process that trains on
the whole global batch with the plain optimizer (the reference, computed here independently).

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


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return example.SmallCNN()


def _reference(name: str, lr: float, images, labels) -> tuple[torch.nn.Module, list[float]]:
    """One process, the whole global batch each step, the unwrapped optimizer."""
    model = _model(0)
    optimizer = example.make_optimizer(name, model, lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: example.warmup_then_decay(step, 2, STEPS))
    losses = []
    for batch in example.global_batches(len(images), GLOBAL_BATCH, STEPS, seed=0):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(images[batch]), labels[batch])
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(float(loss.detach()))
    return model, losses


@pytest.mark.parametrize("name, lr", [("lars", 2.0), ("sgd", 0.1), ("adamw", 0.005)])
def test_replicas_equal_each_other_and_the_single_process_run(comm, data, name, lr):
    images, labels = data
    model = _model(comm.rank)   # a different start on each rank: the broadcast must fix it
    optimizer = hpcdl.DistributedOptimizer(example.make_optimizer(name, model, lr), model, comm)
    hpcdl.broadcast_parameters(model, comm)
    hpcdl.broadcast_optimizer_state(optimizer, comm)
    try:
        losses = example.train(model, optimizer, images, labels, comm, STEPS, GLOBAL_BATCH,
                               seed=0, warmup_steps=2)
    finally:
        optimizer.close()

    everyone = comm.mpi_comm.allgather(_flat(model).numpy())
    for rank, theirs in enumerate(everyone):
        assert (theirs == everyone[0]).all(), f"rank {rank}'s parameters differ from rank 0's"
    reference, reference_losses = _reference(name, lr, images, labels)
    if name == "adamw":
        # Adam divides by sqrt(v): where a gradient is ~0 its rounding (another summation
        # order over 3 or 4 ranks) decides the sign of an lr-sized step, so a few elements
        # of 20,490 differ by ~1e-4 (measured). Compare the whole: the difference against
        # how far training moved the parameters.
        moved = torch.linalg.vector_norm(_flat(reference) - _flat(_model(0)))
        assert torch.linalg.vector_norm(_flat(model) - _flat(reference)) < 1e-3 * moved
    else:
        torch.testing.assert_close(_flat(model), _flat(reference), rtol=1e-4, atol=1e-5)
    assert losses == pytest.approx(reference_losses, rel=1e-4, abs=1e-5)
    assert sum(losses[-3:]) < 0.75 * sum(losses[:3]), losses  # 0.43-0.56 measured


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
