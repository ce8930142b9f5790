"""The measured thread speedup of each operator class, the robust
calibration timing (median after warm-up, no gradient accumulation), the one planner cache,
and the median step of ``--validate``. Arithmetic on synthetic rates only: no timing asserted."""
import importlib
import json
import types

import pytest
from plan_fixtures import CLASS_RATES, calibration_measurements
from torch import nn

from hpcdl.plan import cache, class_rates
from hpcdl.plan import layers as layers_module
from hpcdl.plan.calibrate import machine_document, write_machine
from hpcdl.plan.class_rates import median_time, thread_speedups, time_layer
from hpcdl.plan.layers import OP_CLASSES, Layer
from hpcdl.plan.machine import MachineError, load_machine, parse_machine
from hpcdl.plan.model import PlanInputs, compute_by_class, plan
from hpcdl.plan.validate import measured_step
from hpcdl.plan.workload import Workload

workload_module = importlib.import_module("hpcdl.plan.workload")  # the package exports
# a function of that name
pytestmark = pytest.mark.usefixtures("isolated_plan_dirs")


def fig(v):
    return {"value": v, "source": "test"}


def machine(cores=2, speedups=None, threads=2):
    """2 cores x 64 GFLOP/s, 10 GB/s per core (20 per node); every class at 0.5, and a
    measured thread scaling when ``speedups`` is given."""
    doc = {
        "name": "vm",
        "node": {"sockets": fig(1), "cores_per_socket": fig(cores), "frequency_hz": fig(2e9),
                 "flops_per_cycle_per_core": fig(32), "memory_bandwidth_Bps": fig(2e10),
                 "core_stream_Bps": fig(1e10), "ranks_per_node": fig(1)},
        "compute": {**{c: fig(0.5) for c in OP_CLASSES}, "layer_overhead_s": fig(1e-30)},
        "network": {"latency_s": fig(1e-6), "bandwidth_Bps": fig(1e9)},
        "intra_node": {"latency_s": fig(5e-7), "bandwidth_Bps": fig(5e9)},
        "data": {"decode_images_per_s_per_core": fig(500), "loader_cores_per_node": fig(1)},
    }
    if speedups is not None:
        doc["thread_scaling"] = {"threads": fig(threads),
                                 **{c: fig(speedups.get(c, 1.0)) for c in OP_CLASSES}}
    return parse_machine(doc, "vm.yaml")


CONV = Layer("c", "conv_3x3", macs=1e9, in_bytes=1e6, out_bytes=1e6)
BN = Layer("b", "batch_norm", in_bytes=1e6, out_bytes=1e6)


def work_of(*layers):
    return Workload("hand", 32, sum(la.macs for la in layers), 1000, "test", tuple(layers))


# --------------------------------------------------------------------------- thread speedup
def test_without_thread_scaling_a_rank_s_threads_count_as_cores():
    vm = machine()
    assert vm.thread_speedup("conv_3x3", 1) == 1.0 and vm.thread_speedup("conv_3x3", 2) == 2.0


def test_the_measured_speedup_is_interpolated_then_its_efficiency_kept():
    vm = machine(cores=8, speedups={"conv_3x3": 3.0}, threads=4)
    assert vm.thread_speedup("conv_3x3", 1) == 1.0
    assert vm.thread_speedup("conv_3x3", 4) == pytest.approx(3.0)
    assert vm.thread_speedup("conv_3x3", 2) == pytest.approx(1 + 2.0 / 3.0)
    assert vm.thread_speedup("conv_3x3", 8) == pytest.approx(6.0)   # 0.75 per thread kept


def test_a_one_rank_node_costs_each_class_at_its_own_thread_speedup():
    vm = machine(speedups={"conv_3x3": 1.5, "batch_norm": 1.2})
    seconds = compute_by_class(vm, work_of(CONV, BN), batch_per_rank=4, procs_per_node=1)
    # conv: 4 x 6 GFLOP / (0.5 x 64 GFLOP/s x 1.5); BN: 4 x 8 MB / (0.5 x 10 GB/s x 1.2)
    assert seconds["conv_3x3"] == pytest.approx(4 * 6e9 / (0.5 * 64e9 * 1.5))
    assert seconds["batch_norm"] == pytest.approx(4 * 8e6 / (0.5 * 1e10 * 1.2))


def test_a_poor_thread_speedup_makes_one_two_thread_rank_slower_than_linear():
    linear, measured = machine(), machine(speedups={c: 0.5 for c in OP_CLASSES})
    inp = PlanInputs(global_batch=8, procs=1, procs_per_node=1, synthetic_data=True)
    fast = plan(linear, work_of(CONV, BN), inp).compute_s
    slow = plan(measured, work_of(CONV, BN), inp).compute_s
    assert slow == pytest.approx(4 * fast)   # speedup 2 (linear) against 0.5 (measured)


