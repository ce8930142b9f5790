"""A bound on start-up: MPI_Init and the communicator's creation end within
``HPCDL_STARTUP_TIMEOUT_S`` (300 s; 0: no bound), or the rank says where it was stuck and what
to try, and ends itself (docs/debugging.md, the variables' table and the faults' table).

Nothing else watches a rank before its communicator exists, and a PMI that never answers holds
MPI_Init, ``Win.Allocate_shared`` or oneCCL's init to the time limit. The bound is a daemon
thread with its own clock: no MPI, no peer, no file system; one line on stderr, this rank's
children killed, ``os._exit`` with the stall exit code. 300 s is far above the tens of seconds
MPI_Init and a communicator take at 2,048 ranks.
"""
from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
from collections.abc import Iterator, Mapping

from hpcdl.env import env_seconds

#: What to try when start-up does not end: the usual cause is the launcher's PMI.
WHAT_TO_TRY = ("the launcher's PMI may not suit this MPI: try the other PMI (srun --mpi=pmi2 "
               "or --mpi=pmix; HPCDL_LAUNCHER=srun-pmi2/srun-pmix in the Slurm template) or "
               "the MPI's own launcher (mpiexec/mpirun: HPCDL_LAUNCHER=mpirun), and check "
               "`hpcdl doctor` under the same launcher")


def startup_timeout_s(environ: Mapping[str, str] | None = None) -> float:
    """``HPCDL_STARTUP_TIMEOUT_S`` (seconds; 0 switches the bound off)."""
    return env_seconds("HPCDL_STARTUP_TIMEOUT_S", environ)


def startup_message(what: str, limit_s: float, rank: str) -> str:
    return (f"[{rank} {socket.gethostname()} pid {os.getpid()}] hpcdl: start-up did not end "
            f"within HPCDL_STARTUP_TIMEOUT_S={limit_s:g} s: stuck in {what}; {WHAT_TO_TRY}. "
            f"This rank ends itself.")


def _rank_label() -> str:
    """This rank as far as the launcher says (MPI may be what is stuck)."""
    for var in ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        if os.environ.get(var, "").isdigit():
            return f"rank {os.environ[var]}"
    return "rank ?"


def _end(what: str, limit_s: float) -> None:
    from hpcdl.debug.stall import STALL_EXIT_CODE, end_process

    with contextlib.suppress(Exception):  # a closed stream must not stop the end
        sys.stderr.write(startup_message(what, limit_s, _rank_label()) + "\n")
        sys.stderr.flush()
    end_process(STALL_EXIT_CODE)


@contextlib.contextmanager
def startup_bound(what: str, limit_s: float | None = None) -> Iterator[None]:
    """Within, this rank ends itself (exit code 4, one line naming ``what`` and what to try)
    if the block has not finished ``limit_s`` (default HPCDL_STARTUP_TIMEOUT_S) seconds after
    it began. Nested blocks: each has its own clock."""
    limit_s = startup_timeout_s() if limit_s is None else limit_s
    if limit_s <= 0:
        yield
        return
    done = threading.Event()

    def watch() -> None:
        if not done.wait(limit_s):
            _end(what, limit_s)

    threading.Thread(target=watch, name="hpcdl-startup-bound", daemon=True).start()
    try:
        yield
    finally:
        done.set()


def import_mpi_within_bound():
    """``mpi4py.MPI``, imported -- which runs MPI_Init, the launcher's PMI exchange -- under
    the start-up bound when this is the process's first import of it."""
    if "mpi4py.MPI" in sys.modules:
        return sys.modules["mpi4py.MPI"]
    with startup_bound("MPI_Init (the launcher's PMI exchange)"):
        from mpi4py import MPI
    return MPI
