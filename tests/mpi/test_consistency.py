"""Consistency policies under real MPI (hpcdl/comm/policy.py): local SGD, hierarchical local
SGD on virtual nodes (``ranks_per_node``), PowerSGD's compressed allreduce, exact resume.

References are computed independently: the float64 average of every rank's replica
(allgathered), the world's mean gradient from every rank's input."""
import os

import numpy as np
import pytest
import torch
from signal_at import signal_after_step  # tests/signal_at.py

import hpcdl.comm
from hpcdl.comm.policy import create_policy
from hpcdl.comm.powersgd import PowerSGDReducer, compressed_bytes


def make_model(seed=0):
    torch.manual_seed(seed)  # the same weights on every rank
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def flat_params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()


def everyone(world, vector):
    """Every rank's vector, stacked (rank r is row r)."""
    out = np.empty((world.size, vector.numel()), dtype=np.float64)
    world.Allgather(vector.numpy(), out)
    return out


def take_step(model, optimizer, policy, step, rank):
    """One step as the trainer takes it, up to (not including) ``after_step``."""
    policy.before_step(step)
    optimizer.zero_grad(set_to_none=True)
    policy.reducer.arm(last=True)
    x = torch.arange(18, dtype=torch.float32).view(3, 6) / 10 + rank + 0.3 * step
    model(x).pow(2).mean().backward()
    policy.reducer.synchronize()
    optimizer.step()


def lars(model):
    from hpcdl.optim import create_optimizer

    return create_optimizer({"name": "lars", "momentum": 0.9, "weight_decay": 1e-4}, model,
                            lr=0.05)



@pytest.mark.min_ranks(2)
def test_local_sgd_replicas_diverge_between_averages_and_equal_the_float64_mean_after(
        comm, world):
    model = make_model()
    optimizer = lars(model)
    policy = create_policy(comm, model.named_parameters(), algorithm="local_sgd",
                           local_steps=3, sync_warmup_steps=2, bucket_bytes=256)
    try:
        for step in range(8):
            take_step(model, optimizer, policy, step, world.rank)
            before = everyone(world, flat_params(model))
            policy.after_step(step + 1)
            after = everyone(world, flat_params(model))
            if step < 2:  # synchronous warm-up: one model
                assert np.all(before == before[0]), step
            elif (step + 1 - 2) % 3 == 0:  # an average: every rank holds the mean
                assert np.all(after == after[0]), step
                np.testing.assert_allclose(after[0], before.mean(axis=0), rtol=1e-6,
                                           atol=1e-7)
                assert not np.all(before == before[0]), step  # they had diverged
            else:  # a local step: each rank on its own gradient
                assert not np.all(after == after[0]), step
        assert policy.averages == 2
        traffic = policy.traffic()
        gradient_bytes = sum(b.numel * 4 for b in policy.reducer.buckets)
        # Two synchronous steps of gradients, two model averages of the same bytes.
        assert traffic["bytes_world"] == 4 * gradient_bytes
    finally:
        policy.close()


@pytest.mark.min_ranks(2)
def test_local_sgd_last_step_averages_and_evaluation_does_not_change_the_replicas(comm, world):
    model = make_model()
    optimizer = lars(model)
    policy = create_policy(comm, model.named_parameters(), algorithm="local_sgd",
                           local_steps=4, bucket_bytes=256)
    try:
        take_step(model, optimizer, policy, 0, world.rank)
        policy.after_step(1)
        mine = flat_params(model).clone()
        with policy.averaged():
            inside = everyone(world, flat_params(model))
            assert np.all(inside == inside[0])
        assert torch.equal(flat_params(model), mine)  # each rank's replica is back
        take_step(model, optimizer, policy, 1, world.rank)
        policy.after_step(2, last=True)
        final = everyone(world, flat_params(model))
        assert np.all(final == final[0])
    finally:
        policy.close()


@pytest.mark.min_ranks(2)
def test_hierarchical_local_sgd_equal_within_a_node_every_step_across_nodes_every_h(world):
    per_node = 2 if world.size % 2 == 0 and world.size > 2 else 1
    comm = hpcdl.comm.init("mpi", world, ranks_per_node=per_node)
    model = make_model()
    optimizer = lars(model)
    policy = create_policy(comm, model.named_parameters(), algorithm="hierarchical_local_sgd",
                           local_steps=2, sync_warmup_steps=1, bucket_bytes=256)
    nodes = np.array(world.allgather(comm.node_index))
    assert comm.num_nodes == world.size // per_node
    try:
        for step in range(5):
            take_step(model, optimizer, policy, step, world.rank)
            before = everyone(world, flat_params(model))
            policy.after_step(step + 1)
            after = everyone(world, flat_params(model))
            for node in range(comm.num_nodes):  # one model per node, every step
                rows = after[nodes == node]
                assert np.all(rows == rows[0]), (step, node)
            across = np.all(after == after[0])
            if step == 0 or step in (2, 4):  # warm-up, then averages at steps 3 and 5
                assert across, step
                np.testing.assert_allclose(after[0], before.mean(axis=0), rtol=1e-6,
                                           atol=1e-7)
            else:
                assert not across, step
        traffic = policy.traffic()
        gradient_bytes = sum(b.numel * 4 for b in policy.reducer.buckets)
        assert traffic["bytes_node"] == 4 * gradient_bytes      # steps 2-5 inside the node
        assert traffic["bytes_world"] == 3 * gradient_bytes     # warm-up + two averages
    finally:
        policy.close()
        comm.close()


def set_grads(model, grads):
    for p, g in zip(model.parameters(), grads, strict=True):
        p.grad = g.clone()


