"""The benchmarks behind ``hpcdl bench NAME``: one module each, every one comparing hpcdl
with the baseline a user would otherwise pick, in the same run (docs/performance.md)."""
from __future__ import annotations


def check_model_argument(bench: str, name: str) -> None:
    """``--model NAME`` must name a registered model: one line before any work (bad input,
    exit 2), not a traceback after the data is prepared."""
    from hpcdl.models import list_models

    if name not in list_models():
        raise SystemExit(f"hpcdl bench {bench}: --model {name!r} is not a known model; known: "
                         f"{', '.join(list_models())}")