def test_one_thread_ranks_ignore_the_thread_scaling():
    inp = PlanInputs(global_batch=8, procs=2, procs_per_node=2, synthetic_data=True)
    a = plan(machine(), work_of(CONV, BN), inp).compute_s
    b = plan(machine(speedups={c: 0.5 for c in OP_CLASSES}), work_of(CONV, BN), inp).compute_s
    assert a == pytest.approx(b)


def test_an_incomplete_thread_scaling_section_is_rejected_by_name():
    doc = machine_document({**calibration_measurements(), **threaded()})
    del doc["thread_scaling"]["pool"]
    with pytest.raises(MachineError, match=r"thread_scaling is missing \['pool'\]"):
        parse_machine(doc, "x.yaml")


def threaded(speedup=1.6):
    rates_t = {c: r * speedup for c, r in CLASS_RATES.items()}
    return {"class_threads": 2, "class_rates_threads": rates_t,
            "thread_speedups": thread_speedups(CLASS_RATES, rates_t)}


def test_calibration_writes_each_class_s_speedup_from_its_two_timings(tmp_path):
    write_machine(machine_document({**calibration_measurements(), **threaded(1.6)}),
                  str(tmp_path))
    local = load_machine("local", str(tmp_path))
    assert local.has_thread_scaling and local["thread_scaling.threads"] == 2
    for c in OP_CLASSES:
        assert local.thread_speedup(c, 2) == pytest.approx(1.6)


def test_a_speedup_measured_below_a_tenth_is_floored():
    assert thread_speedups({"relu": 1e9}, {"relu": 1e6}) == {"relu": 0.1}


def test_a_speedup_above_the_thread_count_is_capped_at_it():
    assert thread_speedups({"relu": 1e9}, {"relu": 4.4e9}, threads=2) == {"relu": 2.0}
    assert thread_speedups({"relu": 1e9}, {"relu": 1.5e9}, threads=2) == {"relu": 1.5}


def test_a_calibrated_file_without_thread_scaling_says_so_for_multi_thread_ranks(tmp_path):
    write_machine(machine_document(calibration_measurements()), str(tmp_path))
    local = load_machine("local", str(tmp_path))
    one = plan(local, work_of(CONV), PlanInputs(global_batch=2, procs=1, procs_per_node=1))
    two = plan(local, work_of(CONV), PlanInputs(global_batch=2, procs=2, procs_per_node=2))
    assert any("no measured thread scaling" in n for n in one.notes)
    assert not any("thread scaling" in n for n in two.notes)


