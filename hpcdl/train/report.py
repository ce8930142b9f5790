"""Plots of a run from its directory (``hpcdl report RUN_DIR``): loss, accuracy, learning
rate and the throughput breakdown (compute, data wait, communication wait), as You et al.
(ICPP'18) judge a large-batch run. Reads only ``metrics.jsonl`` and ``summary.json``: no MPI.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from hpcdl.results import png_axes
from hpcdl.train.metrics import read_metrics, read_summary

__all__ = ["plot_run", "summarize_run", "expected_vs_measured"]


def _latest_per_step(records: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """One record per step (a resumed run may have redone steps: the last wins)."""
    by_step: dict[int, dict[str, Any]] = {}
    for r in records:
        if r.get("kind") == kind:
            by_step[int(r["step"])] = r
    return [by_step[s] for s in sorted(by_step)]


@contextlib.contextmanager
def _figure(path: str, title: str, xlabel: str, ylabel: str) -> Iterator[Any]:
    """Axes whose figure is written to ``path`` when the block ends (hpcdl.results.png_axes)."""
    with png_axes(path, (6.4, 4.0), dpi=100) as ax:
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        yield ax


def plot_run(run_dir: str, out_dir: str | None = None) -> list[str]:
    """Write ``loss.png``, ``accuracy.png``, ``lr.png`` and ``throughput.png`` to
    RUN_DIR/plots (or ``out_dir``); returns the paths written."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no metrics (is {run_dir} an hpcdl run directory?)")
    records = read_metrics(path)
    train = _latest_per_step(records, "train")
    evals = _latest_per_step(records, "eval")
    if not train:
        raise ValueError(f"{path}: no training records yet")
    out_dir = out_dir or os.path.join(run_dir, "plots")
    os.makedirs(out_dir, exist_ok=True)
    steps = [r["step"] for r in train]
    written = [os.path.join(out_dir, name) for name in
               ("loss.png", "accuracy.png", "lr.png", "throughput.png")]
    with _figure(written[0], "Training loss", "step", "loss (mean over ranks)") as ax:
        ax.plot(steps, [r["loss"] for r in train], label="train")
        if evals:
            ax.plot([r["step"] for r in evals], [r["loss"] for r in evals], "o-",
                    label="validation")
        ax.legend()
    with _figure(written[1], "Validation accuracy", "step", "accuracy") as ax:
        if evals:
            ax.plot([r["step"] for r in evals], [r["top1"] for r in evals], "o-", label="top-1")
            ax.plot([r["step"] for r in evals], [r["top5"] for r in evals], "s--", label="top-5")
            ax.set_ylim(0, 1)
            ax.legend()
        else:
            ax.text(0.5, 0.5, "no evaluation yet", ha="center", transform=ax.transAxes)
    with _figure(written[2], "Learning rate (schedule)", "step", "lr") as ax:
        ax.plot(steps, [r["lr"] for r in train])
    _plot_throughput(train, written[3])
    return written


def _plot_throughput(train: list[dict[str, Any]], path: str) -> None:
    """Per-step time split into data wait, communication wait and the rest (compute), with
    images/s on a second axis: where a slow run spends its time."""
    steps = [r["step"] for r in train]
    data = [r.get("data_wait_s", 0.0) for r in train]
    comm = [r.get("comm_wait_s", 0.0) for r in train]
    compute = [max(r.get("step_s", 0.0) - d - c, 0.0) for r, d, c in zip(train, data, comm,
                                                                      strict=True)]
    with _figure(path, "Throughput breakdown (rank 0)", "step", "seconds per step") as ax:
        ax.stackplot(steps, compute, comm, data, labels=["compute", "comm wait", "data wait"],
                     alpha=0.8)
        ax.legend(loc="upper left")
        right = ax.twinx()
        right.plot(steps, [r["images_per_s"] for r in train], "k-", lw=1, label="images/s")
        right.set_ylabel("images/s (global)")


def summarize_run(run_dir: str) -> str:
    """A few lines a person reads first: what ran, how far, how well, how fast."""
    path = os.path.join(run_dir, "summary.json")
    if not os.path.exists(path):
        return f"{run_dir}: no summary.json (the run has not finished a stage yet)"
    s = read_summary(path)

    def fmt(value: Any, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    return "\n".join([
        f"run       {run_dir}: {s.get('name')} ({s.get('stopped')})",
        f"progress  step {s.get('steps')}/{s.get('total_steps')}, epochs {s.get('epochs')}",
        f"accuracy  top-1 {fmt(s.get('top1'), '.4f')}, top-5 {fmt(s.get('top5'), '.4f')}",
        f"batch     global {s.get('global_batch')} = {s.get('per_rank_batch')} per rank x "
        f"{s.get('ranks')} ranks x {s.get('accumulation')} accumulation",
        f"speed     {fmt(s.get('images_per_s'), '.1f')} images/s, "
        f"wall {fmt(s.get('wall_s'), '.1f')} s, "
        f"comm wait {fmt(s.get('comm_wait_s'), '.1f')} s",
        f"params    sha256 {s.get('params_sha256')}",
        *expected_vs_measured(run_dir, s.get("top1")),
    ])


def expected_vs_measured(run_dir: str, top1: float | None) -> list[str]:
    """The recipe's ``expected.top1`` (what its source reports) against the measured top-1,
    read from RUN_DIR/config.yaml; nothing when the recipe records no expectation."""
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.exists(path):
        return []
    import yaml

    with open(path, encoding="utf-8") as f:
        expected = (yaml.safe_load(f) or {}).get("expected") or {}
    if "top1" not in expected:
        return []
    note = "" if expected.get("checked") else " [value not re-checked against the source]"
    line = f"expected  top-1 {expected['top1']:.4f} ({expected.get('source')}){note}"
    if top1 is None:
        return [line, "vs        no measured top-1 yet"]
    diff = 100.0 * (top1 - expected["top1"])
    return [line, f"vs        measured {top1:.4f}: {diff:+.2f} points"]
