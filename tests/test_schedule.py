"""Schedules: warm-up, poly power 2, step decay, cosine, linear scaling, momentum correction."""
import math

import pytest

from hpcdl.optim import create_schedule, scaled_lr

POLY = {"name": "poly", "base_lr": 29.0, "warmup_epochs": 5, "warmup_start_lr": 1.0,
        "end_lr": 0.0001, "power": 2.0}


def test_linear_scaling_rule():
    assert scaled_lr(0.1, 8192) == pytest.approx(3.2)
    assert scaled_lr(0.1, 256) == pytest.approx(0.1)
    assert scaled_lr(0.2, 1024, reference=512) == pytest.approx(0.4)
    with pytest.raises(ValueError, match="batch"):
        scaled_lr(0.1, 0)


def test_poly_warmup_is_linear_from_start_lr():
    s = create_schedule(POLY, steps_per_epoch=10, total_steps=900)
    assert s.warmup_steps == 50
    assert s(0) == pytest.approx(1.0)
    assert s(25) == pytest.approx(1.0 + 28.0 * 25 / 50)
    assert s(50) == pytest.approx(29.0)


def test_poly_decay_is_power_two_to_end_lr():
    s = create_schedule(POLY, steps_per_epoch=10, total_steps=900)
    t, T = 300, 850
    assert s(50 + t) == pytest.approx(0.0001 + (29.0 - 0.0001) * (1 - t / T) ** 2)
    assert s(900) == pytest.approx(0.0001)
    assert s(5000) == pytest.approx(0.0001)      # past the end: stays at end_lr


def test_warmup_steps_instead_of_epochs():
    cfg = dict(POLY, warmup_steps=7)
    del cfg["warmup_epochs"]
    s = create_schedule(cfg, steps_per_epoch=10, total_steps=100)
    assert s.warmup_steps == 7 and s(7) == pytest.approx(29.0)
    with pytest.raises(ValueError, match="not both"):
        create_schedule(dict(POLY, warmup_steps=7), steps_per_epoch=10, total_steps=100)


def test_goyal_step_schedule():
    cfg = {"name": "step", "base_lr": 3.2, "warmup_epochs": 5, "warmup_start_lr": 0.1,
           "milestones": [30, 60, 80], "gamma": 0.1}
    s = create_schedule(cfg, steps_per_epoch=100, total_steps=9000)
    assert s(0) == pytest.approx(0.1)
    assert s(500) == pytest.approx(3.2)
    assert s(2999) == pytest.approx(3.2)
    assert s(3000) == pytest.approx(0.32)
    assert s(6000) == pytest.approx(0.032)
    assert s(8999) == pytest.approx(0.0032)


def test_cosine_schedule():
    cfg = {"name": "cosine", "base_lr": 2.0, "warmup_steps": 10, "end_lr": 0.0}
    s = create_schedule(cfg, steps_per_epoch=10, total_steps=110)
    assert s(10) == pytest.approx(2.0)
    assert s(60) == pytest.approx(1.0)
    assert s(35) == pytest.approx(1.0 + math.cos(math.pi * 0.25))
    assert s(110) == pytest.approx(0.0, abs=1e-12)


def test_schedule_is_a_pure_function_of_step():
    s = create_schedule(POLY, steps_per_epoch=10, total_steps=900)
    forward = [s(i) for i in range(900)]
    backward = [s(i) for i in reversed(range(900))][::-1]
    assert forward == backward
    s2 = create_schedule(POLY, steps_per_epoch=10, total_steps=900)
    assert [s2(i) for i in range(400, 900)] == forward[400:]


def test_momentum_correction_is_rate_ratio():
    cfg = {"name": "step", "base_lr": 1.0, "warmup_epochs": 0, "milestones": [3], "gamma": 0.1}
    s = create_schedule(cfg, steps_per_epoch=10, total_steps=100)
    assert s.momentum_correction(0) == 1.0
    assert s.momentum_correction(5) == 1.0
    assert s.momentum_correction(30) == pytest.approx(0.1)
    warm = create_schedule(dict(POLY, warmup_start_lr=0.0), steps_per_epoch=10,
                           total_steps=900)
    assert warm.momentum_correction(1) == 1.0          # previous rate 0: no correction
    assert warm.momentum_correction(2) == pytest.approx(2.0)


