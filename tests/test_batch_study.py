"""`hpcdl bench convergence --study`: equal tuning for both optimizers, holdout selection, the
test split used only by the finals, seeds' spread, resume from record.json, table and plot.

The sweep logic runs with a fake trainer (a formula of lr, batch and seed); the real
Trainer's plumbing is the three-run bench's, tested in test_bench_train_convergence.py."""
import argparse
import json
import math

import pytest

from hpcdl.bench import batch_study as study
from hpcdl.bench import convergence
from hpcdl.errors import BadInputError
from hpcdl.results import format_table
from hpcdl.train.config import config_from_dict


def study_args(**changes) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    convergence.add_arguments(parser)
    args = parser.parse_args(["--study"])
    args.batch_list = [128, 384, 768, 1536, 3072]
    args.grid_list = [0.5, 1.0, 2.0]
    args.extend_edges = 0          # the grid alone, unless a test asks for the extension
    args.optimizer_list = list(study.OPTIMIZERS)
    for key, value in changes.items():
        setattr(args, key, value)
    return args


def fake_top1(run):
    """Peaks at lr = 2·centre for LARS, at the centre for SGD; SGD loses accuracy with batch."""
    centre = study.centre_lr(run.optimizer, run.batch, study_args())
    best = 2 * centre if run.optimizer == "lars" else centre
    drop = 0.0 if run.optimizer == "lars" else 0.02 * math.log2(run.batch / 128)
    return 0.9 - drop - 0.01 * abs(math.log2(run.lr / best)) - 0.001 * run.seed


class FakeTrainer:
    def __init__(self, stop_at=None):
        self.calls, self.stop_at = [], stop_at

    def __call__(self, run, run_dir):
        if self.stop_at is not None and len(self.calls) == self.stop_at:
            return None                        # stopped by a signal
        self.calls.append(run)
        return {"top1": fake_top1(run), "train_s": 1.0}


def test_every_optimizer_gets_the_same_number_of_lrs_at_every_batch():
    runs = study.tuning_runs(study_args())
    for batch in (128, 384, 768, 1536, 3072):
        counts = {opt: sum(1 for r in runs if r.optimizer == opt and r.batch == batch)
                  for opt in study.OPTIMIZERS}
        assert counts == {"lars": 3, "sgd": 3}
    assert all(r.phase == "tune" and r.seed == 0 for r in runs)


def test_grid_centres_are_linear_scaling_for_sgd_and_square_root_for_lars():
    args = study_args()
    assert study.centre_lr("sgd", 3072, args) == pytest.approx(0.1 * 3072 / 128)
    assert study.centre_lr("lars", 384, args) == pytest.approx(2.0 * math.sqrt(384 / 1536))


def test_selection_takes_the_best_holdout_top1_and_the_smaller_lr_on_a_tie():
    runs = [study.StudyRun("tune", "sgd", 128, lr, 0) for lr in (0.05, 0.1, 0.2)]
    records = {runs[0].key: {"top1": 0.8}, runs[1].key: {"top1": 0.85},
               runs[2].key: {"top1": 0.85}}
    assert study.select_lr(records, runs, "sgd", 128) == (0.1, 0.85)
    records[runs[1].key] = {"top1": float("nan")}          # diverged
    assert study.select_lr(records, runs, "sgd", 128) == (0.2, 0.85)


def test_study_tunes_on_holdout_then_runs_three_seeds_of_the_chosen_lr(tmp_path):
    trainer = FakeTrainer()
    result = study.execute_study(study_args(), trainer, str(tmp_path))
    tune = [r for r in trainer.calls if r.phase == "tune"]
    finals = [r for r in trainer.calls if r.phase == "final"]
    assert len(tune) == 30 and len(finals) == 30
    assert trainer.calls == tune + finals                 # the test split only after tuning
    for row in result["rows"]:
        centre = study.centre_lr(row["optimizer"], row["global_batch"], study_args())
        expected = 2 * centre if row["optimizer"] == "lars" else centre
        assert row["lr"] == pytest.approx(expected, rel=1e-5)
        assert row["seeds"] == 3
        assert row["top1_max"] - row["top1_min"] == pytest.approx(0.002)
        assert row["top1_std"] == pytest.approx(0.001)
    assert result["ratios"]["lars_minus_sgd_top1_b3072"] == pytest.approx(
        100 * 0.02 * math.log2(3072 / 128))
    assert result["ratios"]["lars_drop_top1_b128_to_b3072"] == pytest.approx(0.0, abs=1e-4)


def factors_tried(tune, opt, batch, args):
    return sorted(round(r.lr / study.centre_lr(opt, batch, args), 6) for r in tune
                  if r.batch == batch and r.optimizer == opt)


