"""The shard directory format shared by data_prep (writer) and the loader (reader).

``DIR/manifest.json`` lists classes, per-split counts and every shard's name, sample count
and sha256; shards are ``DIR/{split}-{index:05d}-of-{count:05d}.h5`` (docs/data.md).
"""
from __future__ import annotations

import json
import os

FORMAT_VERSION = 1
MANIFEST = "manifest.json"


def shard_name(split: str, index: int, count: int) -> str:
    return f"{split}-{index:05d}-of-{count:05d}.h5"


def read_manifest(shard_dir: str) -> dict:
    """The manifest of a shard directory, with a clear error when it is missing or too new."""
    path = os.path.join(shard_dir, MANIFEST)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no manifest; run `hpcdl prep shard --out {shard_dir}`")
    with open(path, encoding="utf-8") as f:
        manifest = json.load(f)
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: shard format {manifest.get('format_version')!r}; this hpcdl "
                         f"reads format {FORMAT_VERSION}: re-shard with this version")
    return manifest


def split_shards(manifest: dict, split: str) -> list[dict]:
    """The manifest entries of one split, by shard index (a clear error if the split is absent)."""
    entries = sorted((e for e in manifest["shards"] if e["split"] == split),
                     key=lambda e: e["index"])
    if not entries:
        have = sorted({e["split"] for e in manifest["shards"]})
        raise ValueError(f"no {split!r} shards in the manifest (splits: {have})")
    return entries
