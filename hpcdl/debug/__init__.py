"""Debugging a job under mpirun: rank-aware logs, fail-fast, stack dumps, stall reports,
collective records and a chrome://tracing timeline (docs/debugging.md).

The trainer calls ``setup_rank_logging``, ``install_fail_fast``, ``install_stack_dump`` and
``Timeline``; the communicator's ``_collective`` calls a ``CollectiveMonitor``, which
``hpcdl.comm.init`` installs with the stall watchdog by default (``watchdog=False``: a no-op).
"""
from hpcdl.debug.faults import (
    abort_on_unshared_error,
    dump_stacks_now,
    install_fail_fast,
    install_stack_dump,
)
from hpcdl.debug.log import debug_enabled, rank_log_path, setup_rank_logging
from hpcdl.debug.monitor import (
    note_activity,
    unwatch_collectives,
    watch_collectives,
    watch_region,
)
from hpcdl.debug.trace import Timeline

__all__ = [
    "Timeline",
    "abort_on_unshared_error",
    "debug_enabled",
    "dump_stacks_now",
    "install_fail_fast",
    "install_stack_dump",
    "note_activity",
    "rank_log_path",
    "setup_rank_logging",
    "unwatch_collectives",
    "watch_collectives",
    "watch_region",
]
