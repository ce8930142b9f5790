"""The shard directory format shared by data_prep (writer) and the loader (reader).

``DIR/manifest.json`` lists classes, per-split counts and each shard's name, sample count, size
and sha256; shards are ``DIR/{split}-{index:05d}-of-{count:05d}.h5`` (docs/data.md). A reader
checks a shard's size before opening it (a truncated copy is named before training), its
sha256 when asked (``--verify-shards``).
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable

from hpcdl.errors import BadInputError
from hpcdl.io import sha256_file

__all__ = ["FORMAT_VERSION", "MANIFEST", "SPLITS", "ManifestError", "ShardError",
           "check_num_classes", "check_shard_files", "read_manifest", "shard_name",
           "shard_problem", "split_shards"]

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
#: The splits a shard directory may hold (the tree's train/ and val/ folders).
SPLITS = ("train", "val")
_ENTRY_KEYS = ("name", "split", "index", "num_samples", "bytes", "sha256")
_SHA256 = re.compile(r"[0-9a-f]{64}")


class ManifestError(BadInputError, ValueError):
    """The shard directory or its manifest.json is missing, empty, corrupt or too new."""


class ManifestMissingError(ManifestError, FileNotFoundError):
    """No manifest.json (no such directory, an empty one, or not a shard directory)."""


class ShardError(BadInputError, OSError):
    """A shard file is missing, truncated, altered or unreadable."""


def shard_name(split: str, index: int, count: int) -> str:
    return f"{split}-{index:05d}-of-{count:05d}.h5"


def _missing(shard_dir: str, path: str) -> ManifestMissingError:
    if not os.path.isdir(shard_dir):
        what = f"--data {shard_dir}: no such directory" if not os.path.exists(shard_dir) \
            else f"--data {shard_dir}: not a directory"
    elif not os.listdir(shard_dir):
        what = f"--data {shard_dir}: the directory is empty"
    else:
        what = f"{path}: no manifest, so {shard_dir} is not a shard directory"
    return ManifestMissingError(f"{what}; point --data at the output of `hpcdl prep shard` "
                                f"(or make one: hpcdl prep shard --src IMAGENET_TREE --out "
                                f"{shard_dir} --shards N)")


def read_manifest(shard_dir: str) -> dict:
    """The manifest of a shard directory; a :class:`ManifestError` naming the manifest when the
    directory or manifest is missing or empty, not JSON, not a manifest, or too new."""
    path = os.path.join(shard_dir, MANIFEST)
    if not os.path.isfile(path):
        raise _missing(shard_dir, path)
    redo = f"re-shard (hpcdl prep shard --src TREE --out {shard_dir} ...) or restore the manifest"
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"manifest {path} is unreadable or corrupt ({exc}); {redo}") from None
    if not isinstance(manifest, dict):
        raise ManifestError(f"manifest {path} is not a manifest (a JSON "
                            f"{type(manifest).__name__}, not an object); {redo}")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        newer = isinstance(version, int) and version > FORMAT_VERSION
        fix = "upgrade hpcdl (pip install -U hpcdl) or re-shard with this version" if newer \
            else "re-shard with this version of hpcdl"
        raise ManifestError(f"manifest {path}: shard format {version!r}, this hpcdl reads format "
                            f"{FORMAT_VERSION}; {fix}")
    shards = manifest.get("shards")
    if not isinstance(shards, list) or not all(
            isinstance(e, dict) and all(k in e for k in _ENTRY_KEYS) for e in shards):
        raise ManifestError(f"manifest {path}: 'shards' must list entries with "
                            f"{', '.join(_ENTRY_KEYS)}; {redo}")
    classes = manifest.get("classes")
    if not isinstance(classes, list) or not classes or not all(
            isinstance(c, str) for c in classes):
        raise ManifestError(f"manifest {path}: 'classes' must be a non-empty list of class "
                            f"names; {redo}")
    _check_entries(path, shards, redo)
    return manifest


def _check_entries(path: str, entries: list[dict], redo: str) -> None:
    """Every entry is a shard the format defines: a known split, an index below its split's
    shard count, and exactly that shard's name (:func:`shard_name`), once. Names become paths
    (opened, staged on every node), so ``../../x`` or an absolute path is refused here."""
    counts = {split: sum(1 for e in entries if e["split"] == split) for split in SPLITS}
    seen: set[str] = set()
    for position, entry in enumerate(entries):
        split, index = entry["split"], entry["index"]
        if split not in SPLITS:
            why = f"split {ascii(split)} is not one of {', '.join(SPLITS)}"
        elif not isinstance(index, int) or not 0 <= index < counts[split]:
            why = f"index {index!r} is outside 0..{counts[split] - 1} ({split} has " \
                  f"{counts[split]} shards)"
        elif entry["name"] != shard_name(split, index, counts[split]):
            why = f"the name must be {shard_name(split, index, counts[split])!r}"
        elif entry["name"] in seen:
            why = "listed twice"
        elif not all(isinstance(entry[k], int) and entry[k] >= 0
                     for k in ("num_samples", "bytes")):
            why = "num_samples and bytes must be non-negative integers"
        elif not isinstance(entry["sha256"], str) or not _SHA256.fullmatch(entry["sha256"]):
            why = f"sha256 {ascii(entry['sha256'])[:80]} is not 64 hex digits"
        else:
            seen.add(entry["name"])
            continue
        # ascii(): a hostile name cannot break the one-line message (newlines, escapes)
        raise ManifestError(f"manifest {path}: shard entry {position} {ascii(entry['name'])}: "
                            f"{why}; {redo}")


def check_num_classes(shard_dir: str, manifest: dict, num_classes: int | None) -> None:
    """Raise :class:`ManifestError` when the model's ``num_classes`` (the recipe's
    ``model.num_classes``; None: nothing to compare) differs from the manifest's class count
    (labels past the model's outputs, or a class never trained)."""
    have = len(manifest["classes"])
    if num_classes is not None and num_classes != have:
        raise ManifestError(f"manifest {os.path.join(shard_dir, MANIFEST)} has {have} classes, "
                            f"the recipe's model.num_classes is {num_classes}; set "
                            f"model.num_classes={have} or train on shards of {num_classes} "
                            f"classes")


def split_shards(manifest: dict, split: str) -> list[dict]:
    """The manifest entries of one split, by shard index (a clear error if the split is absent)."""
    entries = sorted((e for e in manifest["shards"] if e["split"] == split),
                     key=lambda e: e["index"])
    if not entries:
        have = sorted({e["split"] for e in manifest["shards"]})
        raise ManifestError(f"no {split!r} shards in the manifest (splits: {have}); shard a "
                            f"tree with a {split}/ folder")
    return entries


def shard_problem(shard_dir: str, entry: dict, verify: bool = False) -> str | None:
    """Why the file of one manifest entry is not the shard the manifest records, or None:
    missing (or unreadable), another size, and with ``verify`` another sha256 (reads every
    byte). The one check behind ``hpcdl train`` (at open) and ``hpcdl prep verify``."""
    path = os.path.join(shard_dir, entry["name"])
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        return "missing"
    except OSError as exc:
        return exc.strerror or str(exc)
    if size != entry["bytes"]:
        return f"{size} bytes, the manifest records {entry['bytes']}: truncated or replaced"
    if verify:
        digest = sha256_file(path)
        if digest != entry["sha256"]:
            return (f"sha256 {digest[:12]}... differs from the manifest's "
                    f"{entry['sha256'][:12]}... (corrupted)")
    return None


def check_shard_files(shard_dir: str, entries: Iterable[dict], verify: bool = False) -> None:
    """Raise :class:`ShardError` naming the first of ``entries`` with a :func:`shard_problem`."""
    for entry in entries:
        if (problem := shard_problem(shard_dir, entry, verify)) is not None:
            raise ShardError(f"shard {os.path.join(shard_dir, entry['name'])}: {problem}; "
                             f"stage or copy it again, and check the directory with "
                             f"`hpcdl prep verify {shard_dir}`")
