"""The planner's cost model (hpcdl/plan): α-β-γ formulas by hand, placement, overlap, machine
files, calibration fitting and bench-JSON parsing. No real ResNet-50 tensors: flops come from a
pre-filled cache (tests/conftest.py: isolated_plan_dirs)."""
import math
import os

import pytest
from plan_fixtures import parameter_elements

from hpcdl.plan.calibrate import fit_alpha_beta, machine_document, write_machine
from hpcdl.plan.layers import Layer
from hpcdl.plan.machine import (
    PACKAGE_MACHINES_DIR,
    REQUIRED_FIGURES,
    MachineError,
    load_machine,
    parse_machine,
)
from hpcdl.plan.model import (
    PlanInputs,
    default_sweep,
    gradient_buckets,
    hierarchical_allreduce_s,
    plan,
    rabenseifner_allreduce_s,
    ring_allreduce_s,
)
from hpcdl.plan.validate import measured_step
from hpcdl.plan.workload import Workload, workload

# ResNet-50's totals with a hand-made layer table of the same MACs (no real tensors): the stem,
# then the 1x1 and 3x3 convolutions and one memory-bound pass of each kind.
RESNET50_LAYERS = (
    Layer("conv1", "conv_large", macs=118_013_952, in_bytes=602_112, out_bytes=3_211_264,
          param_bytes=37_632, input_grad=False),
    Layer("bn1", "batch_norm", in_bytes=3_211_264, out_bytes=3_211_264, param_bytes=512),
    Layer("relu", "relu", in_bytes=3_211_264, out_bytes=3_211_264),
    Layer("maxpool", "pool", in_bytes=3_211_264, out_bytes=802_816),
    Layer("1x1", "conv_1x1", macs=2_000_000_000, in_bytes=802_816, out_bytes=802_816,
          param_bytes=4e7),
    Layer("3x3", "conv_3x3", macs=1_969_121_560, in_bytes=802_816, out_bytes=802_816,
          param_bytes=5e7),
    Layer("add", "add", in_bytes=802_816, out_bytes=802_816),
    Layer("fc", "linear", macs=2_048_744, in_bytes=8192, out_bytes=4000, param_bytes=8_196_000),
)
RESNET50 = Workload("resnet50", 224, 4_089_184_256, 25_557_032, "test", RESNET50_LAYERS,
                    parameter_elements=parameter_elements("resnet50"))
ALPHA, BETA, GAMMA = 1e-6, 1e-9, 2e-10
N = 1e6

pytestmark = pytest.mark.usefixtures("isolated_plan_dirs")


def small_machine(cores=2, ranks_per_node=1):
    """A 2-core single node, like the development VM, with round figures."""
    def fig(v):
        return {"value": v, "source": "test"}
    return parse_machine({
        "name": "vm",
        "node": {"sockets": fig(1), "cores_per_socket": fig(cores), "frequency_hz": fig(2e9),
                 "flops_per_cycle_per_core": fig(32), "sustained_fraction": fig(0.25),
                 "memory_bandwidth_Bps": fig(2e10), "core_stream_Bps": fig(1e10),
                 "ranks_per_node": fig(ranks_per_node)},
        "network": {"latency_s": fig(1e-6), "bandwidth_Bps": fig(1e9)},
        "intra_node": {"latency_s": fig(5e-7), "bandwidth_Bps": fig(5e9)},
        "data": {"decode_images_per_s_per_core": fig(500), "loader_cores_per_node": fig(1)},
    }, "vm.yaml")


# --------------------------------------------------------------------------- α-β-γ by hand
def test_ring_matches_hand_computed_value():
    # 2·3·1e-6 + 2·3/4·1e6·1e-9 + 3/4·1e6·2e-10
    assert ring_allreduce_s(4, N, ALPHA, BETA, GAMMA) == pytest.approx(6e-6 + 1.5e-3 + 1.5e-4)


def test_rabenseifner_power_of_two_matches_hand_computed_value():
    # 2·log2(8)·α + 2·7/8·nβ + 7/8·nγ
    assert rabenseifner_allreduce_s(8, N, ALPHA, BETA, GAMMA) == pytest.approx(
        6e-6 + 1.75e-3 + 1.75e-4)


def test_rabenseifner_non_power_of_two_adds_the_fold_step():
    # p=6 -> 4 ranks of recursive halving/doubling + fold in/out: 2α + 2nβ + nγ
    expected = (4e-6 + 1.5e-3 + 1.5e-4) + (2e-6 + 2e-3 + 2e-4)
    assert rabenseifner_allreduce_s(6, N, ALPHA, BETA, GAMMA) == pytest.approx(expected)


