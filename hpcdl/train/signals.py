"""Stop signals as a flag that only feeds the ranks' next agreement.

Slurm's SIGUSR1/SIGTERM reach each task at a slightly different moment, anywhere in a step; a
rank acting on its own copy (checkpointing, a collective, while the others began the next step)
would hold every rank until the stall abort. So the handler only records the signal; each
step's agreement (``Trainer._start_agreement``; LTFB's stop check) sums "any rank
signalled?" and every rank acts at the same step. ``hpcdl train`` installs it at process
start (:func:`until_exit`) so set-up and resume are covered; once the outcome is decided
signals are ignored. Python runs handlers on the main thread between bytecodes: a rank in an
MPI call records it on return.
The whole story and its tests: docs/training.md, "Checkpoints and resume" (**Signals**).
"""
from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

__all__ = ["STOP_SIGNALS", "install", "ignore", "own_process", "until_exit", "as_flag",
           "pending", "consume", "name"]

#: Signals Slurm sends before the time limit (``--signal=USR1@300``) and at it (SIGTERM).
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)

_pending: int | None = None  # the first stop signal since the last stop acted on
_process_owned = False  # set by the hpcdl executable: the process ends with its command


def _record(signum: int, frame: object = None) -> None:
    global _pending
    if _pending is None:
        _pending = signum


def pending() -> int | None:
    """The stop signal this process received and no stop has acted on yet (None: none)."""
    return _pending


def consume() -> int | None:
    """Clear the flag once the agreed stop it fed is acted on; returns what it held."""
    global _pending
    signum, _pending = _pending, None
    return signum


def name(signum: int | None) -> str:
    return signal.Signals(signum).name if signum else "none"


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def install() -> None:
    """From now until the process ends, SIGUSR1/SIGTERM only set the flag (main thread only:
    elsewhere Python cannot install handlers, and this does nothing)."""
    if _on_main_thread():
        for sig in STOP_SIGNALS:
            signal.signal(sig, _record)


def ignore() -> None:
    """From now on SIGUSR1/SIGTERM are discarded (main thread only)."""
    if _on_main_thread():
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)


def own_process() -> None:
    """Declare that this process ends when its command returns (the ``hpcdl`` executable):
    :func:`until_exit` then discards the stop signals afterwards instead of restoring them."""
    global _process_owned
    _process_owned = True


@contextlib.contextmanager
def until_exit() -> Iterator[None]:
    """A command's whole life: the flag from the start (:func:`install`). Once the outcome is
    decided, in the ``hpcdl`` executable (:func:`own_process`) the signals are ignored until
    the process ends (a late, skewed delivery must not kill a rank still finalizing); called
    in-process the previous handlers are restored (an ignored disposition would pass to every
    child the caller starts)."""
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS} if _on_main_thread() else {}
    install()
    try:
        yield
    finally:
        if _process_owned:
            ignore()
        else:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


@contextlib.contextmanager
def as_flag(enabled: bool = True) -> Iterator[None]:
    """While active, SIGUSR1/SIGTERM only set the flag; the handlers before are restored after
    (a library caller's own, or the default). Does nothing with ``enabled=False`` or off the
    main thread."""
    if not enabled or not _on_main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _record) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
