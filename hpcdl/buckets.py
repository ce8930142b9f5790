"""Where gradient fusion buckets begin and end: one rule for the reducer and the planner.

:class:`~hpcdl.comm.reducer.GradientReducer` lays out its buckets with :func:`bucket_bounds`
and ``hpcdl plan`` costs the very same buckets, so the two cannot disagree on a boundary. The
rule (DDP's bucketing, Li et al., VLDB 2020, §3.2.3): parameters in backward's order (reverse
registration); at most ``bucket_bytes`` a bucket, a larger parameter alone; a change of
``kind`` (dtype) starts a bucket; with ``last_bucket_bytes``, the first layers that fit in it
form the last bucket on their own, unless every parameter fits. The MiB -> bytes conversion of
``comm.bucket_mb``, the default and the check live here too, and the bounds of the start-up
trial that may choose the layout (hpcdl/comm/trial.py). Pure arithmetic: no torch, no MPI.
"""
from __future__ import annotations

from collections.abc import Sequence

__all__ = ["DEFAULT_BUCKET_MB", "DEFAULT_TRIAL_S", "LAST_BUCKET_BYTES", "MIB",
           "TRIAL_BUCKET_MB", "TRIAL_FIT_SHARE", "TRIAL_RUN_SHARE", "TRIAL_SAMPLE_MB",
           "bucket_bounds", "bucket_bytes", "check_bucket_bytes", "tail_start"]

MIB = 2**20
#: The bucket reduced after backward has finished: small, since nothing hides its reduction
#: (1 MiB: ResNet-50's stem and first stage).
LAST_BUCKET_BYTES = MIB
#: ``comm.bucket_mb`` when a recipe does not say, and the communicator's own default: the
#: 25 MiB of PyTorch DDP's ``bucket_cap_mb`` (Li et al., VLDB 2020).
DEFAULT_BUCKET_MB = 25.0
#: ``comm.trial_s`` when a recipe does not say: the most seconds ``comm.backend: auto``'s
#: start-up trial may take ...
DEFAULT_TRIAL_S = 3.0
#: ... and at most this share of the run's estimated length, when that is known
TRIAL_RUN_SHARE = 0.01
#: bucket sizes (MiB) the trial tries besides the recipe's ``comm.bucket_mb``: DDP's 25 and
#: a step smaller and larger
TRIAL_BUCKET_MB = (4.0, 25.0, 64.0)
#: bytes (MiB) of the large buckets each trial round reduces, the first layers' bucket besides:
#: a large model's whole step (AlexNet's 245 MB: 1 s a round at 2 Gbit/s) would spend a few
#: seconds' budget on the first candidate alone; a sample this size still holds two buckets
#: at the smallest size tried (4 MiB), so bucket sizes still differ in calls per round
TRIAL_SAMPLE_MB = 8.0
#: ... or less on a slow link: the share of the budget every candidate's rounds at the recipe's
#: layout are fitted into (the rest opens them and measures the compute load), never below
#: 1 MiB a round, where each call's latency would start to count more than its bytes
TRIAL_FIT_SHARE = 0.6


def bucket_bytes(bucket_mb: float) -> int:
    """A recipe's ``comm.bucket_mb`` (MiB) as the bytes a bucket holds."""
    return int(bucket_mb * MIB)


def check_bucket_bytes(value: int, owner: str) -> int:
    """``value`` as an int when positive, else a ValueError naming ``owner`` (a recipe's
    ``comm.bucket_mb`` is checked by its dotted name where the recipe is read)."""
    if int(value) <= 0:
        raise ValueError(f"{owner}: bucket_bytes must be > 0, got {value}")
    return int(value)


def tail_start(sizes: Sequence[float], tail_bytes: float | None) -> int:
    """Index where the longest suffix of ``sizes`` of at most ``tail_bytes`` begins;
    ``len(sizes)`` when there is no such suffix to split off (``tail_bytes`` None or 0, the
    last size alone too large, or every size fitting)."""
    if not tail_bytes:
        return len(sizes)
    total, cut = 0.0, len(sizes)
    while cut > 0 and total + sizes[cut - 1] <= tail_bytes:
        total += sizes[cut - 1]
        cut -= 1
    return len(sizes) if cut == 0 else cut


def bucket_bounds(sizes: Sequence[float], bucket_bytes: float,
                  last_bucket_bytes: float | None = None,
                  kinds: Sequence[object] | None = None) -> list[tuple[int, int]]:
    """The buckets over parameters of ``sizes`` bytes (in backward's order), as ``[start,
    end)`` index ranges in bucket order (module docstring)."""
    cut = tail_start(sizes, last_bucket_bytes)
    return _fill(sizes, 0, cut, bucket_bytes, kinds) + _fill(sizes, cut, len(sizes),
                                                             bucket_bytes, kinds)


def _fill(sizes: Sequence[float], start: int, end: int, bucket_bytes: float,
          kinds: Sequence[object] | None) -> list[tuple[int, int]]:
    bounds: list[tuple[int, int]] = []
    first, filled = start, 0.0
    for i in range(start, end):
        full = filled + sizes[i] > bucket_bytes
        if i > first and (full or (kinds is not None and kinds[i] != kinds[first])):
            bounds.append((first, i))
            first, filled = i, 0.0
        filled += sizes[i]
    if end > first:
        bounds.append((first, end))
    return bounds
