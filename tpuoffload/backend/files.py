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
    # Empty buffers left out: writev writes 0 bytes of them, and the loop would never end on one.
    views = [v for v in (memoryview(b).cast("B") for b in bufs) if len(v)]
    while views:
        n = os.writev(fd, views)
        while n and views:
            if n >= len(views[0]):
                n -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][n:]
                n = 0


def write_new_file(path: str, bufs: list, fsync: bool) -> None:
    """Create ``path`` (it must not exist: ``O_EXCL``), write ``bufs`` into it and close it, with an
    ``fsync`` of its bytes when asked. Publishing it (rename or link) is the caller's step."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        write_all(fd, bufs)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
