"""Per-host stats snapshots: small JSON files an operator (or ``tpuoffload stats``) can read.

Each process writes its own file in ``stats_dir`` (``host-<id>.json`` for a worker,
``scheduler.json`` for the scheduler half) at most every ``interval_s`` seconds, atomically: the
JSON goes to a temporary file in the same directory that then replaces the old one, so a reader
sees the previous snapshot or the new one, never a torn file.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

SCHEMA = 1
# mkstemp creates 0600 files; snapshots are meant for whoever runs ``tpuoffload stats`` (often a
# monitoring user other than the serving one), like any log file.
FILE_MODE = 0o644

logger = logging.getLogger(__name__)


def write_atomic(path: str, payload: dict[str, Any]) -> None:
    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=directory)
    try:
        f = os.fdopen(fd, "w")
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    try:
        with f:
            os.fchmod(f.fileno(), FILE_MODE)
            json.dump(payload, f, separators=(",", ":"))
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


class SnapshotWriter:
    """Writes ``build()`` to ``stats_dir/name`` when ``maybe_write`` finds the interval elapsed.
    The check is one clock read, so it can sit on the engine's main thread."""

    def __init__(self, stats_dir: str, name: str, interval_s: float, build: Callable[[], dict[str, Any]],
                 clock: Callable[[], float] = time.monotonic) -> None:
        os.makedirs(stats_dir, exist_ok=True)
        self.path = os.path.join(stats_dir, name)
        self._interval = interval_s
        self._build = build
        self._clock = clock
        self._due = 0.0
        self.failures = 0

    def maybe_write(self, force: bool = False) -> bool:
        """Write a snapshot if one is due; True if one was written. Never raises: this runs on the
        engine's step path, and a full disk or a removed stats directory must not stop serving
        (the snapshot goes stale and ``tpuoffload stats`` reports the host STOPPED instead)."""
        now = self._clock()
        if not force and now < self._due:
            return False
        self._due = now + self._interval
        try:
            payload = self._build()
            payload.update(schema=SCHEMA, time=time.time(), pid=os.getpid(), interval_s=self._interval)
            write_atomic(self.path, payload)
        except Exception as e:  # noqa: BLE001 - observability must never take the engine down
            self.failures += 1
            if self.failures == 1 or self.failures % 1000 == 0:
                logger.warning("tpuoffload: cannot write stats snapshot %s (%d failures so far): %s",
                               self.path, self.failures, e)
            return False
        return True
