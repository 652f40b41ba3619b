"""Per-host stats snapshots: small JSON files an operator (or ``tpuoffload stats``) can read.

Each process writes its own file in ``stats_dir`` (``host-<id>.json`` for a worker,
``scheduler.json`` for the scheduler half) at most every ``interval_s`` seconds, atomically: the
JSON goes to a temporary file in the same directory that then replaces the old one, so a reader
sees the previous snapshot or the new one, never a torn file.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

SCHEMA = 1


def write_atomic(path: str, payload: dict[str, Any]) -> None:
    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, separators=(",", ":"))
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
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

    def maybe_write(self, force: bool = False) -> bool:
        now = self._clock()
        if not force and now < self._due:
            return False
        self._due = now + self._interval
        payload = self._build()
        payload.update(schema=SCHEMA, time=time.time(), pid=os.getpid(), interval_s=self._interval)
        write_atomic(self.path, payload)
        return True
