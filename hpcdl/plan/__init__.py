"""The scaling planner: predict a data-parallel run from machine figures, every one with its
source (docs/planner.md): ``plan(load_machine(name), workload(model, size), PlanInputs(...))``.
"""
from hpcdl.plan.machine import Machine, MachineError, load_machine
from hpcdl.plan.model import Plan, PlanInputs, plan, sweep
from hpcdl.plan.workload import Workload, workload

__all__ = ["Machine", "MachineError", "load_machine", "Plan", "PlanInputs", "plan", "sweep",
           "Workload", "workload"]
