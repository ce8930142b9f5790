"""The planner's per-operator-class compute term: the layer table of a model, the
class of each operator, the cost of each class, the calibration fit, and the CPU check of a
calibrated machine file. Models here are a few layers at 16-32 px (no real ResNet-50)."""
import json

import pytest
import torch
from plan_fixtures import CLASS_RATES, calibration_measurements
from torch import nn

from hpcdl.plan.calibrate import machine_document, write_machine
from hpcdl.plan.class_rates import (
    REPRESENTATIVE,
    Sample,
    build,
    class_fractions,
    fit_rates,
    layer_work,
)
from hpcdl.plan.cpu import cpu_mismatch, cpu_warning
from hpcdl.plan.layers import (
    LINEAR_WEIGHTS,
    OP_CLASSES,
    PASSES,
    Layer,
    class_totals,
    conv_class,
    count_layers,
    layer_table,
)
from hpcdl.plan.machine import MachineError, load_machine, parse_machine
from hpcdl.plan.model import PlanInputs, compute_by_class, plan, rank_memory_Bps
from hpcdl.plan.workload import Workload

pytestmark = pytest.mark.usefixtures("isolated_plan_dirs")


class TinyResidual(nn.Module):
    """stem conv -> BN -> ReLU -> max pool -> 1x1 -> 3x3 -> (+ identity) -> F.relu -> fc."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 7, stride=2, padding=3, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.pool = nn.MaxPool2d(3, stride=2, padding=1)
        self.reduce = nn.Conv2d(8, 6, 1, bias=False)
        self.conv = nn.Conv2d(6, 8, 3, padding=1, bias=False)
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.relu(self.bn(self.stem(x))))
        out = torch.nn.functional.relu(self.conv(self.reduce(x)) + x)
        return self.fc(out.mean(dim=(2, 3)))


class TwoTower(nn.Module):
    """The two-tower AlexNet's pieces: a grouped convolution, LRN, dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 16, 5, padding=2, groups=2)
        self.lrn = nn.LocalResponseNorm(5)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.lrn(self.conv(x)))


# --------------------------------------------------------------------------- classes
@pytest.mark.parametrize(("kernel", "cin", "groups", "expected"), [
    ((7, 7), 3, 1, "conv_large"), ((11, 11), 3, 1, "conv_large"), ((5, 5), 64, 1, "conv_large"),
    ((3, 3), 3, 1, "conv_large"), ((1, 1), 256, 1, "conv_1x1"), ((3, 3), 64, 1, "conv_3x3"),
    ((3, 3), 192, 2, "conv_grouped"), ((5, 5), 48, 2, "conv_grouped")])
def test_convolutions_are_classed_by_shape(kernel, cin, groups, expected):
    assert conv_class(kernel, cin, groups) == expected


# --------------------------------------------------------------------------- layer table
def test_layer_table_records_every_operator_with_its_class_and_work():
    layers = count_layers(TinyResidual(), 32)
    classes = [la.op_class for la in layers]
    assert classes == ["conv_large", "batch_norm", "relu", "pool", "conv_1x1", "conv_3x3",
                       "add", "relu", "linear"]
    stem, bn, _, pool, reduce, conv3, add, _, fc = layers
    assert stem.macs == 8 * 16 * 16 * 3 * 7 * 7          # out elements x cin x k x k
    assert stem.input_grad is False and conv3.input_grad is True   # the image needs no grad
    assert stem.train_flops == 2 * 2 * stem.macs and conv3.train_flops == 3 * 2 * conv3.macs
    assert bn.out_bytes == 8 * 16 * 16 * 4 and pool.in_bytes == bn.out_bytes
    assert pool.out_bytes == 8 * 8 * 8 * 4
    assert reduce.macs == 6 * 8 * 8 * 8 and conv3.macs == 8 * 8 * 8 * 6 * 9
    assert add.out_bytes == 8 * 8 * 8 * 4                 # caught outside any module
    assert fc.macs == 10 * 8 and fc.param_bytes == (8 * 10 + 10) * 4
    # a convolution's GEMM rows per image are its output positions; other layers have none
    assert (stem.pixels, reduce.pixels, conv3.pixels) == (16 * 16, 8 * 8, 8 * 8)
    assert bn.pixels == fc.pixels == add.pixels == 0


