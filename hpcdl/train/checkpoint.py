"""Checkpoints: what an exact resume needs, written by every rank in parallel, committed by
one rename, checked by sha256, read with weights_only.

A checkpoint is a directory ``RUN_DIR/checkpoints/ckpt-STEP.pt/``: ``manifest.json`` (position,
layout, recipe, line and write sequence, size and sha256 of every other file, its own
``digest``), ``model.pt`` (shared, written by rank 0) and ``rank-XXXXX.pt`` (each rank's own).
What each file holds, lines, pruning and resume: docs/training.md, "Checkpoints and resume";
why no rank's cost grows with the rank count: docs/scaling.md.

- Commit: every part goes into ``.ckpt-STEP.pt.tmp``; rank 0 writes the manifest last, fsyncs
  and renames the directory, so a kill or a full disk leaves earlier checkpoints as they were.
- Checksums: PyTorch does not check a zip member's CRC, so every file's sha256 is checked on
  load; a mismatch, a torn file or a transient read error (:data:`TRANSIENT_ERRNOS`) falls
  back to the previous checkpoint.
- ``torch.load(weights_only=True)`` reads every ``.pt``; the earlier single-file format still
  loads. :func:`check_compatible` refuses another recipe, model or global batch (exit 2).
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import logging
import os
import random
import re
import shutil
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np
import torch

from hpcdl.errors import BadInputError
from hpcdl.io import atomic_write, fsync_directory

__all__ = ["CHECKPOINT_FORMAT", "LEGACY_FORMAT", "CheckpointError", "CheckpointMismatchError",
           "CheckpointWriteError", "checkpoint_path", "check_compatible", "list_checkpoints",
           "save_checkpoint", "load_checkpoint", "latest_valid_checkpoint", "prune_checkpoints",
           "rng_state", "set_rng_state", "resume_layout", "LAYOUT_KEYS", "MANIFEST", "SHARED",
           "rank_file", "check_legacy", "read_file", "begin_write", "write_part", "commit",
           "abandon", "read_manifest", "read_part", "load_part", "merge", "verify_checkpoint",
           "remove_stale_temporaries", "checkpoint_index", "current_line", "start_line",
           "line_recorded", "resume_candidates", "remove_pruned", "TRANSIENT_ERRNOS"]

log = logging.getLogger("hpcdl.train")

#: A checkpoint directory (manifest.json, model.pt, rank-XXXXX.pt).
CHECKPOINT_FORMAT = "hpcdl-checkpoint-2"
#: The single-file checkpoint written before per-rank files (still read).
LEGACY_FORMAT = "hpcdl-checkpoint-1"
MANIFEST = "manifest.json"
SHARED = "model.pt"
#: Keys of the state that go to ``model.pt``; every other key is a scalar of the manifest.
SHARED_KEYS = ("model", "optimizer", "consistency", "bn_mean")
#: errno values that say the file system is in trouble rather than the file damaged.
TRANSIENT_ERRNOS = frozenset({errno.EIO, errno.ESTALE, errno.EACCES, errno.EPERM, errno.EAGAIN,
                              errno.ETIMEDOUT, errno.EBUSY, errno.ENOMEDIUM})
_NAME = re.compile(r"^ckpt-(\d+)\.pt$")
#: temporaries of a checkpoint write (atomic_write's files, the directory being written, a
#: pruned checkpoint being removed): nothing else in checkpoints/ is ever removed as stale
_TEMP = re.compile(r"^\.ckpt-\d+\.pt\..*tmp$")
_LINE_FILE = ".line.json"
#: required keys of a single-file (legacy) checkpoint
_REQUIRED = ("format", "step", "epoch", "batch_in_epoch", "model", "optimizer", "rng",
             "world_size")
_MANIFEST_REQUIRED = ("format", "step", "epoch", "batch_in_epoch", "world_size", "files",
                      "digest")


class CheckpointError(BadInputError, RuntimeError):
    """A checkpoint file is unreadable, corrupt, or not an hpcdl checkpoint. ``transient``:
    the file could not be read for a reason that may pass (:data:`TRANSIENT_ERRNOS`)."""

    transient: bool = False


class CheckpointMismatchError(CheckpointError):
    """A valid checkpoint of another run: another recipe, model or global batch."""


class CheckpointWriteError(CheckpointError, OSError):
    """A checkpoint could not be written (disk full, quota, file-size limit); the previous
    checkpoints are untouched."""


def read_error(path: str, exc: OSError) -> CheckpointError:
    error = CheckpointError(f"checkpoint {path}: cannot read it ({exc.strerror or exc}, "
                            f"errno {exc.errno})")
    error.transient = exc.errno in TRANSIENT_ERRNOS
    return error


@contextlib.contextmanager
def _reading(path: str, missing: str) -> Iterator[None]:
    """Translate a failed read of ``path``: absent -> :class:`CheckpointError` ``missing``;
    any other OSError -> :func:`read_error` (transient or not)."""
    try:
        yield
    except FileNotFoundError:
        raise CheckpointError(missing) from None
    except OSError as exc:
        raise read_error(path, exc) from None


def _not_a_state(source: str, exc: Exception) -> CheckpointError:
    """What ``torch.load`` failing on ``source`` means (it raises many kinds for a bad file)."""
    return CheckpointError(f"checkpoint {source} is corrupt or not written by hpcdl "
                           f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]})")


def checkpoint_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def checkpoint_path(run_dir: str, step: int) -> str:
    return os.path.join(checkpoint_dir(run_dir), f"ckpt-{step:09d}.pt")


def checkpoint_step(path: str) -> int:
    """The step in a checkpoint's name (``ckpt-000000400.pt`` -> 400)."""
    return int(_NAME.match(os.path.basename(os.path.normpath(path))).group(1))


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def list_checkpoints(run_dir: str) -> list[str]:
    """Checkpoints of a run (directories, or single files of the earlier format), oldest step
    first. A temporary (a write not committed) is not one."""
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


