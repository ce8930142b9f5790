"""Every ``HPCDL_*`` environment variable: one table, one parser, one error.

``sbatch --export=ALL`` carries the submitting shell into every rank, so a variable is input
like a flag: each has one kind, its documented values and default, and anything else is an
:class:`EnvVarError` naming variable and value (``hpcdl CMD`` exits 2 with one line).

Kinds: ``flag`` (``1/true/yes/on`` or ``0/false/no/off``, any case; empty = the default),
``seconds`` (a number >= 0; empty = the default), ``count`` (an integer >= 1; empty = unset),
``path`` and ``text`` (any string; empty = unset), ``0/1`` (the job script's switches).
``reader="job script"`` marks variables only slurm/job_body.sh reads, so the table in
docs/debugging.md is complete. Ground floor: imports nothing of hpcdl above it.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hpcdl.errors import BadInputError

__all__ = ["VARIABLES", "EnvVar", "EnvVarError", "check_environment", "env_count", "env_flag",
           "env_seconds", "env_text", "env_tristate", "markdown_table"]

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class EnvVarError(BadInputError, ValueError):
    """An ``HPCDL_*`` variable holds a value outside its documented ones (a ValueError too,
    as the readers raised before)."""


@dataclass(frozen=True)
class EnvVar:
    """One variable: ``kind`` (see the module docstring), its ``default`` as documented, what it
    does, and who reads it."""

    name: str
    kind: str
    default: str
    meaning: str
    reader: str = "hpcdl"


VARIABLES: dict[str, EnvVar] = {v.name: v for v in (
    EnvVar("HPCDL_DEBUG", "flag", "off",
           "debug mode: every rank logs at DEBUG, every collective's signature is checked and "
           "recorded", "hpcdl.debug.log, hpcdl.comm"),
    EnvVar("HPCDL_INJECT", "text", "unset",
           "a rehearsed fault: RANK:SEQ:raise, RANK:SEQ:sleep=S, RANK:checkpointN:sleep=S, "
           "RANK:exit:sleep=S, RANK:startup:sleep=S (rank 0 warns at start)", "hpcdl.debug.inject"),
    EnvVar("HPCDL_STALL_WARN_S", "seconds", "60",
           "a collective waiting this long gets a stall report (0 = off)", "hpcdl.debug.stall"),
    EnvVar("HPCDL_STALL_ABORT_S", "seconds", "600",
           "a collective waiting this long ends the job (0 = off)", "hpcdl.debug.stall"),
    EnvVar("HPCDL_STALL_EXIT_GRACE_S", "seconds", "10",
           "how long MPI_Abort gets before a stalled rank ends itself", "hpcdl.debug.stall"),
    EnvVar("HPCDL_STARTUP_TIMEOUT_S", "seconds", "300",
           "MPI_Init and the communicator's creation must end within this, or the rank names "
           "where it was stuck and ends itself (0 = off)", "hpcdl.debug.startup"),
    EnvVar("HPCDL_HEARTBEAT_DIR", "path", "the host's temporary directory",
           "where a communicator without a run directory keeps heartbeats and stall dumps",
           "hpcdl.debug.stall"),
    EnvVar("HPCDL_DUMP", "flag", "off",
           "every rank writes all its threads' stacks to its log every HPCDL_DUMP_EVERY_S",
           "hpcdl.debug.faults"),
    EnvVar("HPCDL_DUMP_EVERY_S", "seconds", "60", "the period of HPCDL_DUMP's stack dumps",
           "hpcdl.debug.faults"),
    EnvVar("HPCDL_RANKS_PER_NODE", "count", "unset (the real nodes)",
           "testing aid: every k consecutive ranks act as one node", "hpcdl.topology"),
    EnvVar("HPCDL_COMM_YIELD", "flag", "auto (on when ranks outnumber cores)",
           "ring/shm wait with Test+sleep instead of MPI's busy-polling Wait", "hpcdl.comm"),
    EnvVar("HPCDL_MALLOC_RETAIN", "flag", "on",
           "a training process keeps freed memory in glibc's heap (no page faults per step; "
           "hpcdl.cpus.retain_freed_memory); off: glibc's own thresholds",
           "hpcdl.train.session"),
    EnvVar("HPCDL_MACHINES_DIR", "path", "unset",
           "searched for planner machine files before ~/.config/hpcdl/machines",
           "hpcdl.plan.machine"),
    *(EnvVar(name, kind, default, meaning, "job script") for name, kind, default, meaning in (
        ("HPCDL_MPI", "text", "the rendered --mpi", "the MPI the job loads"),
        ("HPCDL_LAUNCHER", "text", "the rendered --launcher", "srun, mpirun, mpiexec or ibrun"),
        ("HPCDL_SETUP", "path", "the rendered --setup",
         "a file sourced before the run (modules, venv)"),
        ("HPCDL_LOCAL_DIR", "path", "the rendered --local-dir",
         "node-local directory shards are staged to"),
        ("HPCDL_DOCTOR", "0/1", "1", "0 skips hpcdl doctor before training"),
        ("HPCDL_STAGE", "0/1", "1", "0 trains from the shared shards without staging"),
        ("HPCDL_KEEP_LOCAL", "0/1", "0",
         "1 keeps the staged shards on node-local disk after a successful run"))),
)}


def _lookup(name: str, environ: Mapping[str, str] | None) -> str:
    if name not in VARIABLES:
        raise KeyError(f"{name} is not in hpcdl.env.VARIABLES: add it there (and to the docs)")
    return (os.environ if environ is None else environ).get(name, "").strip()


def _error(name: str, text: str) -> EnvVarError:
    var = VARIABLES[name]
    expected = {"flag": "1/true/yes/on or 0/false/no/off",
                "seconds": "a number of seconds >= 0",
                "count": "a positive integer"}[var.kind]
    return EnvVarError(f"{name}={text!r}: expected {expected} ({var.meaning}; default "
                       f"{var.default}), or unset it")


def env_tristate(name: str, environ: Mapping[str, str] | None = None) -> bool | None:
    """A ``flag``: True or False when set, None when unset or empty."""
    text = _lookup(name, environ)
    if not text:
        return None
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise _error(name, text)


def env_flag(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """A ``flag``, False when unset (every Python-read flag defaults to off)."""
    return bool(env_tristate(name, environ))


def _number(name: str, text: str, kind: Callable[[str], Any], valid: Callable[[Any], bool]) -> Any:
    """``kind(text)`` when it parses and is ``valid``, else the variable's :func:`_error`."""
    try:
        value = kind(text)
    except ValueError:
        raise _error(name, text) from None
    if not valid(value):
        raise _error(name, text)
    return value


