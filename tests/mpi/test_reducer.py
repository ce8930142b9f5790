"""GradientReducer under real MPI: averaged gradients, fixed bucket order, unused parameters,
bucket views across steps, suspension."""
import contextlib

import pytest
import torch

import hpcdl.comm
from hpcdl.comm.reducer import GradientReducer


@pytest.fixture(scope="module", params=["mpi", "ring", "shm"])
def comm(request):
    from mpi4py import MPI

    c = hpcdl.comm.init(request.param, MPI.COMM_WORLD)
    yield c
    c.close()


def make_model(seed=0):
    torch.manual_seed(seed)  # the same weights on every rank
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16),
                               torch.nn.ReLU(), torch.nn.Linear(16, 4))


def local_grads(model, x):
    model.zero_grad(set_to_none=True)
    model(x).pow(2).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def rank_input(rank, n=3):
    return torch.arange(n * 6, dtype=torch.float32).view(n, 6) / 10 + rank


def reduced_step(model, reducer, rank, set_to_none=True):
    """One step as the trainer takes it: zero, arm, backward on this rank's input, synchronize."""
    model.zero_grad(set_to_none=set_to_none)
    reducer.arm(last=True)
    model(rank_input(rank)).pow(2).sum().backward()
    reducer.synchronize()


def assert_grads(model, expected, context=""):
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, expected[n], rtol=1e-5, atol=1e-6), (context, n)


def world_average_grads(model, size):
    """The world's average gradient, computed locally from every rank's input."""
    expected = {}
    for r in range(size):
        for n, g in local_grads(model, rank_input(r)).items():
            expected[n] = expected.get(n, 0) + g / size
    return expected


def test_gradients_are_averaged_over_ranks(comm, world):
    model = make_model()
    expected = world_average_grads(model, world.size)
    with GradientReducer(comm, model.named_parameters(), bucket_bytes=256) as reducer:
        assert len(reducer.buckets) > 2  # several buckets in flight
        for _ in range(2):  # the reducer is reusable step after step
            reduced_step(model, reducer, world.rank)
            assert_grads(model, expected)


def test_buckets_launch_in_bucket_order_whatever_order_gradients_arrive(comm, world):
    model = make_model()
    params = list(model.parameters())
    with GradientReducer(comm, model.named_parameters(), bucket_bytes=128) as reducer:
        reducer.arm(last=True)
        # Odd ranks see gradients in registration order (the reverse of the layout), even
        # ranks in layout order: the collectives must still pair up bucket by bucket.
        order = params if world.rank % 2 else params[::-1]
        for p in order:
            p.grad = torch.full_like(p, float(world.rank))
            reducer._on_grad_ready(p)
        reducer.synchronize()
    mean_rank = (world.size - 1) / 2
    for p in params:
        assert torch.allclose(p.grad, torch.full_like(p, mean_rank))


def test_parameter_unused_on_some_ranks_gets_the_world_average(comm, world):
    model = make_model()
    head = model[4]
    with GradientReducer(comm, model.named_parameters(), bucket_bytes=1 << 20) as reducer:
        reducer.arm(last=True)
        out = model[:4](rank_input(world.rank))
        # Rank 0 skips the head: its gradient is missing there, present elsewhere.
        loss = out.sum() if world.rank == 0 else model[4](out).sum()
        loss.backward()
        reducer.synchronize()
    grads = world.allgather(head.weight.grad.clone())
    assert all(torch.equal(g, grads[0]) for g in grads)  # one step on every rank
    if world.size > 1:
        assert torch.count_nonzero(head.weight.grad) > 0


def test_bf16_wire_dtype_averages_approximately(comm, world):
    model = make_model()
    with GradientReducer(comm, model.named_parameters(), bucket_bytes=512,
                         wire_dtype=torch.bfloat16) as reducer:
        assert all(b.buffer.dtype == torch.bfloat16 for b in reducer.buckets)
        reducer.arm(last=True)
        for p in model.parameters():
            p.grad = torch.full_like(p, 1.0 + world.rank)
            reducer._on_grad_ready(p)
        reducer.synchronize()
    expected = 1.0 + (world.size - 1) / 2
    for p in model.parameters():
        assert torch.allclose(p.grad, torch.full_like(p, expected), rtol=1e-2)


def test_views_of_the_buckets_stay_right_across_steps(comm, world):
    """After synchronize p.grad views the bucket (for shm: window memory the peers read).
    Both ways of zeroing -- dropping the views, or zeroing them in place -- must give the
    world's average step after step, and close() must leave the values in place."""
    model = make_model()
    expected = world_average_grads(model, world.size)
    reducer = GradientReducer(comm, model.named_parameters(), bucket_bytes=256,
                              last_bucket_bytes=128)
    for set_to_none in (True, False, False, True):
        reduced_step(model, reducer, world.rank, set_to_none)
        assert_grads(model, expected, f"set_to_none={set_to_none}")
    reducer.close()
    assert_grads(model, expected, "after close")


def test_suspended_reducer_keeps_each_ranks_gradients_then_resumes(comm, world):
    model = make_model()
    own = local_grads(model, rank_input(world.rank))
    expected = world_average_grads(model, world.size)
    with GradientReducer(comm, model.named_parameters(), bucket_bytes=256) as reducer:
        for suspend in (True, False, True):
            with reducer.suspended() if suspend else contextlib.nullcontext():
                reduced_step(model, reducer, world.rank)
            assert_grads(model, own if suspend else expected, f"suspended={suspend}")
            assert reducer.enabled
