"""Predict a data-parallel training run before asking for the allocation.

    hpcdl plan --model resnet50 --global-batch 32768 --procs 2048 --machine knl
    hpcdl plan --recipe recipes/alexnet_bn_lars_32k.yaml --procs 2048 --machine skx --plot a.png
    hpcdl plan --calibrate                  # measure this machine into `local`
    hpcdl plan --machine skx --procs 2048 --simulate --placement random
                                            # the allreduce on the fat tree, in SimGrid
    hpcdl plan --validate --json FILE       # predict, then run `hpcdl bench train`: AlexNet-BN
                                            # 224, ResNet-50 112 and 224 px at np 1, 2, 4

Prints the per-iteration breakdown (compute, gradient allreduce and the part hidden behind
backward, data loading), time per epoch and in total, images/s and scaling efficiency, and a
sweep over process counts. The model and every machine figure with its source:
docs/planner.md.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from hpcdl.errors import BadInputError

COMMAND = "plan"
HELP = "predict time per iteration / epoch / run from machine figures (α-β-γ cost model)"

DEFAULTS = {"model": "resnet50", "image_size": 224, "global_batch": 32768, "epochs": 90.0,
            "bucket_mb": 25.0, "wire_dtype": "float32", "local_steps": 1,
            "hierarchical_local": False, "compression_ratio": None, "powersgd_rank": None,
            "sync_warmup_steps": 0, "machine": "knl", "procs": 2048}
# auto (a recipe's comm.wire_dtype) follows the compute dtype; the planner models float32
# compute (its machine files hold float32 rates), so auto sends float32.
WIRE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": 4}


def _procs_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--sweep wants comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"--sweep wants positive process counts, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--calibrate", action="store_true",
                      help="measure this machine into the `local` machine file")
    mode.add_argument("--validate", action="store_true",
                      help="predict `hpcdl bench train` here (--validate-workloads at "
                           "--validate-procs), then measure it")
    run = parser.add_argument_group("the run to predict (defaults: the recipe, then ResNet-50 "
                                    "at 32K for 90 epochs)")
    run.add_argument("--recipe", help="recipes/X.yaml: take model, image size, batch, epochs, "
                                      "bucket size, wire dtype and the comm.algorithm keys "
                                      "from it (flags override)")
    run.add_argument("--model", help="a name from hpcdl.models (default resnet50)")
    run.add_argument("--image-size", type=int, help="training crop in pixels (default 224)")
    run.add_argument("--global-batch", type=int, help="images per iteration, all ranks (32768)")
    run.add_argument("--procs", type=int,
                     help="MPI ranks (default: the recipe's plan.procs, else 2048)")
    run.add_argument("--procs-per-node", type=int,
                     help="ranks per node (default: the machine file's ranks_per_node)")
    run.add_argument("--epochs", type=float, help="epochs (default 90)")
    run.add_argument("--dataset-size", type=int, default=1_281_167,
                     help="training images (default 1,281,167 = ImageNet-1k train)")
    run.add_argument("--allreduce", choices=("ring", "rabenseifner", "hierarchical"),
                     default="ring", help="gradient allreduce algorithm to cost (default ring)")
    run.add_argument("--bucket-mb", type=float, help="fusion bucket size in MB (default 25)")
    run.add_argument("--wire-dtype", choices=sorted(WIRE_BYTES),
                     help="gradient dtype on the wire (default float32)")
    run.add_argument("--local-steps", type=int, metavar="H",
                     help="local SGD: average the model every H steps instead of the gradients "
                          "every step (default 1: synchronous; recipe: comm.local_steps)")
    run.add_argument("--hierarchical-local", action="store_true", default=None,
                     help="with --local-steps: average gradients inside each node every step "
                          "(hierarchical local SGD; recipe: comm.algorithm)")
    run.add_argument("--compression-ratio", type=float, metavar="C",
                     help="gradient compression: send 1/C of the bytes (default: from "
                          "--powersgd-rank, else 1)")
    run.add_argument("--powersgd-rank", type=int, metavar="R",
                     help="PowerSGD at rank R: the compression ratio from the model's shapes "
                          "(recipe: comm.powersgd_rank with comm.algorithm powersgd)")
    run.add_argument("--sync-warmup-steps", type=int, metavar="W",
                     help="synchronous iterations before local SGD / compression start, "
                          "costed as such (default 0; recipe: comm.sync_warmup_steps)")
    run.add_argument("--no-overlap", action="store_true",
                     help="cost communication as if none of it hid behind backward")
    run.add_argument("--loader-cores", type=float,
                     help="cores decoding images per node (default: machine file)")
    run.add_argument("--synthetic", action="store_true", help="no data loading (synthetic input)")
    where = parser.add_argument_group("machine")
    where.add_argument("--machine",
                       help="machine name (skx, knl, local, or your own) or a YAML path "
                            "(default: the recipe's plan.machine, else knl; local for "
                            "--validate)")
    where.add_argument("--machines-dir", help="look here first for NAME.yaml; --calibrate "
                                              "writes here (default ~/.config/hpcdl/machines)")
    out = parser.add_argument_group("output")
    out.add_argument("--sweep", type=_procs_list,
                     help="process counts for the sweep table, e.g. 256,512,1024 "
                          "(default: powers of two up to 2 x --procs)")
    out.add_argument("--plot", metavar="FILE", help="write the sweep as a PNG")
    out.add_argument("--json", metavar="FILE", help="write the prediction as JSON")
    sim = parser.add_argument_group("--simulate: the allreduce on a fat tree in SimGrid "
                                    "(optional; docs/planner.md)")
    sim.add_argument("--simulate", action="store_true",
                     help="also simulate the gradient allreduce of the run and the sweep on "
                          "the machine file's fabric (hpcdl.plan.simulate)")
    sim.add_argument("--placement", metavar="HOW",
                     help="contiguous, scattered (random nodes in list order), random "
                          "(random order), or a Slurm node list like c[001-004,010] "
                          "(default: fabric.placement, else contiguous)")
    sim.add_argument("--fabric-set", action="append", default=[], metavar="KEY=VALUE",
                     help="override a fabric figure, e.g. leaf_uplinks=28 or levels=1 "
                          "(repeatable)")
    sim.add_argument("--placement-seed", type=int, default=0,
                     help="seed of scattered / random placement (default 0)")
    cal = parser.add_argument_group("--calibrate / --validate")
    cal.add_argument("--quick", action="store_true",
                     help="fewer repetitions (for tests and busy machines)")
    cal.add_argument("--batch-per-rank", type=int, default=8,
                     help="images per rank per step of the measured train step (default 8)")
    cal.add_argument("--steps", type=int, default=5, help="--validate: measured steps (5)")
    cal.add_argument("--validate-workloads", default="alexnet_bn@224,resnet50@112,resnet50@224",
                     help="--validate: MODEL@SIZE list (default alexnet_bn@224,resnet50@112,"
                          "resnet50@224); --model/--image-size give one instead")
    cal.add_argument("--validate-procs", type=_procs_list,
                     help="--validate: rank counts (default 1,2,4)")
    cal.add_argument("--repeats", type=int, default=3,
                     help="--validate: measurements per row; the median is compared and the "
                          "spread reported (default 3)")
    cal.add_argument("--validate-timeout", type=float, default=1200,
                     help="--validate: seconds allowed per bench train run (1200)")
    cal.add_argument("--validate-budget", type=float, default=None, metavar="S",
                     help="--validate: start no bench run that would end past S seconds "
                          "(each row's first run is estimated from its prediction, later ones "
                          "from the last); rows are measured in rounds, so every row gets its "
                          "first run before any its second")


def _recipe_values(path: str) -> dict:
    """The planner's inputs from a recipe (recipes are data: read the YAML, no trainer)."""
    import yaml

    from hpcdl.train.config import RecipeError, resolve_recipe

    try:
        path = resolve_recipe(path)
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f) or {}
    except RecipeError as exc:
        raise BadInputError(str(exc)) from exc
    except OSError as exc:
        raise BadInputError(f"cannot read recipe {path}: {exc}") from exc
    comm = doc.get("comm") or {}
    where = doc.get("plan") or {}   # the machine and ranks the source ran on
    found = {
        "machine": where.get("machine"),
        "procs": where.get("procs"),
        "model": (doc.get("model") or {}).get("name"),
        "image_size": (doc.get("data") or {}).get("image_size"),
        "global_batch": (doc.get("batch") or {}).get("global"),
        "epochs": doc.get("epochs"),
        "total_steps": (doc.get("train") or {}).get("total_steps"),
        "bucket_mb": comm.get("bucket_mb"),
        "wire_dtype": comm.get("wire_dtype"),
        **_consistency_values(comm, path),
    }
    return {k: v for k, v in found.items() if v is not None}


