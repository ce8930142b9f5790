"""How a plan is shown: the per-iteration breakdown, the sweep table, the PNG, the JSON (the
bench's shape where it fits, ``command`` and ``results``, and the prediction's own keys:
docs/planner.md, "The JSON of a prediction")."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from hpcdl.plan.layers import COMPUTE_CLASSES, OPTIMIZER, class_totals
from hpcdl.plan.machine import Machine
from hpcdl.plan.model import (
    BACKWARD_SHARE,
    COMPRESSION_BYTES_PER_PARAMETER,
    OPTIMIZER_BYTES_PER_PARAMETER,
    Plan,
    PlanInputs,
    rank_memory_Bps,
    reduction_gamma,
)
from hpcdl.plan.workload import Workload
from hpcdl.results import command_line, format_table

SWEEP_COLUMNS = ("procs", "nodes", "batch_per_rank", "compute_s", "optimizer_s", "comm_s",
                 "comm_exposed_s", "data_s", "iteration_s", "total_min", "images_per_s",
                 "scaling_efficiency", "dominant")


def _si(value: float, unit: str) -> str:
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:9.2f} ms"


def describe(p: Plan, machine: Machine, work: Workload, inp: PlanInputs) -> str:
    """The per-iteration breakdown with the arithmetic behind each term."""
    gamma = reduction_gamma(machine, min(p.procs, inp.procs_per_node))
    wire = {4: "fp32", 2: "bf16"}.get(inp.wire_bytes, f"{inp.wire_bytes} B/element")
    lines = [
        f"hpcdl plan: {work.model} at {work.image_size} px on {machine.name} ({machine.path}), "
        f"computing in {p.precision} (its {machine.precision} rates)",
        f"  {p.procs} ranks on {p.nodes} node(s), {inp.procs_per_node} per node; global batch "
        f"{p.global_batch} = {p.batch_per_rank:.4g} per rank; {p.allreduce} allreduce, "
        f"{inp.bucket_mb:g} MiB buckets, overlap {'on' if inp.overlap else 'off'}",
        "per iteration",
        *compute_lines(p, machine, work, inp),
        f"  optimizer      {_ms(p.optimizer_s)}  LARS update: "
        f"{OPTIMIZER_BYTES_PER_PARAMETER:g} B x {work.parameters / 1e6:.4g} M parameters at "
        f"{machine.optional_fraction(OPTIMIZER):.2g} of "
        f"{_si(rank_memory_Bps(machine, inp.procs_per_node), 'B/s')} per rank",
        *([f"  compression    {_ms(p.compression_s)}  {COMPRESSION_BYTES_PER_PARAMETER:g} B "
           f"x {work.parameters / 1e6:.4g} M parameters (PowerSGD's passes over the gradient)"]
          if p.compression_s else []),
        f"  communication  {_ms(p.comm_s)}  {_si(p.gradient_bytes, 'B')} {wire} gradients in "
        f"{p.buckets} bucket(s); alpha {machine['network.latency_s'] * 1e6:g} us, "
        f"1/beta {_si(machine['network.bandwidth_Bps'], 'B/s')} (intra-node "
        f"{_si(machine['intra_node.bandwidth_Bps'], 'B/s')}), 1/gamma {_si(1 / gamma, 'B/s')}",
        f"    hidden       {_ms(p.comm_hidden_s)}  behind backward ({BACKWARD_SHARE:.2f} of "
        "compute); the last bucket never hides",
        f"    exposed      {_ms(p.comm_exposed_s)}"
        + (f"  incl. model average every {p.local_steps} steps {_ms(p.model_average_s)}"
           if p.local_steps > 1 else "")
        + (f"  (gradients compressed {p.compression_ratio:g}x, not overlapped)"
           if p.compression_ratio > 1 else ""),
        f"  data loading   {_ms(p.data_s)}  node needs "
        f"{p.required_images_per_s_per_node:,.0f} img/s, decodes "
        f"{p.decode_images_per_s_per_node:,.0f} img/s "
        f"({machine['data.decode_images_per_s_per_core']:.3g}/core); exposed "
        f"{p.data_exposed_s * 1e3:.2f} ms",
        f"  iteration      {_ms(p.iteration_s)}  dominant term: {p.dominant}",
        "per run",
        f"  {p.iterations_per_epoch} iterations/epoch x {p.iteration_s:.4g} s = epoch "
        f"{p.epoch_s:.4g} s; {inp.epochs:g} epochs = {p.total_s:.4g} s ({p.total_s / 60:.3g} min)"
        + (f", the first {p.sync_warmup_steps} iterations synchronous ({p.warmup_s:.4g} s)"
           if p.sync_warmup_steps else ""),
        f"  {p.images_per_s:,.0f} images/s ({p.images_per_s_per_rank:.4g} per rank); scaling "
        f"efficiency {p.scaling_efficiency:.1%} (vs one rank with no communication)",
    ]
    lines += [f"  note: {n}" for n in p.notes]
    return "\n".join(lines)


def compute_lines(p: Plan, machine: Machine, work: Workload, inp: PlanInputs) -> list[str]:
    """The compute term, and its split by operator class (hpcdl.plan.layers)."""
    head = (f"  compute        {_ms(p.compute_s)}  {p.batch_per_rank:.4g} img x "
            f"{_si(work.train_flops_per_image, 'FLOP')} (3 x 2 x {_si(work.forward_macs, 'MAC')})"
            f"; rank peak {_si(machine.peak_flops_per_node / inp.procs_per_node, 'FLOP/s')}, "
            f"stream {_si(rank_memory_Bps(machine, inp.procs_per_node), 'B/s')}")
    if not machine.has_class_rates:
        return [head + f" x sustained fraction {machine['node.sustained_fraction']:.3g}"]
    totals = class_totals(work.layers)
    lines = [head + "; by operator class:"]
    for op_class, seconds in sorted(p.compute_by_class.items(), key=lambda kv: -kv[1]):
        t = totals.get(op_class, {"layers": 0, "train_flops": 0.0, "bytes": 0.0})
        work_text = (f"{_si(t['train_flops'] * p.batch_per_rank, 'FLOP')} at "
                     f"{machine[f'compute.{op_class}']:.3g} of peak"
                     if op_class in COMPUTE_CLASSES else
                     f"{_si(t['bytes'] * p.batch_per_rank, 'B')} at "
                     f"{machine[f'compute.{op_class}']:.3g} of stream")
        lines.append(f"    {op_class:<13}{_ms(seconds)}  {int(t['layers'])} layers, {work_text}"
                     + _thread_text(machine, op_class, inp.procs_per_node))
    return lines


def _thread_text(machine: Any, op_class: str, procs_per_node: int) -> str:
    """``, 2 threads x 1.6 measured`` where a rank's threads are priced by thread_scaling."""
    threads = machine.threads_per_rank(procs_per_node)
    if threads <= 1 or not machine.has_thread_scaling:
        return ""
    return (f", {threads:g} threads x {machine.thread_speedup(op_class, threads):.3g} "
            "(measured speedup)")


