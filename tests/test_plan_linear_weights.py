"""A linear layer at small batch is bound by its weight traffic at a
calibrated rate of its own (``compute.linear_weights``), not at the stream rate. Arithmetic on
synthetic rates; no timing asserted."""
import pytest
import torch
from plan_fixtures import CLASS_RATES, calibration_measurements
from test_plan_threads import fig, machine, threaded

from hpcdl.plan.calibrate import machine_document, write_machine
from hpcdl.plan.class_rates import REPRESENTATIVE, Sample, build, fit_rates, layer_work
from hpcdl.plan.layers import LINEAR_WEIGHT_PASSES, LINEAR_WEIGHTS, Layer, count_layers
from hpcdl.plan.machine import parse_machine
from hpcdl.plan.model import layer_s

pytestmark = pytest.mark.usefixtures("isolated_plan_dirs")

# AlexNet's fc6 per image: 9216 -> 4096, 151 MB of weights.
FC6 = Layer("fc6", "linear", macs=9216 * 4096, in_bytes=9216 * 4, out_bytes=4096 * 4,
            param_bytes=(9216 * 4096 + 4096) * 4)


def with_linear_weights(vm, fraction, speedup=None):
    """``vm`` (test_plan_threads.machine) with ``compute.linear_weights`` (and its thread
    speedup) added, re-parsed as a file would be."""
    doc = {"name": vm.name, **_sections(vm)}
    doc["compute"][LINEAR_WEIGHTS] = fig(fraction)
    if speedup is not None:
        doc["thread_scaling"][LINEAR_WEIGHTS] = fig(speedup)
    return parse_machine(doc, "vm.yaml")


def _sections(vm):
    out: dict = {}
    for dotted, figure in vm.figures.items():
        section, key = dotted.split(".", 1)
        out.setdefault(section, {})[key] = {"value": figure.value, "source": figure.source}
    return out


def test_a_small_batch_linear_layer_streams_its_weights_at_the_calibrated_fraction():
    vm = machine()             # 10 GB/s per core, one-thread ranks at np 2; 2 images per rank
    weights_s = LINEAR_WEIGHT_PASSES * FC6.param_bytes
    assert layer_s(vm, FC6, 2, 2) == pytest.approx(weights_s / 1e10, rel=1e-6)
    slow = with_linear_weights(vm, 0.1)
    assert layer_s(slow, FC6, 8, 2) == pytest.approx(weights_s / 1e9, rel=1e-6)


def test_at_large_batch_the_flops_bound_the_linear_layer_whatever_the_weight_rate():
    vm = with_linear_weights(machine(), 0.1)
    flops_s = 4096 * FC6.train_flops / (0.5 * 64e9)
    assert layer_s(vm, FC6, 4096, 2) == pytest.approx(flops_s, rel=1e-6)


def test_the_weight_rate_scales_with_its_own_measured_thread_speedup():
    vm = with_linear_weights(machine(speedups={}), 0.1, speedup=1.5)
    one_thread = layer_s(vm, FC6, 8, 2)
    assert layer_s(vm, FC6, 8, 1) == pytest.approx(one_thread / 1.5, rel=1e-6)
    without = machine(speedups={})         # a file that predates the class: linear in threads
    assert layer_s(without, FC6, 1, 1) == pytest.approx(layer_s(without, FC6, 1, 2) / 2,
                                                        rel=1e-6)


def test_a_weight_sample_counts_three_passes_of_its_weights_whatever_its_rows():
    op_class, kind, args, shape, grad = next(r for r in REPRESENTATIVE if r[0] == LINEAR_WEIGHTS)
    (layer,) = count_layers(build(kind, args), 0, shape, grad)
    work = LINEAR_WEIGHT_PASSES * layer.param_bytes
    assert layer_work(layer, 8, LINEAR_WEIGHTS) == layer_work(layer, 64, LINEAR_WEIGHTS) == work
    assert layer.param_bytes > 32 << 20   # beyond glibc's mmap ceiling, as fc6 is


