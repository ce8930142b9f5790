"""hpcdl/data: HDF5 shards -> per-node sampler -> decode + augment -> prefetched uint8 batches.

``ShardedImageNet``, ``normalize`` and ``node_layout`` import torch / mpi4py when first used,
so ``data_prep`` and ``hpcdl --help`` can import this package cheaply.
"""
from __future__ import annotations

from hpcdl.data.format import FORMAT_VERSION, read_manifest

__all__ = ["FORMAT_VERSION", "ShardedImageNet", "normalize", "input_normalization",
           "node_layout", "read_manifest", "sharded_loader"]


def __getattr__(name: str):
    if name in ("ShardedImageNet", "normalize", "input_normalization", "IMAGENET_MEAN",
                "IMAGENET_STD", "sharded_loader"):
        from hpcdl.data import loader

        return getattr(loader, name)
    if name == "node_layout":
        from hpcdl.topology import node_layout

        return node_layout
    raise AttributeError(f"module 'hpcdl.data' has no attribute {name!r}")
