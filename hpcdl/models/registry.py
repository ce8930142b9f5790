"""Models by name (timm's create_model), so a recipe names a model and the trainer never
imports a concrete class."""
from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["register_model", "create_model", "list_models"]

_MODELS: dict[str, Callable[..., torch.nn.Module]] = {}


def register_model(name: str) -> Callable[[Callable[..., torch.nn.Module]],
                                          Callable[..., torch.nn.Module]]:
    """Decorator: make a builder ``fn(num_classes=1000, **kw) -> nn.Module`` known by ``name``."""
    def add(builder: Callable[..., torch.nn.Module]) -> Callable[..., torch.nn.Module]:
        if name in _MODELS:
            raise ValueError(f"model {name!r} is registered twice")
        _MODELS[name] = builder
        return builder
    return add


def list_models() -> list[str]:
    return sorted(_MODELS)


def create_model(name: str, num_classes: int = 1000, **kw: Any) -> torch.nn.Module:
    """The model registered as ``name`` with ``num_classes`` outputs; ``kw`` go to its builder
    (e.g. ``zero_init_residual=True`` for the ResNets, ``width=32`` for the small members)."""
    if name not in _MODELS:
        raise ValueError(f"model.name={name!r} is not a known model; known: {list_models()}")
    if num_classes <= 0:
        raise ValueError(f"model {name}: num_classes must be > 0, got {num_classes}")
    builder = _MODELS[name]
    try:
        inspect.signature(builder).bind(num_classes=num_classes, **kw)
    except TypeError as exc:
        raise ValueError(f"model {name}: bad options {sorted(kw)}: {exc}") from exc
    return builder(num_classes=num_classes, **kw)
