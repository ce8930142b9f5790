"""How replicas stay consistent: the policy between the reducer and the optimizer.

One policy per recipe (``comm.algorithm``: ``sync``, ``local_sgd``, ``hierarchical_local_sgd``,
``powersgd``); the trainer asks it before and after every optimizer step and never branches on
its name. The levers are Ben-Nun & Hoefler's (ACM CSUR 2019, §6): relax model consistency
(post-local SGD, Lin et al. ICLR'20 Alg. 1, §4; hierarchical, §5) or compress what is sent
(PowerSGD, Vogels et al. NeurIPS'19). Each choice with its reason -- model averages through the
gradient buckets, momentum stays local, LARS sees the delivered gradient, the last step
averages, bytes counted where sent -- is in docs/comm.md, "Consistency policies".

Nodes come from the communicator's topology (``hpcdl.comm.init(ranks_per_node=k)`` runs N nodes
on one machine). This module speaks tensors and communicators; models and optimizers are
duck-typed.
"""
from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from hpcdl.comm.powersgd import PowerSGDReducer
from hpcdl.comm.reducer import GradientReducer, build_reducer

__all__ = ["ALGORITHMS", "ConsistencyPolicy", "LocalSGDPolicy", "HierarchicalLocalSGDPolicy",
           "PowerSGDPolicy", "create_policy"]

ALGORITHMS = ("sync", "local_sgd", "hierarchical_local_sgd", "powersgd")


