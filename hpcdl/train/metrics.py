"""The run's readable record: ``metrics.jsonl`` (one JSON object a line) and ``summary.json``.

Train records: ``{"kind": "train", "step", "epoch", "loss", "lr", "images_per_s",
"step_s", "data_wait_s", "comm_wait_s", "time"}``; eval records: ``{"kind": "eval", "step",
"epoch", "loss", "top1", "top5", "samples", "time"}``. Only rank 0 writes. ``summary.json``
is written atomically at the end of a run (DESIGN.md: the run directory is the record).
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

from hpcdl.io import atomic_write_text

__all__ = ["MetricsWriter", "read_metrics", "write_summary", "read_summary", "params_sha256"]


class MetricsWriter:
    """Append-only ``metrics.jsonl``; a line is flushed as soon as it is written, so ``tail -f``
    and a crash both see every completed step."""

    def __init__(self, path: str) -> None:
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._file = open(path, "a", encoding="utf-8")

    def write(self, record: Mapping[str, Any]) -> None:
        self._file.write(json.dumps(dict(record), sort_keys=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(path: str) -> list[dict[str, Any]]:
    """Records of a metrics.jsonl; a torn last line (a killed run) is skipped."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def truncate_metrics(path: str, after_step: int) -> int:
    """Drop records with step > ``after_step`` (what a resumed run will redo); returns how
    many records were dropped. Keeps the file a single history without duplicate steps."""
    if not os.path.exists(path):
        return 0
    records = read_metrics(path)
    with open(path, encoding="utf-8") as f:
        lines = sum(1 for line in f if line.strip())
    kept = [r for r in records if int(r.get("step", 0)) <= after_step]
    if len(kept) != lines:  # later steps, or a torn line a new record would be glued to
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in kept))
    return len(records) - len(kept)


def write_summary(path: str, summary: Mapping[str, Any]) -> None:
    atomic_write_text(path, json.dumps(dict(summary), indent=2) + "\n")


def read_summary(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def params_sha256(tensors: Iterable[tuple[str, Any]]) -> str:
    """sha256 over (name, dtype, shape, bytes) of each tensor, in the given order: equal
    exactly when every bit of every parameter is equal."""
    import torch

    digest = hashlib.sha256()
    for name, tensor in tensors:
        t = tensor.detach().contiguous().cpu()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        digest.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
