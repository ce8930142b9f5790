"""hpcdl's PowerSGD against PyTorch's ``powerSGD_hook``, side by side.

Both are fed the same gradients on every rank for many steps (a module whose gradient is its
input: ``loss = Σ_p <p, G_p>``), PyTorch's through DDP + gloo, ours through
:class:`~hpcdl.comm.powersgd.PowerSGDReducer`, both from the same first Q. Vogels et al.'s
Algorithm 1 is deterministic given Q, so the decompressed gradients must agree step after step,
error feedback included (to float32 rounding: Householder QR here, Gram-Schmidt there). The
shapes are chosen so that every branch of PyTorch's hook is taken: two compressed matrices, a
matrix PyTorch leaves uncompressed at rank 2 (6×6: factors 24 of 36 elements, a rate of 1.5,
under its ``min_compression_rate`` of 2; hpcdl compressed it before this test), and a vector.
"""
import pytest
import torch

from hpcdl.comm.powersgd import PowerSGDReducer

SHAPES = {"conv": (12, 3, 2, 2), "linear": (10, 20), "square": (6, 6), "bias": (12,)}
RANK = 2
WARMUP = 2      # PyTorch's start_powerSGD_iter (it needs > 1 with error feedback)
STEPS = 30


class GradientIsInput(torch.nn.Module):
    """Parameters of ``SHAPES``; ``forward(gs)`` = Σ <p, g_p>, so backward gives p.grad = g_p."""

    def __init__(self) -> None:
        super().__init__()
        for name, shape in SHAPES.items():
            self.register_parameter(name, torch.nn.Parameter(torch.zeros(shape)))

    def forward(self, gs: dict[str, torch.Tensor]) -> torch.Tensor:
        return sum((getattr(self, name) * g).sum() for name, g in gs.items())


def gradients(rank: int, step: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s gradients at ``step``: a slowly turning common low-rank part (what a
    warm start exploits) plus this rank's full-rank noise (what error feedback carries)."""
    common = torch.Generator().manual_seed(1000 + step // 10)
    own = torch.Generator().manual_seed(rank * 10_000 + step)
    out = {}
    for name, shape in SHAPES.items():
        n = shape[0]
        m = torch.Size(shape[1:]).numel()
        low = torch.randn(n, 3, generator=common) @ torch.randn(3, m, generator=common)
        out[name] = (low + 0.5 * torch.randn(n, m, generator=own)).reshape(shape)
    return out


@pytest.mark.min_ranks(2)
@pytest.mark.max_ranks(4)
def test_powersgd_matches_pytorchs_hook_step_by_step(comm, world):
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hpcdl.comm.gloo import init_process_group_over_mpi

    if not dist.is_initialized():  # torch's default group, once per process
        init_process_group_over_mpi(world)
    theirs = GradientIsInput()
    ddp = DDP(theirs, bucket_cap_mb=1)
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=RANK,
                                        start_powerSGD_iter=WARMUP)
    ours_model = GradientIsInput()
    ours = PowerSGDReducer(comm, ours_model.named_parameters(), rank=RANK)
    # PyTorch and hpcdl compress the same tensors (min_compression_rate 2)
    assert [x.name for x in ours.matrices] == ["conv", "linear"]
    by_shape = {tuple(getattr(theirs, x.name).shape): x.name for x in ours.matrices}

    # PyTorch's first compressed step starts from our first Q, so both start alike
    ddp.register_comm_hook(state, seed_pytorch_q(powerSGD_hook.powerSGD_hook, ours.q, by_shape))
    compared = 0
    for step in range(STEPS):
        gs = gradients(world.rank, step)
        ddp.zero_grad(set_to_none=True)
        ddp({k: v.clone() for k, v in gs.items()}).backward()
        if step < WARMUP:
            continue  # both average uncompressed here (our policy's warm-up)
        for name, g in gs.items():
            ours_model.get_parameter(name).grad = g.clone()
        ours.synchronize()
        for name in SHAPES:
            mine, pytorch = ours_model.get_parameter(name).grad, theirs.get_parameter(name).grad
            # float32 rounding of two QR methods, fed back through the error: a relative
            # difference of ~1e-5 (a different algorithm differs by tens of percent)
            difference = float((mine - pytorch).norm() / pytorch.norm())
            assert difference < 1e-3, f"{name} at step {step}: relative difference {difference}"
        compressed = [x for x in ours.matrices if x.name == "conv"][0]
        assert ours.error[compressed.name].norm() > 0  # rank 2 of a noisy matrix: a residual
        compared += 1
    assert compared == STEPS - WARMUP
    # the same bytes: PyTorch's element count after compression, ours in float32 bytes
    assert ours.bytes_reduced == 4 * state.total_numel_after_compression
    dist.barrier()


def seed_pytorch_q(hook, q, shapes):
    """``hook`` with PyTorch's first Q taken from ours (``q``: name -> (m, r); ``shapes``:
    parameter shape -> name), so a run of both starts from the same subspace."""

    def seeded(hook_state, bucket):
        if hook_state.iter >= hook_state.start_powerSGD_iter and \
                bucket.index() not in hook_state.q_memory_dict:
            names = [shapes[tuple(g.shape)] for g in bucket.gradients()
                     if tuple(g.shape) in shapes]
            hook_state.q_memory_dict[bucket.index()] = torch.cat(
                [q[name].reshape(-1) for name in names])
            hook_state.p_memory_dict[bucket.index()] = torch.empty(
                sum(q[name].shape[1] * (next(s for s, n in shapes.items() if n == name)[0])
                    for name in names))
        return hook(hook_state, bucket)

    return seeded


def small_cnn():
    torch.manual_seed(3)  # the same weights on every rank and for both
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 16, 3), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(), torch.nn.Linear(16, 10))


