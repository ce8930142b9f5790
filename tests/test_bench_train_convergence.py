"""`hpcdl bench convergence`: the three recipes keep the experiment's definition (batches,
linear scaling, LARS), the held-out split never touches the test set, the ratios are top-1
differences in points, and a two-rank run of the real pipeline writes the bench JSON.

Serial tests; the end-to-end one launches its own mpiexec."""
import argparse
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from signal_at import SIGNAL_AT  # tests/signal_at.py

from hpcdl.bench import convergence as bench
from hpcdl.bench import runs
from hpcdl.train.config import config_from_dict


def default_args(**changes) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args([])
    for key, value in changes.items():
        setattr(args, key, value)
    return args


def test_recipes_compare_small_batch_sgd_with_large_batch_sgd_and_lars():
    recipes = bench.run_recipes(default_args(epochs=3))
    assert set(recipes) == set(bench.RUNS + bench.EXTRA_RUNS)
    configs = {name: config_from_dict(r) for name, r in recipes.items()}  # all valid recipes
    assert configs["baseline"].batch.global_ == 128
    assert configs["sgd_scaled"].batch.global_ == configs["lars"].batch.global_ == 1536
    assert configs["baseline"].optimizer["name"] == configs["sgd_scaled"].optimizer["name"] == "sgd"
    assert configs["lars"].optimizer["name"] == "lars"
    # Linear scaling rule (Goyal et al.): lr grows with the batch, 1536/128 = 12x.
    assert configs["sgd_scaled"].schedule["base_lr"] == pytest.approx(
        12 * configs["baseline"].schedule["base_lr"])
    assert {c.epochs for c in configs.values()} == {3}
    # Every run normalises over the baseline's per-rank batch (64 on 2 ranks): the large batch
    # is 12 accumulated micro-batches, as more workers at the same per-worker batch would be.
    assert {c.batch.per_rank for c in configs.values()} == {64}
    assert configs["baseline"].batch.accumulation == 1
    assert configs["lars"].batch.accumulation == configs["sgd_scaled"].batch.accumulation == 12
    assert {c.data.min_scale for c in configs.values()} == {0.7}
    assert configs["sgd_scaled"].schedule["warmup_epochs"] > 0
    assert configs["lars"].schedule["warmup_epochs"] > 0


def test_bf16_run_is_the_lars_recipe_in_bf16_autocast_only():
    recipes = bench.run_recipes(default_args(epochs=3))
    fp32, bf16 = recipes["lars"], recipes["lars_bf16"]
    assert config_from_dict(bf16).train.precision == "bfloat16"
    assert config_from_dict(fp32).train.precision == "float32"
    differ = {k for k in fp32 if fp32[k] != bf16[k]}
    assert differ == {"name", "train"}
    keys = set(fp32["train"]) | set(bf16["train"])
    assert {k for k in keys if fp32["train"].get(k) != bf16["train"].get(k)} == {"precision"}
    ratios = bench.convergence_ratios({"lars": {"top1": 0.880}, "lars_bf16": {"top1": 0.878}})
    assert ratios["lars_bf16_minus_lars_top1"] == pytest.approx(-0.2)
    known = bench.RUNS + bench.EXTRA_RUNS
    assert bench.parse_choices("convergence", "--runs", "lars,lars_bf16", known) == [
        "lars", "lars_bf16"]


def test_micro_batch_must_divide_the_global_batch():
    assert bench.micro_batching(1536, 32, 4) == {"global": 1536, "per_rank": 32,
                                                 "accumulation": 12}
    with pytest.raises(SystemExit, match="--micro-batch 100 x 2 ranks"):
        bench.micro_batching(1536, 100, 2)


def test_ratios_are_top1_differences_in_points():
    records = {"baseline": {"top1": 0.90}, "sgd_scaled": {"top1": 0.85},
               "lars": {"top1": 0.895}}
    ratios = bench.convergence_ratios(records)
    assert ratios["lars_minus_baseline_top1"] == pytest.approx(-0.5)
    assert ratios["sgd_scaled_minus_baseline_top1"] == pytest.approx(-5.0)
    assert ratios["baseline_top1"] == 0.90


