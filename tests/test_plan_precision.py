"""The planner in a compute precision: calibration keys its class rates by precision (a file
without the key is float32), refuses bf16 where it would time the emulation, and `hpcdl plan`
costs the precision the run computes in with that precision's rates and its wire dtype.
None of these tests needs native bf16: the CPU facts are monkeypatched where they matter."""
import json
from collections import Counter

import pytest
import yaml

import hpcdl.cpus
from hpcdl.cli.main import main
from hpcdl.errors import BadInputError
from hpcdl.plan.calibrate import machine_document, write_machine
from hpcdl.plan.class_rates import measure_samples
from hpcdl.plan.cpu import measurable_precision
from hpcdl.plan.machine import MachineError, load_machine, planned_precision
from hpcdl.plan.model import PlanInputs, compute_by_class, compute_s, plan
from hpcdl.plan.workload import workload
from hpcdl.train.config import CommConfig
from hpcdl.train.precision import planned_wire_dtype
from tests.plan_fixtures import CLASS_RATES, calibration_measurements

pytestmark = pytest.mark.usefixtures("isolated_plan_dirs")
#: a CPU whose recorded facts make bf16 native (hpcdl.cpus.bf16_native)
AMX_CPU = {"model_name": "Test CPU AMX", "capability": "AVX512",
           "flags": ["avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"]}
RECIPE_HEAD = "name: r\noptimizer: {name: lars}\nschedule: {name: poly}\n"


def measurements(precision, cpu=AMX_CPU, speedup=1.0, stream=1e10):
    """calibration_measurements() in ``precision``, every class ``speedup`` times as fast."""
    m = calibration_measurements(cpu=cpu)
    return {**m, "precision": precision, "stream_Bps_1_thread": stream,
            "class_rates": {c: r * speedup for c, r in CLASS_RATES.items()}}


def two_precision_file(directory, bf16_speedup=2.0):
    """A local.yaml calibrated in float32, then again in bf16 on the same CPU."""
    write_machine(machine_document(measurements("float32")), str(directory))
    previous = yaml.safe_load((directory / "local.yaml").read_text())
    write_machine(machine_document(measurements("bfloat16", speedup=bf16_speedup), previous),
                  str(directory))
    return yaml.safe_load((directory / "local.yaml").read_text())


def with_cpu(monkeypatch, flags, capability="AVX512"):
    """This process's CPU facts as hpcdl.cpus reports them (bf16_native reads both)."""
    monkeypatch.setattr(hpcdl.cpus, "cpu_flags", lambda: set(flags))
    monkeypatch.setattr(hpcdl.cpus, "cpu_capability", lambda: capability)


def test_a_bf16_calibration_keys_its_rates_by_precision_and_reads_back(tmp_path):
    doc = machine_document(measurements("bfloat16"))
    write_machine(doc, str(tmp_path))
    written = yaml.safe_load((tmp_path / "local.yaml").read_text())
    assert "compute" not in written and set(written["rates"]) == {"bfloat16"}
    assert written["measured"]["precision"] == "bfloat16"
    machine = load_machine("local", str(tmp_path), "bfloat16")
    assert (machine.precision, machine.precisions) == ("bfloat16", ("bfloat16",))
    core_peak = 2400e6 * 32
    assert machine["compute.conv_3x3"] == pytest.approx(CLASS_RATES["conv_3x3"] / core_peak)
    with pytest.raises(MachineError, match="no float32 rates"):
        load_machine("local", str(tmp_path))


def test_a_file_without_the_precision_key_reads_as_float32():
    shipped = load_machine("local")
    assert (shipped.precision, shipped.precisions) == ("float32", ("float32",))
    with pytest.raises(MachineError, match="no bfloat16 rates"):
        load_machine("local", precision="bfloat16")


def test_a_recalibration_keeps_the_other_precision_of_the_same_cpu_at_its_absolute_rate(
        tmp_path):
    write_machine(machine_document(measurements("float32", stream=1e10)), str(tmp_path))
    previous = yaml.safe_load((tmp_path / "local.yaml").read_text())
    doc = machine_document(measurements("bfloat16", speedup=2.0, stream=2e10), previous)
    write_machine(doc, str(tmp_path))
    fp32 = load_machine("local", str(tmp_path), "float32")
    bf16 = load_machine("local", str(tmp_path), "bfloat16")
    assert fp32.precisions == ("float32", "bfloat16")
    # the float32 ReLU pass was 5 GB/s against a 10 GB/s stream; the file's stream is now
    # 20 GB/s, so its fraction halves and the absolute rate stays 5 GB/s
    assert fp32["compute.relu"] * fp32["node.core_stream_Bps"] == pytest.approx(5e9)
    assert bf16["compute.relu"] * bf16["node.core_stream_Bps"] == pytest.approx(1e10)


