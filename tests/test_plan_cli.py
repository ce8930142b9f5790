"""`hpcdl plan` as a user runs it: the table, the JSON keys, the plot, recipes, clear errors."""
import json

import pytest

from hpcdl.cli.main import main

pytestmark = pytest.mark.usefixtures("isolated_plan_dirs")
#: what every recipe names besides the planner's keys (hpcdl.train.config's required keys)
RECIPE_HEAD = "name: r\noptimizer: {name: lars}\nschedule: {name: poly}\n"


def test_plan_prints_the_breakdown_and_a_sweep_table(capsys):
    assert main(["plan", "--model", "resnet50", "--global-batch", "32768", "--procs", "2048",
                 "--machine", "knl", "--epochs", "90"]) == 0
    out = capsys.readouterr().out
    for term in ("compute", "communication", "hidden", "exposed", "data loading", "iteration",
                 "epochs", "images/s", "scaling efficiency"):
        assert term in out
    header = next(line for line in out.splitlines() if line.lstrip().startswith("procs"))
    assert "iteration_s" in header and "scaling_efficiency" in header
    assert "\n 2048 " in out or "\n2048 " in out


def test_plan_json_holds_totals_and_the_per_iteration_breakdown(tmp_path):
    path = tmp_path / "plan.json"
    assert main(["plan", "--machine", "skx", "--model", "alexnet_bn", "--procs", "2048",
                 "--epochs", "100", "--allreduce", "hierarchical", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    for key in ("total_s", "images_per_s", "scaling_efficiency", "per_iteration", "results"):
        assert key in doc
    for key in ("compute_s", "comm_s", "comm_exposed_s", "data_s", "iteration_s"):
        assert doc["per_iteration"][key] >= 0
    assert doc["inputs"]["allreduce"] == "hierarchical"
    assert doc["total_s"] == pytest.approx(
        100 * (1_281_167 // 32768) * doc["per_iteration"]["iteration_s"])
    assert all(f["source"] for f in doc["machine"]["figures"].values())


def test_plan_writes_a_png(tmp_path):
    path = tmp_path / "sweep.png"
    assert main(["plan", "--machine", "knl", "--procs", "256", "--sweep", "64,128,256",
                 "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_recipe_supplies_model_batch_and_epochs_and_flags_override(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE_HEAD + "model: {name: alexnet_bn}\nbatch: {global: 16384}\n"
                      "epochs: 100\ncomm: {bucket_mb: 50}\n")
    path = tmp_path / "plan.json"
    assert main(["plan", "--recipe", str(recipe), "--machine", "skx", "--procs", "512",
                 "--epochs", "10", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert doc["workload"]["model"] == "alexnet_bn"
    assert doc["inputs"]["global_batch"] == 16384
    assert doc["inputs"]["bucket_mb"] == 50
    assert doc["inputs"]["epochs"] == 10


def test_a_recipe_s_total_steps_set_the_epochs_planned(tmp_path):
    """train.total_steps (a solver's max_iter: NVCaffe's 32K AlexNet-BN runs 4,000 steps)
    is what the planner costs, unless --epochs says otherwise."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE_HEAD + "model: {name: alexnet_bn}\nbatch: {global: 32768}\n"
                      "epochs: 100\ntrain: {total_steps: 4000}\n")
    path = tmp_path / "plan.json"
    assert main(["plan", "--recipe", str(recipe), "--machine", "skx", "--procs", "512",
                 "--json", str(path)]) == 0
    # 4,000 steps of the planner's (and trainer's) 1,281,167 // 32,768 = 39 per epoch
    assert json.loads(path.read_text())["inputs"]["epochs"] == pytest.approx(4000 / 39)
    assert main(["plan", "--recipe", str(recipe), "--machine", "skx", "--procs", "512",
                 "--epochs", "100", "--json", str(path)]) == 0
    assert json.loads(path.read_text())["inputs"]["epochs"] == 100


def test_a_bad_recipe_is_one_line_naming_the_file_and_the_key(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE_HEAD + "model: {name: alexnet_bn}\nbatch: {global: 16384}\n"
                      "epochs: 100\ncomm: {bucket_mbb: 50}\n")
    assert main(["plan", "--recipe", str(recipe), "--machine", "skx"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(recipe) in err[0] and "comm.bucket_mbb" in err[0]


def test_without_a_recipe_the_shipped_resnet50_run_is_planned(tmp_path):
    path = tmp_path / "plan.json"
    assert main(["plan", "--sweep", "2048", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert (doc["machine"]["name"], doc["workload"]["model"], doc["inputs"]["procs"],
            doc["inputs"]["global_batch"], doc["inputs"]["epochs"],
            doc["inputs"]["bucket_mb"]) == ("knl", "resnet50", 2048, 32768, 90, 25)


def test_unknown_machine_is_a_clear_error(capsys):
    assert main(["plan", "--machine", "bluegene", "--procs", "8"]) == 2
    assert "unknown machine 'bluegene'" in capsys.readouterr().err


def test_unknown_model_is_a_clear_error(capsys):
    assert main(["plan", "--model", "vgg99", "--machine", "knl", "--procs", "8"]) == 2
    assert "unknown model 'vgg99'" in capsys.readouterr().err


def test_sweep_rejects_non_numbers():
    with pytest.raises(SystemExit):
        main(["plan", "--sweep", "8,lots"])


def test_plan_prints_the_compute_term_by_operator_class(capsys):
    assert main(["plan", "--model", "alexnet_bn", "--machine", "skx", "--procs", "2048",
                 "--sweep", "2048"]) == 0
    out = capsys.readouterr().out
    for op_class in ("conv_large", "conv_3x3", "linear", "batch_norm", "relu", "pool"):
        assert f"    {op_class} " in out
    assert "of peak" in out and "of stream" in out


def _calibrated_dir(tmp_path, cpu):
    from plan_fixtures import calibration_measurements

    from hpcdl.plan.calibrate import machine_document, write_machine

    write_machine(machine_document(calibration_measurements(cpu=cpu)), str(tmp_path))
    return str(tmp_path)


def test_plan_warns_when_the_calibrated_file_describes_another_cpu(tmp_path, capsys):
    other = {"model_name": "Made-up CPU 2", "capability": "AMX", "flags": ["amx_bf16"]}
    assert main(["plan", "--machine", "local", "--machines-dir", _calibrated_dir(tmp_path, other),
                 "--model", "resnet_small", "--image-size", "16", "--global-batch", "8",
                 "--procs", "2", "--sweep", "2"]) == 0
    err = capsys.readouterr().err
    assert "Made-up CPU 2" in err and "recalibrate here with `hpcdl plan --calibrate`" in err


def test_validate_runs_one_real_row_end_to_end(tmp_path, capsys):
    """The plumbing, for real: predict, run `mpiexec -n 1 hpcdl bench train` on a tiny model,
    compare (the ratio itself is not asserted: it is a measurement)."""
    out = tmp_path / "validate.json"
    rc = main(["plan", "--validate", "--machine", "local",
               "--machines-dir", _calibrated_dir(tmp_path, None), "--model", "resnet_small",
               "--image-size", "16", "--validate-procs", "1", "--repeats", "1", "--steps", "1",
               "--batch-per-rank", "2", "--json", str(out)])
    assert rc == 0, capsys.readouterr().err
    doc = json.loads(out.read_text())
    [row] = doc["results"]
    assert (row["model"], row["image_size"], row["ranks"]) == ("resnet_small", 16, 1)
    assert row["measured_step_s"] > 0 and row["predicted_step_s"] > 0
    assert row["predicted_vs_measured"] == pytest.approx(
        row["predicted_step_s"] / row["measured_step_s"])
    assert "resnet_small@16_np1" in doc["ratios"] and "bf16" in doc["bf16"] and doc["complete"]
