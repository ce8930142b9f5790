"""A class's rate as a curve (larger GEMMs run nearer the
peak), calibrated from representative layers of several sizes: a convolution's over the GEMM
rows of one call, a memory pass's over its bytes. Arithmetic on synthetic rates; no timing
asserted."""
import math

import pytest
from plan_fixtures import calibration_measurements

from hpcdl.plan.calibrate import machine_document, write_machine
from hpcdl.plan.class_rates import (
    RATE_CURVE_CLASSES,
    REPRESENTATIVE,
    Sample,
    interpolate_rate,
    rate_curves,
)
from hpcdl.plan.layers import Layer
from hpcdl.plan.machine import MachineError, load_machine, parse_machine
from hpcdl.plan.model import layer_s

pytestmark = pytest.mark.usefixtures("isolated_plan_dirs")

CURVE = [[1e9, 40e9], [4e9, 80e9]]


def test_the_rate_is_log_log_linear_between_points_and_flat_outside():
    assert interpolate_rate(CURVE, 1e9) == pytest.approx(40e9)
    assert interpolate_rate(CURVE, 4e9) == pytest.approx(80e9)
    assert interpolate_rate(CURVE, 2e9) == pytest.approx(math.sqrt(40e9 * 80e9))
    assert interpolate_rate(CURVE, 1e6) == 40e9 and interpolate_rate(CURVE, 1e12) == 80e9


def test_curves_merge_samples_at_equal_x_and_sort_by_x():
    # a convolution's x is its GEMM rows: equal work at other rows is another point
    samples = [Sample("conv_1x1", 4e9, 0.05, rows=6272), Sample("conv_1x1", 1e9, 0.02, rows=392),
               Sample("conv_1x1", 1e9, 0.03, rows=392), Sample("conv_1x1", 1e9, 0.04, rows=128),
               Sample("pool", 1e6, 1e-3), Sample("relu", 2e6, 1e-4), Sample("relu", 1e6, 1e-4)]
    curves = rate_curves(samples, overhead=0.0)
    assert set(curves) == {"conv_1x1", "relu"}    # pool is not a curve class
    assert curves["conv_1x1"] == [[128, pytest.approx(25e9)], [392, pytest.approx(2e9 / 0.05)],
                                  [6272, pytest.approx(80e9)]]
    assert curves["relu"] == [[1e6, pytest.approx(1e10)], [2e6, pytest.approx(2e10)]]


def test_a_convolution_sample_carries_its_gemm_rows():
    from hpcdl.plan.class_rates import ROWS_CURVE_CLASSES, curve_axis, measure_samples

    assert all(curve_axis(c) == "gemm_rows" for c in ROWS_CURVE_CLASSES)
    assert curve_axis("batch_norm") == "work"
    small = [r for r in REPRESENTATIVE if r[0] == "conv_1x1" and r[3][1:] == (4, 4)]
    (sample,) = measure_samples(batch=2, repeats=1, log=lambda _: None, layers=small,
                                optimizer=False)
    assert sample.rows == 2 * 4 * 4 and sample.curve_x() == 32


def test_every_curve_class_has_samples_at_two_or_more_places_on_its_axis():
    from hpcdl.plan.class_rates import ROWS_AXIS, build, curve_axis, layer_work
    from hpcdl.plan.layers import LINEAR_WEIGHTS, count_layers

    xs: dict[str, set] = {}
    for op_class, kind, args, shape, grad in REPRESENTATIVE:
        if op_class in RATE_CURVE_CLASSES:
            (layer,) = [la for la in count_layers(build(kind, args), 0, shape, grad)
                        if la.op_class == ("linear" if op_class == LINEAR_WEIGHTS else op_class)]
            x = 8 * layer.pixels if curve_axis(op_class) == ROWS_AXIS else layer_work(
                layer, 8, op_class)
            assert x > 0, (op_class, args)
            xs.setdefault(op_class, set()).add(x)
    assert set(xs) == set(RATE_CURVE_CLASSES)
    assert all(len(x) >= 2 for x in xs.values()), xs
    assert min(xs["conv_1x1"]) == min(xs["conv_3x3"]) == 8 * 4 * 4   # the 4x4 stage


