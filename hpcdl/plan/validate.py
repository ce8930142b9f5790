"""``hpcdl plan --validate``: predict ``hpcdl bench train`` here, then measure it.

For np = 2 and 4 on this one machine (the ``local`` machine file, from ``--calibrate``):

1. predict the step time of ResNet-50 at 112 px, synthetic data, ``--batch-per-rank`` images
   per rank, np ranks on one node (np = 4 on a 2-core machine: ranks share cores, and the
   model slows compute proportionally);
2. run ``mpiexec -n NP python -m hpcdl.cli.main bench train --model resnet50 --image-size 112
   --synthetic --json F``, adding ``--batch B --steps S --modes ours --threads T`` (T = cores /
   np, at least 1, so ranks do not oversubscribe threads as well as cores) for each flag the
   bench's ``--help`` lists;
3. report predicted / measured (goal: within ±20%), as ratios
   ``predicted_vs_measured_np2`` and ``predicted_vs_measured_np4`` in the bench JSON.

Reading the bench's JSON is deliberately tolerant (:func:`measured_step`), because the train
bench and this planner are built apart. From ``results`` it takes the record for NP ranks
(``ranks`` field; preferring one whose ``name``/``variant``/``mode`` mentions ours, hpcdl or
overlap), then the step time from the first of :data:`STEP_KEYS`; failing that, batch per
rank (:data:`BATCH_KEYS`) ÷ images/s per rank (:data:`RATE_KEYS`), or ÷ (images/s ÷ ranks).
If the bench reports a per-rank batch other than the one predicted, the prediction is redone
for the reported batch before comparing (the model is a pure function of its inputs, so
this uses no measured time).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

STEP_KEYS = ("step_s", "step_time_s", "time_per_step_s", "mean_step_s", "iteration_s",
             "seconds_per_step")
BATCH_KEYS = ("batch_per_rank", "per_rank_batch", "local_batch", "batch")
RATE_KEYS = ("images_per_s_per_rank", "images_per_s_rank", "img_per_s_per_rank")
SPLIT_KEYS = {"compute_s": ("compute_s", "compute_time_s", "step_compute_s"),
              "comm_wait_s": ("comm_wait_s", "comm_s", "communication_wait_s"),
              "data_wait_s": ("data_wait_s", "data_s")}
VALIDATE_PROCS = (2, 4)
VALIDATE_MODEL = "resnet50"
VALIDATE_IMAGE_SIZE = 112


def _first(record: Mapping[str, Any], keys: Sequence[str]) -> float | None:
    for key in keys:
        value = record.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    return None


def _pick_record(records: Sequence[Mapping[str, Any]], ranks: int) -> Mapping[str, Any]:
    same = [r for r in records if r.get("ranks") in (None, ranks)]
    if not same:
        raise ValueError(f"no bench train record for {ranks} ranks in {len(records)} records")

    def preferred(r: Mapping[str, Any]) -> bool:
        label = " ".join(str(r.get(k, "")) for k in ("name", "variant", "mode", "impl")).lower()
        return "ours" in label or "hpcdl" in label or "overlap" in label

    return next((r for r in same if preferred(r)), same[0])


def measured_step(report: Mapping[str, Any], ranks: int) -> dict[str, float]:
    """Step time (and its split, where given) for ``ranks`` from a bench train JSON."""
    results = report.get("results")
    if not isinstance(results, list) or not results:
        raise ValueError("bench train JSON has no 'results' records")
    rec = _pick_record(results, ranks)
    batch = _first(rec, BATCH_KEYS)
    step = _first(rec, STEP_KEYS)
    if step is None and batch is not None:
        rate = _first(rec, RATE_KEYS)
        total = _first(rec, ("images_per_s",))
        if rate:
            step = batch / rate
        elif total:
            step = batch * ranks / total
    if step is None or step <= 0:
        raise ValueError(f"cannot find a step time in the bench train record {dict(rec)}; "
                         f"expected one of {STEP_KEYS} or batch / images-per-second")
    out = {"step_s": step}
    if batch is not None:
        out["batch_per_rank"] = batch
    for name, keys in SPLIT_KEYS.items():
        value = _first(rec, keys)
        if value is not None:
            out[name] = value
    return out


def bench_train_command(procs: int, model: str, image_size: int, batch: int, steps: int,
                        json_path: str, mpiexec: str = "mpiexec") -> list[str]:
    base = [sys.executable, "-m", "hpcdl.cli.main", "bench", "train"]
    help_text = subprocess.run(base + ["--help"], capture_output=True, text=True).stdout
    if "--model" not in help_text:
        raise RuntimeError("`hpcdl bench train` is not available in this installation "
                           "(hpcdl/bench/train.py); cannot measure")
    cmd = [mpiexec, "-n", str(procs), *base, "--model", model, "--image-size", str(image_size),
           "--synthetic", "--json", json_path]
    threads = max(1, (os.cpu_count() or 1) // procs)
    for flag, value in (("--batch", batch), ("--steps", steps), ("--warmup", 1),
                        ("--modes", "ours"), ("--threads", threads)):
        if flag in help_text:
            cmd += [flag, str(value)]
    return cmd


def run_bench_train(procs: int, model: str, image_size: int, batch: int, steps: int,
                    timeout_s: float) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, f"train-np{procs}.json")
        cmd = bench_train_command(procs, model, image_size, batch, steps, out)
        print("running:", " ".join(cmd), flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"bench train at np={procs} failed (exit {proc.returncode}): "
                               f"{(proc.stderr or proc.stdout)[-1000:]}")
        with open(out, encoding="utf-8") as f:
            return measured_step(json.load(f), procs)


def predict_step(machine: Any, work: Any, procs: int, batch: int, allreduce: str,
                 bucket_mb: float) -> Any:
    """The planner's prediction for one bench train configuration on one node."""
    from hpcdl.plan.model import PlanInputs, plan

    inp = PlanInputs(global_batch=batch * procs, procs=procs, procs_per_node=procs, epochs=1,
                     dataset_size=batch * procs, allreduce=allreduce, bucket_mb=bucket_mb,
                     synthetic_data=True)
    return plan(machine, work, inp)


