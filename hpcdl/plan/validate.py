"""``hpcdl plan --validate``: predict ``hpcdl bench train`` here, then measure it.

Per workload and rank count on this machine (the ``local`` file): predict the bench's step on
synthetic data, run it ``--repeats`` times in rounds (so a run cut short by
``--validate-budget`` still covers every row) and report predicted ÷ the median measurement
with the spread, in the bench JSON convention. The bench's JSON is read tolerantly
(:func:`measured_step`). What is run and reported: docs/planner.md, "--validate".
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from hpcdl.results import run_bench_json
from hpcdl.train.config import CommConfig

# The median step first (hpcdl bench train's ``step_time_median_s``: one slow step of a few,
# a neighbour's burst, moves a mean but not a median), then the mean.
STEP_KEYS = ("step_s", "step_time_median_s", "step_time_s", "time_per_step_s", "mean_step_s",
             "iteration_s", "seconds_per_step")
BATCH_KEYS = ("batch_per_rank", "per_rank_batch", "local_batch", "batch")
RATE_KEYS = ("images_per_s_per_rank", "images_per_s_rank", "img_per_s_per_rank")
SPLIT_KEYS = {"compute_s": ("compute_s", "compute_time_s", "step_compute_s"),
              "comm_wait_s": ("comm_wait_s", "comm_s", "communication_wait_s"),
              "data_wait_s": ("data_wait_s", "data_s"),
              # the rank's CPU seconds per step (all its threads): on a busy machine, what
              # the step cost it when the wall clock also counts other processes' turns
              "cpu_s": ("cpu_s_per_step",),
              # of which the communication thread's (MPI polls while it waits for a peer)
              "comm_thread_cpu_s": ("comm_thread_cpu_s_per_step",)}
VALIDATE_PROCS = (1, 2, 4)
# Seconds a bench train run spends before its first step (interpreter, torch, MPI, model):
# only the budget's estimate of a row's first run uses it.
RUN_STARTUP_S = 15.0
# Held out: calibration times representative layers, never these models' steps.
VALIDATE_WORKLOADS = "alexnet_bn@224,resnet50@112,resnet50@224"


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


def bench_threads(procs: int) -> int:
    """Torch threads of each of ``procs`` ranks on this node: cores ÷ ranks, at least one."""
    return max(1, (os.cpu_count() or 1) // procs)


def run_bench_train(procs: int, model: str, image_size: int, batch: int, steps: int,
                    timeout_s: float, precision: str = "float32") -> dict[str, float]:
    """``hpcdl bench train`` as --validate runs it: ours only, synthetic data, no profiled
    breakdown (it costs a step and is not read), cores ÷ ranks threads each, computing in
    ``precision`` (the machine file's rates of it predict the step; the bench's ``ours``
    sends float32 gradients in every precision)."""
    threads = bench_threads(procs)
    report = run_bench_json(procs, (
        "train", "--model", model, "--image-size", str(image_size), "--synthetic", "--batch",
        str(batch), "--steps", str(steps), "--warmup", "1", "--modes", "ours", "--threads",
        str(threads), "--matmul-size", "256", "--no-breakdown",
        # the rule's backend at the planner's bucket size: a timed trial could pick another
        # backend or layout than the prediction assumes
        "--backend", "rule",
        # never the bench's default, auto: the dtype whose rates made the prediction
        "--precision", precision), timeout_s, announce=True)
    return measured_step(report, procs)


def predict_step(machine: Any, work: Any, procs: int, batch: int, allreduce: str = "ring",
                 bucket_mb: float = CommConfig.bucket_mb) -> Any:
    """The planner's prediction for one bench train configuration on one node."""
    from hpcdl.plan.model import PlanInputs, plan

    inp = PlanInputs(global_batch=batch * procs, procs=procs, procs_per_node=procs, epochs=1,
                     dataset_size=batch * procs, allreduce=allreduce, bucket_mb=bucket_mb,
                     synthetic_data=True)
    return plan(machine, work, inp)


