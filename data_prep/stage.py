"""Copy the shards a node will read to node-local disk (``hpcdl prep stage``).

Run with one rank per node (``srun --ntasks-per-node=1`` or ``mpiexec -ppn 1``); extra ranks
on a node are tolerated and only its first rank copies. The node index is the order of the
nodes' lowest world ranks, by the communicator's rule (hpcdl.topology: ranks that share
memory, or HPCDL_RANKS_PER_NODE pretend nodes) -- the same numbering the loader uses, so node
k stages exactly the shards k, k+K, ... it will read. Copies are atomic (temporary name,
rename after the sha256 matched the manifest) and files already present with the right sha256
are skipped, so a re-run is cheap.

The manifest comes from a shared directory that others may write, and its names become paths
written on every node: ``read_manifest`` admits only the format's own shard names, and each
target is resolved here as well (symbolic links included) and must be a file directly inside
the staging directory. Every target is checked before the directory is created or any byte
copied, so a refused manifest leaves nothing behind.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil

from hpcdl.data.format import SPLITS, ManifestError, shard_problem
from hpcdl.data_prep.shard import MANIFEST
from hpcdl.data_prep.verify import read_manifest
from hpcdl.io import atomic_write, atomic_write_text


def shards_for_node(manifest: dict, node_index: int, num_nodes: int,
                    splits: tuple[str, ...] = SPLITS,
                    everything: bool = False) -> list[dict]:
    """Manifest entries node ``node_index`` of ``num_nodes`` reads: shard i of a split when
    i mod num_nodes == node_index (all of them with ``everything``, for rotate_shards)."""
    return [e for e in manifest["shards"]
            if e["split"] in splits and (everything or e["index"] % num_nodes == node_index)]


def staging_target(local_dir: str, name: str, shard_dir: str) -> str:
    """Where shard ``name`` is staged: ``local_dir/name`` resolved, which must be a file
    directly inside ``local_dir`` (resolved too), else a :class:`ManifestError` naming the
    manifest of ``shard_dir`` and the entry."""
    root = os.path.realpath(local_dir)
    target = os.path.realpath(os.path.join(root, name))
    if os.path.dirname(target) != root or target == root:
        raise ManifestError(f"manifest {os.path.join(shard_dir, MANIFEST)}: shard entry "
                            f"{ascii(name)} would be staged to {target}, outside --to "
                            f"{local_dir}; nothing was staged: restore the manifest or re-shard")
    return target


def copy_verified(src: str, dst: str, sha256: str, chunk: int = 1 << 22) -> None:
    """Copy ``src`` to ``dst`` atomically, hashing on the way; a mismatch leaves nothing."""
    def write(out) -> None:
        digest = hashlib.sha256()
        with open(src, "rb") as f:
            while block := f.read(chunk):
                digest.update(block)
                out.write(block)
        if digest.hexdigest() != sha256:
            raise ValueError(f"{src}: sha256 {digest.hexdigest()[:12]}... does not match the "
                             f"manifest ({sha256[:12]}...); run `hpcdl prep verify`")
    atomic_write(dst, write)


def stage_node(shard_dir: str, local_dir: str, node_index: int, num_nodes: int,
               splits: tuple[str, ...] = SPLITS, everything: bool = False) -> dict:
    """Stage one node's shards; returns counts of copied and already-present files."""
    manifest = read_manifest(shard_dir)
    entries = shards_for_node(manifest, node_index, num_nodes, splits, everything)
    targets = {e["name"]: staging_target(local_dir, e["name"], shard_dir) for e in entries}
    os.makedirs(local_dir, exist_ok=True)
    copied, present, todo = [], [], []
    for entry in entries:
        dst = targets[entry["name"]]
        # dst is local_dir/name resolved (staging_target): its directory holds the same file
        if shard_problem(os.path.dirname(dst), entry, verify=True) is None:
            present.append(entry["name"])
        else:
            todo.append(entry)
    needed, free = sum(e["bytes"] for e in todo), shutil.disk_usage(local_dir).free
    if needed > free:
        raise OSError(f"{local_dir}: {needed / 2**30:.1f} GiB to stage but {free / 2**30:.1f} GiB "
                      "free; stage to a larger disk or use more nodes")
    for entry in todo:
        copy_verified(os.path.join(shard_dir, entry["name"]), targets[entry["name"]],
                      entry["sha256"])
        copied.append(entry["name"])
    atomic_write_text(os.path.join(local_dir, MANIFEST), json.dumps(manifest, indent=1) + "\n")
    return {"node_index": node_index, "num_nodes": num_nodes, "local_dir": local_dir,
            "copied": copied,
            "present": present,
            "bytes": sum(os.path.getsize(targets[n]) for n in copied + present)}