# -- writing: one file each rank, the manifest last, one rename ---------------------------
class _HashingWriter:
    """A file that hashes what passes through it (``torch.save`` streams into it): the sha256
    of a part costs no second read and no second copy in memory."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.sha256, self.bytes = f, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        self.bytes += len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def _temporary_name(path: str, kind: str = "") -> str:
    """``.ckpt-STEP.pt.tmp`` (the write), or ``.ckpt-STEP.pt.KIND.tmp``, beside ``path``."""
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{kind}tmp")


def begin_write(path: str) -> str:
    """Rank 0, before any rank writes a part of checkpoint ``path``: remove the stale
    temporaries of the run, make the (empty) temporary directory, return it."""
    remove_stale_temporaries(os.path.dirname(os.path.dirname(path)))
    tmp = _temporary_name(path)
    os.makedirs(tmp)
    return tmp


def write_part(directory: str, name: str, state: Mapping[str, Any]) -> dict[str, Any]:
    """Write ``state`` to ``directory/name`` (fsynced) and return its ``{"bytes", "sha256"}``.
    The directory is a temporary one: its rename is what makes the part count."""
    path = os.path.join(directory, name)
    try:
        with open(path, "wb") as f:
            writer = _HashingWriter(f)
            torch.save(dict(state), writer)
            f.flush()
            os.fsync(f.fileno())
    except (OSError, RuntimeError) as exc:
        raise _os_error_of(exc) from exc
    return {"bytes": writer.bytes, "sha256": writer.sha256.hexdigest()}


def _digest(manifest: Mapping[str, Any]) -> str:
    content = {k: v for k, v in manifest.items() if k != "digest"}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def commit(tmp: str, path: str, manifest: Mapping[str, Any],
           pause_s: float = 0.0) -> str | None:
    """Rank 0, once every part is in ``tmp``: write the manifest (with its own digest),
    fsync, rename ``tmp`` to ``path``. Returns the temporary name of a checkpoint of the same
    step it replaced (to remove like a pruned one), else None. ``pause_s``: a rehearsed slow write
    (``HPCDL_INJECT=0:checkpointN:sleep=S``), after the data and before the rename."""
    manifest = {**manifest, "format": CHECKPOINT_FORMAT}
    manifest["digest"] = _digest(manifest)
    atomic_write(os.path.join(tmp, MANIFEST),
                 lambda f: f.write(json.dumps(manifest, indent=1, sort_keys=True).encode()))
    _rehearsed_pause(pause_s, path)
    fsync_directory(tmp)
    replaced = None
    if os.path.lexists(path):  # a checkpoint of this step from another line: this one wins
        replaced = _temporary_name(path, "replaced.")
        os.rename(path, replaced)
        log.warning("%s replaces the checkpoint of the same step of an earlier line", path)
    os.rename(tmp, path)
    fsync_directory(os.path.dirname(path))
    return replaced


def abandon(tmp: str) -> None:
    """Remove the temporary directory of a write that failed (rank 0, after every rank)."""
    shutil.rmtree(tmp, ignore_errors=True)


def save_checkpoint(path: str, state: Mapping[str, Any], pause_s: float = 0.0) -> None:
    """Write ``state`` as one file atomically (the single-file format: tools and tests that
    write one state). ``pause_s``: a rehearsed slow write, after the data is in the temporary
    file and before it takes the checkpoint's name."""
    missing = [k for k in _REQUIRED if k not in state]
    if missing:
        raise ValueError(f"save_checkpoint {path}: state lacks {missing}")

    def write(f: Any) -> None:
        torch.save(dict(state), f)
        f.flush()
        _rehearsed_pause(pause_s, path)

    try:
        atomic_write(path, write)
    except (OSError, RuntimeError) as exc:
        raise CheckpointWriteError(f"could not write checkpoint {path}: "
                                   f"{_os_error_of(exc)}") from exc