# --------------------------------------------------------------------------- robust timing
def test_median_time_discards_the_warm_up_and_takes_the_median(monkeypatch):
    clock = [0.0]
    durations = iter([100.0, 5.0, 1.0, 2.0])   # the warm-up (100 s) is never timed

    def call():
        clock[0] += next(durations)

    monkeypatch.setattr(class_rates, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    assert median_time(call, repeats=3, warmup=1) == 2.0


def test_timing_a_layer_accumulates_no_gradient():
    """out.backward() would add into .grad on every repeat: an extra memory pass per call."""
    module = nn.BatchNorm2d(4)
    time_layer(module, (4, 3, 3), 2, True, repeats=2)
    assert module.weight.grad is None and module.bias.grad is None


# --------------------------------------------------------------------------- one cache
def test_the_cache_survives_corruption_and_keeps_other_keys(tmp_path):
    path = str(tmp_path / "c.json")
    (tmp_path / "c.json").write_text("{not json")
    assert cache.read_cache(path) == {}
    cache.update_cache(path, "a@1", 1)
    cache.update_cache(path, "b@2", [2])
    assert json.loads((tmp_path / "c.json").read_text()) == {"a@1": 1, "b@2": [2]}


def test_a_read_only_cache_only_costs_recounting(tmp_path, monkeypatch):
    """A cache that cannot be written raises nothing and changes nothing; the planner counts
    the model again on each call, with the same result. Unwritable here means a file stands
    where the cache's directory should be: root, which the tests may run as, ignores modes."""
    (tmp_path / "f").write_text("not a directory")
    path = str(tmp_path / "f" / "c.json")
    cache.update_cache(path, "k", 1)
    assert (tmp_path / "f").read_text() == "not a directory"
    assert cache.read_cache(path) == {}

    counted = []
    count = layers_module.count_layers
    monkeypatch.setattr(layers_module, "count_layers",
                        lambda model, size: counted.append(size) or count(model, size))
    monkeypatch.setattr(layers_module, "_MEMO", {})   # not counted earlier in this process
    first = workload_module.workload("resnet_small", 32, cache_path=path)
    monkeypatch.setattr(layers_module, "_MEMO", {})   # a new process
    second = workload_module.workload("resnet_small", 32, cache_path=path)
    assert counted == [32] * 2   # recounted: nothing was cached
    assert first.forward_macs > 0 and first.parameters > 0
    assert (second.forward_macs, second.parameters) == (first.forward_macs, first.parameters)
    assert "cached" not in second.source


def test_layer_tables_are_cached_under_the_user_cache_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert layers_module.layers_cache_path() == str(tmp_path / "hpcdl" / "layers-v2.json")
    assert not hasattr(workload_module, "_read_cache") and not hasattr(layers_module,
                                                                       "_read_cache")


# --------------------------------------------------------------------------- validation
def test_validation_compares_the_median_step_when_the_bench_reports_it():
    record = {"ranks": 2, "batch_per_rank": 8, "step_time_s": 10.0, "step_time_median_s": 2.0}
    assert measured_step({"results": [record]}, 2)["step_s"] == 2.0


# --------------------------------------------------------------------------- as a user runs it
def test_plan_on_another_cpu_s_calibration_warns_and_shows_the_thread_speedup(tmp_path,
                                                                             monkeypatch,
                                                                             capsys):
    from hpcdl.cli.main import main

    other = {"model_name": "Made-up CPU 2", "capability": "AVX512", "flags": ["avx512f"]}
    write_machine(machine_document({**calibration_measurements(cpu=other), **threaded(1.6)}),
                  str(tmp_path))
    monkeypatch.setattr("hpcdl.plan.cpu.cpu_identity", lambda: {
        "model_name": "AMD EPYC", "capability": "AVX2", "flags": ["avx2", "fma"]})
    assert main(["plan", "--machine", "local", "--machines-dir", str(tmp_path), "--model",
                 "resnet_small", "--image-size", "16", "--global-batch", "8", "--procs", "1",
                 "--procs-per-node", "1", "--synthetic", "--sweep", "1"]) == 0
    captured = capsys.readouterr()
    assert "calibrated on another CPU" in captured.err and "Made-up CPU 2" in captured.err
    assert "2 threads x 1.6 (measured speedup)" in captured.out


def validate_with_fake_runs(tmp_path, monkeypatch, *extra):
    """`hpcdl plan --validate` on a tiny model with bench train replaced by a fake that takes
    100 s of a fake clock per run; returns (the runs' np in order, the JSON)."""
    from hpcdl.cli.main import main
    from hpcdl.plan import validate

    write_machine(machine_document(calibration_measurements()), str(tmp_path))
    clock, calls = [0.0], []

    def fake_run(procs, model, image_size, batch, steps, timeout_s, precision="float32"):
        calls.append(procs)
        clock[0] += 100.0
        return {"step_s": 2.0, "batch_per_rank": batch}

    monkeypatch.setattr(validate, "run_bench_train", fake_run)
    monkeypatch.setattr(validate, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    out = tmp_path / "v.json"
    assert main(["plan", "--validate", "--machine", "local", "--machines-dir", str(tmp_path),
                 "--model", "resnet_small", "--image-size", "16", "--validate-procs", "1,2",
                 "--repeats", "2", "--json", str(out), *extra]) == 0
    return calls, json.loads(out.read_text())


def test_validation_measures_every_row_once_before_any_row_twice(tmp_path, monkeypatch):
    calls, doc = validate_with_fake_runs(tmp_path, monkeypatch)
    assert calls == [1, 2, 1, 2]
    assert [len(r["measured_repeats_s"]) for r in doc["results"]] == [2, 2]
    assert doc["not_measured"] == [] and doc["complete"] is True


def test_the_validation_budget_starts_no_run_that_would_end_past_it(tmp_path, monkeypatch):
    # runs take 100 s: np1, np2 (t = 200), np1 again (ends at 300 <= 350), np2 again would
    # end at 400 > 350: not started
    calls, doc = validate_with_fake_runs(tmp_path, monkeypatch, "--validate-budget", "350")
    assert calls == [1, 2, 1]
    assert [len(r["measured_repeats_s"]) for r in doc["results"]] == [2, 1]


def test_rows_the_budget_never_reached_are_listed(tmp_path, monkeypatch):
    calls, doc = validate_with_fake_runs(tmp_path, monkeypatch, "--validate-budget", "1")
    assert calls == [] and doc["results"] == []
    assert doc["not_measured"] == ["resnet_small@16 np=1", "resnet_small@16 np=2"]
    assert doc["ratios"]["within_15_percent"] is False
