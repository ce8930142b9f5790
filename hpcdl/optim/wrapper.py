"""A torch optimizer that wraps another and shares its data (Horovod's DistributedOptimizer
pattern): ``param_groups``, ``state`` and ``defaults`` are the wrapped optimizer's own objects,
so the schedule's learning rate, ``state_dict`` and torch schedulers act on one set of groups.
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["OptimizerWrapper"]


def _shared(name: str) -> property:
    """The wrapped optimizer's attribute ``name`` itself, read and assigned through."""
    return property(lambda self: getattr(self.optimizer, name),
                    lambda self, value: setattr(self.optimizer, name, value))


class OptimizerWrapper(torch.optim.Optimizer):
    """Base of :class:`hpcdl.optim.sharded.ShardedOptimizer` and
    :class:`hpcdl.DistributedOptimizer`. A subclass sets ``self.optimizer`` and does not call
    ``super().__init__`` (the base constructor would overwrite the shared groups). Names the
    wrapper lacks go to :meth:`_delegate` (the wrapped optimizer unless overridden)."""

    optimizer: torch.optim.Optimizer
    param_groups = _shared("param_groups")
    state = _shared("state")
    defaults = _shared("defaults")

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optimizer!r})"

    def _delegate(self) -> Any:
        return self.__dict__.get("optimizer")

    def __getattr__(self, name: str) -> Any:
        # Only reached for names the wrapper lacks: the wrapped optimizer's extras and
        # torch's hook dictionaries (so hooks registered here run on the wrapped step).
        target = self._delegate()
        if target is None:
            raise AttributeError(name)
        return getattr(target, name)
