"""Predict a data-parallel training run before asking for the allocation.

    hpcdl plan --model resnet50 --global-batch 32768 --procs 2048 --machine knl
    hpcdl plan --recipe recipes/alexnet_bn_lars_32k.yaml --procs 2048 --machine skx --plot a.png
    hpcdl plan --calibrate                  # measure this machine into `local`
    hpcdl plan --calibrate --precision bfloat16   # its bf16 rates (where bf16 is native)
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

from hpcdl.plan.model import ALLREDUCE_ALGORITHMS, IMAGENET_TRAIN_IMAGES
from hpcdl.plan.predict import DEFAULT_MACHINE, DEFAULT_PROCS, DEFAULT_RECIPE, WIRE_DTYPES
from hpcdl.plan.validate import VALIDATE_WORKLOADS
from hpcdl.train.config import PRECISIONS

COMMAND = "plan"
HELP = "predict time per iteration / epoch / run from machine figures (α-β-γ cost model)"


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
    run = parser.add_argument_group("the run to predict (defaults: the recipe, else "
                                    f"{DEFAULT_RECIPE}; flags override)")
    run.add_argument("--recipe", help="recipes/X.yaml: take model, image size, batch, epochs, "
                                      "bucket size, wire dtype and the comm.algorithm keys "
                                      "from it (flags override)")
    run.add_argument("--model", help="a name from hpcdl.models")
    run.add_argument("--image-size", type=int, help="training crop in pixels")
    run.add_argument("--global-batch", type=int, help="images per iteration, all ranks")
    run.add_argument("--procs", type=int,
                     help=f"MPI ranks (default: the recipe's plan.procs, else {DEFAULT_PROCS})")
    run.add_argument("--procs-per-node", type=int,
                     help="ranks per node (default: the machine file's ranks_per_node)")
    run.add_argument("--epochs", type=float, help="epochs (default: the recipe's)")
    run.add_argument("--dataset-size", type=int, default=IMAGENET_TRAIN_IMAGES,
                     help=f"training images (default {IMAGENET_TRAIN_IMAGES:,} = ImageNet-1k "
                          "train)")
    run.add_argument("--allreduce", choices=ALLREDUCE_ALGORITHMS, default="ring",
                     help="gradient allreduce algorithm to cost (default ring)")
    run.add_argument("--bucket-mb", type=float,
                     help="fusion bucket size in MiB (default: the recipe's comm.bucket_mb)")
    run.add_argument("--wire-dtype", choices=WIRE_DTYPES,
                     help="gradient dtype on the wire (default: the recipe's comm.wire_dtype; "
                          "auto: bf16 where the run computes in bf16 on ring or shm)")
    run.add_argument("--precision", choices=PRECISIONS,
                     help="compute dtype, as train.precision (auto: bf16 where the machine "
                          "file's CPU computes it natively), costed with the file's rates of "
                          "that dtype (default: the recipe's train.precision). --calibrate: "
                          "the dtype to measure the rates in (default float32; bfloat16 only "
                          "where native); --validate: the dtype to predict and measure the "
                          "step in (default float32)")
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
                            f"(default: the recipe's plan.machine, else {DEFAULT_MACHINE}; "
                            "local for --validate)")
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
    cal.add_argument("--validate-workloads", default=VALIDATE_WORKLOADS,
                     help=f"--validate: MODEL@SIZE list (default {VALIDATE_WORKLOADS}); "
                          "--model/--image-size give one instead")
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


def run(args: argparse.Namespace) -> int:
    if args.calibrate:
        from hpcdl.plan.calibrate import calibrate_command

        return calibrate_command(args)
    if args.validate:
        from hpcdl.plan.validate import validate_command

        return validate_command(args)
    from hpcdl.plan.predict import predict_command

    return predict_command(args)
