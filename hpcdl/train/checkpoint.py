"""Checkpoints: what an exact resume needs, written atomically, read with weights_only.

A checkpoint (``RUN_DIR/checkpoints/ckpt-STEP.pt``) holds the model and optimizer state, the
global step (the schedule is a pure function of it), the loader position (epoch and batch
offset; the loader's order is a function of (seed, epoch)) and every rank's RNG states, so a
resumed ``--deterministic`` run ends with the same parameters as an uninterrupted one.

Only tensors and primitive containers are stored, so ``torch.load(weights_only=True)`` reads
it: a checkpoint cannot run code when loaded. Rank 0 writes: temporary file, fsync, rename
(hpcdl.io.atomic_write), then deletes all but the newest ``keep``. A write that fails (disk
full, file-size limit) or a job killed mid-write leaves the previous checkpoints as they were.

A checkpoint records the run, not the layout: resuming on another rank count is allowed, but
one of another recipe, model or global batch is refused by :func:`check_compatible`, naming
what differs (each is bad input: exit 2, DESIGN.md).
"""
from __future__ import annotations

import logging
import os
import random
import re
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from hpcdl.errors import BadInputError
from hpcdl.io import atomic_write

__all__ = ["CHECKPOINT_FORMAT", "CheckpointError", "CheckpointMismatchError",
           "CheckpointWriteError", "checkpoint_path", "check_compatible", "list_checkpoints",
           "save_checkpoint", "load_checkpoint", "latest_valid_checkpoint", "prune_checkpoints",
           "rng_state", "set_rng_state", "resume_layout", "LAYOUT_KEYS"]

log = logging.getLogger("hpcdl.train")

CHECKPOINT_FORMAT = "hpcdl-checkpoint-1"
_NAME = re.compile(r"^ckpt-(\d+)\.pt$")
_REQUIRED = ("format", "step", "epoch", "batch_in_epoch", "model", "optimizer", "rng",
             "world_size")


class CheckpointError(BadInputError, RuntimeError):
    """A checkpoint file is unreadable, corrupt, or not an hpcdl checkpoint."""


class CheckpointMismatchError(CheckpointError):
    """A valid checkpoint of another run: another recipe, model or global batch."""


class CheckpointWriteError(CheckpointError, OSError):
    """A checkpoint could not be written (disk full, quota, file-size limit); the previous
    checkpoints are untouched."""


def checkpoint_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def checkpoint_path(run_dir: str, step: int) -> str:
    return os.path.join(checkpoint_dir(run_dir), f"ckpt-{step:09d}.pt")


def list_checkpoints(run_dir: str) -> list[str]:
    """Checkpoint files of a run, oldest step first."""
    directory = checkpoint_dir(run_dir)
    if not os.path.isdir(directory):
        return []
    found = [(int(m.group(1)), name) for name in os.listdir(directory)
             if (m := _NAME.match(name))]
    return [os.path.join(directory, name) for _, name in sorted(found)]


# -- RNG states as tensors and primitives (weights_only-safe) ---------------------------------
def rng_state() -> dict[str, Any]:
    """This process's torch, numpy and Python RNG states, as tensors and primitives."""
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "numpy": {"name": np_name, "keys": torch.from_numpy(np_keys.astype(np.int64)),
                  "pos": int(np_pos), "has_gauss": int(np_has_gauss),
                  "cached_gaussian": float(np_gauss)},
        "python": {"version": py_version, "state": list(py_state), "gauss": py_gauss},
    }


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    npy = state["numpy"]
    np.random.set_state((npy["name"], npy["keys"].numpy().astype(np.uint32), npy["pos"],
                         npy["has_gauss"], npy["cached_gaussian"]))
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))


# -- write, read, choose ------------------------------------------------------------------------
def save_checkpoint(path: str, state: Mapping[str, Any], pause_s: float = 0.0) -> None:
    """Write ``state`` atomically (rank 0 only; the caller gathers the RNG states first).
    ``pause_s``: a rehearsed slow write (``HPCDL_INJECT=0:checkpointN:sleep=S``), after the data
    is in the temporary file and before it takes the checkpoint's name."""
    missing = [k for k in _REQUIRED if k not in state]
    if missing:
        raise ValueError(f"save_checkpoint {path}: state lacks {missing}")

    def write(f: Any) -> None:
        torch.save(dict(state), f)
        if pause_s > 0:
            f.flush()
            log.warning("pausing %.1f s inside the write of %s (HPCDL_INJECT)", pause_s, path)
            time.sleep(pause_s)

    try:
        atomic_write(path, write)
    except (OSError, RuntimeError) as exc:
        # torch.save reports a failed write as RuntimeError("unexpected pos ..."), with the
        # OSError (ENOSPC, EFBIG) only as its context: name the OSError, the cause a person
        # can act on.
        cause = _os_error_of(exc)
        if cause is None:
            raise
        raise CheckpointWriteError(f"could not write checkpoint {path}: {cause}") from exc