def _rehearsed_pause(pause_s: float, path: str) -> None:
    """A rehearsed slow write (``HPCDL_INJECT=RANK:checkpointN:sleep=S``)."""
    if pause_s > 0:
        log.warning("pausing %.1f s inside the write of %s (HPCDL_INJECT)", pause_s, path)
        time.sleep(pause_s)


def _os_error_of(exc: BaseException) -> BaseException:
    """The OSError (ENOSPC, EFBIG) behind a failed write, the cause a person can act on:
    torch.save reports one as RuntimeError("unexpected pos ...") with the OSError only as its
    context. Re-raises ``exc`` when there is none."""
    cause: BaseException | None = exc
    for _ in range(8):
        if isinstance(cause, OSError):
            return cause
        cause = cause and (cause.__cause__ or cause.__context__)
    raise exc


# -- reading: every file checked against the manifest --------------------------------------
def read_manifest(path: str) -> dict[str, Any]:
    """The manifest of checkpoint ``path``, its digest checked (a single-file checkpoint: its
    scalars, memory-mapped, no tensor read). Raises :class:`CheckpointError` naming the file."""
    if not os.path.isdir(path):
        state = _load_legacy(path, mmap=True)
        return {k: v for k, v in state.items() if not isinstance(v, (dict, list, torch.Tensor))
                or k == "model_config"}
    name = os.path.join(path, MANIFEST)
    with _reading(name, f"checkpoint {path} is incomplete: no {MANIFEST}"), open(name, "rb") as f:
        data = f.read()
    try:
        manifest = json.loads(data)
    except ValueError as exc:
        raise CheckpointError(f"checkpoint {name} is corrupt ({exc})") from None
    _check_record(manifest, CHECKPOINT_FORMAT, _MANIFEST_REQUIRED, path, name)
    if manifest["digest"] != _digest(manifest):
        raise CheckpointError(f"checkpoint {name} is corrupt: its content does not match its "
                              f"sha256 digest (flipped or torn bytes)")
    return manifest


