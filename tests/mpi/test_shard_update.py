"""Weight-update sharding under real MPI (hpcdl/optim/sharded.py): reduce-scatter, each rank
steps its slice, one allreduce of LARS's partial norms, allgather. At P = 2, 3, 4 the slices
are uneven and cut through layers (buckets of a few hundred floats).

Tolerance: the sharded parameters equal the unsharded run's to rtol 1e-5 / atol 1e-6 after
four steps. The elementwise update is the same arithmetic on the same averaged gradient; what
differs is the order in which a layer's squares are summed for LARS's norms (per slice, in
float64, then across ranks, against one float32 pass), which moves a trust ratio by a few ulps
(and, with the mpi backend at P >= 3, MPI's Reduce_scatter may sum ranks in another order than
its Allreduce). A sharded run resumed from its own checkpoint continues bit-identically."""
import copy
import os

import pytest
import torch
from mpi4py import MPI

import hpcdl.comm
from hpcdl import DistributedOptimizer
from hpcdl.comm.reducer import GradientReducer
from hpcdl.optim import ShardedOptimizer, create_optimizer, set_learning_rate
from hpcdl.train.config import RecipeError, config_from_dict
from hpcdl.train.trainer import Trainer, TrainOptions

RTOL, ATOL = 1e-5, 1e-6
BUCKET_BYTES = 1024   # 256 floats: the tiny model spans several buckets
OPTIMIZERS = {
    "lars": {"name": "lars", "momentum": 0.9, "weight_decay": 1e-3, "trust_coefficient": 0.02},
    "lars_no_skip_list": {"name": "lars", "momentum": 0.9, "weight_decay": 1e-3,
                          "trust_coefficient": 0.02, "skip_list": False},
    "lars_trust_ratio_wd_off": {"name": "lars", "momentum": 0.9, "weight_decay": 1e-3,
                                "trust_coefficient": 0.02, "trust_ratio_wd": False},
    "lars_larc_clip": {"name": "lars", "momentum": 0.9, "weight_decay": 1e-3,
                       "trust_coefficient": 0.02, "larc_clip": True},
    "lars_trust_clip_nesterov": {"name": "lars", "momentum": 0.9, "weight_decay": 1e-3,
                                 "trust_coefficient": 0.02, "trust_clip": True,
                                 "nesterov": True},
    "lars_no_momentum": {"name": "lars", "momentum": 0.0, "weight_decay": 1e-3,
                         "trust_coefficient": 0.02},
    "sgd": {"name": "sgd", "momentum": 0.9, "weight_decay": 1e-3},
    "sgd_nesterov_bn_no_decay": {"name": "sgd", "momentum": 0.9, "weight_decay": 1e-3,
                                 "nesterov": True, "bn_weight_decay": False},
}
LRS = (0.5, 1.0, 0.8, 0.3)


@pytest.fixture(scope="module", params=["shm", "mpi"])
def comm(request):
    c = hpcdl.comm.init(request.param, MPI.COMM_WORLD)
    yield c
    c.close()


def make_model():
    torch.manual_seed(0)  # the same weights on every rank
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 5, 3), torch.nn.BatchNorm2d(5), torch.nn.ReLU(), torch.nn.Flatten(),
        torch.nn.Linear(80, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 3, 6, 6, generator=g), torch.randint(0, 3, (4,), generator=g)


@pytest.mark.min_ranks(2)
@pytest.mark.parametrize("numel", [11, 4099])   # uneven slices at P = 2, 3, 4
def test_reduce_scatter_then_publish_gives_the_allreduce(comm, world, numel):
    buffer = comm.empty(numel)   # window memory on shm: the in-window path
    mine = torch.arange(numel, dtype=torch.float32) * (world.rank + 1)
    buffer.copy_(mine)
    comm.reduce_scatter_flat_(buffer, average=True)
    bounds = comm.shard_bounds(numel)
    lo, hi = bounds[world.rank], bounds[world.rank + 1]
    expected = torch.arange(numel, dtype=torch.float32) * (world.size + 1) / 2
    assert torch.allclose(buffer[lo:hi], expected[lo:hi])
    assert bounds[-1] == numel and max(bounds[k + 1] - bounds[k] for k in range(world.size)) \
        - min(bounds[k + 1] - bounds[k] for k in range(world.size)) <= 1
    buffer[lo:hi] = -expected[lo:hi]   # what the update writes
    sources = comm.publish_flat_(buffer)
    gathered = torch.cat([sources[k][bounds[k]:bounds[k + 1]] for k in range(world.size)])
    comm.release_flat_(buffer)
    assert torch.equal(gathered, -expected)
    plain = torch.arange(numel, dtype=torch.float32)   # any buffer: the MPI path
    plain[lo:hi] = world.rank
    comm.allgather_flat_(plain)
    assert torch.equal(plain, torch.cat([torch.full((bounds[k + 1] - bounds[k],), float(k))
                                         for k in range(world.size)]))


