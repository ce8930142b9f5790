"""The planner's on-disk cache: one reader and one writer for every per-model count.

Counting a model's layer table costs seconds at 224 px, so the planner keeps each per
``MODEL@SIZE`` key in a JSON file under ``~/.cache/hpcdl`` (``$XDG_CACHE_HOME``):
``layers-v2.json`` (hpcdl.plan.layers). A cache is a convenience, so a missing, corrupt or
read-only one is recounted, never fatal.
"""
from __future__ import annotations

import contextlib
import json
import os
from typing import Any

from hpcdl.io import atomic_write_text


def cache_path(filename: str) -> str:
    """``$XDG_CACHE_HOME/hpcdl/FILENAME`` (default ``~/.cache/hpcdl/FILENAME``)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "hpcdl", filename)


def cache_key(model: str, image_size: int) -> str:
    return f"{model}@{image_size}"


def read_cache(path: str) -> dict[str, Any]:
    """The cache's entries; {} when the file is missing, unreadable or not a JSON object."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def update_cache(path: str, key: str, value: Any) -> None:
    """Add ``key`` to the cache at ``path`` (atomic write; a read-only home is ignored)."""
    entries = read_cache(path)
    entries[key] = value
    with contextlib.suppress(OSError):   # only costs recounting next time
        atomic_write_text(path, json.dumps(entries, indent=1, sort_keys=True) + "\n")