def read_part(path: str, name: str, record: Mapping[str, Any]) -> bytearray:
    """The bytes of part ``name`` of checkpoint ``path``, checked against its manifest
    ``record`` (size, sha256). Raises :class:`CheckpointError` naming the file and why."""
    file = os.path.join(path, name)
    with _reading(file, f"checkpoint {path} is incomplete: {name} is missing"), \
            open(file, "rb") as f:
        data = bytearray(record["bytes"])
        got = f.readinto(data)
        extra = len(f.read(1))
    if got != record["bytes"] or extra:
        raise CheckpointError(f"checkpoint {file} is corrupt: {'more than ' if extra else ''}"
                              f"{got} bytes, the manifest says {record['bytes']} (torn or "
                              f"truncated)")
    sha = hashlib.sha256(data).hexdigest()
    if sha != record["sha256"]:
        raise CheckpointError(f"checkpoint {file} is corrupt: sha256 {sha[:16]}..., the "
                              f"manifest says {record['sha256'][:16]}... (flipped bytes)")
    return data


def load_part(data: bytes | bytearray, source: str) -> dict[str, Any]:
    """``torch.load(weights_only=True)`` of a part's bytes; a clear error when it fails."""
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises many kinds for a bad file
        raise _not_a_state(source, exc) from None
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {source} holds a {type(state).__name__}, not a state")
    return state


def _load_legacy(path: str, mmap: bool = False) -> dict[str, Any]:
    try:
        with _reading(path, f"checkpoint {path}: no such file"):
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - torch raises many kinds for a bad file
        raise _not_a_state(path, exc) from None
    return check_legacy(state, path)


def check_legacy(state: Any, path: str) -> dict[str, Any]:
    """``state`` when it is a single-file checkpoint, else a :class:`CheckpointError`."""
    _check_record(state, LEGACY_FORMAT, _REQUIRED, path, path)
    return state


def _check_record(record: Any, fmt: str, required: Iterable[str], path: str,
                  name: str) -> None:
    """A :class:`CheckpointError` unless ``record`` is a dict of format ``fmt`` holding every
    ``required`` key; a wrong format names ``path`` and the current format, a missing key
    ``name``."""
    if not isinstance(record, dict) or record.get("format") != fmt:
        found = record.get("format") if isinstance(record, dict) else type(record).__name__
        raise CheckpointError(f"checkpoint {path} is not an hpcdl checkpoint (format {found!r}, "
                              f"expected {CHECKPOINT_FORMAT!r})")
    missing = [k for k in required if k not in record]
    if missing:
        raise CheckpointError(f"checkpoint {name} is incomplete: missing {missing}")


def read_file(path: str) -> bytearray:
    """A single-file checkpoint's bytes (rank 0 reads, then broadcasts them)."""
    with _reading(path, f"checkpoint {path}: no such file"), open(path, "rb") as f:
        data = bytearray(os.fstat(f.fileno()).st_size)
        f.readinto(data)
    return data


def merge(manifest: Mapping[str, Any], shared: Mapping[str, Any]) -> dict[str, Any]:
    """The state a trainer loads: the manifest's scalars and ``model.pt``'s tensors."""
    return {**{k: v for k, v in manifest.items() if k not in ("files", "digest")}, **shared}


def load_checkpoint(path: str, mmap: bool = False) -> dict[str, Any]:
    """The shared state of checkpoint ``path`` (manifest scalars, model, optimizer, ...),
    every byte read checked against the manifest; a clear error when it is not one.
    ``mmap=True``: the manifest's scalars only (cheap)."""
    if not os.path.isdir(path):
        return _load_legacy(path, mmap=mmap)
    manifest = read_manifest(path)
    if mmap:
        return merge(manifest, {})
    data = read_part(path, SHARED, manifest["files"][SHARED])
    return merge(manifest, load_part(data, os.path.join(path, SHARED)))


