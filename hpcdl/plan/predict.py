"""``hpcdl plan``: the run to predict from a recipe (read by hpcdl.train.config, the trainer's
own reader; default DEFAULT_RECIPE) and flags over it, then the breakdown, the sweep, the
optional simulation, plot and JSON.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

from hpcdl.errors import BadInputError
from hpcdl.train.config import Config, RecipeError, load_recipe, resolve_recipe

DEFAULT_RECIPE = "resnet50_lars_32k"
#: Where a recipe without a ``plan`` section is planned.
DEFAULT_MACHINE, DEFAULT_PROCS = "knl", 2048
#: bytes per gradient element on the wire
WIRE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: what --wire-dtype and comm.wire_dtype take: a dtype, or auto (the run's rule:
#: hpcdl.train.precision.planned_wire_dtype)
WIRE_DTYPES = ("auto", *WIRE_BYTES)
#: What a flag of the same name overrides.
RUN_KEYS = ("model", "image_size", "global_batch", "epochs", "bucket_mb", "wire_dtype",
            "local_steps", "hierarchical_local", "compression_ratio", "powersgd_rank",
            "sync_warmup_steps", "machine", "procs", "precision")


def recipe_values(config: Config, dataset_size: int) -> dict[str, Any]:
    """The planner's inputs from a validated recipe; ``comm.algorithm``'s keys count only
    for the algorithm that reads them, as in the trainer (hpcdl/comm/policy.py)."""
    comm = config.comm
    local = comm.algorithm in ("local_sgd", "hierarchical_local_sgd")
    values = {
        "machine": config.plan.get("machine", DEFAULT_MACHINE),
        "procs": config.plan.get("procs", DEFAULT_PROCS),
        "model": config.model["name"], "image_size": config.data.image_size,
        "global_batch": config.batch.global_, "epochs": config.epochs,
        "bucket_mb": comm.bucket_mb, "wire_dtype": comm.wire_dtype,
        "precision": config.train.precision, "backend": comm.backend,
        "shard_update": comm.shard_update,
        "local_steps": comm.local_steps if local else 1,
        "hierarchical_local": comm.algorithm == "hierarchical_local_sgd",
        "powersgd_rank": comm.powersgd_rank if comm.algorithm == "powersgd" else None,
        "sync_warmup_steps": comm.sync_warmup_steps if comm.algorithm != "sync" else 0,
        "compression_ratio": None}
    if config.train.total_steps:
        # A source's max_iter is what the run trains, in the epochs the planner and the
        # trainer both count: dataset // batch steps each (the last partial batch dropped).
        # NVCaffe's 4,000 steps at 32K are 102.56 such epochs (102.31 passes over the data).
        values["epochs"] = config.train.total_steps / max(1, dataset_size
                                                          // config.batch.global_)
    return values


def read_recipe(path: str) -> Config:
    """:func:`load_recipe`, every error naming the file (the ``comm`` section's own checks
    name only the key)."""
    path = resolve_recipe(path)
    try:
        return load_recipe(path)
    except RecipeError as exc:
        if path in str(exc):
            raise
        raise RecipeError(f"{path}: {exc}") from None


def resolve(args: argparse.Namespace) -> dict[str, Any]:
    """Flags over the recipe (default DEFAULT_RECIPE); the compression ratio from PowerSGD's
    rank where none is given."""
    values = recipe_values(read_recipe(args.recipe or DEFAULT_RECIPE), args.dataset_size)
    values.update({k: getattr(args, k) for k in RUN_KEYS if getattr(args, k, None) is not None})
    if values["compression_ratio"] is None:
        values["compression_ratio"] = 1.0
        if values["powersgd_rank"] is not None:
            from hpcdl.plan.workload import powersgd_compression_ratio

            try:
                values["compression_ratio"] = powersgd_compression_ratio(
                    values["model"], int(values["powersgd_rank"]))
            except ValueError as exc:
                raise BadInputError(str(exc)) from exc
    if values["wire_dtype"] not in WIRE_DTYPES:
        raise BadInputError(f"wire dtype {values['wire_dtype']!r} is not one of "
                            f"{list(WIRE_DTYPES)}")
    return values


def planned_algorithm(values: dict[str, Any]) -> str:
    """The ``comm.algorithm`` the resolved values describe (flags may relax a sync recipe)."""
    if int(values["local_steps"]) > 1:
        return "hierarchical_local_sgd" if values["hierarchical_local"] else "local_sgd"
    return "powersgd" if float(values["compression_ratio"]) > 1 else "sync"


def wire_dtype(values: dict[str, Any], precision: str, ranks_per_node: int) -> str:
    """The gradients' dtype on the wire of the run ``values`` describe, computing in
    ``precision`` with ``ranks_per_node`` ranks on its fullest node: the dtype asked, or for
    ``auto`` the run's own rule (hpcdl.train.precision.planned_wire_dtype)."""
    from hpcdl.train.config import CommConfig
    from hpcdl.train.precision import planned_wire_dtype

    algorithm = planned_algorithm(values)
    section = CommConfig(backend=str(values.get("backend", "auto")),
                         wire_dtype=str(values["wire_dtype"]), algorithm=algorithm,
                         shard_update=bool(values.get("shard_update")) and algorithm == "sync")
    return planned_wire_dtype(section, precision, ranks_per_node)


