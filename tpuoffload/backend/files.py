"""File-system steps the on-disk stores share (backend/disk_tier.py, backend/shared_store.py)."""

from __future__ import annotations

import os


def unlink_if_present(path: str) -> None:
    """Remove ``path``; a file already gone (another writer or evictor removed it) is no error."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def fsync_dir(path: str) -> None:
    """Make a rename or link in directory ``path`` durable (POSIX: fsync the directory itself)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, bufs: list) -> None:
    """Write every buffer of ``bufs`` to ``fd``, in order, through ``writev`` (retried until a
    short write has written everything)."""
    views = [memoryview(b).cast("B") for b in bufs]
    while views:
        n = os.writev(fd, views)
        while n and views:
            if n >= len(views[0]):
                n -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][n:]
                n = 0