class Run:
    """A model, its optimizer and reducer: unsharded (allreduce, then the full step) or
    sharded (reduce-scatter, the slice's step, allgather)."""

    def __init__(self, comm, cfg, sharded, model=None):
        self.model = model or make_model()
        self.optimizer = create_optimizer(cfg, self.model, lr=LRS[0])
        self.reducer = GradientReducer(comm, list(self.model.named_parameters()),
                                       bucket_bytes=BUCKET_BYTES, last_bucket_bytes=200,
                                       reduce_scatter=sharded)
        if sharded:
            self.optimizer = ShardedOptimizer(self.optimizer, self.reducer, comm)
        self.step_count = 0

    def steps(self, n, rank):
        for _ in range(n):
            set_learning_rate(self.optimizer, LRS[self.step_count % len(LRS)])
            self.optimizer.zero_grad(set_to_none=True)
            self.reducer.arm(last=True)
            x, y = batch(rank, self.step_count)
            torch.nn.functional.cross_entropy(self.model(x), y).backward()
            self.reducer.synchronize()
            self.optimizer.step()
            self.step_count += 1

    def close(self):
        self.reducer.close()


def assert_params_close(a, b, rtol=RTOL, atol=ATOL):
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.allclose(p, q, rtol=rtol, atol=atol), \
            (name, (p - q).abs().max().item())


def momentum_of(state_dict):
    return {k: v["momentum_buffer"] for k, v in state_dict["state"].items()
            if v.get("momentum_buffer") is not None}


@pytest.mark.min_ranks(2)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_sharded_update_equals_the_unsharded_step(comm, world, name):
    cfg = OPTIMIZERS[name]
    full, sharded = Run(comm, cfg, sharded=False), Run(comm, cfg, sharded=True)
    try:
        start = copy.deepcopy(full.model)
        full.steps(4, world.rank)
        sharded.steps(4, world.rank)
        assert_params_close(sharded.model, full.model)
        # ... and the test can fail: the parameters moved by far more than the tolerance.
        moved = max((p - q).abs().max().item()
                    for p, q in zip(full.model.parameters(), start.parameters(), strict=True))
        assert moved > 1e3 * ATOL
        # every rank holds the whole, identical model after the allgather
        mine = torch.cat([p.detach().view(-1) for p in sharded.model.parameters()])
        assert torch.equal(mine, torch.from_numpy(world.bcast(mine.numpy(), root=0)))
        # the checkpoint layout is the unsharded one (collective on the sharded side)
        got, want = momentum_of(sharded.optimizer.state_dict()), \
            momentum_of(full.optimizer.state_dict())
        assert got.keys() == want.keys()
        for k in want:
            assert got[k].shape == want[k].shape
            assert torch.allclose(got[k], want[k], rtol=RTOL, atol=ATOL), k
    finally:
        full.close()
        sharded.close()


@pytest.mark.min_ranks(2)
@pytest.mark.parametrize("name", ["lars", "sgd"])
def test_sharded_checkpoint_resumes_identically_and_unsharded(comm, world, name):
    cfg = OPTIMIZERS[name]
    straight = Run(comm, cfg, sharded=True)
    first = Run(comm, cfg, sharded=True)
    try:
        straight.steps(4, world.rank)
        first.steps(2, world.rank)
        saved_model = copy.deepcopy(first.model.state_dict())
        saved = copy.deepcopy(first.optimizer.state_dict())   # full layout, collective
    finally:
        first.close()
    resumed = Run(comm, cfg, sharded=True)
    unsharded = Run(comm, cfg, sharded=False)
    try:
        for run in (resumed, unsharded):
            run.model.load_state_dict(saved_model)
            run.optimizer.load_state_dict(copy.deepcopy(saved))
            run.step_count = 2
            run.steps(2, world.rank)
        for p, q in zip(resumed.model.parameters(), straight.model.parameters(), strict=True):
            assert torch.equal(p, q)
        assert_params_close(unsharded.model, straight.model)
    finally:
        for run in (straight, resumed, unsharded):
            run.close()