class ConsistencyPolicy:
    """``sync``: the world's average gradient every step (the reducer does everything).

    The trainer calls ``before_step(step)`` before the forward pass of step ``step`` (0-based),
    ``after_step(step, last)`` after the optimizer step with ``step`` steps completed, and
    ``averaged()`` around evaluation. ``reducer`` is what backward feeds.
    """

    name = "sync"

    def __init__(self, comm, reducer) -> None:
        self.comm = comm
        self.reducer = reducer
        #: whether this policy communicates at all (False: one rank, or --no-comm)
        self.communicates = reducer.buckets[0].buffer is not None  # (built enabled)
        self.bytes_world = 0
        self.bytes_node = 0
        self._seen = 0       # reducer.bytes_reduced already attributed

    @property
    def replicas_equal(self) -> bool:
        """Whether every rank holds the same parameters now (they are checked then)."""
        return True

    def before_step(self, step: int) -> None:
        """Set up the reducer for step ``step``."""

    def after_step(self, step: int, last: bool = False) -> None:
        """Account this step's bytes; subclasses average models when due."""
        self._account(node=False)

    @contextlib.contextmanager
    def averaged(self) -> Iterator[None]:
        """Within, every rank holds the world's average model (replicas are equal already)."""
        yield

    def traffic(self) -> dict[str, Any]:
        """Payload bytes this rank passed to allreduce, by communicator."""
        return {"algorithm": self.name, "bytes_world": self.bytes_world,
                "bytes_node": self.bytes_node}

    # -- checkpoints: shared state (rank 0 writes it), per-rank state (each rank its file) --
    def state_dict(self) -> dict[str, Any]:
        return {"algorithm": self.name, "bytes_world": self.bytes_world,
                "bytes_node": self.bytes_node}

    def load_state_dict(self, state: dict[str, Any] | None, source: str = "<state>") -> None:
        if not state:
            return
        if state.get("algorithm", self.name) != self.name:
            raise ValueError(f"{source}: written with comm.algorithm={state['algorithm']}, this "
                             f"run has comm.algorithm={self.name}; resume with the same "
                             f"algorithm")
        self.bytes_world = int(state.get("bytes_world", 0))
        self.bytes_node = int(state.get("bytes_node", 0))

    def rank_state(self, step: int, model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
        """What differs between ranks and a resume needs (none: replicas are equal)."""
        return {}

    def load_rank_state(self, state: dict[str, Any] | None, model: torch.nn.Module,
                        optimizer: Any) -> None:
        """Restore :meth:`rank_state` (call after the shared model/optimizer are loaded)."""

    def close(self) -> None:
        self.reducer.close()

    # -- helpers -----------------------------------------------------------------------------
    def _account(self, node: bool) -> None:
        delta = self.reducer.bytes_reduced - self._seen
        self._seen = self.reducer.bytes_reduced
        if node:
            self.bytes_node += delta
        else:
            self.bytes_world += delta


class LocalSGDPolicy(ConsistencyPolicy):
    """Post-local SGD (Lin et al., ICLR'20, Alg. 1; §4 for the synchronous first phase):
    the world's average gradient for the first ``sync_warmup_steps`` steps, then each rank
    steps on its own gradient and the models are averaged every ``local_steps`` steps."""

    name = "local_sgd"
    #: whether a local step's gradients are averaged inside the node (counted as node bytes)
    local_steps_on_node = False

    def __init__(self, comm, reducer: GradientReducer, local_steps: int,
                 sync_warmup_steps: int = 0) -> None:
        super().__init__(comm, reducer)
        if local_steps < 1:
            raise ValueError(f"comm.local_steps must be >= 1, got {local_steps}")
        if sync_warmup_steps < 0:
            raise ValueError(f"comm.sync_warmup_steps must be >= 0, got {sync_warmup_steps}")
        self.local_steps = int(local_steps)
        self.sync_warmup_steps = int(sync_warmup_steps)
        self.steps_since_average = 0   # local steps since the replicas were last equal
        self.averages = 0

    def synchronous(self, step: int) -> bool:
        return step < self.sync_warmup_steps

    @property
    def replicas_equal(self) -> bool:
        return self.steps_since_average == 0

    def before_step(self, step: int) -> None:
        self.reducer.enabled = self.synchronous(step)

    def after_step(self, step: int, last: bool = False) -> None:
        synchronous = self.synchronous(step - 1)
        self._account(node=self.local_steps_on_node and not synchronous)
        if synchronous:
            return
        self.steps_since_average += 1
        if self.steps_since_average >= self.local_steps or last:
            self._average()

    def _average(self) -> None:
        self.bytes_world += self.reducer.average_parameters(self.comm)
        self.steps_since_average = 0
        self.averages += 1

    @contextlib.contextmanager
    def averaged(self) -> Iterator[None]:
        if self.steps_since_average == 0:
            yield
            return
        params = [p for b in self.reducer.buckets for p in b.params]
        own = [p.detach().clone() for p in params]
        self.reducer.average_parameters(self.comm)  # evaluation traffic: not counted
        try:
            yield
        finally:
            with torch.no_grad():
                for p, mine in zip(params, own, strict=True):
                    p.copy_(mine)

    def traffic(self) -> dict[str, Any]:
        return {**super().traffic(), "local_steps": self.local_steps,
                "sync_warmup_steps": self.sync_warmup_steps, "averages": self.averages}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "local_steps": self.local_steps,
                "steps_since_average": self.steps_since_average, "averages": self.averages}

    def load_state_dict(self, state: dict[str, Any] | None, source: str = "<state>") -> None:
        super().load_state_dict(state, source)
        if not state:
            return
        if int(state.get("local_steps", self.local_steps)) != self.local_steps:
            # A different H would put the next average elsewhere than the interrupted run.
            raise ValueError(f"{source}: written with comm.local_steps={state['local_steps']}, "
                             f"this run has {self.local_steps}; resume with the same H")
        self.steps_since_average = int(state.get("steps_since_average", 0))
        self.averages = int(state.get("averages", 0))

    def rank_state(self, step: int, model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
        """Each rank's own parameters and momentum (they differ after the warm-up)."""
        if step <= self.sync_warmup_steps:
            return {}
        return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
                "optimizer": copy.deepcopy(optimizer.state_dict())}

    def load_rank_state(self, state: dict[str, Any] | None, model: torch.nn.Module,
                        optimizer: Any) -> None:
        if not state or "params" not in state:
            return
        own = dict(model.named_parameters())
        with torch.no_grad():
            for name, value in state["params"].items():
                own[name].copy_(value)
        optimizer.load_state_dict(state["optimizer"])


class HierarchicalLocalSGDPolicy(LocalSGDPolicy):
    """Hierarchical local SGD (Lin et al., ICLR'20, §5): after the synchronous warm-up,
    gradients are averaged inside the node every step (``node_comm``, the shared-memory path)
    and models across nodes every ``local_steps`` steps. Replicas of one node stay equal."""

    name = "hierarchical_local_sgd"
    local_steps_on_node = True

    def __init__(self, comm, reducer: GradientReducer, node_comm, local_steps: int,
                 sync_warmup_steps: int = 0) -> None:
        super().__init__(comm, reducer, local_steps, sync_warmup_steps)
        self.node_comm = node_comm

    def before_step(self, step: int) -> None:
        self.reducer.enabled = True
        self.reducer.gradient_comm = self.comm if self.synchronous(step) else self.node_comm

    def close(self) -> None:
        super().close()
        self.node_comm.close()


