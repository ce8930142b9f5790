"""Atomic writes: temporary name in the same directory, fsync, rename, fsync the directory.

A crash or a Slurm time-limit kill then leaves either the old file or the new one, never half
of one. Also :class:`Closing`, the ``with`` form of anything that has a ``close()``.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from typing import BinaryIO, Self


class Closing:
    """``with obj:`` for a class with a ``close()``: the block's end closes it, however it
    ends."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def fsync_directory(directory: str) -> None:
    fd = os.open(directory or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_umask_lock = threading.Lock()


def _umask() -> int:
    """The process umask, read without changing it (``/proc/self/status``, Linux 4.7+): only
    without it is ``os.umask`` set and restored, under a lock and with the strictest mask, so a
    racing thread's file gets fewer permissions, never more."""
    with (contextlib.suppress(OSError, ValueError, IndexError),
          open("/proc/self/status", encoding="ascii") as status):
        for line in status:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    with _umask_lock:
        mask = os.umask(0o077)
        os.umask(mask)
    return mask


def atomic_write(path: str, write: Callable[[BinaryIO], None]) -> None:
    """Call ``write(f)`` on a temporary file beside ``path``, then rename it into place."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        # mkstemp creates 0600; shards, checkpoints and summaries are read by a project
        # group, so give the file the permissions an ordinary open() would.
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_directory(directory)


def atomic_write_bytes(path: str, data: bytes) -> None:
    atomic_write(path, lambda f: f.write(data))


def atomic_write_text(path: str, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def sha256_file(path: str, chunk: int = 1 << 22) -> str:
    """The file's sha256, read in 4 MiB blocks (shards are GiB: never the whole file at once)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def remove_created_directories(path: str, created: str | None) -> None:
    """Undo ``os.makedirs(path)`` of a command that rejected its input: remove ``path`` with
    what the command wrote in it, then each parent up to ``created`` (the highest directory
    the command made; None: ``path`` existed, nothing is removed) only while it is empty: a
    run started beside it meanwhile (``--out a/b/other``) keeps its directory and the parent.
    """
    if created is None:
        return
    path, created = os.path.abspath(path), os.path.abspath(created)
    if path != created and not path.startswith(created + os.sep):
        raise ValueError(f"{created} is not {path} or a parent of it")
    shutil.rmtree(path, ignore_errors=True)
    while path != created:
        path = os.path.dirname(path)
        try:
            os.rmdir(path)  # only an empty directory: someone else's files stay
        except OSError:
            return
