"""Check a shard directory against its manifest: every shard present, its sha256 and its
sample count as recorded. ``hpcdl prep verify DIR`` exits non-zero naming each bad shard."""
from __future__ import annotations

import os
from collections.abc import Iterable

from hpcdl.data.format import read_manifest, shard_problem

__all__ = ["read_manifest", "verify_shards", "check_shard"]


def shard_count(path: str) -> int:
    """Samples in one shard file (the length of its ``labels``)."""
    import h5py

    with h5py.File(path, "r") as f:
        counts = {len(f[name]) for name in ("images", "labels", "keys", "shapes")}
    if len(counts) != 1:
        raise ValueError(f"{path}: datasets disagree on the sample count {sorted(counts)}")
    return counts.pop()


def check_shard(shard_dir: str, entry: dict) -> str | None:
    """Why one manifest entry's shard is bad, or None when it is good: its file, size and
    sha256 (:func:`hpcdl.data.format.shard_problem`), then its sample count."""
    problem = shard_problem(shard_dir, entry, verify=True)
    if problem is not None:
        return problem
    try:
        count = shard_count(os.path.join(shard_dir, entry["name"]))
    except Exception as exc:  # noqa: BLE001 - any HDF5 failure makes the shard bad
        return f"unreadable: {exc}"
    if count != entry["num_samples"]:
        return f"{count} samples != manifest {entry['num_samples']}"
    return None


def verify_shards(shard_dir: str, names: Iterable[str] | None = None) -> dict[str, str]:
    """Bad shards (name -> reason) among ``names`` (default: all in the manifest)."""
    wanted = set(names) if names is not None else None
    checked = [e for e in read_manifest(shard_dir)["shards"]
               if wanted is None or e["name"] in wanted]
    return {e["name"]: reason for e in checked if (reason := check_shard(shard_dir, e))}
