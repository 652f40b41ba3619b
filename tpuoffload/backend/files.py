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