def test_a_recalibration_on_another_cpu_drops_the_old_rates(tmp_path):
    write_machine(machine_document(measurements("float32")), str(tmp_path))
    previous = yaml.safe_load((tmp_path / "local.yaml").read_text())
    other = {**AMX_CPU, "model_name": "Another CPU"}
    doc = machine_document(measurements("bfloat16", cpu=other), previous)
    assert "compute" not in doc and set(doc["rates"]) == {"bfloat16"}


def test_calibrating_bf16_without_native_bf16_is_refused_in_one_line(tmp_path, monkeypatch,
                                                                      capsys):
    with_cpu(monkeypatch, {"avx2", "fma", "avx512f"})
    assert main(["plan", "--calibrate", "--precision", "bfloat16",
                 "--machines-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no native bf16" in err[0] and "mislead" in err[0]
    assert not (tmp_path / "local.yaml").exists()


def test_auto_measures_bf16_only_where_native(monkeypatch):
    with_cpu(monkeypatch, {"avx2", "fma", "avx512f"})
    assert measurable_precision("auto", "--calibrate") == "float32"
    with pytest.raises(BadInputError, match="--validate --precision bfloat16"):
        measurable_precision("bfloat16", "--validate")
    with_cpu(monkeypatch, {"avx512f", "amx_bf16"})
    assert measurable_precision("auto", "--calibrate") == "bfloat16"
    with_cpu(monkeypatch, {"avx512f", "amx_bf16"}, capability="AVX2")   # torch kept at AVX2
    assert measurable_precision("auto", "--calibrate") == "float32"


def test_representative_layers_time_in_bf16_autocast_on_any_cpu():
    """Emulated where not native: slow, but the timing path is the same."""
    layers = (("conv_3x3", "conv", (8, 8, 3, 1, 1, 1), (8, 6, 6), True),
              ("add", "add", (), (4, 6, 6), True))
    samples = measure_samples(2, 1, log=lambda _line: None, layers=layers, optimizer=False,
                              precision="bfloat16")
    assert [s.op_class for s in samples] == ["conv_3x3", "add"]
    assert all(s.seconds > 0 and s.work > 0 for s in samples)


def test_auto_plans_bf16_where_the_file_s_cpu_computes_it_natively():
    assert planned_precision({"cpu": AMX_CPU}, "auto") == "bfloat16"
    assert planned_precision({"cpu": {**AMX_CPU, "capability": "AVX2"}}, "auto") == "float32"
    assert planned_precision({}, "auto") == "float32"          # a file naming no CPU
    assert planned_precision({"cpu": AMX_CPU}, "float32") == "float32"
    assert load_machine("skx", precision="auto").precision == "float32"


def test_the_prediction_costs_the_bf16_rates(tmp_path):
    two_precision_file(tmp_path, bf16_speedup=2.0)
    work = workload("resnet50", 112)
    fp32 = load_machine("local", str(tmp_path), "float32")
    bf16 = load_machine("local", str(tmp_path), "bfloat16")
    fp32_s, bf16_s = (compute_by_class(m, work, 8, 1) for m in (fp32, bf16))
    layers = Counter(layer.op_class for layer in work.layers)
    for op_class in ("conv_large", "conv_1x1", "conv_3x3"):
        # twice the rate; the per-layer overhead is the same in both
        overhead = fp32["compute.layer_overhead_s"] * layers[op_class]
        assert bf16_s[op_class] - overhead == pytest.approx((fp32_s[op_class] - overhead) / 2)
    # memory passes at twice the rate meet the node's bandwidth: faster, at most twice
    assert all(fp32_s[c] / 2 <= bf16_s[c] <= fp32_s[c] for c in fp32_s)
    p = plan(bf16, work, PlanInputs(global_batch=16, procs=2, procs_per_node=2))
    assert p.precision == "bfloat16"
    assert p.compute_s == pytest.approx(compute_s(bf16, work, 8, 2))


@pytest.mark.parametrize(("backend", "ranks_per_node", "algorithm", "precision", "wire"), [
    ("auto", 2, "sync", "bfloat16", "bfloat16"),      # shm: bf16 on the wire
    ("auto", 1, "sync", "bfloat16", "float32"),       # one rank a node: mpi sends float32
    ("ring", 1, "sync", "bfloat16", "bfloat16"),
    ("mpi", 4, "sync", "bfloat16", "float32"),
    ("auto", 2, "local_sgd", "bfloat16", "float32"),  # model averages stay float32
    ("auto", 2, "sync", "float32", "float32"),
])
def test_the_planned_wire_dtype_follows_the_run_s_rule(backend, ranks_per_node, algorithm,
                                                       precision, wire):
    section = CommConfig(backend=backend, algorithm=algorithm)
    assert planned_wire_dtype(section, precision, ranks_per_node) == wire


def plan_json(tmp_path, *args):
    out = tmp_path / "plan.json"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE_HEAD + "model: {name: resnet50}\nbatch: {global: 64}\n"
                      "epochs: 1\ntrain: {precision: auto}\ncomm: {wire_dtype: auto}\n")
    assert main(["plan", "--recipe", str(recipe), "--machine", "local", "--machines-dir",
                 str(tmp_path), "--procs", "8", "--procs-per-node", "2", "--sweep", "8",
                 "--json", str(out), *args]) == 0
    return json.loads(out.read_text())


def test_hpcdl_plan_predicts_the_recipe_s_bf16_run_with_bf16_gradients(tmp_path):
    two_precision_file(tmp_path)
    bf16 = plan_json(tmp_path)   # train.precision auto on a file whose CPU has AMX
    fp32 = plan_json(tmp_path, "--precision", "float32")
    params = bf16["workload"]["parameters"]
    assert bf16["plan"]["precision"] == "bfloat16" and bf16["inputs"]["wire_bytes"] == 2
    assert bf16["plan"]["gradient_bytes"] == pytest.approx(2 * params)
    assert fp32["plan"]["precision"] == "float32" and fp32["inputs"]["wire_bytes"] == 4
    assert fp32["plan"]["gradient_bytes"] == pytest.approx(4 * params)
    assert bf16["per_iteration"]["compute_s"] < fp32["per_iteration"]["compute_s"]
    forced = plan_json(tmp_path, "--wire-dtype", "float32")
    assert forced["plan"]["precision"] == "bfloat16" and forced["inputs"]["wire_bytes"] == 4


def test_planning_a_precision_the_file_has_no_rates_for_is_one_line(tmp_path, capsys):
    write_machine(machine_document(calibration_measurements()), str(tmp_path))
    assert main(["plan", "--machine", "local", "--machines-dir", str(tmp_path), "--model",
                 "resnet50", "--procs", "2", "--precision", "bfloat16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no bfloat16 rates" in err[0] and "--calibrate --precision" in err[0]


def test_validation_predicts_from_the_bf16_rates_and_measures_in_bf16(tmp_path, monkeypatch):
    from hpcdl.plan import validate

    with_cpu(monkeypatch, {"avx512f", "amx_bf16"})
    two_precision_file(tmp_path)
    asked = []

    def fake_run(procs, model, image_size, batch, steps, timeout_s, precision="float32"):
        asked.append(precision)
        return {"step_s": 1.0, "batch_per_rank": batch}

    monkeypatch.setattr(validate, "run_bench_train", fake_run)
    out = tmp_path / "v.json"
    assert main(["plan", "--validate", "--machine", "local", "--machines-dir", str(tmp_path),
                 "--model", "resnet_small", "--image-size", "16", "--validate-procs", "1",
                 "--repeats", "1", "--precision", "bfloat16", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    bf16 = load_machine("local", str(tmp_path), "bfloat16")
    expected = validate.predict_step(bf16, workload("resnet_small", 16), 1, 8).iteration_s
    assert asked == ["bfloat16"] and doc["precision"] == "bfloat16"
    assert doc["results"][0]["predicted_step_s"] == pytest.approx(expected)
    assert {"cpu_model_name", "cpu_capability", "load_average"} <= set(doc["machine"])


def test_a_validation_row_keeps_the_rank_s_cpu_seconds():
    """On a busy machine the wall clock counts other processes' turns; the bench's CPU
    seconds per step travel into the row beside it."""
    from hpcdl.plan.validate import measured_step

    report = {"results": [{"ranks": 1, "mode": "ours", "batch_per_rank": 8,
                           "step_time_median_s": 2.0, "cpu_s_per_step": 1.5,
                           "comm_thread_cpu_s_per_step": 0.1}]}
    assert measured_step(report, 1) == {"step_s": 2.0, "batch_per_rank": 8, "cpu_s": 1.5,
                                        "comm_thread_cpu_s": 0.1}
