"""One run session: what a training process opens around its trainer, in one place, closed
in the reverse order (``hpcdl train``, the demo, LTFB's runs, the training benches).

    with RunSession(world, config.comm, run_dir=RUN_DIR, log_level="info") as session:
        trainer = session.own(Trainer(config, data, RUN_DIR, session.comm,
                                      timeline=session.timeline))
        trainer.train()

Closing: ``abort_on_unshared_error`` first (an error of this rank alone ends the job before any
teardown waits for peers), the timeline saved, owned objects closed last first, the
communicator last.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

from hpcdl.errors import BadInputError
from hpcdl.io import Closing
from hpcdl.train.config import CommConfig

__all__ = ["OutputDirError", "RunSession", "check_output_dir", "comm_trial",
           "job_seconds_left", "open_communicator", "recipe_gradients", "run_directory",
           "setup_run_process"]


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


@contextlib.contextmanager
def run_directory(world: Any, out: str | None, prefix: str) -> Iterator[str]:
    """``out`` (kept), or a temporary directory rank 0 makes and removes at the end; a rank
    that cannot see it (node-local /tmp) stops every rank with one line. Collective."""
    from hpcdl.errors import agree_on

    made = None if out is not None or world.rank != 0 else tempfile.mkdtemp(prefix=prefix)
    path, host = world.bcast((made or os.path.abspath(out or "."), socket.gethostname()))
    error = None
    if out is None and not os.path.isdir(path):
        error = BadInputError(f"{path}, made by rank 0 on {host}, is not visible here "
                              f"(node-local /tmp): across hosts, pass --out DIR on a file "
                              f"system every host shares")
    try:
        agree_on(world, error)
        yield path
    finally:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)  # a rejected command leaves nothing


def setup_run_process(run_dir: str | None, rank: int, size: int, level: str,
                      mpi_comm: Any) -> None:
    """Rank logs under ``run_dir``, SIGUSR2 stack dumps, fail-fast (hpcdl/debug), file-size
    limits reported as errors rather than as a killing signal, and freed memory kept for the
    next step (``HPCDL_MALLOC_RETAIN``, the allocator policy ``hpcdl bench train`` and the
    planner's calibration time the step under)."""
    from hpcdl.cpus import retain_freed_memory
    from hpcdl.debug import install_fail_fast, install_stack_dump, setup_rank_logging
    from hpcdl.env import env_tristate

    if env_tristate("HPCDL_MALLOC_RETAIN") is not False:
        retain_freed_memory()
    setup_rank_logging(run_dir, rank, size, level)
    install_stack_dump()
    if size > 1:
        install_fail_fast(mpi_comm)  # an uncaught error on one rank ends the job, not hangs it
    # Past RLIMIT_FSIZE (ulimit -f) the kernel kills the writer with SIGXFSZ, mid-checkpoint
    # and without a word; ignored, the write fails with EFBIG, which the checkpoint reports
    # (the previous checkpoint stays: writes are atomic).
    if hasattr(signal, "SIGXFSZ"):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def open_communicator(section: CommConfig, world: Any, backend: str | None = None,
                      ranks_per_node: int | None = None, precision: str = "float32",
                      gradients: Sequence[int] | None = None, deterministic: bool = False,
                      run_s: float | None = None):
    """The communicator a recipe's ``comm`` section describes, over ``world`` (any mpi4py
    Intracomm: COMM_WORLD, or an LTFB trainer's). ``backend`` overrides ``section.backend``
    (``--backend``); ``precision`` is the recipe's ``train.precision``, which ``comm.wire_dtype:
    auto`` follows (hpcdl.train.precision). Collective over ``world``.

    ``auto``: the backend and bucket layout a start-up trial measures fastest on
    ``gradients`` (the trainable parameters' element counts, registration order;
    :func:`recipe_gradients`), kept in ``comm.trial``; the rule decides without them, on one
    rank, with ``deterministic`` (a timed choice is not repeatable) or ``comm.trial_s: 0``.
    ``run_s``: the run's estimated seconds, when known (the trial takes at most 1% of it)."""
    import hpcdl.comm
    from hpcdl.train.precision import run_wire_dtype

    name = (backend or section.backend).lower()
    if name == "auto":
        trial = comm_trial(section, world, ranks_per_node, precision, gradients,
                           deterministic, run_s)
        comm = hpcdl.comm.init(
            trial.backend, world, bucket_bytes=trial.layout.bucket_bytes,
            wire_dtype=run_wire_dtype(section, precision, world, trial.backend),
            ranks_per_node=ranks_per_node, last_bucket_bytes=trial.layout.last_bucket_bytes)
        comm.trial = trial
        return comm
    return hpcdl.comm.init(name, world, bucket_bytes=section.bucket_bytes,
                           wire_dtype=run_wire_dtype(section, precision, world, backend),
                           ranks_per_node=ranks_per_node)


def comm_trial(section: CommConfig, world: Any, ranks_per_node: int | None,
               precision: str, gradients: Sequence[int] | None, deterministic: bool = False,
               run_s: float | None = None):
    """``comm.backend: auto`` decided: the trial's result (hpcdl/comm/trial.py), or the
    rule's choice at the recipe's layout with why the trial did not run. Collective."""
    import hpcdl.comm
    from hpcdl.comm.trial import (
        rule_result,
        run_trial,
        trial_budget,
        trial_candidates,
        unavailable_backends,
    )
    from hpcdl.train.precision import agreed_precision, wire_dtype_for

    started = time.perf_counter()  # the budget covers the checks below too
    rule = hpcdl.comm.auto_backend(world)
    # rank 0's: every branch of the trial compares with it (clocks and run_s may differ)
    budget = world.bcast(trial_budget(section.trial_s, run_s), root=0)
    why = ("one rank: nothing to reduce" if world.size == 1 else
           "comm.trial_s: 0" if budget <= 0 else
           "--deterministic: a timed choice would not repeat" if deterministic else
           "no model to time" if not gradients else None)
    if why is not None:
        return rule_result(rule, section.bucket_mb, budget, why)
    names, excluded = trial_candidates(
        list(hpcdl.comm.BACKENDS), rule,
        unavailable_backends(world, hpcdl.comm.largest_node(world, ranks_per_node)))
    agreed = agreed_precision(precision, world)
    wire = {n: wire_dtype_for(section, agreed, n) for n in names}

    def open_candidate(name, layout, wire_dtype):
        return hpcdl.comm.init(name, world, bucket_bytes=layout.bucket_bytes,
                               wire_dtype=wire_dtype, ranks_per_node=ranks_per_node,
                               last_bucket_bytes=layout.last_bucket_bytes)

    return run_trial(world, gradients, wire, rule, section.bucket_mb, budget, open_candidate,
                     vary_buckets=section.trial_buckets, excluded=excluded, started=started)


def job_seconds_left(environ: Mapping[str, str] | None = None) -> float | None:
    """Seconds until the Slurm job's projected end (``SLURM_JOB_END_TIME``, a Unix time,
    set by Slurm 22.05 and later), or None outside such a job: the run's length as far as
    the start-up trial's budget can know it."""
    env = os.environ if environ is None else environ
    try:
        left = float(env.get("SLURM_JOB_END_TIME", "")) - time.time()
    except ValueError:
        return None
    return left if left > 0 else None


def recipe_gradients(config: Any) -> list[int] | None:
    """Element counts of the recipe model's trainable parameters, in registration order,
    without allocating them (built on torch's meta device): what the trial times. None when
    the recipe's model cannot be built: the trainer reports that bad input, agreed by every
    rank, as it would without a trial."""
    import torch

    from hpcdl.train.trainer import recipe_model

    try:
        with torch.device("meta"):
            model = recipe_model(config)
    except (ValueError, TypeError):
        return None
    return [p.numel() for p in model.parameters() if p.requires_grad]


class RunSession(Closing):
    """The communicator, process set-up, threads, timeline and stall watchdog of one run.

    ``comm``: the recipe's ``comm`` section (None: LTFB's trainers open their own and hand it
    to :meth:`watch`). ``log_level`` None: the process is already set up. ``threads``:
    ``"node"`` (the rank's share of its node's cores), a count, or None. ``precision``: the
    recipe's ``train.precision``, which ``comm.wire_dtype: auto`` follows. ``gradients``,
    ``deterministic``, ``run_s``: what ``comm.backend: auto``'s trial needs
    (:func:`open_communicator`); its line is logged once rank logs exist. Collective.
    """

    def __init__(self, world: Any, comm: CommConfig | None = None, *,
                 run_dir: str | None = None, backend: str | None = None,
                 log_level: str | None = "info", threads: int | Literal["node"] | None = "node",
                 timeline: str | None = None, ranks_per_node: int | None = None,
                 precision: str = "float32", gradients: Sequence[int] | None = None,
                 deterministic: bool = False, run_s: float | None = None) -> None:
        from hpcdl.errors import agreed

        self.world, self.run_dir = world, run_dir
        self.comm = None
        self.timeline = None
        self._owned = contextlib.ExitStack()
        if comm is not None:
            with agreed(world):
                self.comm = open_communicator(comm, world, backend, ranks_per_node, precision,
                                              gradients, deterministic, run_s)
        try:
            self._set_up(log_level, threads, timeline)
        except BaseException:
            self.close()
            raise

    def _set_up(self, log_level: str | None, threads: int | str | None,
                timeline: str | None) -> None:
        from hpcdl.debug import Timeline

        if log_level is not None:
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
            if self.comm.trial is not None and self.world.rank == 0:
                logging.getLogger(__name__).info("%s", self.comm.trial.line())

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