@pytest.mark.min_ranks(3)
def test_sharded_checkpoint_of_two_ranks_resumes_on_all_sliced_anew(comm, world):
    """Elastic resume: 2 ranks train and save (full layout), then every rank of the world
    continues from it; sharded and unsharded paths end on the same model."""
    cfg = OPTIMIZERS["lars"]
    sub = world.Split(0 if world.rank < 2 else 1, world.rank)
    pair = hpcdl.comm.init("mpi", sub)
    saved = None
    try:
        if world.rank < 2:
            runs = {shard: Run(pair, cfg, sharded=shard) for shard in (True, False)}
            try:
                for run in runs.values():
                    run.steps(2, pair.rank)
                saved = {shard: (copy.deepcopy(run.model.state_dict()),
                                 copy.deepcopy(run.optimizer.state_dict()))
                         for shard, run in runs.items()}
            finally:
                for run in runs.values():
                    run.close()
    finally:
        pair.close()
        sub.Free()
    saved = world.bcast(saved, root=0)
    resumed = {shard: Run(comm, cfg, sharded=shard) for shard in (True, False)}
    try:
        for shard, run in resumed.items():
            run.model.load_state_dict(saved[shard][0])
            run.optimizer.load_state_dict(saved[shard][1])
            run.step_count = 2
            run.steps(2, world.rank)
        assert_params_close(resumed[True].model, resumed[False].model)
    finally:
        for run in resumed.values():
            run.close()


@pytest.mark.min_ranks(2)
def test_distributed_optimizer_shard_update_matches_the_allreduce(comm, world):
    models = [make_model(), make_model()]
    wrapped = [DistributedOptimizer(create_optimizer(OPTIMIZERS["lars"], m, lr=1.0), m, comm,
                                    bucket_bytes=BUCKET_BYTES, shard_update=shard)
               for m, shard in zip(models, (False, True), strict=True)]
    try:
        for step in range(3):
            for model, optimizer in zip(models, wrapped, strict=True):
                optimizer.zero_grad()
                x, y = batch(world.rank, step)
                torch.nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
        assert_params_close(models[1], models[0])
        assert momentum_of(wrapped[1].state_dict()).keys() == \
            momentum_of(wrapped[0].state_dict()).keys()
    finally:
        for optimizer in wrapped:
            optimizer.close()


@pytest.mark.min_ranks(2)
def test_broadcast_optimizer_state_of_a_sharded_optimizer_reaches_every_rank(comm, world):
    """state_dict() of a sharded optimizer gathers the slices, a collective: asked on the
    root only, the other ranks sat in the broadcast and the job hung."""
    from hpcdl import broadcast_optimizer_state

    model = make_model()
    optimizer = DistributedOptimizer(create_optimizer(OPTIMIZERS["lars"], model, lr=1.0),
                                     model, comm, bucket_bytes=BUCKET_BYTES, shard_update=True)
    try:
        x, y = batch(world.rank, 0)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.param_groups[0]["lr"] = 0.25 if world.rank == 0 else 9.0
        broadcast_optimizer_state(optimizer, comm, root=0)
        assert optimizer.param_groups[0]["lr"] == 0.25
        mine = momentum_of(optimizer.state_dict())
        assert mine and all(v.abs().sum() > 0 for v in mine.values())
    finally:
        optimizer.close()


@pytest.mark.min_ranks(2)
def test_parameters_the_optimizer_does_not_step_stay_unchanged(comm, world):
    model = make_model()
    frozen = list(model[-1].parameters())   # reduced (they require grad) but not optimized
    before = [p.detach().clone() for p in frozen]
    stepped = [p for p in model.parameters() if all(p is not q for q in frozen)]
    optimizer = DistributedOptimizer(torch.optim.SGD(stepped, lr=0.5, momentum=0.9), model,
                                     comm, bucket_bytes=BUCKET_BYTES, shard_update=True)
    try:
        for step in range(2):
            optimizer.zero_grad()
            x, y = batch(world.rank, step)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        for p, q in zip(frozen, before, strict=True):
            assert torch.equal(p, q)
        assert not torch.equal(stepped[0], make_model()[0].weight)
    finally:
        optimizer.close()


