"""Learning-rate schedules as pure functions of the step, so a resumed run is exact.

- ``poly``: linear warm-up from ``warmup_start_lr`` to ``base_lr``, then polynomial decay
  lr = end_lr + (base_lr − end_lr)·(1 − t/T)^power, power 2 (You et al., arXiv:1709.05011 §4;
  the MLPerf ResNet-50 LARS reference);
- ``step``: warm-up, then base_lr·gamma^k after the k-th milestone epoch (Goyal et al.,
  arXiv:1706.02677: ×0.1 at epochs 30, 60, 80 after a 5-epoch gradual warm-up);
- ``cosine``: warm-up, then end_lr + (base_lr − end_lr)·(1 + cos(π·t/T))/2 (Loshchilov & Hutter).

Warm-up length is ``warmup_epochs`` (times steps_per_epoch) or ``warmup_steps``; t counts
steps after warm-up and T = total_steps − warm-up steps. The Caffe solvers' forms
(docs/recipes.md): ``decay_over: all_steps`` (t = step, T = total_steps, warm-up taken first:
Intel Caffe and NVCaffe ``GetLearningRate``) and ``warmup_power: 2`` (NVCaffe's ramp-up
rampup_lr + (base_lr − rampup_lr)·(step/W)², sgd_solver.cpp ``alpha * alpha``; 1 is linear).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

DECAY_OVER = ("after_warmup", "all_steps")

__all__ = ["Schedule", "PolySchedule", "StepSchedule", "CosineSchedule", "create_schedule",
           "scaled_lr", "SCHEDULES"]


def scaled_lr(base_lr: float, batch: int, reference: int = 256) -> float:
    """The linear scaling rule (Goyal et al., arXiv:1706.02677, §2.1): lr = base_lr·batch/256."""
    if batch <= 0 or reference <= 0:
        raise ValueError(f"scaled_lr: batch and reference must be > 0, got batch={batch}, "
                         f"reference={reference}")
    return base_lr * batch / reference


class Schedule:
    """lr(step) with linear warm-up; subclasses give the rate after warm-up in ``decay``."""

    def __init__(self, base_lr: float, total_steps: int, warmup_steps: int = 0,
                 warmup_start_lr: float = 0.0, end_lr: float = 0.0,
                 decay_over: str = "after_warmup", warmup_power: float = 1.0) -> None:
        if total_steps <= 0:
            raise ValueError(f"schedule: total_steps must be > 0, got {total_steps}")
        if not 0 <= warmup_steps <= total_steps:
            raise ValueError(f"schedule: warm-up of {warmup_steps} steps does not fit in "
                             f"total_steps={total_steps}")
        if base_lr < 0 or end_lr < 0 or warmup_start_lr < 0:
            raise ValueError(f"schedule: rates must be >= 0, got base_lr={base_lr}, "
                             f"end_lr={end_lr}, warmup_start_lr={warmup_start_lr}")
        if decay_over not in DECAY_OVER:
            raise ValueError(f"schedule: decay_over must be one of {DECAY_OVER}, got "
                             f"{decay_over!r}")
        if warmup_power <= 0:
            raise ValueError(f"schedule: warmup_power must be > 0, got {warmup_power}")
        self.decay_over = decay_over
        self.warmup_power = float(warmup_power)
        # Step the decay counts from: end of warm-up (hpcdl, MLPerf) or 0 (the Caffe solvers).
        self.decay_origin = int(warmup_steps) if decay_over == "after_warmup" else 0
        self.base_lr = float(base_lr)
        self.total_steps = int(total_steps)
        self.warmup_steps = int(warmup_steps)
        self.warmup_start_lr = float(warmup_start_lr)
        self.end_lr = float(end_lr)

    def __call__(self, step: int) -> float:
        if step < 0:
            raise ValueError(f"schedule: step must be >= 0, got {step}")
        if step < self.warmup_steps:
            # Gradual warm-up (Goyal et al. §2.2): linear from warmup_start_lr, reaching
            # base_lr at step == warmup_steps.
            frac = (step / self.warmup_steps) ** self.warmup_power
            return self.warmup_start_lr + (self.base_lr - self.warmup_start_lr) * frac
        decay_steps = self.total_steps - self.decay_origin
        t = min(step - self.decay_origin, decay_steps)
        return self.decay(t, decay_steps)

    def decay(self, t: int, decay_steps: int) -> float:
        raise NotImplementedError

    def momentum_correction(self, step: int) -> float:
        """lr(step)/lr(step−1): the factor for the momentum buffer before step ``step``
        (Goyal et al. §2.2, "momentum correction"); 1 at step 0 or after a zero rate."""
        if step <= 0:
            return 1.0
        previous = self(step - 1)
        return self(step) / previous if previous > 0 else 1.0

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


class PolySchedule(Schedule):
    """Polynomial decay to end_lr, power 2 in the papers (You et al. 2018; MLPerf LARS)."""

    def __init__(self, *args: Any, power: float = 2.0, **kw: Any) -> None:
        super().__init__(*args, **kw)
        if power <= 0:
            raise ValueError(f"poly schedule: power must be > 0, got {power}")
        self.power = float(power)

    def decay(self, t: int, decay_steps: int) -> float:
        if decay_steps == 0:
            return self.end_lr
        remaining = 1.0 - t / decay_steps
        return self.end_lr + (self.base_lr - self.end_lr) * remaining ** self.power


class StepSchedule(Schedule):
    """base_lr·gamma^k, k = milestones passed (Goyal et al.: ×0.1 at epochs 30, 60, 80).
    Milestones count steps from the start of training, not from the end of warm-up."""

    def __init__(self, *args: Any, milestone_steps: list[int], gamma: float = 0.1,
                 **kw: Any) -> None:
        super().__init__(*args, **kw)
        if sorted(milestone_steps) != list(milestone_steps):
            raise ValueError(f"step schedule: milestones must increase, got {milestone_steps}")
        self.milestone_steps = [int(m) for m in milestone_steps]
        self.gamma = float(gamma)

    def decay(self, t: int, decay_steps: int) -> float:
        step = t + self.decay_origin
        passed = sum(1 for m in self.milestone_steps if step >= m)
        return self.base_lr * self.gamma ** passed


class CosineSchedule(Schedule):
    """Half-cosine from base_lr to end_lr (Loshchilov & Hutter, arXiv:1608.03983, no restarts)."""

    def decay(self, t: int, decay_steps: int) -> float:
        if decay_steps == 0:
            return self.end_lr
        cosine = 0.5 * (1.0 + math.cos(math.pi * t / decay_steps))
        return self.end_lr + (self.base_lr - self.end_lr) * cosine


SCHEDULES = {"poly": PolySchedule, "step": StepSchedule, "cosine": CosineSchedule}

_COMMON_KEYS = {"name", "base_lr", "warmup_epochs", "warmup_steps", "warmup_start_lr", "end_lr",
                "decay_over", "warmup_power"}
#: recipe keys handed to the schedule's constructor as they are: a key the recipe leaves out
#: takes the constructor's default
_PASSED = {"warmup_start_lr": float, "end_lr": float, "decay_over": str, "warmup_power": float,
           "power": float, "gamma": float}
_KEYS = {"poly": _COMMON_KEYS | {"power"},
         "step": _COMMON_KEYS | {"milestones", "gamma"},
         "cosine": _COMMON_KEYS}


def _warmup_steps(cfg: Mapping[str, Any], steps_per_epoch: int) -> int:
    epochs, steps = cfg.get("warmup_epochs"), cfg.get("warmup_steps")
    if epochs is not None and steps is not None:
        raise ValueError(f"schedule: give warmup_epochs or warmup_steps, not both "
                         f"(got warmup_epochs={epochs}, warmup_steps={steps})")
    if steps is not None:
        return int(steps)
    return round(float(epochs or 0) * steps_per_epoch)


def create_schedule(cfg: Mapping[str, Any], steps_per_epoch: int, total_steps: int) -> Schedule:
    """A schedule from a recipe's ``schedule`` section (docs/architecture.md); epoch
    quantities become steps; a key the named schedule lacks is an error (a typo is not ignored)."""
    name = cfg.get("name")
    if name not in SCHEDULES:
        raise ValueError(f"schedule.name={name!r} is not one of {sorted(SCHEDULES)}")
    unknown = set(cfg) - _KEYS[name]
    if unknown:
        raise ValueError(f"schedule ({name}): unknown keys {sorted(unknown)}; "
                         f"known: {sorted(_KEYS[name])}")
    if "base_lr" not in cfg:
        raise ValueError(f"schedule ({name}): base_lr is missing")
    if steps_per_epoch <= 0:
        raise ValueError(f"schedule: steps_per_epoch must be > 0, got {steps_per_epoch}")
    options = {key: convert(cfg[key]) for key, convert in _PASSED.items() if key in cfg}
    if name == "step":
        options["milestone_steps"] = [round(float(e) * steps_per_epoch)
                                      for e in cfg.get("milestones", [])]
    return SCHEDULES[name](float(cfg["base_lr"]), int(total_steps),
                           warmup_steps=_warmup_steps(cfg, steps_per_epoch), **options)