def _os_error_of(exc: BaseException | None) -> OSError | None:
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError):
            return exc
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def load_checkpoint(path: str, mmap: bool = False) -> dict[str, Any]:
    """Read a checkpoint with ``weights_only=True``; a clear error when it is not one.
    ``mmap=True`` maps tensors instead of reading them (cheap, to look at the scalars)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path}: no such file") from None
    except Exception as exc:  # noqa: BLE001 - torch raises many kinds for a bad file
        raise CheckpointError(f"checkpoint {path} is corrupt or not a checkpoint written by "
                              f"hpcdl ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
                              ) from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(f"checkpoint {path} is not an hpcdl checkpoint (format {found!r}, "
                              f"expected {CHECKPOINT_FORMAT!r})")
    missing = [k for k in _REQUIRED if k not in state]
    if missing:
        raise CheckpointError(f"checkpoint {path} is incomplete: missing {missing}")
    return state


def check_compatible(state: Mapping[str, Any], source: str, *, recipe: str | None,
                     global_batch: int, model_config: Mapping[str, Any] | None,
                     model_state: Mapping[str, torch.Tensor]) -> None:
    """Raise :class:`CheckpointMismatchError` naming every difference between the run that
    wrote ``state`` and this one: recipe name, model (its recipe section when recorded, then
    parameter names and shapes) and global batch. The rank count may differ (elastic resume);
    keys a checkpoint predates are not compared."""
    differs = []
    if state.get("recipe") is not None and recipe is not None and state["recipe"] != recipe:
        differs.append(f"recipe {state['recipe']!r} (this run: {recipe!r})")
    saved_model = state.get("model_config")
    if saved_model is not None and model_config is not None and dict(saved_model) != \
            dict(model_config):
        keys = sorted(set(saved_model) | set(model_config), key=str)
        diff = ", ".join(f"model.{k}={saved_model.get(k)!r} (this run: {model_config.get(k)!r})"
                         for k in keys if saved_model.get(k) != model_config.get(k))
        differs.append(diff)
    else:
        tensors = _tensor_differences(state["model"], model_state)
        if tensors:
            differs.append(f"the model's tensors ({tensors})")
    if state.get("global_batch", global_batch) != global_batch:
        differs.append(f"global batch {state['global_batch']} (this run: {global_batch})")
    if differs:
        raise CheckpointMismatchError(
            f"checkpoint {source} is from another run: {'; '.join(differs)}. Resume it with "
            f"the recipe and batch.global it was written with, or start fresh: --resume none, "
            f"or better a new --out so its checkpoints stay apart")


def _tensor_differences(saved: Mapping[str, Any], mine: Mapping[str, torch.Tensor],
                        show: int = 3) -> str:
    """'2 missing (a, b), 1 of another shape (fc.weight (10, 64) vs (3, 64))', or ''."""
    missing = [k for k in mine if k not in saved]
    extra = [k for k in saved if k not in mine]
    shapes = [f"{k} {tuple(saved[k].shape)} vs {tuple(mine[k].shape)}" for k in mine
              if k in saved and hasattr(saved[k], "shape") and saved[k].shape != mine[k].shape]
    parts = []
    for label, items in (("missing", missing), ("unexpected", extra),
                         ("of another shape", shapes)):
        if items:
            more = f", ... {len(items) - show} more" if len(items) > show else ""
            parts.append(f"{len(items)} {label} ({', '.join(items[:show])}{more})")
    return ", ".join(parts)


def latest_valid_checkpoint(run_dir: str,
                            mmap: bool = False) -> tuple[str, dict[str, Any]] | None:
    """The newest checkpoint of ``run_dir`` that loads; a bad one is logged (with its name)
    and the previous one is tried. None when there is none."""
    for path in reversed(list_checkpoints(run_dir)):
        try:
            return path, load_checkpoint(path, mmap=mmap)
        except CheckpointError as exc:
            log.error("%s; trying the previous checkpoint", exc)
    return None


#: What a checkpoint says about the layout that wrote it (hpcdl.train.trainer, elastic resume).
LAYOUT_KEYS = ("world_size", "global_batch", "per_rank", "accumulation", "step",
               "steps_per_epoch")


def resume_layout(spec: str | None, run_dir: str, mpi_comm) -> dict[str, int] | None:
    """The layout (:data:`LAYOUT_KEYS`) of the checkpoint ``--resume spec`` will load, or None
    (fresh start, or a checkpoint that does not load: the resume itself reports that).

    Read before the trainer is built, so that the per-rank batch at a new rank count is
    chosen, or refused, before any rank loads data. Rank 0 maps the file (no tensor is
    read) and broadcasts. Collective over ``mpi_comm``."""
    layout = None
    if mpi_comm.rank == 0 and spec not in (None, "", "none"):
        try:
            found = latest_valid_checkpoint(run_dir, mmap=True) if spec == "auto" \
                else (spec, load_checkpoint(spec, mmap=True))
        except CheckpointError:
            found = None
        if found is not None:
            state = found[1]
            layout = {k: int(state[k]) for k in LAYOUT_KEYS if k in state}
    return mpi_comm.bcast(layout, root=0)


def prune_checkpoints(run_dir: str, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` checkpoints; returns the deleted paths."""
    paths = list_checkpoints(run_dir)
    doomed = paths[:-keep] if keep > 0 else []
    for path in doomed:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    return doomed
