"""data_prep: ImageNet tree -> checksummed HDF5 shards (MPI-parallel, resumable), verification,
staging to node-local disk, and the trees used by tests and the demo (docs/data.md).

Modules: ``tree`` (scan TREE/train, TREE/val and the validation label files), ``shard``,
``verify``, ``stage``, ``synthetic`` (ImageNet-shaped trees with ILSVRC2012's quirks),
``fashion_mnist`` (the demo data as an ImageNet-shaped tree).
"""
