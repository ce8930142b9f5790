"""``hpcdl train --backend ccl`` in miniature: the trainer on oneCCL's allreduce reaches the
same model as on MPI_Allreduce, and its replicas stay identical.

Tiny model (resnet_small, width 4) on tiny synthetic shards, as tests/mpi/test_train.py. The
full demo to its top-1 is recorded in docs/comm.md ("oneCCL on a cluster")."""
import os

import pytest
import torch
from mpi4py import MPI

import hpcdl.comm
from hpcdl.comm.ccl import missing_reason
from hpcdl.train.config import config_from_dict
from hpcdl.train.trainer import Trainer, TrainOptions

# tests/run.sh's ccl stage sets HPCDL_REQUIRE_CCL=1: there a missing oneCCL fails
if missing_reason() is not None and os.environ.get("HPCDL_REQUIRE_CCL", "0") not in ("", "0"):
    raise RuntimeError(f"HPCDL_REQUIRE_CCL is set but {missing_reason()}")
pytestmark = pytest.mark.skipif(missing_reason() is not None, reason=str(missing_reason()))
PER_RANK = 4
STEPS = 12


def recipe(size: int, backend: str):
    return config_from_dict({
        "name": "tiny-ccl",
        "model": {"name": "resnet_small", "num_classes": 3, "width": 4, "layers": [1, 1, 1]},
        "data": {"image_size": 16, "workers": 1},
        "batch": {"global": PER_RANK * size, "per_rank": PER_RANK},
        "epochs": 4,
        "optimizer": {"name": "lars", "momentum": 0.9, "weight_decay": 5.0e-5},
        "schedule": {"name": "poly", "base_lr": 0.5, "warmup_epochs": 0.5},
        "train": {"seed": 3, "log_every_steps": 1},
        "comm": {"backend": backend, "bucket_mb": 0.004},  # several buckets per step
    })


@pytest.fixture(scope="module")
def shards(make_tiny_shards):
    return make_tiny_shards()


def train(backend: str, shards: str, run_dir: str) -> tuple[dict, list[torch.Tensor], bool]:
    """STEPS deterministic steps on ``backend``: summary, final parameters, replicas equal."""
    world = MPI.COMM_WORLD
    with hpcdl.comm.init(backend, world) as comm:
        trainer = Trainer(recipe(world.size, backend), shards, run_dir, comm,
                          options=TrainOptions(deterministic=True, progress=False,
                                               max_steps=STEPS, evaluate=False))
        try:
            summary = trainer.train()
            params = [p.detach().clone() for p in trainer.model.parameters()]
            replicas_equal = trainer.check_replicas()
        finally:
            trainer.close()
    return summary, params, replicas_equal


def test_training_on_ccl_matches_training_on_mpi(shards, shared_tmp):
    ccl, ccl_params, ccl_replicas_equal = train("ccl", shards, os.path.join(shared_tmp, "c"))
    _, mpi_params, _ = train("mpi", shards, os.path.join(shared_tmp, "m"))
    assert ccl["steps"] == STEPS and ccl["stopped"] == "max_steps"
    assert ccl_replicas_equal  # every rank holds the same bits after oneCCL's averages
    if MPI.COMM_WORLD.size == 2:  # a + b == b + a in fp32: the same model, bit for bit
        assert all(torch.equal(a, b) for a, b in zip(ccl_params, mpi_params, strict=True))
        return
    # p >= 3: the backends add the gradients in different orders, up to one fp32 ulp
    # (6e-8 relative) per averaged gradient and step; 12 steps stay below 1e-5 (1.2e-7 seen
    # at p=3).
    for ours, reference in zip(ccl_params, mpi_params, strict=True):
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)