def env_seconds(name: str, environ: Mapping[str, str] | None = None) -> float:
    """A ``seconds`` variable, its table default when unset or empty."""
    text = _lookup(name, environ) or VARIABLES[name].default
    return _number(name, text, float, lambda v: v >= 0 and v != float("inf"))  # also refuses nan


def env_count(name: str, environ: Mapping[str, str] | None = None) -> int | None:
    """A ``count``: a positive int, or None when unset or empty."""
    text = _lookup(name, environ)
    return _number(name, text, int, lambda v: v >= 1) if text else None


def env_text(name: str, environ: Mapping[str, str] | None = None) -> str:
    """A ``path`` or ``text`` variable, stripped; "" when unset."""
    return _lookup(name, environ)


def markdown_table() -> str:
    """The table docs/debugging.md shows (tests/test_env.py keeps the two equal)."""
    rows = ["| variable | kind | default | what it does | read by |",
            "|---|---|---|---|---|"]
    rows += [f"| `{v.name}` | {v.kind} | {v.default} | {v.meaning} | {v.reader} |"
             for v in VARIABLES.values()]
    return "\n".join(rows)


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Parse every variable Python reads, raising :class:`EnvVarError` at the first bad one:
    a command calls it before it starts, so a bad value is one line and exit 2 before any work
    (not a traceback in a later phase, or on every rank at a different moment)."""
    readers = {"flag": env_tristate, "seconds": env_seconds, "count": env_count,
               "path": env_text, "text": env_text}
    for var in VARIABLES.values():
        if var.reader != "job script":
            readers[var.kind](var.name, environ)