def test_hierarchical_matches_hand_computed_value():
    # 4 nodes x 2 ranks: intra RS + inter ring on n (slices of n/2 reduced) + intra AG
    a_i, b_i, g = 5e-7, 2e-10, 1e-10
    intra_rs = a_i + 0.5 * N * (b_i + g)
    inter = 6 * ALPHA + 1.5 * N * BETA + 0.75 * (N / 2) * g
    intra_ag = a_i + 0.5 * N * b_i
    assert hierarchical_allreduce_s(4, 2, N, ALPHA, BETA, a_i, b_i, g) == pytest.approx(
        intra_rs + inter + intra_ag)


def test_hierarchical_with_one_rank_per_node_is_the_ring_across_nodes():
    assert hierarchical_allreduce_s(8, 1, N, ALPHA, BETA, 5e-7, 2e-10, GAMMA) == pytest.approx(
        ring_allreduce_s(8, N, ALPHA, BETA, GAMMA))


@pytest.mark.parametrize("cost", [
    lambda: ring_allreduce_s(1, N, ALPHA, BETA, GAMMA),
    lambda: rabenseifner_allreduce_s(1, N, ALPHA, BETA, GAMMA),
    lambda: hierarchical_allreduce_s(1, 1, N, ALPHA, BETA, 5e-7, 2e-10, GAMMA),
])
def test_one_rank_communicates_nothing(cost):
    assert cost() == 0.0