def predict_command(args: argparse.Namespace) -> int:
    """``hpcdl plan`` without --calibrate / --validate."""
    from hpcdl.plan.cpu import cpu_warning
    from hpcdl.plan.machine import MachineError, load_machine
    from hpcdl.plan.model import PlanInputs, default_sweep, plan, sweep
    from hpcdl.plan.report import describe, plan_json, plot_sweep, sweep_table
    from hpcdl.plan.workload import workload
    from hpcdl.results import write_json

    values = resolve(args)
    try:
        machine = load_machine(values["machine"], args.machines_dir, values["precision"])
        work = workload(values["model"], int(values["image_size"]))
        procs_per_node = args.procs_per_node or machine.ranks_per_node
        wire = wire_dtype(values, machine.precision,
                          min(int(values["procs"]), procs_per_node))
        inp = PlanInputs(
            global_batch=int(values["global_batch"]), procs=int(values["procs"]),
            procs_per_node=procs_per_node,
            epochs=float(values["epochs"]), dataset_size=args.dataset_size,
            allreduce=args.allreduce, bucket_mb=float(values["bucket_mb"]),
            wire_bytes=WIRE_BYTES[wire],
            overlap=not args.no_overlap,
            loader_cores_per_node=args.loader_cores, synthetic_data=args.synthetic,
            local_steps=int(values["local_steps"]),
            hierarchical_local=bool(values["hierarchical_local"]),
            compression_ratio=float(values["compression_ratio"]),
            sync_warmup_steps=int(values["sync_warmup_steps"]))
        result = plan(machine, work, inp)
        procs_list = args.sweep or default_sweep(inp.procs, inp.global_batch)
        rows = sweep(machine, work, inp, [p for p in procs_list if p <= inp.global_batch])
    except (MachineError, ValueError) as exc:
        raise BadInputError(str(exc)) from exc
    warning = cpu_warning(machine)
    if warning:
        print(f"hpcdl plan: {warning}", file=sys.stderr)
    print(describe(result, machine, work, inp))
    print(f"\nsweep: global batch {inp.global_batch} fixed, {inp.procs_per_node} ranks per node")
    print(sweep_table(rows))
    simulated = None
    if args.simulate:
        from hpcdl.plan.simulate import simulate, simulation_table

        runs = sorted({q.procs: q for q in (*rows, result)}.values(), key=lambda q: q.procs)
        simulated = simulate(machine, inp, runs, args.placement, args.fabric_set,
                             args.placement_seed)
        print(simulation_table(simulated))
    if args.plot:
        plot_sweep(args.plot, rows, f"{work.model} {work.image_size}px, batch "
                   f"{inp.global_batch}, {machine.name}, {inp.allreduce}")
        print(f"wrote {args.plot}")
    if args.json:
        doc = plan_json(result, rows, machine, work, inp)
        if simulated is not None:
            doc["simulation"] = simulated.to_dict()
        write_json(args.json, doc)
        print(f"wrote {args.json}")
    return 0