@pytest.mark.min_ranks(2)
@pytest.mark.max_ranks(4)
def test_powersgd_policy_with_lars_trains_as_ddp_with_pytorchs_hook(comm, world):
    """The full path: warm-up of plain averaging, then compression, error feedback, LARS on
    the decompressed gradient, step by step against DDP + ``powerSGD_hook`` + the same LARS
    on the same batches; the parameters must stay together."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hpcdl.comm.gloo import init_process_group_over_mpi
    from hpcdl.comm.policy import create_policy
    from hpcdl.optim import create_optimizer

    if not dist.is_initialized():  # torch's default group, once per process
        init_process_group_over_mpi(world)
    lars = {"name": "lars", "momentum": 0.9, "weight_decay": 5e-4, "trust_coefficient": 0.02}
    ours, theirs = small_cnn(), small_cnn()
    policy = create_policy(comm, list(ours.named_parameters()), algorithm="powersgd",
                           sync_warmup_steps=WARMUP, powersgd_rank=RANK, bucket_bytes=1 << 20)
    ddp = DDP(theirs, bucket_cap_mb=1, broadcast_buffers=False)
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=RANK,
                                        start_powerSGD_iter=WARMUP)
    shapes = {tuple(x.param.shape): x.name for x in policy.compressor.matrices}
    assert sorted(shapes.values()) == ["0.weight", "3.weight", "7.weight"]
    first_q = {name: q.clone() for name, q in policy.compressor.q.items()}
    ddp.register_comm_hook(state, seed_pytorch_q(powerSGD_hook.powerSGD_hook, first_q, shapes))
    opt_ours, opt_theirs = create_optimizer(lars, ours, 0.5), create_optimizer(lars, theirs, 0.5)
    criterion = torch.nn.CrossEntropyLoss()
    data = torch.Generator().manual_seed(world.rank)
    try:
        for step in range(20):
            images = torch.randn(8, 1, 10, 10, generator=data)
            labels = torch.randint(0, 10, (8,), generator=data)
            # ours, as the trainer takes a step
            policy.before_step(step)
            opt_ours.zero_grad(set_to_none=True)
            policy.reducer.arm(last=True)
            criterion(ours(images), labels).backward()
            policy.reducer.synchronize()
            opt_ours.step()
            policy.after_step(step + 1, last=step == 19)
            # PyTorch's
            opt_theirs.zero_grad(set_to_none=True)
            criterion(ddp(images), labels).backward()
            opt_theirs.step()
            for (name, mine), pytorch in zip(ours.named_parameters(), theirs.parameters(),
                                             strict=True):
                difference = float((mine - pytorch).detach().norm() / pytorch.detach().norm())
                assert difference < 1e-3, f"{name} after step {step + 1}: {difference}"
        assert policy.compressor.steps == 20 - WARMUP
        moved = float((ours[0].weight - small_cnn()[0].weight).norm())
        assert moved > 0.01  # they trained (agreeing by not moving would prove nothing)
    finally:
        policy.close()
    dist.barrier()
