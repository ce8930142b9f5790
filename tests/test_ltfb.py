"""LTFB without MPI ranks of its own: the pure pieces (pairing, data partition, state as bytes,
who wins), then `mpiexec hpcdl train --algorithm ltfb` end to end: `--trainers 1` is exactly
the ordinary trainer, a bad trainer count is refused, a signal stops every trainer at one
step and `--resume auto` reproduces the uninterrupted run's winners and parameters.

Serial test that launches its own mpiexec (never nested inside an MPI-launched rank)."""
import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from signal_at import SIGNAL_AT  # tests/signal_at.py

from hpcdl.train.tournament import (
    better,
    flatten_state,
    load_flat_state,
    partition_samples,
    slice_counts,
    tournament_partners,
)
from hpcdl.train.trainer import EXIT_STOPPED_BY_SIGNAL


# -- pure pieces -------------------------------------------------------------------------------
@pytest.mark.parametrize("trainers", [2, 3, 4, 7])
def test_partners_form_a_symmetric_pairing_with_one_odd_trainer_out(trainers):
    for round_index in range(1, 6):
        partners = tournament_partners(0, round_index, trainers)
        assert partners == tournament_partners(0, round_index, trainers)  # no hidden state
        for t, p in enumerate(partners):
            assert p is None or (p != t and partners[p] == t)
        assert partners.count(None) == trainers % 2


def test_pairing_changes_between_rounds_and_with_the_seed():
    rounds = [tuple(tournament_partners(0, r, 6)) for r in range(1, 11)]
    assert len(set(rounds)) > 1
    assert [tournament_partners(1, r, 6) for r in range(1, 11)] != [list(r) for r in rounds]


def test_partition_gives_each_trainer_its_shards_minus_a_disjoint_holdout():
    counts = [10, 12, 9, 11, 10]
    parts = partition_samples(counts, 2, 0.2, seed=3, min_holdout=2)
    everything = np.concatenate([np.concatenate(p) for p in parts])
    assert sorted(everything.tolist()) == list(range(sum(counts)))  # each sample once
    offsets = np.cumsum([0] + counts)
    for t, (train, held) in enumerate(parts):
        shards = np.searchsorted(offsets, np.concatenate([train, held]), side="right") - 1
        assert set(shards.tolist()) == set(range(t, len(counts), 2))
        assert not set(train.tolist()) & set(held.tolist())
        assert len(held) == round(0.2 * (len(train) + len(held)))
    again = partition_samples(counts, 2, 0.2, seed=3, min_holdout=2)
    assert all((a[1] == b[1]).all() for a, b in zip(parts, again, strict=True))


def test_partition_needs_a_shard_per_trainer():
    with pytest.raises(ValueError, match="2 shards, fewer than the 3 trainers"):
        partition_samples([5, 5], 3, 0.1, seed=0)


def test_slices_cover_the_vector_in_order():
    counts, displs = slice_counts(10, 3)
    assert counts == [4, 3, 3] and displs == [0, 4, 7]


def test_state_bytes_round_trip_exactly_across_dtypes_and_memory_formats():
    source = [torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
              torch.tensor([7], dtype=torch.int64), torch.randn(3, dtype=torch.float64)]
    target = [torch.zeros(2, 3, 4, 5), torch.zeros(1, dtype=torch.int64),
              torch.zeros(3, dtype=torch.float64)]
    load_flat_state(target, flatten_state(source))
    assert all(torch.equal(a, b) for a, b in zip(source, target, strict=True))
    with pytest.raises(ValueError, match="were received"):
        load_flat_state(target[:1], flatten_state(source))


def test_ties_keep_the_local_model_and_a_diverged_model_loses():
    assert not better("top1", 0.5, 0.5) and not better("loss", 1.0, 1.0)
    assert better("top1", 0.6, 0.5) and better("loss", 0.9, 1.0)
    assert not better("loss", math.nan, 1.0) and better("loss", 1.0, math.nan)


def test_bench_curve_is_the_best_trainer_per_evaluation_timed_at_the_slowest(tmp_path):
    from hpcdl.bench.ltfb import best_of, ltfb_ratios, plot_curves

    trainers = [[{"run": "ltfb", "trainer": 0, "step": 10, "elapsed_s": 5.0, "top1": 0.6},
                 {"run": "ltfb", "trainer": 0, "step": 20, "elapsed_s": 9.0, "top1": 0.7}],
                [{"run": "ltfb", "trainer": 1, "step": 10, "elapsed_s": 6.0, "top1": 0.5},
                 {"run": "ltfb", "trainer": 1, "step": 20, "elapsed_s": 8.0, "top1": 0.8}]]
    best = best_of([p for points in trainers for p in points])
    assert [(p["step"], p["trainer"], p["top1"], p["elapsed_s"]) for p in best] == \
        [(10, 0, 0.6, 6.0), (20, 1, 0.8, 9.0)]
    dp = [{"run": "data_parallel", "step": 20, "elapsed_s": 12.0, "top1": 0.75}]
    rounds = [{"round": 1, "partner": 1, "replaced": True, "tournament_s": 1.0},
              {"round": 1, "partner": 0, "replaced": False, "tournament_s": 3.0}]
    ratios = ltfb_ratios(dp, best, {"rounds": rounds})
    assert ratios["ltfb_minus_dp_top1_points"] == pytest.approx(5.0)
    assert ratios["ltfb_over_dp_wall"] == pytest.approx(0.75)
    assert ratios["tournament_rounds"] == 1 and ratios["models_replaced"] == 1
    plot_curves(str(tmp_path / "ltfb.png"), dp, trainers, best, "test")
    assert (tmp_path / "ltfb.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- the command -------------------------------------------------------------------------------
RECIPE = """
name: tiny_ltfb_cli
model: {name: resnet_small, num_classes: 3, width: 4, layers: [1, 1, 1]}
data: {image_size: 16, workers: 1}
batch: {global: 2, per_rank: 2}
epochs: 2
optimizer: {name: sgd, momentum: 0.9, weight_decay: 5.0e-5}
schedule: {name: poly, base_lr: 0.1, warmup_epochs: 0.5}
train: {seed: 1, log_every_steps: 2}
comm: {backend: mpi, bucket_mb: 0.004}
"""

@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_shards):
    root = tmp_path_factory.mktemp("ltfb_cli")
    (root / "shards").symlink_to(tiny_shards, target_is_directory=True)
    (root / "tiny.yaml").write_text(RECIPE)
    return root