def verify_checkpoint(path: str) -> None:
    """Check every part of checkpoint ``path`` against its manifest (a tool's full check;
    a resume reads each part on the rank that needs it)."""
    if os.path.isdir(path):
        manifest = read_manifest(path)
        for name, record in manifest["files"].items():
            read_part(path, name, record)
    else:
        _load_legacy(path)


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


# -- lines: which checkpoints belong to the run being continued -----------------------------
@dataclass
class IndexEntry:
    """A checkpoint as its manifest places it: ``line`` ('' for the single-file format, None
    when the manifest cannot be read) and write sequence ``seq`` (None: unknown)."""

    path: str
    step: int
    line: str | None
    seq: int | None

    def order(self) -> tuple[float, int]:
        """Write order; a checkpoint whose manifest does not read sorts newest, so that a
        resume tries it first and reports it by name."""
        return (float("inf") if self.seq is None else self.seq, self.step)


def checkpoint_index(run_dir: str) -> list[IndexEntry]:
    """Every checkpoint of ``run_dir`` with its line and write sequence, in write order."""
    entries = []
    for path in list_checkpoints(run_dir):
        step = checkpoint_step(path)
        if not os.path.isdir(path):
            entries.append(IndexEntry(path, step, "", -1))  # single file: by step, first
            continue
        try:
            with open(os.path.join(path, MANIFEST), "rb") as f:
                manifest = json.loads(f.read())
            entries.append(IndexEntry(path, step, str(manifest["line"]), int(manifest["seq"])))
        except (OSError, ValueError, KeyError, TypeError):
            entries.append(IndexEntry(path, step, None, None))
    return sorted(entries, key=IndexEntry.order)


def current_line(run_dir: str, index: list[IndexEntry] | None = None) -> dict[str, Any] | None:
    """The line ``--resume auto`` follows: the one started last (``.line.json``, written when
    a line starts beside checkpoints of others), else the line of the checkpoint written
    last; ``{"line", "from"}`` or None (no checkpoint)."""
    record = os.path.join(checkpoint_dir(run_dir), _LINE_FILE)
    try:
        with open(record) as f:
            line = json.load(f)
        return {"line": str(line["line"]), "from": line.get("from")}
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("%s is unreadable (%s): following the line of the newest checkpoint",
                    record, exc)
    known = [e for e in (index if index is not None else checkpoint_index(run_dir))
             if e.line is not None]
    return {"line": known[-1].line, "from": None} if known else None


def start_line(run_dir: str, source: str | None) -> str:
    """Rank 0: a new line (``source``: the checkpoint it continues, None from step 0). When
    other lines' checkpoints are there, record it so ``--resume auto`` follows it even before
    its first checkpoint; returns its id."""
    line = uuid.uuid4().hex[:12]
    record = os.path.join(checkpoint_dir(run_dir), _LINE_FILE)
    others = list_checkpoints(run_dir)
    if others:
        atomic_write(record, lambda f: f.write(json.dumps(
            {"line": line, "from": source, "time": time.time()}).encode()))
        log.info("a new line of checkpoints starts here (%s); the %d checkpoint(s) of earlier "
                 "lines in %s are kept, not pruned: remove them when they are not needed",
                 f"from {source}" if source else "from step 0", len(others),
                 checkpoint_dir(run_dir))
    else:
        line_recorded(run_dir)
    return line


def line_recorded(run_dir: str) -> None:
    """Rank 0, after a line's first checkpoint: its manifest now says which line is current."""
    record = os.path.join(checkpoint_dir(run_dir), _LINE_FILE)
    if os.path.exists(record):
        os.unlink(record)