def test_a_best_lr_at_an_edge_widens_that_optimizers_grid_beyond_that_edge(tmp_path):
    """fake_top1's LARS peaks at 2x its centre, the top of the x0.5/x1/x2 grid: LARS's grid
    gains x4 at every batch; SGD's best is inside, so its grid stays as it was."""
    trainer = FakeTrainer()
    args = study_args(extend_edges=1, batch_list=[128, 3072])
    result = study.execute_study(args, trainer, str(tmp_path))
    tune = [r for r in trainer.calls if r.phase == "tune"]
    for batch in (128, 3072):
        assert factors_tried(tune, "lars", batch, args) == pytest.approx([0.5, 1, 2, 4])
        assert factors_tried(tune, "sgd", batch, args) == pytest.approx([0.5, 1, 2])
    chosen = {(row["optimizer"], row["global_batch"]):
              round(row["lr"] / study.centre_lr(row["optimizer"], row["global_batch"], args), 3)
              for row in result["rows"]}
    assert chosen == {("lars", 128): 2.0, ("sgd", 128): 1.0, ("lars", 3072): 2.0,
                      ("sgd", 3072): 1.0}                       # still the true optima
    assert not any(row["at_edge"] for row in result["rows"])
    assert {row["tuned_lrs"] for row in result["rows"] if row["optimizer"] == "lars"} == {4}
    assert trainer.calls == tune + [r for r in trainer.calls if r.phase == "final"]


@pytest.mark.parametrize("times, chosen_factor, at_edge, tuned", [(1, 1.0, True, 3),
                                                                    (3, 2.0, False, 5)])
def test_the_extension_repeats_until_the_choice_is_interior_or_says_it_is_not(
        tmp_path, times, chosen_factor, at_edge, tuned):
    """LARS peaks at x2; a grid of x0.25, x0.5 needs three steps up (x1, x2, x4) before x2 is
    inside it. One step is not enough, and the row says so."""
    args = study_args(extend_edges=times, batch_list=[384], grid_list=[0.25, 0.5],
                      optimizer_list=["lars"], seeds=1)
    result = study.execute_study(args, FakeTrainer(), str(tmp_path))
    (row,) = result["rows"]
    assert row["lr"] / study.centre_lr("lars", 384, args) == pytest.approx(chosen_factor)
    assert (row["at_edge"], row["tuned_lrs"]) == (at_edge, tuned)


def test_a_batch_is_widened_only_when_a_best_lr_is_at_an_edge_of_its_grid(tmp_path):
    trainer = FakeTrainer()
    args = study_args(extend_edges=1, batch_list=[384], grid_list=[1.0, 2.0, 4.0])
    study.execute_study(args, trainer, str(tmp_path))   # LARS best x2, SGD x1: SGD at an edge
    assert sum(r.phase == "tune" for r in trainer.calls) == 7
    tune = [r for r in trainer.calls if r.phase == "tune"]
    assert factors_tried(tune, "sgd", 384, args) == pytest.approx([0.5, 1, 2, 4])
    trainer = FakeTrainer()
    args = study_args(extend_edges=1, batch_list=[384], grid_list=[0.5, 1.0, 2.0, 4.0])
    study.execute_study(args, trainer, str(tmp_path / "b"))   # both inside: no extension
    assert sum(r.phase == "tune" for r in trainer.calls) == 8


def bench_json_of(result, ranks=2, **fields):
    """The study's bench JSON as run_study writes it: each run's record carries its settings."""
    args = study_args()
    runs = []
    for record in result["runs"]:
        run = study.StudyRun(record["phase"], record["optimizer"], record["batch"],
                             record["lr"], record["seed"])
        recipe = study.study_recipe(run, args, ranks)
        runs.append({**record, "ranks": ranks, "epochs": float(args.epochs),
                     "micro_batch": recipe["batch"]["per_rank"],
                     "accumulation": recipe["batch"]["accumulation"],
                     "warmup_epochs": args.warmup_epochs, "weight_decay": args.weight_decay,
                     "trust_coefficient": recipe["optimizer"].get("trust_coefficient"),
                     **fields})
    return {"runs": runs}


def test_reused_runs_are_taken_only_where_every_recorded_setting_matches(tmp_path):
    """An earlier study whose SGD decayed every parameter: its LARS runs are this study's
    (LARS skips BN and biases under both policies), its SGD runs are not, and are trained."""
    first = study.execute_study(study_args(batch_list=[128], seeds=1), FakeTrainer(),
                                str(tmp_path / "first"))
    old = tmp_path / "old.json"
    old.write_text(json.dumps(bench_json_of(first)))    # no decay_policy: the first studies'
    trainer = FakeTrainer()
    args = study_args(batch_list=[128], seeds=1, reuse_runs=str(old))
    again = study.execute_study(args, trainer, str(tmp_path / "again"))
    assert {r.optimizer for r in trainer.calls} == {"sgd"}
    assert len(trainer.calls) == 3 + 1
    assert [r["lr"] for r in again["rows"]] == [r["lr"] for r in first["rows"]]
    trainer = FakeTrainer()
    args = study_args(batch_list=[128], seeds=1, reuse_runs=str(old),
                      decay_policy="sgd_decays_all")
    study.execute_study(args, trainer, str(tmp_path / "same-policy"))
    assert trainer.calls == []
    trainer = FakeTrainer()
    args = study_args(batch_list=[128], seeds=1, reuse_runs=str(old), warmup_epochs=2.0)
    study.execute_study(args, trainer, str(tmp_path / "other-warmup"))
    assert len(trainer.calls) == 8                      # nothing matches: everything trained