class PowerSGDPolicy(ConsistencyPolicy):
    """Synchronous SGD on PowerSGD-compressed gradients (Vogels et al., NeurIPS'19), after
    ``sync_warmup_steps`` steps of plain averaging (PyTorch's ``start_powerSGD_iter``)."""

    name = "powersgd"

    def __init__(self, comm, reducer: GradientReducer, compressor: PowerSGDReducer,
                 sync_warmup_steps: int = 0) -> None:
        super().__init__(comm, reducer)
        self.compressor = compressor
        self.sync_warmup_steps = int(sync_warmup_steps)
        self._plain = reducer

    def before_step(self, step: int) -> None:
        plain = step < self.sync_warmup_steps
        self._plain.enabled = plain
        self.compressor.enabled = not plain
        self.reducer = self._plain if plain else self.compressor

    def after_step(self, step: int, last: bool = False) -> None:
        # both reducers' bytes: the plain one's during the warm-up, the compressor's after
        sent = self._plain.bytes_reduced + self.compressor.bytes_reduced
        self.bytes_world += sent - self._seen
        self._seen = sent

    def traffic(self) -> dict[str, Any]:
        return {**super().traffic(), "powersgd_rank": self.compressor.rank,
                "sync_warmup_steps": self.sync_warmup_steps}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "powersgd": self.compressor.state_dict()}

    def load_state_dict(self, state: dict[str, Any] | None, source: str = "<state>") -> None:
        super().load_state_dict(state, source)
        if state and "powersgd" in state:
            self.compressor.load_state_dict(state["powersgd"])

    def rank_state(self, step: int, model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
        return {"powersgd": self.compressor.rank_state_dict()}

    def load_rank_state(self, state: dict[str, Any] | None, model: torch.nn.Module,
                        optimizer: Any) -> None:
        if state and "powersgd" in state:
            self.compressor.load_rank_state_dict(state["powersgd"])

    def close(self) -> None:
        self._plain.close()
        self.compressor.close()


def create_policy(comm, named_params: Iterable[tuple[str, torch.Tensor]], *,
                  algorithm: str = "sync", local_steps: int = 1, sync_warmup_steps: int = 0,
                  powersgd_rank: int = 4, bucket_bytes: int | None = None,
                  enabled: bool = True, seed: int = 0,
                  shard_update: bool = False) -> ConsistencyPolicy:
    """The policy of ``comm.algorithm`` with its reducer(s). ``enabled=False`` (one rank, or
    ``--no-comm``): nothing is communicated, whatever the algorithm. ``shard_update``: the
    reducer reduce-scatters (weight-update sharding, hpcdl/optim/sharded.py); ``sync`` only."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"comm.algorithm={algorithm!r}: choose one of {', '.join(ALGORITHMS)}")
    if shard_update and algorithm != "sync":
        raise ValueError(f"comm.shard_update: true needs comm.algorithm: sync, not "
                         f"{algorithm!r}; set one of the two keys")
    named_params = list(named_params)
    reducer = build_reducer(comm, named_params, bucket_bytes=bucket_bytes, enabled=enabled,
                            shard_update=shard_update)
    if not enabled or algorithm == "sync":
        return ConsistencyPolicy(comm, reducer)
    if algorithm == "local_sgd":
        return LocalSGDPolicy(comm, reducer, local_steps, sync_warmup_steps)
    if algorithm == "hierarchical_local_sgd":
        return HierarchicalLocalSGDPolicy(comm, reducer, node_communicator(comm), local_steps,
                                          sync_warmup_steps)
    compressor = PowerSGDReducer(comm, named_params, rank=powersgd_rank, seed=seed)
    return PowerSGDPolicy(comm, reducer, compressor, sync_warmup_steps)


def node_communicator(comm):
    """A communicator of the same backend over ``comm``'s node (its topology's node, so
    ``ranks_per_node=k`` is honoured). Collective over ``comm``."""
    from hpcdl.comm import init

    return init(comm.backend, world=comm.node_comm, bucket_bytes=comm.bucket_bytes,
                ranks_per_node=comm.local_size,
                last_bucket_bytes=comm.last_bucket_bytes)