def resume_candidates(run_dir: str) -> list[IndexEntry]:
    """What ``--resume auto`` tries, in order: the current line's checkpoints, newest written
    first (and any whose manifest does not read, to report it)."""
    index = checkpoint_index(run_dir)
    line = current_line(run_dir, index)
    if line is None:
        return []
    found = [e for e in reversed(index) if e.line in (line["line"], None)]
    source = line.get("from")
    if source and not any(e.line == line["line"] for e in found) and _NAME.match(
            os.path.basename(os.path.normpath(source))):
        # a line started from a checkpoint and stopped before its own first one
        found.append(IndexEntry(source, checkpoint_step(source), None, None))
    return found


def latest_valid_checkpoint(run_dir: str,
                            mmap: bool = False) -> tuple[str, dict[str, Any]] | None:
    """The newest checkpoint of the current line that loads (``model.pt`` checked; with
    ``mmap`` the manifest only); a bad one is logged (with its name) and the previous one is
    tried. None when there is none."""
    for entry in resume_candidates(run_dir):
        try:
            return entry.path, load_checkpoint(entry.path, mmap=mmap)
        except CheckpointError as exc:
            log.error("%s; trying the previous checkpoint", exc)
    return None


#: What a checkpoint says about the layout that wrote it (hpcdl.train.trainer, elastic resume).
LAYOUT_KEYS = ("world_size", "global_batch", "per_rank", "accumulation", "step",
               "steps_per_epoch")


def resume_layout(spec: str | None, run_dir: str, mpi_comm) -> dict[str, int] | None:
    """The layout (:data:`LAYOUT_KEYS`) of the checkpoint ``--resume spec`` will load, or None
    (fresh start, or one that does not load: the resume reports that). Read before the
    trainer is built, so a new rank count's batch is chosen or refused before any rank loads
    data: rank 0 reads the manifest and broadcasts. Collective over ``mpi_comm``."""
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


# -- pruning and what a kill leaves behind -------------------------------------------------
def prune_checkpoints(run_dir: str, keep: int, line: str | None = None) -> list[str]:
    """Rank 0: take all but the newest ``keep`` checkpoints of ``line`` (by write order) out
    of the run, renamed to temporary names (they stop counting at once) that the caller
    removes (:func:`remove_pruned`). ``line`` None: the newest checkpoint's."""
    index = checkpoint_index(run_dir)
    known = [e for e in index if e.line is not None]
    if line is None and known:
        line = known[-1].line
    mine = [e for e in known if e.line == line]
    pruned = []
    for entry in mine[:-keep] if keep > 0 else []:
        tmp = _temporary_name(entry.path, "pruned.")
        with contextlib.suppress(FileNotFoundError):
            os.rename(entry.path, tmp)
            pruned.append(tmp)
    return pruned


def remove_pruned(pruned: list[str], rank: int | None = None) -> None:
    """Remove pruned checkpoints: ``rank`` given, only that rank's own file in each (every
    rank, in parallel); None, everything left (rank 0, after every rank)."""
    for path in pruned:
        if rank is None and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        elif rank is None or os.path.isdir(path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path if rank is None else os.path.join(path, rank_file(rank)))


def remove_stale_temporaries(run_dir: str) -> list[str]:
    """Rank 0, when no checkpoint write is in flight (at start, before a checkpoint): remove
    what killed writes left in ``checkpoints/`` -- only names of the checkpoint temporary
    pattern (``.ckpt-STEP.pt.*tmp``). Returns the names removed."""
    directory = checkpoint_dir(run_dir)
    if not os.path.isdir(directory):
        return []
    stale = sorted(name for name in os.listdir(directory) if _TEMP.match(name))
    for name in stale:
        remove_pruned([os.path.join(directory, name)])
    if stale:
        log.info("removed %d temporar%s of checkpoint writes that did not finish: %s",
                 len(stale), "y" if len(stale) == 1 else "ies", ", ".join(stale))
    return stale