def test_calibration_fits_and_writes_the_weight_rate_beside_the_classes(tmp_path):
    samples = [Sample(c, 1.0, 1.0) for c in CLASS_RATES] + [Sample(LINEAR_WEIGHTS, 2e9, 1.0)]
    rates = fit_rates(samples, 0.0)
    assert rates[LINEAR_WEIGHTS] == pytest.approx(2e9)
    m = calibration_measurements()
    m["class_rates"] = {**m["class_rates"], LINEAR_WEIGHTS: 2e9}
    t = threaded(1.6)
    t["class_rates_threads"][LINEAR_WEIGHTS] = 3e9
    t["thread_speedups"][LINEAR_WEIGHTS] = 1.5
    write_machine(machine_document({**m, **t}), str(tmp_path))
    from hpcdl.plan.machine import load_machine

    local = load_machine("local", str(tmp_path))
    # of the 1-thread stream
    assert local.optional_fraction(LINEAR_WEIGHTS) == pytest.approx(2e9 / 1e10)
    assert local.thread_speedup(LINEAR_WEIGHTS, 2) == pytest.approx(1.5)


def test_a_file_without_the_weight_rate_keeps_the_stream_rate(tmp_path):
    write_machine(machine_document(calibration_measurements()), str(tmp_path))
    from hpcdl.plan.machine import load_machine

    assert load_machine("local", str(tmp_path)).optional_fraction(LINEAR_WEIGHTS) == 1.0


# --------------------------------------------------------------------------- the optimizer
def test_the_optimizer_moves_its_bytes_at_the_calibrated_fraction_and_shares_a_core():
    from hpcdl.plan.layers import OPTIMIZER, OPTIMIZER_BYTES_PER_PARAMETER
    from hpcdl.plan.model import optimizer_s
    from hpcdl.plan.workload import Workload

    work = Workload("hand", 32, 1e9, 10_000_000, "test", ())
    nominal = OPTIMIZER_BYTES_PER_PARAMETER * 10_000_000
    vm = machine()                                       # 10 GB/s per core, 2 cores
    assert optimizer_s(vm, work, 2) == pytest.approx(nominal / 1e10)
    doc = {"name": vm.name, **_sections(vm)}
    doc["compute"][OPTIMIZER] = fig(0.5)
    slow = parse_machine(doc, "vm.yaml")
    assert optimizer_s(slow, work, 2) == pytest.approx(nominal / 0.5e10)
    # four ranks on two cores: each has half a core (and a quarter of the node's 20 GB/s)
    assert optimizer_s(slow, work, 4) == pytest.approx(nominal / (0.5 * 0.5e10))


def test_calibration_times_hpcdl_s_lars_as_the_optimizer_sample():
    from hpcdl.plan.class_rates import OPTIMIZER_SHAPES, optimizer_sample
    from hpcdl.plan.layers import OPTIMIZER, OPTIMIZER_BYTES_PER_PARAMETER

    sample = optimizer_sample(repeats=1)
    count = sum(torch.Size(s).numel() for s in OPTIMIZER_SHAPES)
    assert sample.op_class == OPTIMIZER and sample.seconds > 0
    assert sample.work == OPTIMIZER_BYTES_PER_PARAMETER * count and count * 4 > 32 << 20


def test_a_pass_runs_at_its_own_rate_up_to_its_share_of_the_node():
    """A roofline, not a product: a pass measured at 0.1 of one core's 10 GB/s runs at 1 GB/s
    whether or not the node's 12 GB/s is shared by two ranks (6 GB/s each); only a pass faster
    than the share is capped by it."""
    from hpcdl.plan.model import pass_rate_Bps

    doc = {"name": "vm", **_sections(machine())}
    doc["node"]["memory_bandwidth_Bps"] = fig(1.2e10)
    vm = parse_machine(doc, "vm.yaml")
    assert pass_rate_Bps(vm, 0.1, 1.0, 2) == pytest.approx(1e9)
    assert pass_rate_Bps(vm, 0.9, 1.0, 2) == pytest.approx(6e9)
    assert pass_rate_Bps(vm, 0.1, 1.0, 24) == pytest.approx(5e8)


