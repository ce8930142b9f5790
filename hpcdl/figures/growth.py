"""How a per-rank cost grows with the rank count P: the least-squares line ``a + b*P`` over
the measured rank counts, with the noise rule that tells "grows" from "does not".

The checkpoint-cost bench (``benchmarks/checkpoint_cost.py``) fits with it and records the
fits in its JSON; the docs' ``checkpoint-cost`` block reads those fits and states this rule,
so the rule has one home.
"""
from __future__ import annotations

from collections.abc import Sequence

#: a fitted change of fewer bytes than this over the measured range is noise (a lazy import,
#: a log line): counted as none
NOISE_BYTES = 64


def fit(ps: Sequence[int], values: Sequence[float]) -> tuple[float, float]:
    """Least squares ``a + b*P``; ``b`` is 0 when the fitted change over the measured ranks
    is below :data:`NOISE_BYTES` (then ``a`` is the largest value measured)."""
    n = len(ps)
    mp, mv = sum(ps) / n, sum(values) / n
    var = sum((p - mp) ** 2 for p in ps)
    b = sum((p - mp) * (v - mv) for p, v in zip(ps, values, strict=True)) / var if var else 0.0
    if abs(b) * (max(ps) - min(ps)) < NOISE_BYTES:
        return float(max(values)), 0.0
    return mv - b * mp, b