@pytest.mark.parametrize("cfg, word", [
    ({"name": "exp", "base_lr": 1.0}, "exp"),
    ({"name": "poly", "base_lr": 1.0, "milestones": [30]}, "milestones"),
    ({"name": "poly"}, "base_lr"),
    ({"name": "poly", "base_lr": 1.0, "warmup_epochs": 50}, "warm-up"),
    ({"name": "poly", "base_lr": 1.0, "power": 0.0}, "power"),
    ({"name": "step", "base_lr": 1.0, "milestones": [60, 30]}, "milestones"),
    ({"name": "poly", "base_lr": 1.0, "decay_over": "warmup"}, "decay_over"),
    ({"name": "poly", "base_lr": 1.0, "warmup_power": 0}, "warmup_power"),
])
def test_bad_schedule_config_is_named(cfg, word):
    with pytest.raises(ValueError, match=word):
        create_schedule(cfg, steps_per_epoch=10, total_steps=100)


def caffe_poly_lr(it, *, base_lr, max_iter, power, warmup_iter, warmup_start_lr, warmup_power):
    """Intel Caffe / NVCaffe ``SGDSolver::GetLearningRate`` in float64: the warm-up branch
    while it < warmup_iter, else lr_policy "poly" over all of max_iter from iteration 0.
    warmup_power 1: Intel's GetWarmUpLR; 2: NVCaffe's rampup (alpha * alpha)."""
    if it < warmup_iter:
        alpha = it / warmup_iter
        return warmup_start_lr + (base_lr - warmup_start_lr) * alpha ** warmup_power
    return base_lr * (1.0 - min(it, max_iter) / max_iter) ** power


@pytest.mark.parametrize("warmup_power", [1.0, 2.0])
def test_caffe_poly_from_step_zero_matches_the_solver(warmup_power):
    """NVCaffe solver_32k.prototxt: base_lr 32, rampup_lr 1 over 400 of max_iter 4000, power 2."""
    cfg = {"name": "poly", "base_lr": 32.0, "warmup_steps": 400, "warmup_start_lr": 1.0,
           "power": 2.0, "decay_over": "all_steps", "warmup_power": warmup_power}
    s = create_schedule(cfg, steps_per_epoch=40, total_steps=4000)
    for it in (0, 1, 199, 399, 400, 401, 2000, 3999, 4000, 4500):
        assert s(it) == pytest.approx(caffe_poly_lr(
            it, base_lr=32.0, max_iter=4000, power=2.0, warmup_iter=400, warmup_start_lr=1.0,
            warmup_power=warmup_power), rel=1e-12, abs=1e-12)
    # The Caffe form drops at the end of warm-up: 32·(1 − 400/4000)² = 25.92.
    assert s(400) == pytest.approx(25.92)


def test_default_poly_still_decays_after_warmup_only():
    s = create_schedule({**POLY, "end_lr": 0.0}, steps_per_epoch=10, total_steps=900)
    assert s(50) == pytest.approx(29.0)
    assert s(475) == pytest.approx(29.0 * (1 - 425 / 850) ** 2)


def test_step_schedule_is_the_same_either_way_it_counts():
    """Goyal's milestones count from step 0 already; decay_over changes nothing for them."""
    step = {"name": "step", "base_lr": 3.2, "warmup_epochs": 5, "warmup_start_lr": 0.1,
            "milestones": [30, 60, 80]}
    a = create_schedule(step, 10, 900)
    b = create_schedule({**step, "decay_over": "all_steps"}, 10, 900)
    assert [a(i) for i in range(0, 900, 7)] == [b(i) for i in range(0, 900, 7)]
