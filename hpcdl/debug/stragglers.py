"""Stragglers: each log interval, the rank the others waited for, for two tiny allreduces.

Each rank knows only how long it sat in collectives (the monitor sums them); the rank that
arrives last waits least. So per log interval one MINLOC and one MAXLOC allreduce over (wait,
rank) name the straggler and the most patient rank: O(log P) tiny messages, nothing per step.
Rank 0 logs the line when the gap is at least ``MIN_GAP_S`` and ``MIN_GAP_FRACTION`` of the
interval (docs/debugging.md, "Stragglers").
"""
from __future__ import annotations

import logging
import time
from typing import Any

#: gaps below these are noise: at least this many seconds, and this fraction of the interval
MIN_GAP_S = 0.25
MIN_GAP_FRACTION = 0.05

log = logging.getLogger("hpcdl.train")


class StragglerReport:
    """An after-step hook (``trainer.after_step_hooks``): every ``every_steps`` steps, name
    the rank the others waited for. Collective over the communicator's ranks (every rank runs
    the same hooks at the same step)."""

    def __init__(self, comm: Any, every_steps: int) -> None:
        self.comm = comm
        self.every_steps = max(1, int(every_steps))
        self._seen_wait_s = self._wait_s()
        self._since, self._since_step = time.perf_counter(), None
        self.last: str | None = None

    def _wait_s(self) -> float:
        return float(getattr(self.comm.monitor, "wait_s", 0.0))

    def __call__(self, trainer: Any) -> None:
        if trainer.step % self.every_steps == 0:
            self.report(trainer.step)

    def report(self, step: int) -> str | None:
        """Two tiny allreduces; returns (and on rank 0 logs) the line, or None below noise."""
        from mpi4py import MPI

        total = self._wait_s()
        wait, self._seen_wait_s = total - self._seen_wait_s, total
        now = time.perf_counter()
        interval_s, self._since = now - self._since, now
        first, self._since_step = self._since_step, step
        mpi_comm = self.comm.mpi_comm
        rank = mpi_comm.Get_rank()
        least = mpi_comm.allreduce((wait, rank), op=MPI.MINLOC)
        most = mpi_comm.allreduce((wait, rank), op=MPI.MAXLOC)
        gap = most[0] - least[0]
        if mpi_comm.Get_size() < 2 or gap < max(MIN_GAP_S, MIN_GAP_FRACTION * interval_s):
            return None
        hosts = getattr(self.comm.monitor, "hosts", None) or []
        where = f" on {hosts[least[1]]}" if least[1] < len(hosts) else ""
        steps = f"steps {first + 1}-{step}" if first is not None else f"up to step {step}"
        self.last = (f"straggler ({steps}): the ranks waited up to {gap:.2f} s for rank "
                     f"{least[1]}{where} (its own wait in collectives {least[0]:.2f} s, rank "
                     f"{most[1]}'s {most[0]:.2f} s, over {interval_s:.1f} s)")
        if rank == 0:
            log.info("%s", self.last)
        return self.last
