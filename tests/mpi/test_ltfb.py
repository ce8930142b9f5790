"""LTFB under real MPI (Jacobs et al. MLHPC'17): pairing agreed without messages, the pairwise
exchange, the winner's optimizer state, the odd trainer out, exact resume across a tournament.

Size-adaptive: 2 ranks = 2 trainers x 1 rank, 3 ranks = 3 trainers x 1 rank (one sits out each
round), 4 ranks = 2 trainers x 2 ranks. Tiny model (resnet_small, width 4) on tiny shards."""
import hashlib
import os

import pytest
import torch
from mpi4py import MPI

from hpcdl.train.config import config_from_dict
from hpcdl.train.ltfb import LTFB, LTFBOptions
from hpcdl.train.tournament import flatten_state, state_tensors, tournament_partners
from hpcdl.train.trainer import TrainOptions

PER_RANK = 2
SEED = 5


def trainers_for(size):
    return 2 if size % 2 == 0 else size


def recipe(trainer_size):
    return config_from_dict({
        "name": "tiny_ltfb",
        "model": {"name": "resnet_small", "num_classes": 3, "width": 4, "layers": [1, 1, 1]},
        "data": {"image_size": 16, "workers": 1},
        "batch": {"global": PER_RANK * trainer_size, "per_rank": PER_RANK},
        "epochs": 2,
        "optimizer": {"name": "lars", "momentum": 0.9, "weight_decay": 5.0e-5},
        "schedule": {"name": "poly", "base_lr": 1.0, "warmup_epochs": 0.5},
        "train": {"seed": SEED, "log_every_steps": 2},
        "comm": {"backend": "mpi", "bucket_mb": 0.004},
    })


@pytest.fixture(scope="module")
def shards(make_tiny_shards):
    return make_tiny_shards(val_per_class=2, shards=6)


def make_ltfb(shards, run_dir, world, interval=1000, exchange="weights", metric="loss",
              **options):
    k = trainers_for(world.size)
    ltfb = LTFBOptions(trainers=k, interval=interval, metric=metric, exchange=exchange,
                       holdout_fraction=0.25)
    opts = TrainOptions(deterministic=True, progress=False, **options)
    return LTFB(recipe(world.size // k), shards, run_dir, world, ltfb, opts)


def digest(tensors):
    return hashlib.sha256(flatten_state(tensors).numpy().tobytes()).hexdigest()


def sabotage(model):
    """Make a model that loses any loss tournament on a set with two or more classes."""
    final = [m for m in model.modules() if isinstance(m, torch.nn.Linear)][-1]
    with torch.no_grad():
        final.bias.zero_()
        final.bias[0] = 1e4  # every sample not of class 0 costs ~1e4


def test_pairing_is_the_same_on_every_rank_and_changes_between_rounds(world):
    k = max(world.size, 4)
    mine = [tournament_partners(SEED, r, k) for r in range(1, 9)]
    assert world.allgather(mine) == [mine] * world.size
    assert len({tuple(p) for p in mine}) > 1
    for partners in mine:  # a pairing: symmetric, nobody meets itself
        for t, p in enumerate(partners):
            assert p is None or (p != t and partners[p] == t)


@pytest.mark.parametrize("exchange", ["weights", "weights+optimizer"])
def test_exchange_leaves_both_sides_bit_identical_copies_of_the_winner(
        shards, world, shared_tmp, exchange):
    ltfb = make_ltfb(shards, os.path.join(shared_tmp, f"x-{exchange}"), world,
                     exchange=exchange, max_steps=2, evaluate=False, write_files=False)
    try:
        ltfb.train()
        k, t = ltfb.trainers, ltfb.index
        partners = tournament_partners(SEED, 1, k)
        labels = {int(y) for _, ys in ltfb.tournament_loader for y in ys}
        held = ltfb.layout.trainer_comm.allreduce(len(labels), op=MPI.MAX)
        assert held >= 2  # precondition of sabotage(): the tournament set has two classes
        loser = partners[t] is not None and t > partners[t]
        if loser:
            sabotage(ltfb.trainer.model)
        ltfb.trainer.average_bn_statistics()
        model, opt = ltfb.trainer.model, ltfb.trainer.optimizer
        before = world.allgather((t, digest(state_tensors(model)),
                                  digest(state_tensors(model, opt)[len(state_tensors(model)):])))
        record = ltfb.play_round(1)
        after = world.allgather((t, digest(state_tensors(model)),
                                 digest(state_tensors(model, opt)[len(state_tensors(model)):])))
    finally:
        ltfb.close()
    model_before = {i: m for i, m, _ in before}
    opt_before = {i: o for i, _, o in before}
    assert record["partner"] == partners[t]
    for i, m, o in after:
        partner = partners[i]
        winner = i if partner is None else min(i, partner)
        assert m == model_before[winner]  # bit-identical copy of the winner's model
        replaced = winner != i
        if exchange == "weights+optimizer" and replaced:
            assert o == opt_before[winner]  # continues from the winner's momentum
        else:
            assert o == opt_before[i]  # keeps its own optimizer state
    assert record["winner"] == (t if partners[t] is None else min(t, partners[t]))
    assert record["replaced"] == loser


@pytest.mark.min_ranks(3)
@pytest.mark.max_ranks(3)
def test_three_trainers_leave_the_odd_one_out_with_its_own_model(shards, world, shared_tmp):
    ltfb = make_ltfb(shards, os.path.join(shared_tmp, "odd"), world, metric="top1",
                     max_steps=1, evaluate=False, write_files=False)
    rounds = []
    try:
        ltfb.train()
        for r in (1, 2, 3):
            before = ltfb.trainer.params_sha256()
            record = ltfb.play_round(r)
            rounds.append((record, before, ltfb.trainer.params_sha256()))
    finally:
        ltfb.close()
    sat_out = [record["round"] for record, _, _ in rounds if record["partner"] is None]
    # exactly one of the three trainers sits out each round
    assert sorted(sum(world.allgather(sat_out), [])) == [1, 2, 3]
    for record, before, after in rounds:
        if record["partner"] is None:
            assert record["winner"] == ltfb.index and record["replaced"] is False
            assert after == before


def test_resume_after_a_tournament_reproduces_the_same_winners(shards, world, shared_tmp):
    def run(run_dir, max_steps):
        ltfb = make_ltfb(shards, run_dir, world, interval=2, metric="top1", max_steps=max_steps)
        try:
            resumed = ltfb.resume("auto")
            summary = ltfb.train()
        finally:
            ltfb.close()
        return resumed, summary

    _, reference = run(os.path.join(shared_tmp, "ref"), 6)
    stopped_dir = os.path.join(shared_tmp, "stopped")
    _, first = run(stopped_dir, 3)  # a checkpoint at step 3, after round 1 (step 2)
    assert [r["round"] for r in first["rounds"]] == [1] * ltfb_trainers(world)
    resumed_from, resumed = run(stopped_dir, 6)
    assert resumed_from.endswith("ckpt-000000003.pt")

    def winners(summary):
        return [(r["round"], r["trainer"], r["partner"], r["winner"], r["local_score"],
                 r["partner_score"]) for r in summary["rounds"]]

    assert [r["round"] for r in reference["rounds"]] == \
        sorted([1, 2, 3] * ltfb_trainers(world))
    assert winners(resumed) == winners(reference)
    assert resumed["trainer_params_sha256"] == reference["trainer_params_sha256"]


def ltfb_trainers(world):
    return trainers_for(world.size)
