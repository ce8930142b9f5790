"""The scaling planner: predict a data-parallel run from machine figures (docs/planner.md).

``load_machine(name)`` reads ``hpcdl/plan/machines/NAME.yaml`` (every figure with its source),
``workload(model, image_size)`` gives forward MACs and parameters (cached), and
``plan(machine, workload, PlanInputs(...))`` returns the per-iteration breakdown and totals.
"""
from hpcdl.plan.machine import Machine, MachineError, load_machine
from hpcdl.plan.model import Plan, PlanInputs, plan, sweep
from hpcdl.plan.workload import Workload, workload

__all__ = ["Machine", "MachineError", "load_machine", "Plan", "PlanInputs", "plan", "sweep",
           "Workload", "workload"]
