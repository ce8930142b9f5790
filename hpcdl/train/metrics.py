"""The run's readable record: ``metrics.jsonl`` (one JSON object a line) and ``summary.json``.

Train records: ``{"kind": "train", "step", "epoch", "loss", "lr", "images_per_s",
"step_s", "data_wait_s", "comm_wait_s", "time"}``; eval records: ``{"kind": "eval", "step",
"epoch", "loss", "top1", "top5", "samples", "time"}``. Only rank 0 writes; ``summary.json``
atomically at the end. The same records go to TensorBoard (``tensorboard/``, tags
``KIND/FIELD``) when the optional package is installed (docs/training.md, "The run directory").
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections.abc import Iterable, Mapping
from typing import Any

from hpcdl.io import Closing, atomic_write_text

__all__ = ["MetricsWriter", "read_metrics", "write_summary", "read_summary", "params_sha256"]

log = logging.getLogger("hpcdl.train")
#: fields of a record that are its coordinates, not its measurements
NOT_SCALARS = ("kind", "step", "time")


class TensorBoardEvents:
    """Metrics records as TensorBoard scalars in ``directory``. ``resume_step``: the step a
    resumed run continues from; TensorBoard then drops the earlier session's events after it
    (``purge_step``), as ``truncate_metrics`` drops its lines."""

    def __init__(self, directory: str, resume_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        purge = None if resume_step is None else resume_step + 1
        self._writer = SummaryWriter(log_dir=directory, purge_step=purge)

    def write(self, record: Mapping[str, Any]) -> None:
        kind, step, when = record.get("kind", "metrics"), record.get("step"), record.get("time")
        for field, value in record.items():
            if field not in NOT_SCALARS and isinstance(value, int | float) \
                    and not isinstance(value, bool):
                self._writer.add_scalar(f"{kind}/{field}", value, global_step=step,
                                        walltime=when)
        self._writer.flush()  # as metrics.jsonl: a crash loses no completed record

    def close(self) -> None:
        self._writer.close()


def tensorboard_events(directory: str, resume_step: int | None) -> TensorBoardEvents | None:
    """The event writer, or None (and one log line) when the tensorboard package is absent."""
    try:
        return TensorBoardEvents(directory, resume_step)
    except ImportError as exc:
        log.info("TensorBoard event files off: %s (pip install 'hpcdl[tensorboard]')", exc)
        return None


class MetricsWriter(Closing):
    """Append-only ``metrics.jsonl``; a line is flushed as soon as it is written, so ``tail -f``
    and a crash both see every completed step. Each record also goes to TensorBoard event files
    in ``tensorboard/`` beside it when the package is installed (``tensorboard=False``: never)."""

    def __init__(self, path: str, tensorboard: bool = True) -> None:
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        # a resumed run has had its later lines truncated: its last step is where it resumes
        previous = read_metrics(path) if os.path.exists(path) else []
        resume_step = max((int(r.get("step", 0)) for r in previous), default=None)
        self._file = open(path, "a", encoding="utf-8")
        self._events = None
        if tensorboard:
            directory = os.path.join(os.path.dirname(os.path.abspath(path)), "tensorboard")
            self._events = tensorboard_events(directory, resume_step)

    def write(self, record: Mapping[str, Any]) -> None:
        self._file.write(json.dumps(dict(record), sort_keys=False) + "\n")
        self._file.flush()
        if self._events is not None:
            self._events.write(record)

    def close(self) -> None:
        self._file.close()
        if self._events is not None:
            self._events.close()
            self._events = None


def read_metrics(path: str) -> list[dict[str, Any]]:
    """Records of a metrics.jsonl; a torn last line (a killed run) is skipped."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            with contextlib.suppress(json.JSONDecodeError):
                records.append(json.loads(line.strip()))
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