def test_buckets_fill_in_reverse_order_up_to_the_mib_size_with_a_last_mib_of_first_layers():
    # registration order: a 0.25 MiB stem, a 0.5 MiB layer, then three of 3 MiB (fp32 bytes)
    mib = 2**20 // 4
    work = Workload("hand", 32, 1e6, 0, "test", parameter_elements=(
        mib // 4, mib // 2, 3 * mib, 3 * mib, 3 * mib))
    assert gradient_buckets(work, 4, 8) == [6 * 2**20, 3 * 2**20, 0.75 * 2**20]
    assert gradient_buckets(work, 2, 8) == [4.5 * 2**20, 0.375 * 2**20]   # bf16: 2 B each
    assert gradient_buckets(Workload("one", 32, 1e6, 10, "test"), 4, 25) == [40]


# --------------------------------------------------------------------------- the iteration
def knl_inputs(procs, **kw):
    return PlanInputs(global_batch=32768, procs=procs, procs_per_node=1, **kw)


def test_more_procs_means_less_compute_per_iteration():
    knl = load_machine("knl")
    computes = [plan(knl, RESNET50, knl_inputs(p)).compute_s for p in default_sweep(2048, 32768)]
    assert all(a > b for a, b in zip(computes, computes[1:], strict=False))


def test_legacy_file_uses_three_forwards_of_two_flops_per_mac_at_one_fraction():
    vm = small_machine()    # no compute section: the single sustained fraction
    p = plan(vm, RESNET50, PlanInputs(global_batch=16, procs=2, procs_per_node=2))
    expected = 8 * 6 * RESNET50.forward_macs / (2 * 2e9 * 32 * 0.25 / 2)
    assert p.compute_s == pytest.approx(expected, rel=1e-6)
    assert any("recalibrate" in n for n in p.notes)


def test_ranks_beyond_the_cores_slow_compute_proportionally():
    vm = small_machine(cores=2)
    two = plan(vm, RESNET50, PlanInputs(global_batch=16, procs=2, procs_per_node=2))
    four = plan(vm, RESNET50, PlanInputs(global_batch=32, procs=4, procs_per_node=4))
    assert four.compute_s == pytest.approx(2 * two.compute_s)
    assert any("share" in n for n in four.notes)


def test_overlap_hides_at_most_backward_and_never_the_last_bucket():
    knl = load_machine("knl")
    p = plan(knl, RESNET50, knl_inputs(2048))
    assert 0 < p.comm_exposed_s < p.comm_s
    assert p.comm_hidden_s <= 2 / 3 * p.compute_s + 1e-12
    flat = plan(knl, RESNET50, knl_inputs(2048, overlap=False))
    assert flat.comm_exposed_s == pytest.approx(flat.comm_s)
    assert flat.iteration_s > p.iteration_s


def test_single_node_without_a_free_core_hides_no_communication():
    p = plan(small_machine(cores=2), RESNET50,
             PlanInputs(global_batch=16, procs=2, procs_per_node=2, synthetic_data=True))
    assert p.comm_exposed_s == pytest.approx(p.comm_s) and p.comm_s > 0


def test_totals_follow_from_the_iteration():
    p = plan(load_machine("knl"), RESNET50, knl_inputs(2048, epochs=90))
    assert p.iterations_per_epoch == 1_281_167 // 32768
    assert p.total_s == pytest.approx(90 * p.iterations_per_epoch * p.iteration_s)
    assert p.images_per_s == pytest.approx(32768 / p.iteration_s)
    assert 0 < p.scaling_efficiency <= 1


def test_one_rank_is_perfectly_efficient():
    assert plan(load_machine("knl"), RESNET50, knl_inputs(1)).scaling_efficiency == 1.0


def test_every_algorithm_costs_communication():
    skx = load_machine("skx")
    for algorithm in ("ring", "rabenseifner", "hierarchical"):
        assert plan(skx, RESNET50, PlanInputs(32768, 2048, 2, allreduce=algorithm)).comm_s > 0


def test_hierarchical_and_rabenseifner_cut_the_latency_term_of_a_small_allreduce():
    # 100k parameters on 2,048 ranks, 24 per node: the ring's 2(p-1) alpha dominates.
    small = Workload("tiny", 224, 1e6, 100_000, "test",
                     (Layer("conv", "conv_3x3", macs=1e6, in_bytes=1e4, out_bytes=1e4),))
    skx = load_machine("skx")
    times = {a: plan(skx, small, PlanInputs(32768, 2048, 24, allreduce=a)).comm_s
             for a in ("ring", "rabenseifner", "hierarchical")}
    assert times["hierarchical"] < times["ring"] / 5
    assert times["rabenseifner"] < times["ring"] / 5


def test_batch_smaller_than_the_ranks_is_a_clear_error():
    with pytest.raises(ValueError, match="smaller than 4096 ranks"):
        plan(load_machine("knl"), RESNET50, PlanInputs(2048, 4096, 1))


def test_unknown_algorithm_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown allreduce algorithm 'tree'"):
        plan(load_machine("knl"), RESNET50, PlanInputs(32768, 64, 1, allreduce="tree"))


# --------------------------------------------------------------------------- machine files
@pytest.mark.parametrize("name", sorted(f[:-5] for f in os.listdir(PACKAGE_MACHINES_DIR)
                                        if f.endswith(".yaml")))
def test_shipped_machine_files_load_and_every_figure_has_a_source(name):
    machine = load_machine(name)
    for section, keys in REQUIRED_FIGURES.items():
        for key in keys:
            assert machine.figures[f"{section}.{key}"].source.strip()
            assert machine[f"{section}.{key}"] > 0


def test_knl_peak_is_68_cores_at_1_4_ghz_times_64():
    assert load_machine("knl").peak_flops_per_node == pytest.approx(68 * 1.4e9 * 64)


def test_a_figure_without_source_is_rejected_by_name(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(open(os.path.join(PACKAGE_MACHINES_DIR, "knl.yaml")).read().replace(
        'source: "Intel ARK, Xeon Phi 7250: 68 cores (4 hardware threads each)"', "note: x"))
    with pytest.raises(MachineError, match="node.cores_per_socket"):
        load_machine(str(bad))


def test_unknown_machine_names_the_known_ones():
    with pytest.raises(MachineError, match=r"unknown machine 'cray'.*knl"):
        load_machine("cray")


def test_machines_dir_comes_first(tmp_path):
    text = open(os.path.join(PACKAGE_MACHINES_DIR, "knl.yaml")).read()
    (tmp_path / "knl.yaml").write_text(text.replace("value: 68", "value: 64"))
    assert load_machine("knl", str(tmp_path)).cores_per_node == 64
    assert load_machine("knl").cores_per_node == 68


# --------------------------------------------------------------------------- workload
def test_workload_sums_the_layer_table_to_the_models_flop_count():
    w = workload("resnet50", 224)
    assert w.forward_macs == RESNET50.forward_macs and w.parameters == RESNET50.parameters
    assert w.train_flops_per_image == 6 * RESNET50.forward_macs


def test_workload_counts_with_hpcdl_models_once_then_caches(tmp_path):
    cache = str(tmp_path / "layers.json")
    first = workload("resnet_small", 32, cache_path=cache)
    assert first.forward_macs > 0 and first.parameters > 0
    assert "cached" in workload("resnet_small", 32, cache_path=cache).source


def test_unknown_model_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="unknown model 'vgg99'"):
        workload("vgg99", 224, cache_path=str(tmp_path / "f.json"))


# --------------------------------------------------------------------------- calibration
def test_alpha_beta_fit_recovers_the_line():
    alpha, beta, gamma = 3e-6, 2e-10, 1e-10
    records = [{"backend": "mpi", "ranks": 2, "bytes": n,
                "time_s": 2 * alpha + n * beta + n / 2 * gamma}
               for n in (1 << 10, 1 << 16, 1 << 20, 1 << 24)]
    records.append({"backend": "ring", "ranks": 2, "bytes": 1 << 20, "time_s": 9.0})
    records += [{"backend": "default", "ranks": 2, "bytes": n, "time_s": 5.0}
                for n in (1 << 10, 1 << 20)]   # another backend's line is never mixed in
    fit = fit_alpha_beta(records, gamma)
    assert fit["alpha_s"] == pytest.approx(alpha, rel=1e-3)
    assert fit["beta_s_per_byte"] == pytest.approx(beta, rel=1e-3)
    assert fit["points"] == 4


def test_alpha_beta_fit_needs_mpi_records():
    with pytest.raises(ValueError, match="need >= 2"):
        fit_alpha_beta([{"backend": "ring", "ranks": 2, "bytes": 1, "time_s": 1}], 1e-10)


def test_calibration_writes_a_machine_file_the_planner_loads(tmp_path):
    from plan_fixtures import calibration_measurements

    path = write_machine(machine_document(calibration_measurements()), str(tmp_path))
    local = load_machine("local", str(tmp_path))
    assert local.path == path and local.calibrated and local.has_class_rates
    assert local["compute.conv_3x3"] == pytest.approx(3e10 / (2.4e9 * 32))
    assert local["compute.batch_norm"] == pytest.approx(5e9 / 1e10)
    assert local["compute.layer_overhead_s"] == pytest.approx(3e-5)
    assert local["intra_node.bandwidth_Bps"] == pytest.approx(5e9)
    assert "measured" in local.figures["compute.conv_1x1"].source
    assert local.cpu["model_name"] == "Test CPU 9000" and local.cpu["capability"] == "AVX2"


# --------------------------------------------------------------------------- bench train JSON
def test_measured_step_reads_a_step_time():
    report = {"results": [{"ranks": 2, "batch_per_rank": 8, "step_s": 1.5, "compute_s": 1.2}]}
    assert measured_step(report, 2) == {"step_s": 1.5, "batch_per_rank": 8.0, "compute_s": 1.2}


def test_measured_step_derives_step_from_images_per_second_per_rank():
    report = {"results": [{"ranks": 4, "variant": "baseline", "batch": 8,
                           "images_per_s_per_rank": 2.0},
                          {"ranks": 4, "variant": "hpcdl", "batch": 8,
                           "images_per_s_per_rank": 4.0}]}
    assert measured_step(report, 4)["step_s"] == pytest.approx(2.0)


def test_measured_step_without_a_time_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot find a step time"):
        measured_step({"results": [{"ranks": 2, "loss": 1.0}]}, 2)


def test_default_sweep_is_powers_of_two_and_the_asked_count():
    assert default_sweep(48, 32768) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert math.log2(default_sweep(2048, 32768)[-1]) == 12


def test_validation_predicts_np4_on_two_cores_as_twice_the_compute_of_np2():
    from hpcdl.plan.validate import predict_step, validation_record

    vm = small_machine(cores=2)
    np2 = predict_step(vm, RESNET50, 2, batch=8, allreduce="ring", bucket_mb=25)
    np4 = predict_step(vm, RESNET50, 4, batch=8, allreduce="ring", bucket_mb=25)
    assert np4.compute_s == pytest.approx(2 * np2.compute_s)
    assert np2.data_s == 0 and np4.comm_exposed_s == pytest.approx(np4.comm_s)
    record = validation_record(np2, {"step_s": np2.iteration_s * 1.25, "compute_s": 1.0},
                               [np2.iteration_s, np2.iteration_s * 1.25, np2.iteration_s * 1.5])
    assert record["predicted_vs_measured"] == pytest.approx(0.8)
    assert record["measured_compute_s"] == 1.0
    assert record["ratio_range"] == pytest.approx([1 / 1.5, 1.0])
    assert record["spread"] == pytest.approx(0.5 / 1.25)