def validation_record(pred: Any, meas: Mapping[str, float]) -> dict[str, Any]:
    rec = {"ranks": pred.procs, "batch_per_rank": pred.batch_per_rank,
           "predicted_step_s": pred.iteration_s, "measured_step_s": meas["step_s"],
           "predicted_vs_measured": pred.iteration_s / meas["step_s"],
           "predicted_compute_s": pred.compute_s, "predicted_optimizer_s": pred.optimizer_s,
           "predicted_comm_exposed_s": pred.comm_exposed_s}
    for key in ("compute_s", "comm_wait_s", "data_wait_s"):
        if key in meas:
            rec[f"measured_{key}"] = meas[key]
    return rec


def validate_command(args: argparse.Namespace) -> int:
    from hpcdl.bench.report import bench_report, emit
    from hpcdl.plan.machine import MachineError, load_machine
    from hpcdl.plan.workload import workload

    name = args.machine or "local"
    model = args.model or VALIDATE_MODEL
    size = args.image_size or VALIDATE_IMAGE_SIZE
    try:
        machine = load_machine(name, args.machines_dir)
        work = workload(model, size)
    except (MachineError, ValueError) as exc:
        print(f"hpcdl plan --validate: {exc}", file=sys.stderr)
        return 2
    print(f"validating machine file {machine.path} against hpcdl bench train "
          f"({model} at {size} px, synthetic, {args.batch_per_rank} images per rank)")
    records, ratios = [], {}
    for procs in VALIDATE_PROCS:
        pred = predict_step(machine, work, procs, args.batch_per_rank, args.allreduce,
                            args.bucket_mb or 25.0)
        print(f"np={procs}: predicted step {pred.iteration_s:.4g} s (compute "
              f"{pred.compute_s:.4g} s, exposed comm {pred.comm_exposed_s:.4g} s)", flush=True)
        try:
            meas = run_bench_train(procs, model, size, args.batch_per_rank, args.steps,
                                   timeout_s=args.validate_timeout)
        except (RuntimeError, ValueError, subprocess.TimeoutExpired) as exc:
            print(f"hpcdl plan --validate: np={procs}: {exc}", file=sys.stderr)
            return 1
        batch = int(meas.get("batch_per_rank", args.batch_per_rank))
        if batch != args.batch_per_rank:
            pred = predict_step(machine, work, procs, batch, args.allreduce,
                                args.bucket_mb or 25.0)
        records.append(validation_record(pred, meas))
        ratios[f"predicted_vs_measured_np{procs}"] = records[-1]["predicted_vs_measured"]
    ratios["within_20_percent"] = all(0.8 <= r <= 1.2 for r in ratios.values())
    report = bench_report("plan-validate", records, ratios, ranks=max(VALIDATE_PROCS))
    report["machine_file"] = machine.path
    emit(report, ("ranks", "batch_per_rank", "predicted_step_s", "measured_step_s",
                  "predicted_vs_measured", "predicted_compute_s", "measured_compute_s",
                  "measured_comm_wait_s"), args.json)
    return 0