def _consistency_values(comm: dict, path: str) -> dict:
    """The planner's inputs of ``comm.algorithm`` and its keys, as the trainer reads them
    (hpcdl.train.config.CommConfig: same defaults, same errors)."""
    from hpcdl.train.config import CommConfig, RecipeError

    keys = ("algorithm", "local_steps", "sync_warmup_steps", "powersgd_rank")
    try:
        config = CommConfig(**{k: comm[k] for k in keys if k in comm})
    except (RecipeError, TypeError) as exc:
        raise BadInputError(f"recipe {path}: {exc}") from exc
    if config.algorithm == "sync":
        return {}
    found: dict = {"sync_warmup_steps": config.sync_warmup_steps}
    if config.algorithm == "powersgd":
        found["powersgd_rank"] = config.powersgd_rank
    else:
        found["local_steps"] = config.local_steps
        found["hierarchical_local"] = config.algorithm == "hierarchical_local_sgd"
    return found


def resolve(args: argparse.Namespace) -> dict:
    """Flags over recipe over defaults."""
    values = dict(DEFAULTS)
    if args.recipe:
        values.update(_recipe_values(args.recipe))
    total_steps = values.pop("total_steps", None)
    if total_steps and getattr(args, "epochs", None) is None:
        # The recipe's train.total_steps (a source's max_iter) is what the run trains, in the
        # epochs the planner and the trainer both count: dataset // batch steps each (the
        # last partial batch dropped). NVCaffe's 4,000 steps at 32K are 102.56 such epochs
        # (they see 4,000 x 32,768 images, 102.31 passes over the data, which at 39 steps an
        # epoch would cost 3,990 steps).
        values["epochs"] = total_steps / max(1, args.dataset_size // int(values["global_batch"]))
    for key in DEFAULTS:
        if getattr(args, key, None) is not None:
            values[key] = getattr(args, key)
    if values["compression_ratio"] is None:
        values["compression_ratio"] = 1.0
        if values["powersgd_rank"] is not None:
            from hpcdl.plan.workload import powersgd_compression_ratio

            try:
                values["compression_ratio"] = powersgd_compression_ratio(
                    values["model"], int(values["powersgd_rank"]))
            except ValueError as exc:
                raise BadInputError(str(exc)) from exc
    if values["wire_dtype"] not in WIRE_BYTES:
        raise BadInputError(f"wire dtype {values['wire_dtype']!r} is not one of "
                            f"{sorted(WIRE_BYTES)}")
    return values


def predict(args: argparse.Namespace) -> int:
    from hpcdl.plan.machine import MachineError, load_machine
    from hpcdl.plan.model import PlanInputs, default_sweep, plan, sweep
    from hpcdl.plan.report import describe, plan_json, plot_sweep, sweep_table, write_plan_json
    from hpcdl.plan.validate import cpu_warning
    from hpcdl.plan.workload import workload

    values = resolve(args)
    try:
        machine = load_machine(values["machine"], args.machines_dir)
        work = workload(values["model"], int(values["image_size"]),
                        with_layers=machine.has_class_rates)
        inp = PlanInputs(
            global_batch=int(values["global_batch"]), procs=int(values["procs"]),
            procs_per_node=args.procs_per_node or machine.ranks_per_node,
            epochs=float(values["epochs"]), dataset_size=args.dataset_size,
            allreduce=args.allreduce, bucket_mb=float(values["bucket_mb"]),
            wire_bytes=WIRE_BYTES[values["wire_dtype"]], overlap=not args.no_overlap,
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
        doc = plan_json(result, rows, machine, work, replace(inp))
        if simulated is not None:
            doc["simulation"] = simulated.to_dict()
        write_plan_json(args.json, doc)
        print(f"wrote {args.json}")
    return 0


def check_calibrate_inputs(args: argparse.Namespace) -> None:
    """What ``--calibrate`` would otherwise find bad only after minutes of measuring: the batch,
    the directory it writes (single-node runs; across hosts world rank 0 writes) and the
    machine file it keeps figures from."""
    import os
    import tempfile

    import yaml

    from hpcdl.plan.calibrate import launched_world_size
    from hpcdl.plan.machine import user_machines_dir

    if args.batch_per_rank < 1:
        raise BadInputError(f"--calibrate: --batch-per-rank {args.batch_per_rank}: need at "
                            f"least 1 image per rank")
    directory = args.machines_dir or user_machines_dir()
    if launched_world_size() <= 1:
        try:
            os.makedirs(directory, exist_ok=True)
            with tempfile.TemporaryFile(dir=directory):
                pass
        except OSError as exc:
            raise BadInputError(f"--calibrate: cannot write {directory} ({exc}); use "
                                f"--machines-dir DIR") from None
    old = os.path.join(directory, "local.yaml")
    if os.path.exists(old):
        try:
            with open(old, encoding="utf-8") as f:
                kept = yaml.safe_load(f)
        except (OSError, yaml.YAMLError) as exc:
            raise BadInputError(f"--calibrate: {old} is unreadable ({exc}); move it away to "
                                f"measure afresh") from None
        if not isinstance(kept, dict):
            raise BadInputError(f"--calibrate: {old} is not a machine file (a YAML mapping); "
                                f"move it away to measure afresh")


def run(args: argparse.Namespace) -> int:
    if args.calibrate:
        from hpcdl.plan.calibrate import calibrate_command

        check_calibrate_inputs(args)
        return calibrate_command(args)
    if args.validate:
        from hpcdl.plan.validate import validate_command

        return validate_command(args)
    return predict(args)
