"""hpcdl's PowerSGD against PyTorch's ``powerSGD_hook``, side by side (issue 17, second pass).

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
from mpi4py import MPI

import hpcdl.comm
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


@pytest.fixture(scope="module")
def comm():
    c = hpcdl.comm.init("mpi", MPI.COMM_WORLD)
    yield c
    c.close()


@pytest.mark.min_ranks(2)
@pytest.mark.max_ranks(4)
def test_powersgd_matches_pytorchs_hook_step_by_step(comm, world):
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hpcdl.bench.relaxed import init_torch_distributed

    init_torch_distributed(world)
    theirs = GradientIsInput()
    ddp = DDP(theirs, bucket_cap_mb=1)
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=RANK,
                                        start_powerSGD_iter=WARMUP)
    ours_model = GradientIsInput()
    ours = PowerSGDReducer(comm, ours_model.named_parameters(), rank=RANK)
    # PyTorch and hpcdl compress the same tensors (min_compression_rate 2)
    assert [x.name for x in ours.matrices] == ["conv", "linear"]
    by_shape = {tuple(getattr(theirs, x.name).shape): x.name for x in ours.matrices}

    def seeded_hook(hook_state, bucket):
        # Before PyTorch's first compressed step, give it our first Q (its layout: the
        # bucket's compressed gradients in order, (m, r) each), so both start alike.
        if hook_state.iter >= WARMUP and bucket.index() not in hook_state.q_memory_dict:
            names = [by_shape[tuple(g.shape)] for g in bucket.gradients()
                     if tuple(g.shape) in by_shape]
            hook_state.q_memory_dict[bucket.index()] = torch.cat(
                [ours.q[name].reshape(-1) for name in names])
            hook_state.p_memory_dict[bucket.index()] = torch.empty(
                sum(ours_model.get_parameter(name).shape[0] * RANK for name in names))
        return powerSGD_hook.powerSGD_hook(hook_state, bucket)

    ddp.register_comm_hook(state, seeded_hook)
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
