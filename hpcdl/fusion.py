"""The fusion bucket: gradients, and any list given to ``Communicator.allreduce_``, travel in
flat buckets of at most this many bytes (hpcdl/comm/reducer.py says why). A recipe gives the
size in MiB (``comm.bucket_mb``), the communicator and the reducer take bytes: the default and
the one conversion live here, standard library only, below the recipe reader and the comm.
"""
from __future__ import annotations

__all__ = ["DEFAULT_BUCKET_MB", "bucket_bytes", "check_bucket_bytes"]

#: ``comm.bucket_mb`` when a recipe does not say, and the communicator's own default: the
#: 25 MiB of PyTorch DDP's ``bucket_cap_mb`` (Li et al., VLDB 2020).
DEFAULT_BUCKET_MB = 25.0


def bucket_bytes(mb: float) -> int:
    """``mb`` MiB (2**20 bytes each) in whole bytes."""
    return int(mb * 2**20)


def check_bucket_bytes(value: int, owner: str) -> int:
    """``value`` as an int when positive, else a ValueError naming ``owner`` (a recipe's
    ``comm.bucket_mb`` is checked by its dotted name where the recipe is read)."""
    if int(value) <= 0:
        raise ValueError(f"{owner}: bucket_bytes must be > 0, got {value}")
    return int(value)