def sweep_record(p: Plan) -> dict[str, Any]:
    record = {key: getattr(p, key) for key in SWEEP_COLUMNS if key != "total_min"}
    return {**record, "total_s": p.total_s, "total_min": p.total_s / 60}


def sweep_table(plans: Sequence[Plan]) -> str:
    return format_table([sweep_record(p) for p in plans], SWEEP_COLUMNS)


def plan_json(p: Plan, plans: Sequence[Plan], machine: Machine, work: Workload,
              inp: PlanInputs) -> dict[str, Any]:
    return {
        "planner": "hpcdl plan",
        "command": command_line(),
        "machine": {"name": machine.name, "path": machine.path,
                    "description": machine.description, "precision": machine.precision,
                    "precisions": list(machine.precisions),
                    "figures": {k: {"value": f.value, "source": f.source}
                                for k, f in machine.figures.items()}},
        "workload": {"model": work.model, "image_size": work.image_size,
                     "forward_macs": work.forward_macs,
                     "train_flops_per_image": work.train_flops_per_image,
                     "parameters": work.parameters},
        "inputs": asdict(inp),
        "total_s": p.total_s,
        "images_per_s": p.images_per_s,
        "scaling_efficiency": p.scaling_efficiency,
        "dominant": p.dominant,
        "per_iteration": p.per_iteration(),
        "compute_by_class": dict(p.compute_by_class),
        "plan": p.to_dict(),
        "results": [sweep_record(q) for q in plans],
        "notes": list(p.notes),
    }


def plot_sweep(path: str, plans: Sequence[Plan], title: str) -> None:
    """Iteration time by term, scaling efficiency and time to train against process count."""
    from hpcdl.results import png_axes

    procs = [p.procs for p in plans]
    with png_axes(path, (11, 4.2), ncols=2) as (ax_t, ax_e):
        for key, label, style in (("iteration_s", "iteration", "k-"),
                                  ("compute_s", "compute", "o-"),
                                  ("optimizer_s", "LARS update", "d:"),
                                  ("comm_s", "allreduce (total)", "s--"),
                                  ("comm_exposed_s", "allreduce (exposed)", "s-"),
                                  ("data_s", "data loading (per node)", "^:")):
            values = [getattr(p, key) for p in plans]
            if any(v > 0 for v in values):
                ax_t.plot(procs, [v if v > 0 else float("nan") for v in values], style,
                          label=label)
        for ax in (ax_t, ax_e):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("MPI ranks")
        ax_t.set_yscale("log")
        ax_t.set_ylabel("seconds per iteration")
        ax_t.legend(fontsize=8)
        ax_e.plot(procs, [p.scaling_efficiency * 100 for p in plans], "o-")
        ax_e.set_ylim(0, 105)
        ax_e.set_ylabel("scaling efficiency (%)")
        ax_e2 = ax_e.twinx()
        ax_e2.plot(procs, [p.total_s / 60 for p in plans], "s:", color="tab:red")
        ax_e2.set_yscale("log")
        ax_e2.set_ylabel("time to train (min)", color="tab:red")
        ax_t.figure.suptitle(title)
