"""The shard directory format shared by data_prep (writer) and the loader (reader).

``DIR/manifest.json`` lists classes, per-split counts and every shard's name, sample count,
size in bytes and sha256; shards are ``DIR/{split}-{index:05d}-of-{count:05d}.h5``
(docs/data.md). A reader checks what it is about to open against the manifest: the size always
(one ``stat`` per shard, so a truncated copy is named before training starts, not found as a
bare HDF5 error in a loader thread hours in), the sha256 when asked (``--verify-shards``).
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable

from hpcdl.errors import BadInputError
from hpcdl.io import sha256_file

__all__ = ["FORMAT_VERSION", "MANIFEST", "ManifestError", "ShardError", "check_shard_files",
           "read_manifest", "shard_name", "split_shards"]

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_ENTRY_KEYS = ("name", "split", "index", "num_samples", "bytes", "sha256")


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
    return manifest


def split_shards(manifest: dict, split: str) -> list[dict]:
    """The manifest entries of one split, by shard index (a clear error if the split is absent)."""
    entries = sorted((e for e in manifest["shards"] if e["split"] == split),
                     key=lambda e: e["index"])
    if not entries:
        have = sorted({e["split"] for e in manifest["shards"]})
        raise ManifestError(f"no {split!r} shards in the manifest (splits: {have}); shard a "
                            f"tree with a {split}/ folder")
    return entries


def check_shard_files(shard_dir: str, entries: Iterable[dict], verify: bool = False) -> None:
    """Raise :class:`ShardError` naming the first of ``entries`` whose file is missing or has
    another size than the manifest records; with ``verify`` also another sha256 (reads every
    byte: ``--verify-shards``)."""
    for entry in entries:
        path = os.path.join(shard_dir, entry["name"])
        try:
            size = os.path.getsize(path)
        except OSError as exc:
            raise ShardError(f"shard {path}: {exc.strerror or exc}; stage or copy it again, or "
                             f"check the directory with `hpcdl prep verify {shard_dir}`") from None
        if size != entry["bytes"]:
            raise ShardError(f"shard {path} is {size} bytes, the manifest records "
                             f"{entry['bytes']}: truncated or replaced; copy it again and run "
                             f"`hpcdl prep verify {shard_dir}`")
        if verify:
            digest = sha256_file(path)
            if digest != entry["sha256"]:
                raise ShardError(f"shard {path}: sha256 {digest[:12]}... differs from the "
                                 f"manifest's {entry['sha256'][:12]}... (corrupted); copy it "
                                 f"again and run `hpcdl prep verify {shard_dir}`")