def validation_record(pred: Any, meas: Mapping[str, float],
                      repeats: Sequence[float] = ()) -> dict[str, Any]:
    """One row: prediction, measurement (the median of ``repeats`` when given) and ratio."""
    rec = {"model": getattr(pred, "model", None), "image_size": getattr(pred, "image_size", None),
           "ranks": pred.procs, "batch_per_rank": pred.batch_per_rank,
           "predicted_step_s": pred.iteration_s, "measured_step_s": meas["step_s"],
           "predicted_vs_measured": pred.iteration_s / meas["step_s"],
           "predicted_compute_s": pred.compute_s, "predicted_optimizer_s": pred.optimizer_s,
           "predicted_comm_exposed_s": pred.comm_exposed_s}
    if repeats:
        rec["measured_repeats_s"] = list(repeats)
        rec["measured_min_s"], rec["measured_max_s"] = min(repeats), max(repeats)
        rec["spread"] = (max(repeats) - min(repeats)) / meas["step_s"]
        rec["ratio_range"] = [pred.iteration_s / max(repeats), pred.iteration_s / min(repeats)]
    for key in SPLIT_KEYS:
        if key in meas:
            rec[f"measured_{key}"] = meas[key]
    return rec


def median_measurement(runs: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The run with the median step time (repeats vary by up to 10% on a shared machine)."""
    ordered = sorted(runs, key=lambda r: r["step_s"])
    return dict(ordered[(len(ordered) - 1) // 2])


def bf16_note(machine: Any, native: bool | None = None) -> str:
    """What this validation says of bf16: measured, or why not (no native bf16 here, or no
    bf16 rates in the machine file, or float32 asked)."""
    from hpcdl.cpus import bf16_native
    from hpcdl.plan.cpu import cpu_identity

    native = bf16_native() if native is None else native
    if machine.precision == "bfloat16":
        return "bf16 rows: predicted from the file's bfloat16 rates, measured in bf16 autocast"
    if not native:
        return (f"bf16 rows skipped: this CPU ({cpu_identity()['capability']}) has no native "
                "bf16 (AVX512-BF16 or AMX with torch at AVX-512)")
    if "bfloat16" not in machine.precisions:
        return ("bf16 rows skipped: the CPU has native bf16 and the machine file no bfloat16 "
                "rates (`hpcdl plan --calibrate --precision bfloat16`, then --precision "
                "bfloat16)")
    return "bf16 rows skipped: float32 asked (--precision bfloat16 validates bf16)"


def parse_workloads(text: str) -> list[tuple[str, int]]:
    """``alexnet_bn@224,resnet50@112`` -> [(model, size), ...]."""
    out = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        model, sep, size = item.partition("@")
        if not sep or not size.isdigit() or int(size) <= 0:
            raise ValueError(f"--validate-workloads: {item!r} is not MODEL@SIZE "
                             "(e.g. resnet50@112)")
        out.append((model, int(size)))
    if not out:
        raise ValueError("--validate-workloads names no workload")
    return out


def validate_command(args: argparse.Namespace) -> int:
    from hpcdl.errors import BadInputError
    from hpcdl.plan.cpu import cpu_warning, measurable_precision
    from hpcdl.plan.machine import MachineError, load_machine
    from hpcdl.plan.workload import workload
    from hpcdl.results import emit, write_json

    name = args.machine or "local"
    try:
        precision = measurable_precision(args.precision or "float32", "--validate")
        machine = load_machine(name, args.machines_dir, precision)
        pairs = ([(args.model or "resnet50", args.image_size or 112)]
                 if args.model or args.image_size else parse_workloads(args.validate_workloads))
        works = [workload(m, s) for m, s in pairs]
    except (MachineError, BadInputError, ValueError) as exc:
        print(f"hpcdl plan --validate: {exc}", file=sys.stderr)
        return 2
    warning = cpu_warning(machine)
    if warning:
        print(f"hpcdl plan --validate: {warning}", file=sys.stderr)
    procs_list = args.validate_procs or list(VALIDATE_PROCS)
    budget = getattr(args, "validate_budget", None)
    print(f"validating machine file {machine.path} against hpcdl bench train (synthetic, "
          f"{precision}, {args.batch_per_rank} images per rank, np {procs_list}, "
          f"{args.repeats} repeats"
          + (f", {budget:g} s budget" if budget else "") + ")")
    rows = [ValidationRow(machine, work, procs, args)
            for work in works for procs in procs_list]
    bf16 = bf16_note(machine)
    load_before = os.getloadavg()
    deadline = time.monotonic() + budget if budget else None
    for repeat in range(max(1, args.repeats)):
        # Round-robin: every row gets its first measurement before any gets its second, so
        # a validation cut short by its budget still covers every row.
        for row in rows:
            if deadline is not None and time.monotonic() + row.estimate_s(args) > deadline:
                print(f"  {row.label} repeat {repeat + 1}: not run, the --validate-budget "
                      "would be exceeded", flush=True)
                continue
            if not row.measure(args):
                return 1
        if args.json:   # a long validation stopped early keeps the rows it measured
            write_json(args.json, validation_report(rows, machine, warning, procs_list, bf16,
                                                    complete=False, load_before=load_before))
    report = validation_report(rows, machine, warning, procs_list, bf16, complete=True,
                               load_before=load_before)
    print(report["bf16"])
    emit(report, ("model", "image_size", "ranks", "batch_per_rank", "predicted_step_s",
                  "measured_step_s", "measured_min_s", "measured_max_s",
                  "predicted_vs_measured", "predicted_compute_s", "measured_compute_s"),
         args.json)
    return 0


def validation_report(rows: Sequence[ValidationRow], machine: Any, warning: str | None,
                      procs_list: Sequence[int], bf16: str, complete: bool,
                      load_before: Sequence[float] = ()) -> dict[str, Any]:
    """The bench JSON of a validation (``complete`` False while rows are still to come); rows
    never measured (budget) are listed under ``not_measured``; ``bf16`` says whether bf16 was
    validated and why not; ``precision`` is the dtype predicted and measured, and the machine
    block records the CPU (lscpu's model name, torch's capability, the flags that move the
    rates) and the load average before and after."""
    from hpcdl.plan.cpu import cpu_identity
    from hpcdl.results import bench_report, in_band

    records = [row.record() for row in rows if row.runs]
    ratios: dict[str, Any] = {f"{r['model']}@{r['image_size']}_np{r['ranks']}":
                              r["predicted_vs_measured"] for r in records}
    ratios["within_15_percent"] = bool(records) and all(
        in_band(r["predicted_vs_measured"]) for r in records)
    report = bench_report("plan-validate", records, ratios, ranks=max(procs_list))
    report.update(machine_file=machine.path, bf16=bf16, complete=complete,
                  not_measured=[row.label for row in rows if not row.runs],
                  precision=machine.precision, wire_dtype="float32")
    cpu = cpu_identity()
    report["machine"].update(cpu_model_name=cpu["model_name"], cpu_capability=cpu["capability"],
                             cpu_flags=cpu["flags"],
                             load_average={"before": list(load_before),
                                           "after": list(os.getloadavg())})
    if warning:
        report["cpu_warning"] = warning
    return report


class ValidationRow:
    """One (workload, np): its prediction and the bench runs measured so far."""

    def __init__(self, machine: Any, work: Any, procs: int, args: argparse.Namespace) -> None:
        self.machine, self.work, self.procs = machine, work, procs
        self.prediction = self.predict(args, args.batch_per_rank)
        self.runs: list[dict[str, float]] = []
        self.last_wall_s: float | None = None
        self.label = f"{work.model}@{work.image_size} np={procs}"
        p = self.prediction
        print(f"{self.label}: predicted step {p.iteration_s:.4g} s (compute "
              f"{p.compute_s:.4g} s, exposed comm {p.comm_exposed_s:.4g} s)", flush=True)

    def estimate_s(self, args: argparse.Namespace) -> float:
        """Wall seconds of the next run: the last one's, or the prediction's steps + start-up."""
        if self.last_wall_s is not None:
            return self.last_wall_s
        return RUN_STARTUP_S + (args.steps + 1) * self.prediction.iteration_s

    def measure(self, args: argparse.Namespace) -> bool:
        """One bench run; False (after saying why) when it failed."""
        start = time.monotonic()
        try:
            run = run_bench_train(self.procs, self.work.model, self.work.image_size,
                                  args.batch_per_rank, args.steps,
                                  timeout_s=args.validate_timeout,
                                  precision=self.machine.precision)
        except (RuntimeError, ValueError, subprocess.TimeoutExpired) as exc:
            print(f"hpcdl plan --validate: {self.label}: {exc}", file=sys.stderr)
            return False
        self.runs.append(run)
        self.last_wall_s = time.monotonic() - start
        print(f"  {self.label}: measured {run['step_s']:.4g} s (run {len(self.runs)}, "
              f"{self.last_wall_s:.0f} s wall)", flush=True)
        batch = int(run.get("batch_per_rank", args.batch_per_rank))
        if batch != self.prediction.batch_per_rank:   # the model is a pure function: redo it
            self.prediction = self.predict(args, batch)
        return True

    def predict(self, args: argparse.Namespace, batch: int) -> Any:
        return predict_step(self.machine, self.work, self.procs, batch, args.allreduce,
                            args.bucket_mb or CommConfig.bucket_mb)

    def record(self) -> dict[str, Any]:
        """The row as the JSON holds it: prediction against the median run."""
        return {**validation_record(self.prediction, median_measurement(self.runs),
                                    [r["step_s"] for r in self.runs]),
                "threads_per_rank": bench_threads(self.procs)}
