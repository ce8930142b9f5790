"""Debugging a job under mpirun: rank-aware logs, fail-fast, stack dumps, stall reports,
collective records and a chrome://tracing timeline (docs/debugging.md).

``hpcdl.comm.init`` installs a ``CollectiveMonitor`` and the stall watchdog through the
communicator's public ``set_monitor``; these names are all hpcdl/comm imports from here, and
nothing they import imports hpcdl/comm (tests/test_layering.py).
"""
from hpcdl.debug.faults import (
    abort_on_unshared_error,
    dump_stacks_now,
    install_fail_fast,
    install_stack_dump,
)
from hpcdl.debug.inject import injected_pause
from hpcdl.debug.log import debug_enabled, rank_log_path, setup_rank_logging
from hpcdl.debug.monitor import (
    NULL_MONITOR,
    note_activity,
    unwatch_collectives,
    watch_collectives,
    watch_region,
)
from hpcdl.debug.startup import import_mpi_within_bound, startup_bound
from hpcdl.debug.trace import Timeline

__all__ = [
    "NULL_MONITOR",
    "Timeline",
    "abort_on_unshared_error",
    "debug_enabled",
    "dump_stacks_now",
    "import_mpi_within_bound",
    "injected_pause",
    "install_fail_fast",
    "install_stack_dump",
    "note_activity",
    "rank_log_path",
    "setup_rank_logging",
    "startup_bound",
    "unwatch_collectives",
    "watch_collectives",
    "watch_region",
]
