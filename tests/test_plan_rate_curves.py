"""Issue 18, third pass: a class's rate as a curve over the work of one call (larger GEMMs run
nearer the peak), calibrated from representative layers of several sizes. Arithmetic on
synthetic rates; no timing asserted."""
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


def test_curves_merge_samples_of_equal_work_and_sort_by_work():
    samples = [Sample("conv_1x1", 4e9, 0.05), Sample("conv_1x1", 1e9, 0.02),
               Sample("conv_1x1", 1e9, 0.03), Sample("pool", 1e6, 1e-3)]
    curves = rate_curves(samples, overhead=0.0)
    assert set(curves) == {"conv_1x1"}            # pool is not a curve class
    assert curves["conv_1x1"] == [[1e9, pytest.approx(2e9 / 0.05)], [4e9, pytest.approx(80e9)]]


def test_every_curve_class_has_samples_of_at_least_two_sizes():
    from hpcdl.plan.class_rates import build, layer_work
    from hpcdl.plan.layers import LINEAR_WEIGHTS, count_layers

    works: dict[str, set] = {}
    for op_class, kind, args, shape, grad in REPRESENTATIVE:
        if op_class in RATE_CURVE_CLASSES:
            (layer,) = [la for la in count_layers(build(kind, args), 0, shape, grad)
                        if la.op_class == ("linear" if op_class == LINEAR_WEIGHTS else op_class)]
            works.setdefault(op_class, set()).add(layer_work(layer, 8, op_class))
    assert set(works) == set(RATE_CURVE_CLASSES)
    assert all(len(w) >= 2 for w in works.values()), works


def calibrated(tmp_path):
    m = calibration_measurements()                       # 76.8 GFLOP/s core peak, 10 GB/s
    m["class_curves"] = {"conv_1x1": [[w, r] for w, r in CURVE]}
    write_machine(machine_document(m), str(tmp_path))
    return load_machine("local", str(tmp_path))


def test_calibration_writes_the_curves_and_a_layer_is_costed_on_them(tmp_path):
    local = calibrated(tmp_path)
    peak = 2400e6 * 32
    assert local.curves["conv_1x1"] == ((1e9, pytest.approx(40e9 / peak)),
                                        (4e9, pytest.approx(80e9 / peak)))
    small = Layer("s", "conv_1x1", macs=1e9 / 8 / 6, input_grad=True)   # 1 GFLOP at batch 8
    large = Layer("l", "conv_1x1", macs=4e9 / 8 / 6, input_grad=True)   # 4 GFLOP
    overhead = local["compute.layer_overhead_s"]
    assert layer_s(local, small, 8, 2) - overhead == pytest.approx(1e9 / 40e9)
    assert layer_s(local, large, 8, 2) - overhead == pytest.approx(4e9 / 80e9)
    conv3 = Layer("c", "conv_3x3", macs=1e9 / 8 / 6)                   # no curve: the figure
    assert layer_s(local, conv3, 8, 2) - overhead == pytest.approx(1e9 / 3e10)


def test_a_bad_curve_is_refused_by_name(tmp_path):
    doc = machine_document({**calibration_measurements(),
                            "class_curves": {"conv_1x1": [[4e9, 1e9], [1e9, 2e9]]}})
    with pytest.raises(MachineError, match=r"rate_curves.conv_1x1.points must be .*increasing"):
        parse_machine(doc, "x.yaml")
    doc["rate_curves"] = {"conv_9x9": {"points": [[1, 1]], "source": "s"}}
    with pytest.raises(MachineError, match=r"rate_curves.conv_9x9: unknown class"):
        parse_machine(doc, "x.yaml")