def test_grouped_convolution_lrn_and_dropout_are_handled_generically():
    layers = count_layers(TwoTower(), 0, input_shape=(8, 12, 12), input_requires_grad=True)
    assert [la.op_class for la in layers] == ["conv_grouped", "lrn", "dropout"]
    conv = layers[0]
    assert conv.macs == 16 * 12 * 12 * (8 // 2) * 25       # a group sees cin / groups
    assert conv.input_grad is True
    assert layers[1].memory_bytes() == PASSES["lrn"][1] * 16 * 12 * 12 * 4


@pytest.mark.parametrize(("model", "expected"), [
    ("alexnet_bvlc", {"conv_large", "conv_grouped", "conv_3x3", "lrn", "linear", "dropout"}),
    ("alexnet_bn_nvcaffe", {"conv_large", "conv_grouped", "conv_3x3", "batch_norm", "linear"})])
def test_the_two_tower_alexnets_cost_their_grouped_convolutions_and_lrn(model, expected,
                                                                     tmp_path):
    layers = layer_table(model, 227, str(tmp_path / "layers.json"))
    assert expected <= {la.op_class for la in layers}
    grouped = [la for la in layers if la.op_class == "conv_grouped"]
    assert len(grouped) == 3 and all(la.macs > 0 for la in grouped)


def test_class_totals_sum_flops_and_bytes_per_class():
    layers = count_layers(TinyResidual(), 32)
    totals = class_totals(layers)
    assert totals["relu"]["layers"] == 2
    assert totals["conv_3x3"]["train_flops"] == layers[5].train_flops
    assert totals["batch_norm"]["bytes"] == 8 * layers[1].out_bytes


def test_layer_table_is_counted_once_then_read_from_the_cache(tmp_path, monkeypatch):
    from hpcdl.plan import layers as layers_module

    cache = tmp_path / "layers.json"
    monkeypatch.setattr(layers_module, "_MEMO", {})  # not counted earlier in this process
    first = layer_table("resnet_small", 16, str(cache))
    assert "resnet_small@16" in json.loads(cache.read_text())
    monkeypatch.setattr(layers_module, "_MEMO", {})
    monkeypatch.setattr(layers_module, "count_layers",
                        lambda *a, **k: pytest.fail("recounted despite the cache"))
    assert layer_table("resnet_small", 16, str(cache)) == first
    assert {la.op_class for la in first} >= {"conv_large", "conv_3x3", "batch_norm", "add"}


def test_tables_cached_before_gemm_rows_are_not_read(tmp_path, monkeypatch):
    # a v1 record (no 'pixels') would cost every convolution without its rows
    from hpcdl.plan import layers as layers_module

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    (tmp_path / "hpcdl").mkdir()
    (tmp_path / "hpcdl" / "layers.json").write_text(json.dumps(
        {"resnet_small@16": [{"name": "x", "op_class": "conv_3x3", "macs": 1.0}]}))
    monkeypatch.setattr(layers_module, "_MEMO", {})
    table = layer_table("resnet_small", 16)
    assert len(table) > 1 and any(la.pixels > 0 for la in table)
    assert layers_module.layers_cache_path() == str(tmp_path / "hpcdl" / "layers-v2.json")


# --------------------------------------------------------------------------- per-class cost
def class_machine(cores=2, overhead=0.0):
    def fig(v):
        return {"value": v, "source": "test"}
    fractions = {c: 0.5 for c in OP_CLASSES}
    fractions["conv_3x3"] = 0.25
    return parse_machine({
        "name": "vm",
        "node": {"sockets": fig(1), "cores_per_socket": fig(cores), "frequency_hz": fig(2e9),
                 "flops_per_cycle_per_core": fig(32), "memory_bandwidth_Bps": fig(2e10),
                 "core_stream_Bps": fig(1e10), "ranks_per_node": fig(1)},
        "compute": {**{c: fig(v) for c, v in fractions.items()},
                    "layer_overhead_s": fig(overhead) if overhead else fig(1e-30)},
        "network": {"latency_s": fig(1e-6), "bandwidth_Bps": fig(1e9)},
        "intra_node": {"latency_s": fig(5e-7), "bandwidth_Bps": fig(5e9)},
        "data": {"decode_images_per_s_per_core": fig(500), "loader_cores_per_node": fig(1)},
    }, "vm.yaml")


CONV = Layer("c", "conv_3x3", macs=1e9, in_bytes=1e6, out_bytes=1e6, param_bytes=1e6)
BN = Layer("b", "batch_norm", in_bytes=1e6, out_bytes=1e6)
FC = Layer("f", "linear", macs=1e6, param_bytes=1e8)


def work_of(*layers):
    return Workload("hand", 32, sum(la.macs for la in layers), 1000, "test", tuple(layers))


def test_a_convolution_costs_its_flops_at_its_class_fraction_of_the_rank_peak():
    vm = class_machine()
    seconds = compute_by_class(vm, work_of(CONV), batch_per_rank=4, procs_per_node=2)
    # 4 images x 6 GFLOP / (0.25 x 64 GFLOP/s per core x 1 core per rank)
    assert seconds["conv_3x3"] == pytest.approx(4 * 6e9 / (0.25 * 64e9))


def test_a_memory_pass_costs_its_bytes_at_its_fraction_of_the_rank_stream():
    vm = class_machine()
    seconds = compute_by_class(vm, work_of(BN), batch_per_rank=4, procs_per_node=1)
    rank_bw = rank_memory_Bps(vm, 1)
    assert rank_bw == pytest.approx(2e10)          # 2 cores x 10 GB/s capped by the node's 20
    assert seconds["batch_norm"] == pytest.approx(4 * 8 * 1e6 / (0.5 * rank_bw))


def test_a_small_batch_linear_layer_is_bound_by_its_weight_traffic():
    vm = class_machine()
    seconds = compute_by_class(vm, work_of(FC), batch_per_rank=2, procs_per_node=1)
    assert seconds["linear"] == pytest.approx(3 * 1e8 / rank_memory_Bps(vm, 1))


def test_every_layer_pays_the_overhead_and_the_plan_reports_classes():
    vm = class_machine(overhead=1e-3)
    bare = class_machine()
    work = work_of(CONV, BN, BN)
    p = plan(vm, work, PlanInputs(global_batch=4, procs=1, procs_per_node=1))
    q = plan(bare, work, PlanInputs(global_batch=4, procs=1, procs_per_node=1))
    assert p.compute_s - q.compute_s == pytest.approx(3e-3)
    assert set(p.compute_by_class) == {"conv_3x3", "batch_norm"}
    assert p.compute_s == pytest.approx(sum(p.compute_by_class.values()))


def test_ranks_beyond_the_cores_slow_every_class_proportionally():
    vm = class_machine(overhead=1e-3)
    work = work_of(CONV, BN)
    two = compute_by_class(vm, work, 4, procs_per_node=2)
    four = compute_by_class(vm, work, 4, procs_per_node=4)
    assert four["conv_3x3"] == pytest.approx(2 * two["conv_3x3"])
    assert four["batch_norm"] > two["batch_norm"]


def test_a_class_rated_machine_needs_the_layer_table():
    with pytest.raises(ValueError, match="layer table, and it cannot be counted"):
        plan(class_machine(), Workload("m", 32, 1e9, 10, "test"),
             PlanInputs(global_batch=2, procs=1, procs_per_node=1))


def test_an_incomplete_compute_section_is_rejected_by_name(tmp_path):
    doc = machine_document(calibration_measurements())
    del doc["compute"]["lrn"]
    with pytest.raises(MachineError, match=r"compute is missing \['lrn'\]"):
        parse_machine(doc, "x.yaml")


# --------------------------------------------------------------------------- calibration
def test_fit_recovers_each_class_rate_from_synthetic_timings():
    overhead = 2e-5
    truth = {c: r * (1 + i / 10) for i, (c, r) in enumerate(CLASS_RATES.items())}
    samples = [Sample(c, w, overhead + w / rate)
               for c, rate in truth.items() for w in (1e8, 3e8, 7e8)]
    fitted = fit_rates(samples, overhead)
    for c in OP_CLASSES:
        assert fitted[c] == pytest.approx(truth[c], rel=1e-9)


def test_fit_names_the_classes_without_samples():
    with pytest.raises(ValueError, match="no samples of .*lrn"):
        fit_rates([Sample(c, 1.0, 1.0) for c in OP_CLASSES if c != "lrn"], 0.0)


def test_fractions_are_over_the_core_peak_or_the_core_stream():
    fractions = class_fractions({"conv_1x1": 4e10, "relu": 5e9}, core_peak_flops=8e10,
                                core_stream_Bps=1e10)
    assert fractions == {"conv_1x1": 0.5, "relu": 0.5}


def test_every_representative_layer_is_of_its_class():
    for op_class, kind, args, shape, input_grad in REPRESENTATIVE:
        layers = count_layers(build(kind, args), 0, shape, input_grad)
        layer_class = "linear" if op_class == LINEAR_WEIGHTS else op_class
        assert [la.op_class for la in layers] == [layer_class], (kind, args)
        assert layer_work(layers[0], 2, op_class) > 0


def test_representative_layers_time_after_their_table_is_counted():
    """Calibration counts a layer (on an empty batch) and then times it on a real one."""
    from hpcdl.plan.class_rates import time_layer

    for op_class, kind, args, shape, input_grad in REPRESENTATIVE:
        if op_class in ("add", "relu", "batch_norm"):
            module = build(kind, args)
            count_layers(module, 0, shape, input_grad)
            assert time_layer(module, shape, 2, input_grad, repeats=1) > 0
    assert {r[0] for r in REPRESENTATIVE} == {*OP_CLASSES, LINEAR_WEIGHTS}


# --------------------------------------------------------------------------- CPU check
HERE = {"model_name": "AMD EPYC", "capability": "AVX2", "flags": ["avx2", "fma"]}


def test_the_same_cpu_is_no_mismatch():
    assert cpu_mismatch(HERE, dict(HERE)) is None


def test_another_cpu_is_named_with_what_differs():
    zen4 = {"model_name": "AMD EPYC 9R14", "capability": "AVX512",
            "flags": ["avx2", "fma", "avx512f", "avx512_bf16"]}
    diff = cpu_mismatch(HERE, zen4)
    assert "'AMD EPYC' vs 'AMD EPYC 9R14'" in diff and "'AVX2' vs 'AVX512'" in diff
    assert "+avx512_bf16" in diff and "+avx512f" in diff


def test_a_calibrated_file_from_another_cpu_warns_to_recalibrate(tmp_path, monkeypatch):
    other = {"model_name": "Made-up CPU 1", "capability": "AVX512", "flags": ["avx512f"]}
    write_machine(machine_document(calibration_measurements(cpu=other)), str(tmp_path))
    monkeypatch.setattr("hpcdl.plan.cpu.cpu_identity", lambda: dict(HERE))
    warning = cpu_warning(load_machine("local", str(tmp_path)))
    assert "Made-up CPU 1" in warning and "hpcdl plan --calibrate" in warning
    monkeypatch.setattr("hpcdl.plan.cpu.cpu_identity", lambda: dict(other))
    assert cpu_warning(load_machine("local", str(tmp_path))) is None


def test_spec_files_are_never_checked_against_this_cpu():
    assert cpu_warning(load_machine("skx")) is None and load_machine("knl").cpu


def test_the_shipped_local_file_records_its_cpu():
    local = load_machine("local")
    assert local.calibrated and local.has_class_rates
    assert local.cpu["model_name"] and local.cpu["capability"]