def test_unknown_run_is_refused():
    with pytest.raises(SystemExit, match="adam"):
        bench.parse_choices("convergence", "--runs", "baseline,adam",
                            bench.RUNS + bench.EXTRA_RUNS)


def test_holdout_split_is_carved_from_training_images_only(tmp_path):
    from hpcdl.data_prep.fashion_mnist import load_split

    folder = runs.write_holdout_source(str(tmp_path / "idx"), "demo", holdout=1000)
    train_images, train_labels = load_split(folder, "train")
    held_images, held_labels = load_split(folder, "val")
    all_images, all_labels = load_split("demo", "train")
    assert len(train_labels) == 5000 and len(held_labels) == 1000
    assert np.array_equal(held_images, all_images[-1000:])
    assert np.array_equal(train_labels, all_labels[:5000])


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec")
def test_two_rank_run_writes_the_table_json(tmp_path):
    out = tmp_path / "conv.json"
    # The shipped subset and three steps per run: the plumbing, not the accuracy.
    bench_args = ["bench", "convergence", "--source", "demo", "--epochs", "1", "--max-steps",
                  "3", "--small-batch", "64", "--large-batch", "256", "--width", "4",
                  "--out", str(tmp_path / "runs"), "--json", str(out)]
    cmd = ["mpiexec", "-n", "2", sys.executable, "-m", "hpcdl.cli.main", *bench_args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MPIEXEC_TIMEOUT": "400"}
    # Slurm's time-limit signal during the first run (raised on rank 0 after step 1, acted on
    # at the end of step 2 by every rank): checkpoint, stop the bench, exit 75.
    stopped = subprocess.run(["mpiexec", "-n", "2", *SIGNAL_AT, "0", "step=1", *bench_args],
                             env=env, capture_output=True, text=True, timeout=450)
    assert stopped.returncode == 75, stopped.stdout + stopped.stderr
    assert not out.exists() and not (tmp_path / "runs" / "lars-e1").exists()
    assert os.listdir(tmp_path / "runs" / "baseline-e1" / "checkpoints") == ["ckpt-000000002.pt"]
    # The same command again (a requeued job) resumes the first run and does the rest.
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=450)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ckpt-000000002.pt at step 2" in proc.stdout + proc.stderr  # "resumed from ..."
    report = json.loads(out.read_text())
    assert [r["run"] for r in report["results"]] == list(bench.RUNS)
    assert [r["global_batch"] for r in report["results"]] == [64, 256, 256]
    for record in report["results"]:
        assert 0.0 <= record["top1"] <= 1.0 and record["steps"] == 3
    assert "lars_minus_baseline_top1" in report["ratios"]
    assert (tmp_path / "runs" / "lars-e1" / "summary.json").exists()
    assert json.loads((tmp_path / "runs" / "baseline-e1" / "summary.json").read_text())[
        "resumed_from"].endswith("ckpt-000000002.pt")


def test_the_bf16_run_trains_in_bf16_even_where_it_is_emulated():
    # auto would fall back to float32 on such a CPU, and the check would compare float32 with
    # itself: the run asks for bfloat16 by name.
    from hpcdl.train.precision import agreed_precision

    config = config_from_dict(bench.run_recipes(default_args(epochs=3))["lars_bf16"])
    assert agreed_precision(config.train.precision, native=False) == "bfloat16"
    for name, recipe in bench.run_recipes(default_args(epochs=3)).items():
        if name != "lars_bf16":   # the others in float32 on every CPU
            assert agreed_precision(config_from_dict(recipe).train.precision,
                                    native=True) == "float32"


def test_seed_reaches_every_recipe():
    recipes = bench.run_recipes(default_args(epochs=3, seed=4))
    assert {config_from_dict(r).train.seed for r in recipes.values()} == {4}
    assert config_from_dict(bench.run_recipes(default_args())["lars"]).train.seed == 0
