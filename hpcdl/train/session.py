"""One run session: what a training process opens around its trainer, opened in one place
and closed in the reverse order.

    with RunSession(world, config.comm, run_dir=RUN_DIR, log_level="info") as session:
        trainer = session.own(Trainer(config, data, RUN_DIR, session.comm,
                                      timeline=session.timeline))
        trainer.train()

Opening, in this order (every step collective over ``world``):

1. the communicator of the recipe's ``comm`` section (:func:`open_communicator`: its
   ``bucket_bytes``, the one conversion of ``comm.bucket_mb``), agreed by every rank, so a bad
   backend ends all of them with one line;
2. the process (hpcdl/train/launch.py ``setup_run_process``): rank logs under ``run_dir``,
   SIGUSR2 stack dumps, fail-fast (an uncaught error on one rank ends the job);
3. compute threads: each rank's share of its node's cores (hpcdl/train/threads.py), or a
   fixed count;
4. the timeline (``timeline``: a chrome://tracing file) and the stall watchdog with its
   heartbeats in ``RUN_DIR/logs/heartbeat`` (hpcdl/debug/monitor.py ``watch_collectives``).

Closing: first ``abort_on_unshared_error`` (an error of this rank alone ends the job here,
before any teardown that waits for peers: docs/architecture.md), then the timeline is saved,
what the session owns is closed (last owned first), and the communicator last.
"""
from __future__ import annotations

import contextlib
from typing import Any, Literal

from hpcdl.train.config import CommConfig

__all__ = ["RunSession", "open_communicator"]


def open_communicator(section: CommConfig, world: Any, backend: str | None = None,
                      ranks_per_node: int | None = None):
    """The communicator a recipe's ``comm`` section describes, over ``world`` (any mpi4py
    Intracomm: COMM_WORLD, or an LTFB trainer's). ``backend`` overrides ``section.backend``
    (``--backend``). Collective over ``world``."""
    import hpcdl.comm

    return hpcdl.comm.init(backend or section.backend, world, bucket_bytes=section.bucket_bytes,
                           wire_dtype=section.wire_dtype, ranks_per_node=ranks_per_node)


class RunSession:
    """The communicator, process set-up, threads, timeline and stall watchdog of one run.

    ``comm``: the recipe's ``comm`` section (None: no communicator, e.g. LTFB, whose trainers
    open their own and hand it to :meth:`watch`). ``log_level`` None: the process is already
    set up (a bench that runs several trainings). ``threads``: ``"node"`` (the rank's share
    of its node's cores), a count, or None (torch's own). Collective over ``world``.
    """

    def __init__(self, world: Any, comm: CommConfig | None = None, *,
                 run_dir: str | None = None, backend: str | None = None,
                 log_level: str | None = "info", threads: int | Literal["node"] | None = "node",
                 timeline: str | None = None, ranks_per_node: int | None = None) -> None:
        from hpcdl.errors import agreed

        self.world, self.run_dir = world, run_dir
        self.comm = None
        self.timeline = None
        self._owned = contextlib.ExitStack()
        if comm is not None:
            with agreed(world):
                self.comm = open_communicator(comm, world, backend, ranks_per_node)
        try:
            self._set_up(log_level, threads, timeline)
        except BaseException:
            self.close()
            raise

    def _set_up(self, log_level: str | None, threads: int | str | None,
                timeline: str | None) -> None:
        from hpcdl.debug import Timeline

        if log_level is not None:
            from hpcdl.train.launch import setup_run_process

            setup_run_process(self.run_dir, self.world.rank, self.world.size, log_level,
                              self.world)
        if threads == "node":
            from hpcdl.train.threads import configure_threads

            configure_threads(self.world)
        elif threads is not None:
            import torch

            torch.set_num_threads(threads)
        self.timeline = Timeline(timeline, self.world.rank, self.world) if timeline else None
        if self.comm is not None:
            self.watch(self.comm, self.run_dir)

    def watch(self, comm: Any, run_dir: str | None) -> None:
        """The stall watchdog on ``comm``, heartbeats in ``run_dir``, collectives on the
        timeline; without either, the default watchdog ``hpcdl.comm.init`` installed stays."""
        if run_dir is not None or self.timeline is not None:
            from hpcdl.debug import watch_collectives

            watch_collectives(comm, run_dir, timeline=self.timeline)

    def own(self, resource: Any) -> Any:
        """Close ``resource`` (a trainer, an LTFB) with the session, before the communicator;
        returns it."""
        self._owned.callback(resource.close)
        return resource

    def at_close(self, callback: Any) -> None:
        """Run ``callback()`` when the session closes, before what was owned earlier."""
        self._owned.callback(callback)

    def close(self) -> None:
        from hpcdl.debug import abort_on_unshared_error

        abort_on_unshared_error()  # an error of this rank alone: end the job, no teardown
        try:
            if self.timeline is not None:
                self.timeline.save()
            self._owned.close()
        finally:
            if self.comm is not None:
                self.comm.close()

    def __enter__(self) -> RunSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
