"""A bound on start-up: MPI_Init and the communicator's creation end within
``HPCDL_STARTUP_TIMEOUT_S`` (300 s; 0: no bound), or the rank says where it was stuck and what
to try, and ends itself (docs/debugging.md, the variables' and the faults' tables). The bound
is a daemon thread with its own clock: no MPI, no peer, no file system.

Every ``hpcdl`` command runs inside :func:`mpi_init_bounded`: the process's first import of
``mpi4py.MPI``, wherever it happens, runs MPI_Init under the bound, and a command that never
imports it never starts MPI.
"""
from __future__ import annotations

import contextlib
import importlib.abc
import os
import socket
import sys
import threading
from collections.abc import Iterator, Mapping

from hpcdl.env import env_seconds
from hpcdl.mpi_library import RANK_ENV, mpich_netmod_for_slurm_pmi1

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
    said = [os.environ[v] for v in (*RANK_ENV, "SLURM_PROCID") if os.environ.get(v, "").isdigit()]
    return f"rank {said[0]}" if said else "rank ?"


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


#: what the bound names while MPI_Init runs
MPI_INIT = "MPI_Init (the launcher's PMI exchange)"
_MPI_MODULE = "mpi4py.MPI"
#: mpi4py.rc.thread_level's names
_THREAD_LEVELS = ("single", "funneled", "serialized", "multiple")


def import_mpi_within_bound():
    """``mpi4py.MPI``, imported -- which runs MPI_Init, the launcher's PMI exchange -- under
    the start-up bound when this is the process's first import of it."""
    if _MPI_MODULE in sys.modules:
        return sys.modules[_MPI_MODULE]
    with mpi_init_bounded():
        from mpi4py import MPI
    return MPI


def _init_releasing_the_gil(mpi) -> None:
    """MPI_Init_thread as mpi4py's import would call it, but through ctypes, which releases
    the GIL for the call: mpi4py's own initialisation holds it, so no thread -- the bound's
    included -- runs while a PMI exchange hangs (measured: with PMI_PORT a socket that never
    answers, ``import mpi4py.MPI`` held the process and a waiting thread never woke)."""
    import ctypes

    import mpi4py

    level = str(mpi4py.rc.thread_level).lower()
    required = getattr(mpi, f"THREAD_{level.upper()}" if level in _THREAD_LEVELS
                       else "THREAD_MULTIPLE")
    provided = ctypes.c_int(0)
    init_thread = _mpi_init_thread_symbol(mpi.__file__)
    if init_thread is None:  # no symbol to call without the GIL: mpi4py's own (unwatched)
        mpi.Init_thread(required)
    elif init_thread(None, None, ctypes.c_int(required), ctypes.byref(provided)) != 0:
        raise RuntimeError("MPI_Init_thread failed")
    if str(mpi4py.rc.errors) == "exception":  # what mpi4py sets after its own MPI_Init
        for comm in (mpi.COMM_SELF, mpi.COMM_WORLD):
            comm.Set_errhandler(mpi.ERRORS_RETURN)


def _mpi_init_thread_symbol(extension: str):
    """MPI_Init_thread of the libmpi mpi4py's extension uses: found through the extension's
    own handle (the library it links), else in the process's global scope; None if neither."""
    import ctypes

    for handle in (extension, None):
        try:
            return ctypes.CDLL(handle).MPI_Init_thread
        except (AttributeError, OSError):
            continue
    return None


class _BoundedLoader(importlib.abc.Loader):
    """mpi4py.MPI's own loader with MPI_Init taken out of the import (``mpi4py.rc.initialize``
    off while the module runs) and run afterwards under the start-up bound, without the GIL.
    MPI is finalised at exit as when mpi4py initialises it (``rc.finalize``). The library is
    known before MPI_Init: MPICH under srun gets the network module Slurm's PMI can carry."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        import mpi4py

        rc = mpi4py.rc
        initialize = rc.initialize  # False: the program initialises MPI itself; leave it so
        if initialize and rc.finalize is None:
            rc.finalize = True
        rc.initialize = False
        try:
            self._inner.exec_module(module)
        finally:
            rc.initialize = initialize
        if initialize and not module.Is_initialized():
            mpich_netmod_for_slurm_pmi1(module.Get_library_version())
            with startup_bound(MPI_INIT):
                _init_releasing_the_gil(module)


class _BoundedMPIFinder(importlib.abc.MetaPathFinder):
    """Finds ``mpi4py.MPI`` where the other finders do (mpi4py installs its own, which picks
    the build for the MPI found), and hands it the bounded loader."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _MPI_MODULE:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            ours = isinstance(finder, _BoundedMPIFinder)
            spec = None if ours or find is None else find(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _BoundedLoader(spec.loader)
                return spec
        return None


@contextlib.contextmanager
def mpi_init_bounded() -> Iterator[None]:
    """Within, the process's first import of ``mpi4py.MPI`` (MPI_Init) runs under the
    start-up bound, whichever module imports it; nothing imports MPI that did not already."""
    if any(isinstance(f, _BoundedMPIFinder) for f in sys.meta_path):  # nested: already on
        yield
        return
    finder = _BoundedMPIFinder()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
