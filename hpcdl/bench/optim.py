"""LARS step time against the optimizer a user would otherwise pick, torch.optim.SGD
(momentum, foreach=True), on ResNet-50's 161 parameter tensors with random gradients.

Both optimizers get the same parameter groups (the MLPerf skip list: BN and biases excluded
from weight decay, and from the trust ratio for LARS); the median step time after warm-up is
compared. Torch runs on one thread by default (``--threads``) so the ratio is stable on a
busy machine; the goal is ``lars_vs_sgd_step_time`` ≤ 1.5.
"""
from __future__ import annotations

import argparse
import statistics

COMMAND = "optim"
HELP = "LARS step time vs torch.optim.SGD(momentum, foreach=True) on ResNet-50's parameters"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="FILE", help="write the results here (bench JSON)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per optimizer")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--model", default="resnet50", help="whose parameters to step")
    parser.add_argument("--weight-decay", type=float, default=5e-5)


def run(args: argparse.Namespace) -> int:
    import torch

    from hpcdl.bench import check_model_argument
    from hpcdl.models import create_model
    from hpcdl.optim import LARS, param_groups
    from hpcdl.plan.class_rates import call_times
    from hpcdl.results import bench_report, emit

    if args.steps < 1 or args.warmup < 0 or args.threads < 1:
        raise SystemExit(f"hpcdl bench optim: --steps >= 1, --warmup >= 0, --threads >= 1 "
                         f"(got {args.steps}, {args.warmup}, {args.threads})")
    check_model_argument("optim", args.model)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = create_model(args.model)
    params = list(model.parameters())
    for p in params:
        # Gradients ~1e-3 of the weights' scale, as after an allreduce: values, not zeros,
        # so no kernel takes a shortcut.
        p.grad = torch.randn_like(p) * 1e-3
    numel = sum(p.numel() for p in params)
    candidates = {
        "sgd_foreach": torch.optim.SGD(param_groups(model, args.weight_decay), lr=0.1,
                                       momentum=0.9, foreach=True),
        "lars": LARS(param_groups(model, args.weight_decay), lr=0.1, momentum=0.9),
    }
    records = []
    for name, optimizer in candidates.items():
        times = call_times(optimizer.step, args.steps, warmup=args.warmup)
        records.append({"optimizer": name, "model": args.model, "tensors": len(params),
                        "parameters": numel, "threads": args.threads, "steps": args.steps,
                        "median_ms": 1e3 * statistics.median(times),
                        "min_ms": 1e3 * min(times), "max_ms": 1e3 * max(times)})
    ratio = records[1]["median_ms"] / records[0]["median_ms"]
    report = bench_report("optim", records, {"lars_vs_sgd_step_time": ratio})
    emit(report, ["optimizer", "model", "tensors", "threads", "steps", "median_ms", "min_ms",
                  "max_ms"], args.json)
    return 0
