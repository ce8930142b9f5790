"""Debugging a job under mpirun: rank-aware logs, fail-fast, stack dumps, stall reports,
collective records and a chrome://tracing timeline (docs/debugging.md).

The trainer calls ``setup_rank_logging``, ``install_fail_fast``, ``install_stack_dump`` and
``Timeline``; the communicator's ``_collective`` calls a ``CollectiveMonitor``, which
``hpcdl.comm.init`` installs with the stall watchdog by default (``watchdog=False``: a no-op,
``NULL_MONITOR``) through the communicator's public ``set_monitor``. These names are all that
hpcdl/comm imports from here, and nothing they import imports hpcdl/comm: the watchdog does not
depend on what it watches (tests/test_layering.py).
"""
from hpcdl.debug.faults import dump_stacks_now, install_fail_fast, install_stack_dump
from hpcdl.debug.log import debug_enabled, rank_log_path, setup_rank_logging
from hpcdl.debug.monitor import (
    NULL_MONITOR,
    note_activity,
    unwatch_collectives,
    watch_collectives,
    watch_region,
)
from hpcdl.debug.trace import Timeline

__all__ = [
    "NULL_MONITOR",
    "Timeline",
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