# -- the trainer ------------------------------------------------------------------------------
PER_RANK = 2


def recipe(size, shard_update, **comm):
    return config_from_dict({
        "name": "tiny_sharded",
        "model": {"name": "resnet_small", "num_classes": 3, "width": 4, "layers": [1, 1, 1]},
        "data": {"image_size": 16, "workers": 1},
        "batch": {"global": PER_RANK * size, "per_rank": PER_RANK},
        "epochs": 2,
        "optimizer": {"name": "lars", "momentum": 0.9, "weight_decay": 5.0e-5},
        "schedule": {"name": "poly", "base_lr": 1.0, "warmup_epochs": 0.5},
        "train": {"seed": 3, "log_every_steps": 100},
        "comm": {"backend": "shm", "bucket_mb": 0.004, "shard_update": shard_update, **comm},
    })


@pytest.fixture(scope="module")
def shards(make_tiny_shards):
    return make_tiny_shards(train_per_class=8, val_per_class=2)


def train(config, shards, run_dir, comm, resume="none", **options):
    trainer = Trainer(config, shards, run_dir, comm,
                      options=TrainOptions(deterministic=True, progress=False, evaluate=False,
                                           **options))
    try:
        trainer.resume(resume)
        summary = trainer.train()
        params = [p.detach().clone() for p in trainer.model.parameters()]
    finally:
        trainer.close()
    return summary, params


@pytest.mark.min_ranks(2)
def test_trainer_sharded_resume_continues_identically(shards, comm, world, shared_tmp):
    if comm.backend != "shm":
        pytest.skip("the trainer's plumbing is backend-independent: run once, on shm")
    sharded = recipe(world.size, True)
    reference, ref_params = train(sharded, shards, os.path.join(shared_tmp, "a"), comm,
                                  max_steps=6)
    assert reference["steps"] == 6 and reference["shard_update"] is True
    run_b = os.path.join(shared_tmp, "b")
    train(sharded, shards, run_b, comm, max_steps=3)
    resumed, _ = train(sharded, shards, run_b, comm, resume="auto", max_steps=6)
    assert resumed["resumed_from"].endswith("ckpt-000000003.pt")
    assert resumed["params_sha256"] == reference["params_sha256"]
    # the unsharded run and the sharded checkpoint resumed unsharded: the same model
    _, plain = train(recipe(world.size, False), shards, os.path.join(shared_tmp, "c"), comm,
                     max_steps=6)
    _, crossed = train(recipe(world.size, False), shards, os.path.join(shared_tmp, "d"), comm,
                       resume=resumed["resumed_from"], max_steps=6)
    for p, q, r in zip(ref_params, plain, crossed, strict=True):
        assert torch.allclose(p, q, rtol=RTOL, atol=ATOL)
        assert torch.allclose(r, q, rtol=RTOL, atol=ATOL)


def test_shard_update_refuses_relaxed_consistency_naming_the_keys():
    with pytest.raises(RecipeError, match="comm.shard_update.*comm.algorithm"):
        recipe(2, True, algorithm="local_sgd", local_steps=2)
    with pytest.raises(RecipeError, match="comm.shard_update.*comm.algorithm"):
        recipe(2, True, algorithm="powersgd")
    with pytest.raises(RecipeError, match="comm.shard_update.*comm.wire_dtype"):
        recipe(2, True, wire_dtype="bfloat16")
    assert recipe(2, False, algorithm="powersgd").comm.shard_update is False


def test_sharded_optimizer_refuses_an_optimizer_it_cannot_slice(comm):
    model = make_model()
    reducer = GradientReducer(comm, list(model.named_parameters()), bucket_bytes=BUCKET_BYTES,
                              reduce_scatter=True)
    try:
        with pytest.raises(ValueError, match="Adam cannot be sharded"):
            ShardedOptimizer(torch.optim.Adam(model.parameters()), reducer, comm)
    finally:
        reducer.close()


def test_ltfb_with_several_trainers_refuses_shard_update(world, tmp_path):
    from hpcdl.train.ltfb import LTFB, LTFBOptions

    with pytest.raises(RecipeError, match="comm.shard_update.*LTFB"):
        LTFB(recipe(world.size, True), None, str(tmp_path), world, LTFBOptions(trainers=2))