def hpcdl_train(root, run, ranks, *extra, signal_at=None):
    """mpiexec -n RANKS hpcdl train ...; ``signal_at=(RANK, WHEN)``: that world rank raises
    SIGUSR1 then (tests/signal_at.py)."""
    hpcdl = [*SIGNAL_AT, *map(str, signal_at)] if signal_at else \
        [sys.executable, "-m", "hpcdl.cli.main"]
    cmd = ["mpiexec", "-n", str(ranks), *hpcdl, "train",
           "--recipe", str(root / "tiny.yaml"), "--data", str(root / "shards"),
           "--out", str(root / run), "--deterministic", *extra]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "MPIEXEC_TIMEOUT": "300"}
    return subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def finish(proc):
    out, _ = proc.communicate(timeout=300)
    return proc.returncode, out


def summary(root, run):
    return json.load(open(root / run / "summary.json"))


LTFB = ("--algorithm", "ltfb", "--trainers", "2", "--tournament-interval", "2",
        "--tournament-holdout", "0.25", "--max-steps", "6")


@pytest.fixture(scope="module")
def launched(setup):
    """The independent runs, launched together (each is mostly interpreter start-up)."""
    if shutil.which("mpiexec") is None:
        pytest.skip("needs mpiexec")
    runs = {
        "plain": hpcdl_train(setup, "plain", 1, "--max-steps", "5"),
        "one": hpcdl_train(setup, "one", 1, "--max-steps", "5", "--algorithm", "ltfb",
                           "--trainers", "1"),
        "bad": hpcdl_train(setup, "bad", 3, "--algorithm", "ltfb", "--trainers", "2"),
        "ref": hpcdl_train(setup, "ref", 2, *LTFB, "--resume", "none"),
        # SIGUSR1 reaches trainer 0 only (after step 3): trainer 1 must stop at the same step.
        "stopped": hpcdl_train(setup, "run", 2, *LTFB, signal_at=(0, "step=3")),
    }
    yield runs
    for proc in runs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_one_trainer_is_exactly_the_ordinary_trainer(setup, launched):
    for name in ("plain", "one"):
        code, out = finish(launched[name])
        assert code == 0, out
    assert summary(setup, "one")["params_sha256"] == summary(setup, "plain")["params_sha256"]
    assert summary(setup, "one")["algorithm"] == "ltfb"


def test_trainers_must_divide_the_ranks(launched):
    code, out = finish(launched["bad"])
    assert code == 2
    assert "--trainers 2 does not divide the 3 MPI ranks" in out


def test_signal_stops_every_trainer_and_resume_reproduces_the_winners(setup, launched):
    code, out = finish(launched["stopped"])
    assert code == EXIT_STOPPED_BY_SIGNAL, out
    first = summary(setup, "run")
    assert first["stopped"] == "signal" and first["steps"] == 4  # agreed at the step-4 check
    for t in (0, 1):
        assert os.listdir(setup / "run" / f"trainer-{t:02d}" / "checkpoints") == \
            ["ckpt-000000004.pt"]
    code, out = finish(hpcdl_train(setup, "run", 2, *LTFB))  # --resume auto
    assert code == 0, out
    code, out = finish(launched["ref"])
    assert code == 0, out
    ref, resumed = summary(setup, "ref"), summary(setup, "run")

    def winners(s):
        return [(r["round"], r["trainer"], r["partner"], r["winner"], r["local_score"],
                 r["partner_score"]) for r in s["rounds"]]

    assert [r["round"] for r in ref["rounds"]] == [1, 1, 2, 2, 3, 3]
    assert winners(resumed) == winners(ref)
    assert resumed["trainer_params_sha256"] == ref["trainer_params_sha256"]
    assert [p and os.path.basename(p) for p in resumed["resumed_from"]] == \
        ["ckpt-000000004.pt"] * 2
    records = [json.loads(line) for line in open(setup / "run" / "metrics.jsonl")]
    assert {"round", "partner", "local_score", "partner_score", "winner"} <= set(records[0])
    per_trainer = [json.loads(line)
                   for line in open(setup / "run" / "trainer-01" / "metrics.jsonl")]
    assert [r["round"] for r in per_trainer if r["kind"] == "tournament"] == [1, 2, 3]
