"""Bad input: errors a person fixes by changing what they passed, and how every rank agrees.

A run started wrong ends with one line naming the file, rank or value and what to do: not a
traceback, not a hang. Every such error is a :class:`BadInputError` (the library's kinds also
derive from their builtin, so ``except ValueError`` keeps working), printed as
``hpcdl CMD: message`` with exit :data:`EXIT_BAD_INPUT`; where ranks may see different things,
:func:`agreed` is a collective after which every rank raises the lowest failing rank's error
(a rank exiting alone would leave the others blocked: MPI has no timeout).
Ground floor: imports nothing of hpcdl.
"""
from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from typing import Any

__all__ = ["EXIT_BAD_INPUT", "BadInputError", "agreed", "agree_on", "mark_agreed"]

#: Exit code of a command that was given bad input (argparse's own code for bad usage).
EXIT_BAD_INPUT = 2


class BadInputError(Exception):
    """Input a person can fix: the message names what is wrong and what to do.

    ``agreed`` is True once every rank is known to raise it (after :func:`agree_on`, or a
    broadcast decision): every rank may then exit cleanly. One not agreed may be this rank's
    alone, so the command must abort the job (the others may wait in a collective).
    """

    agreed: bool = False


def mark_agreed(error: BadInputError) -> BadInputError:
    """``error``, marked as raised on every rank (see :attr:`BadInputError.agreed`)."""
    error.agreed = True
    return error


def agree_on(mpi_comm: Any, error: BaseException | None) -> None:
    """Collective over ``mpi_comm``: raise on every rank if ``error`` is set on any rank.

    The raised error is this rank's own when it failed, else a :class:`BadInputError` with
    the lowest failing rank's message, prefixed ``rank 3 of 8 on c401-002: `` to name where.
    """
    size = mpi_comm.Get_size() if mpi_comm is not None else 1
    if size == 1:
        if error is not None:
            raise mark_agreed(error) if isinstance(error, BadInputError) else error
        return
    from mpi4py import MPI

    # the common case, nobody failed, costs one int a rank; only a failure gathers the text
    if not mpi_comm.allreduce(error is not None, op=MPI.LOR):
        return
    messages = mpi_comm.allgather(None if error is None else (socket.gethostname(), str(error)))
    failed = [(rank, text) for rank, text in enumerate(messages) if text is not None]
    if not failed:
        return
    if isinstance(error, BadInputError) and failed[0][0] == mpi_comm.Get_rank():
        raise mark_agreed(error)
    rank, (host, text) = failed[0]
    where = "" if len(failed) == size else f"rank {rank} of {size} on {host}: "
    raise mark_agreed(BadInputError(f"{where}{text}")) from error


@contextlib.contextmanager
def agreed(mpi_comm: Any) -> Iterator[None]:
    """``with agreed(comm): build()`` -- a :class:`BadInputError` raised in the block on any
    rank is raised on every rank at the end of the block (collective; see :func:`agree_on`).
    Other exceptions pass through untouched (fail-fast ends the job on those)."""
    error: BadInputError | None = None
    try:
        yield
    except BadInputError as exc:
        error = exc
    agree_on(mpi_comm, error)