def test_a_reuse_file_that_is_not_a_study_is_named(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("[1, 2]")
    with pytest.raises(BadInputError, match="x.json"):
        study.execute_study(study_args(batch_list=[128], reuse_runs=str(bad)), FakeTrainer(),
                            str(tmp_path / "out"))


def test_an_interrupted_study_resumes_without_redoing_finished_runs(tmp_path):
    first = FakeTrainer(stop_at=7)
    assert study.execute_study(study_args(), first, str(tmp_path)) is None
    assert len(first.calls) == 7
    second = FakeTrainer()
    result = study.execute_study(study_args(), second, str(tmp_path))
    assert len(second.calls) == 60 - 7
    assert not {r.key for r in first.calls} & {r.key for r in second.calls}
    third = FakeTrainer(stop_at=0)                        # everything recorded: no training
    assert study.execute_study(study_args(), third, str(tmp_path))["rows"] == result["rows"]


def test_a_study_with_other_settings_on_the_same_out_is_refused(tmp_path):
    study.execute_study(study_args(batch_list=[128], seeds=1), FakeTrainer(), str(tmp_path))
    with pytest.raises(BadInputError, match="epochs"):
        study.execute_study(study_args(batch_list=[128], seeds=1, epochs=3), FakeTrainer(),
                            str(tmp_path))


def test_study_recipes_differ_only_in_batch_lr_optimizer_and_seed():
    args = study_args(epochs=4, width=8, warmup_epochs=0.5)
    a = study.study_recipe(study.StudyRun("final", "lars", 3072, 3.0, 2), args, ranks=2)
    b = study.study_recipe(study.StudyRun("tune", "sgd", 128, 0.1, 0), args, ranks=2)
    for key in ("model", "data", "epochs", "comm"):
        assert a[key] == b[key]
    assert a["batch"] == {"global": 3072, "per_rank": 64, "accumulation": 24}
    assert b["batch"] == {"global": 128, "per_rank": 64, "accumulation": 1}
    assert a["schedule"]["warmup_epochs"] == b["schedule"]["warmup_epochs"] == 0.5
    assert a["optimizer"]["weight_decay"] == b["optimizer"]["weight_decay"]
    assert (b["optimizer"]["bn_weight_decay"], b["optimizer"]["bias_decay_mult"]) == (False, 0.0)
    old = study.study_recipe(study.StudyRun("tune", "sgd", 128, 0.1, 0),
                             study_args(decay_policy="sgd_decays_all"), ranks=2)
    assert "bn_weight_decay" not in old["optimizer"]
    assert a["train"]["seed"] == 2
    config_from_dict(a)
    config_from_dict(b)


def test_the_forward_batch_does_not_depend_on_the_batches_one_invocation_runs():
    """A study run one batch at a time (--batches 3072, then --batches 128) must keep every
    run's batch-norm batch at the study's 64 per rank (it once became 1,536)."""
    run = study.StudyRun("tune", "lars", 3072, 2.0, 0)
    alone = study.study_recipe(run, study_args(batch_list=[3072]), ranks=2)
    whole = study.study_recipe(run, study_args(batch_list=[128, 3072]), ranks=2)
    assert alone["batch"] == whole["batch"] == {"global": 3072, "per_rank": 64,
                                                "accumulation": 24}
    assert study.study_micro_batch(study_args(batch_list=[3072]), ranks=4) == 32
    assert study.study_micro_batch(study_args(micro_batch=16), ranks=2) == 16


def test_table_and_plot_of_the_study(tmp_path):
    result = study.execute_study(study_args(batch_list=[128, 3072], seeds=2), FakeTrainer(),
                                 str(tmp_path))
    table = format_table(result["rows"], study.STUDY_COLUMNS)
    assert len(table.splitlines()) == 2 + 4 and "top1_mean" in table
    png = study.plot_study(result["rows"], str(tmp_path / "study.png"))
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("flag, text", [("--batches", "128,x"), ("--grid", "0,1")])
def test_bad_lists_are_named(flag, text):
    with pytest.raises(BadInputError, match=flag):
        study.parse_list(text, float, flag)