@pytest.mark.min_ranks(2)
def test_powersgd_allreduce_of_a_low_rank_average_is_exact(comm, world):
    model = torch.nn.Linear(12, 10)
    generator = torch.Generator().manual_seed(7)
    u = torch.randn(10, 2, generator=generator)
    v = torch.randn(12, 2, generator=generator)
    # Rank r sends u·diag(r+1, 1)·vᵀ: different matrices whose average has rank 2.
    weights = [u @ torch.diag(torch.tensor([r + 1.0, 1.0])) @ v.T for r in range(world.size)]
    biases = [torch.full((10,), float(r)) for r in range(world.size)]
    with PowerSGDReducer(comm, model.named_parameters(), rank=2) as reducer:
        set_grads(model, [weights[world.rank], biases[world.rank]])
        reducer.synchronize()
        torch.testing.assert_close(model.weight.grad, sum(weights) / world.size, rtol=1e-4,
                                   atol=1e-5)
        torch.testing.assert_close(model.bias.grad, sum(biases) / world.size)
        assert reducer.bytes_reduced == compressed_bytes([(10, 12), (10,)], 2)
        assert reducer.bytes_reduced == 4 * (2 * (10 + 12) + 10)


@pytest.mark.min_ranks(2)
def test_powersgd_error_feedback_keeps_what_was_not_sent(comm, world):
    """Σ_t sent_t + mean_i(E_i,T) = Σ_t mean_i(G_i,t): nothing a rank computed is lost."""
    model = torch.nn.Linear(16, 12, bias=False)
    generator = torch.Generator().manual_seed(world.rank)
    sent = torch.zeros(12, 16, dtype=torch.float64)
    true = torch.zeros(12, 16, dtype=torch.float64)
    with PowerSGDReducer(comm, model.named_parameters(), rank=1) as reducer:
        for _ in range(4):
            grad = torch.randn(12, 16, generator=generator)  # full rank: rank 1 loses a lot
            true += torch.from_numpy(everyone(world, grad.reshape(-1).double()).mean(axis=0)
                                     ).view(12, 16)
            model.weight.grad = grad
            reducer.synchronize()
            sent += model.weight.grad.double()
            residual = reducer.error["weight"].double()
            assert residual.norm() > 0  # rank 1 of a full-rank matrix leaves a residual
        mean_error = everyone(world, reducer.error["weight"].reshape(-1).double()).mean(axis=0)
        torch.testing.assert_close(sent + torch.from_numpy(mean_error).view(12, 16), true,
                                   rtol=1e-4, atol=1e-4)
        assert reducer.bytes_reduced == 4 * compressed_bytes([(12, 16)], 1)


# -- exact resume through the trainer -----------------------------------------------------------
PER_RANK = 2


def recipe(size, **comm):
    from hpcdl.train.config import config_from_dict

    return config_from_dict({
        "name": "tiny",
        "model": {"name": "resnet_small", "num_classes": 3, "width": 4, "layers": [1, 1, 1]},
        "data": {"image_size": 16, "workers": 1},
        "batch": {"global": PER_RANK * size, "per_rank": PER_RANK},
        "epochs": 2,
        "optimizer": {"name": "lars", "momentum": 0.9, "weight_decay": 5.0e-5},
        "schedule": {"name": "poly", "base_lr": 1.0, "warmup_epochs": 0.5},
        "train": {"seed": 3, "log_every_steps": 2},
        "comm": {"backend": "mpi", "bucket_mb": 0.004, **comm},
    })


@pytest.fixture(scope="module")
def shards(make_tiny_shards):
    return make_tiny_shards()


def run_trainer(config, shards, run_dir, comm, resume="none", hooks=(), **options):
    from hpcdl.train.trainer import Trainer, TrainOptions

    trainer = Trainer(config, shards, run_dir, comm,
                      options=TrainOptions(deterministic=True, progress=False, evaluate=False,
                                           **options))
    trainer.after_step_hooks.extend(hooks)
    try:
        trainer.resume(resume)
        return trainer.train()
    finally:
        trainer.close()


@pytest.mark.min_ranks(2)
@pytest.mark.parametrize("algorithm", ["local_sgd", "hierarchical_local_sgd", "powersgd"])
def test_resume_mid_interval_ends_with_the_uninterrupted_replicas(
        algorithm, shards, world, shared_tmp):
    per_node = 2 if world.size % 2 == 0 and world.size > 2 else 1
    comm = hpcdl.comm.init("mpi", world, ranks_per_node=per_node)
    config = recipe(world.size, algorithm=algorithm, local_steps=3, sync_warmup_steps=2,
                    powersgd_rank=1)
    try:
        reference = run_trainer(config, shards, os.path.join(shared_tmp, "a"), comm,
                                max_steps=8)
        # Stop after step 4: two local steps into an interval of three (local SGD), with
        # error-feedback buffers and Q mid-flight (PowerSGD). Rank 0 is signalled after step
        # 3's agreement; every rank stops at the next.
        run_b = os.path.join(shared_tmp, "b")
        stopped = run_trainer(config, shards, run_b, comm, max_steps=8,
                              hooks=[signal_after_step(3, 0)])
        assert stopped["stopped"] == "signal" and stopped["steps"] == 4
        if algorithm != "powersgd":  # replicas differ in the checkpoint: per-rank state
            assert len(set(world.allgather(stopped["params_sha256"]))) > 1
        resumed = run_trainer(config, shards, run_b, comm, resume="auto", max_steps=8)
    finally:
        comm.close()
    assert world.allgather(resumed["params_sha256"]) == \
        world.allgather(reference["params_sha256"])
    assert resumed["traffic"] == reference["traffic"]
    assert resumed["reducer"] == "enabled"
    assert len(set(world.allgather(resumed["params_sha256"]))) == 1  # last step averaged
