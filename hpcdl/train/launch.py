"""What every training process does once, before it builds a trainer: check that the run
directory can be written, then set up rank logging, stack dumps and fail-fast.

``hpcdl train`` (data-parallel and LTFB) calls these; they live here, under the command line,
so the library's pieces (hpcdl/train/ltfb.py, the demo) never import hpcdl.cli.
"""
from __future__ import annotations

import os
import signal
import tempfile
from typing import Any

from hpcdl.errors import BadInputError

__all__ = ["OutputDirError", "check_output_dir", "setup_run_process"]


class OutputDirError(BadInputError, OSError):
    """The run directory cannot be created or written."""


def check_output_dir(run_dir: str) -> None:
    """Create ``run_dir`` if needed and write (then remove) a file in it: an unwritable
    ``--out`` is named now, before training, not at the first checkpoint."""
    try:
        os.makedirs(run_dir, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=run_dir, prefix=".hpcdl-write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise OutputDirError(f"--out {run_dir}: cannot write there ({reason}); choose a "
                             f"directory you can write (on a cluster: scratch or project "
                             f"space, visible to every node)") from None


def setup_run_process(run_dir: str, rank: int, size: int, level: str, mpi_comm: Any) -> None:
    """Rank logs under ``run_dir``, SIGUSR2 stack dumps, fail-fast (hpcdl/debug), and file-size
    limits reported as errors rather than as a killing signal."""
    from hpcdl.debug import install_fail_fast, install_stack_dump, setup_rank_logging

    setup_rank_logging(run_dir, rank, size, level)
    install_stack_dump()
    if size > 1:
        install_fail_fast(mpi_comm)  # an uncaught error on one rank ends the job, not hangs it
    # Past RLIMIT_FSIZE (ulimit -f) the kernel kills the writer with SIGXFSZ, mid-checkpoint
    # and without a word; ignored, the write fails with EFBIG, which the checkpoint reports
    # (the previous checkpoint stays: writes are atomic).
    if hasattr(signal, "SIGXFSZ"):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