# --------------------------------------------------------------------------- contention
def with_contention(vm, factors, ranks=2):
    doc = {"name": vm.name, **_sections(vm)}
    doc["contention"] = {"ranks": fig(ranks), **{c: fig(f) for c, f in factors.items()}}
    return parse_machine(doc, "vm.yaml")


def test_ranks_that_fill_the_node_run_at_the_measured_contention():
    conv = Layer("c", "conv_3x3", macs=1e9)
    vm = machine()
    crowded = with_contention(vm, {"conv_3x3": 0.8})
    alone = layer_s(vm, conv, 8, 2)
    assert layer_s(crowded, conv, 8, 2) == pytest.approx(alone / 0.8, rel=1e-6)
    assert layer_s(crowded, conv, 8, 1) == pytest.approx(layer_s(vm, conv, 8, 1), rel=1e-9)
    # four ranks on two cores: half a core each, and the node's contention once
    assert layer_s(crowded, conv, 8, 4) == pytest.approx(2 * alone / 0.8, rel=1e-6)
    assert crowded.contention_factor("relu", 2) == 1.0          # a class not measured


def test_contention_is_interpolated_from_one_rank_to_the_calibrated_count():
    vm = with_contention(machine(cores=8), {"conv_3x3": 0.6}, ranks=8)
    assert vm.contention_factor("conv_3x3", 1) == 1.0
    assert vm.contention_factor("conv_3x3", 8) == pytest.approx(0.6)
    # 4 ranks x 2 threads: the other 6 busy cores of 7 possible others
    assert vm.contention_factor("conv_3x3", 4) == pytest.approx(1 - 0.4 * 6 / 7)


def test_contention_is_a_rate_ratio_kept_within_a_tenth_and_one():
    from hpcdl.plan.class_rates import contention

    assert contention({"a": 1e9, "b": 1e9, "c": 1e9}, {"a": 8e8, "b": 1.2e9, "c": 1e6}) == {
        "a": pytest.approx(0.8), "b": 1.0, "c": 0.1}


def test_calibration_writes_the_contention_section(tmp_path):
    from hpcdl.plan.machine import load_machine

    m = {**calibration_measurements(), "class_rates_corun":
         {c: r * 0.9 for c, r in CLASS_RATES.items()}}
    m["contention"] = {c: 0.9 for c in CLASS_RATES}
    write_machine(machine_document(m), str(tmp_path))
    local = load_machine("local", str(tmp_path))
    assert local["contention.ranks"] == 2 and local.contention_factor("batch_norm", 2) == 0.9


def test_co_running_ranks_time_the_same_layers_at_once_in_separate_processes():
    """Real processes (spawn), two tiny layers: each rank returns its own sample of each."""
    from hpcdl.plan.class_rates import corun_samples

    layers = (("relu", "relu", (), (8, 8, 8), True),
              ("conv_3x3", "conv", (8, 8, 3, 1, 1, 1), (8, 8, 8), True))
    samples = corun_samples(batch=2, repeats=1, ranks=2, layers=layers, optimizer=False)
    assert sorted(s.op_class for s in samples) == ["conv_3x3", "conv_3x3", "relu", "relu"]
    assert all(s.seconds > 0 and s.work > 0 for s in samples)


def test_a_multi_thread_rank_sees_only_the_other_ranks_share_of_contention():
    vm = with_contention(machine(cores=48), {"conv_3x3": 0.6}, ranks=16)
    assert vm.contention_factor("conv_3x3", 1) == 1.0             # one rank, 48 threads
    assert vm.contention_factor("conv_3x3", 2) == pytest.approx(0.6)   # 24 busy others > 15
    vm8 = with_contention(machine(cores=8), {"conv_3x3": 0.6}, ranks=8)
    assert vm8.contention_factor("conv_3x3", 2) == pytest.approx(1 - 0.4 * 4 / 7)  # 2 x 4
