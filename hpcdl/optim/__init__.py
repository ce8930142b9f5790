"""Optimizers and learning-rate schedules: LARS with the MLPerf skip list, poly/step/cosine
schedules as pure functions of the step, the linear scaling rule, and a registry by name."""
from hpcdl.optim.factory import (
    OPTIMIZERS,
    apply_momentum_correction,
    create_optimizer,
    list_optimizers,
    set_learning_rate,
    step_parameters,
    steps_tensor_by_tensor,
)
from hpcdl.optim.lars import LARS, param_groups, trust_ratios
from hpcdl.optim.schedule import (
    SCHEDULES,
    CosineSchedule,
    PolySchedule,
    Schedule,
    StepSchedule,
    create_schedule,
    scaled_lr,
)
from hpcdl.optim.sharded import ShardedOptimizer

__all__ = [
    "LARS", "param_groups", "trust_ratios", "create_optimizer", "list_optimizers",
    "apply_momentum_correction", "set_learning_rate", "OPTIMIZERS", "Schedule", "PolySchedule",
    "StepSchedule", "CosineSchedule", "create_schedule", "scaled_lr", "SCHEDULES",
    "ShardedOptimizer", "step_parameters", "steps_tensor_by_tensor",
]