ROWS_CURVE = [[128, 40e9], [512, 80e9]]     # GEMM rows of one call -> FLOP/s


def calibrated(tmp_path):
    m = calibration_measurements()                       # 76.8 GFLOP/s core peak, 10 GB/s
    m["class_curves"] = {"conv_1x1": [[x, r] for x, r in ROWS_CURVE],
                         "batch_norm": [[w, r / 8] for w, r in CURVE]}
    write_machine(machine_document(m), str(tmp_path))
    return load_machine("local", str(tmp_path))


def test_calibration_writes_the_curves_and_a_layer_is_costed_on_them(tmp_path):
    local = calibrated(tmp_path)
    peak = 2400e6 * 32
    assert local.curves["conv_1x1"] == ((128, pytest.approx(40e9 / peak)),
                                        (512, pytest.approx(80e9 / peak)))
    assert local.curve_axes == {"conv_1x1": "gemm_rows", "batch_norm": "work"}
    # the same FLOPs at 16 and at 64 positions per image: 128 and 512 rows at batch 8
    small = Layer("s", "conv_1x1", macs=1e9 / 8 / 6, input_grad=True, pixels=16)
    large = Layer("l", "conv_1x1", macs=1e9 / 8 / 6, input_grad=True, pixels=64)
    overhead = local["compute.layer_overhead_s"]
    assert layer_s(local, small, 8, 2) - overhead == pytest.approx(1e9 / 40e9)
    assert layer_s(local, large, 8, 2) - overhead == pytest.approx(1e9 / 80e9)
    assert layer_s(local, large, 2, 2) - overhead == pytest.approx(0.25e9 / 40e9)  # 128 rows
    no_rows = Layer("n", "conv_1x1", macs=1e9 / 8 / 6)                 # no rows: the figure
    conv3 = Layer("c", "conv_3x3", macs=1e9 / 8 / 6, pixels=16)        # no curve: the figure
    assert layer_s(local, no_rows, 8, 2) - overhead == pytest.approx(1e9 / 3e10)
    assert layer_s(local, conv3, 8, 2) - overhead == pytest.approx(1e9 / 3e10)


def test_a_file_written_before_axes_reads_its_curves_over_work(tmp_path):
    doc = machine_document({**calibration_measurements(),
                            "class_curves": {"conv_1x1": [[w, r] for w, r in CURVE]}})
    del doc["rate_curves"]["conv_1x1"]["axis"]
    old = parse_machine(doc, "old.yaml")
    assert old.curve_axes == {"conv_1x1": "work"}
    layer = Layer("s", "conv_1x1", macs=1e9 / 8 / 6, input_grad=True, pixels=16)
    assert layer_s(old, layer, 8, 2) - old["compute.layer_overhead_s"] == pytest.approx(
        1e9 / 40e9)
    doc["rate_curves"]["conv_1x1"]["axis"] = "images"
    with pytest.raises(MachineError, match=r"rate_curves.conv_1x1.axis must be"):
        parse_machine(doc, "x.yaml")


def test_a_bad_curve_is_refused_by_name(tmp_path):
    doc = machine_document({**calibration_measurements(),
                            "class_curves": {"conv_1x1": [[4e9, 1e9], [1e9, 2e9]]}})
    with pytest.raises(MachineError, match=r"rate_curves.conv_1x1.points must be .*increasing"):
        parse_machine(doc, "x.yaml")
    doc["rate_curves"] = {"conv_9x9": {"points": [[1, 1]], "source": "s"}}
    with pytest.raises(MachineError, match=r"rate_curves.conv_9x9: unknown class"):
        parse_machine(doc, "x.yaml")
