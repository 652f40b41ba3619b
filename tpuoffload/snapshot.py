"""Per-host stats snapshots: small JSON files an operator (or ``tpuoffload stats``) can read.

Each process writes its own file in ``stats_dir`` (``host-<id>.json`` for a worker,
``scheduler.json`` for the scheduler half) at most every ``interval_s`` seconds, atomically: the
JSON goes to a temporary file in the same directory that then replaces the old one, so a reader
sees the previous snapshot or the new one, never a torn file.

Heartbeat. vLLM calls no connector hook while the engine has no requests, so a snapshot written
only from the step path goes stale on an idle engine, and ``tpuoffload stats`` could not tell an
idle host from a dead one. Each writer therefore runs a heartbeat thread that rewrites the file
every ``heartbeat_s`` seconds when nothing else did. Every file carries, besides the owner's data:

    time        wall-clock time of this write (the host is alive as of then)
    built       wall-clock time the owner's data was built (older than ``time`` after a heartbeat)
    busy_s      how long the step in progress had been running at ``time`` (0.0: no step open)
    interval_s, heartbeat_s, pid, schema

The owner brackets each step with ``step_begin()`` / ``step_end()``. A host whose process died or
froze stops writing (the file's ``time`` ages); a host stuck inside a step keeps heartbeating but
its ``busy_s`` grows: ``tpuoffload stats`` flags both STOPPED, and neither an idle host nor a
host in a normal step.

Threads and locks:

* the owner's thread (the engine's main thread) calls ``step_begin``, ``step_end`` and
  ``maybe_write``; one daemon thread per writer (``tpuoffload-heartbeat-<name>``) does heartbeats.
* ``_state_lock`` guards ``_open`` (start times of the steps in progress), ``_payload`` (the last
  data built), ``_seq`` and ``_due``, and every call of ``build()``: the heartbeat calls ``build()``
  only while no step is open and only if the owner passed ``build_when_idle=True``, declaring that
  everything ``build()`` reads changes only inside a step on the owner's thread or under the
  owner's own locks. Otherwise the heartbeat rewrites the last data with a fresh ``time``.
  No I/O happens under this lock.
* ``_fail_lock`` guards ``failures``.
* ``_write_lock`` guards the file: one write at a time, and never an older payload over a newer
  one (``_written_seq``). The owner's periodic writes do not wait for it: if a heartbeat is
  writing, the owner's write is skipped and retried at its next step.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

SCHEMA = 1
# mkstemp creates 0600 files; snapshots are meant for whoever runs ``tpuoffload stats`` (often a
# monitoring user other than the serving one), like any log file.
FILE_MODE = 0o644

logger = logging.getLogger(__name__)


def heartbeat_period(interval_s: float) -> float:
    """How often an idle writer rewrites its file: every ``interval_s``, at least 1 s apart."""
    return max(1.0, float(interval_s))


def write_atomic(path: str, payload: dict[str, Any]) -> None:
    directory = os.path.dirname(path) or "."
    # The temporary name must not look like a snapshot: a reader listing ``*.json`` would open it
    # half written (serve_stack's reader did, and failed a CI run on an empty file).
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".part", dir=directory)
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
    """Writes ``build()`` to ``stats_dir/name`` when ``maybe_write`` finds the interval elapsed,
    and keeps the file fresh from a heartbeat thread (see the module docstring). The periodic
    check on the owner's thread is one clock read. ``close()`` stops the heartbeat; so does
    dropping the writer.

    ``heartbeat=False``: no thread (the file goes stale between writes). ``heartbeat_s``
    overrides the period (default ``heartbeat_period(interval_s)``). ``build_when_idle``: see the
    module docstring. The first file is written by the owner (``maybe_write``); a heartbeat only
    refreshes one."""

    def __init__(self, stats_dir: str, name: str, interval_s: float, build: Callable[[], dict[str, Any]],
                 clock: Callable[[], float] = time.monotonic, *, heartbeat: bool = True,
                 heartbeat_s: float | None = None, build_when_idle: bool = False) -> None:
        os.makedirs(stats_dir, exist_ok=True)
        self.path = os.path.join(stats_dir, name)
        self._interval = interval_s
        self.heartbeat_s = heartbeat_period(interval_s) if heartbeat_s is None else heartbeat_s
        self._build = build
        self._clock = clock
        self._build_when_idle = build_when_idle
        self._fail_lock = threading.Lock()  # guards failures (both threads may fail a write)
        self.failures = 0

        self._state_lock = threading.Lock()  # guards _open, _payload, _seq, _due and calls of build()
        self._open: collections.deque[float] = collections.deque()  # start times of the open steps
        self._payload: dict[str, Any] | None = None
        self._seq = 0
        self._due = 0.0

        self._write_lock = threading.Lock()  # guards the file and _written_seq, _last_write
        self._written_seq = 0
        self._last_write = clock()

        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if heartbeat:
            self._thread = threading.Thread(target=_heartbeat_loop, args=(weakref.ref(self), self._stop,
                                                                          self.heartbeat_s),
                                            name=f"tpuoffload-heartbeat-{name}", daemon=True)
            self._thread.start()

    # ---------------------------------------------------------------- the owner's thread
    def step_begin(self) -> None:
        """A step started: until ``step_end`` the heartbeat reports its age (``busy_s``) and does
        not call ``build()``. May wait for a heartbeat's ``build()`` in progress, never for I/O."""
        with self._state_lock:
            self._open.append(self._clock())

    def step_end(self, write: bool = True) -> bool:
        """The oldest open step ended; then ``maybe_write()`` if ``write``. True if written."""
        with self._state_lock:
            if self._open:
                self._open.popleft()
        return self.maybe_write() if write else False

    def maybe_write(self, force: bool = False) -> bool:
        """Write a snapshot if one is due; True if one was written. Never raises: this runs on the
        engine's step path, and a full disk or a removed stats directory must not stop serving
        (the snapshot goes stale and ``tpuoffload stats`` reports the host STOPPED instead)."""
        now = self._clock()
        with self._state_lock:
            if not force and now < self._due:
                return False
            self._due = now + self._interval
            payload = self._build_locked(now)
        if payload is None:
            return False
        if not self._write_lock.acquire(blocking=force):
            with self._state_lock:
                self._due = now  # a heartbeat is writing: retry at the next call
            return False
        try:
            return self._write_locked(payload)
        finally:
            self._write_lock.release()

    def close(self) -> None:
        """Stop the heartbeat thread (waits for a write in progress)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    # ---------------------------------------------------------------- shared
    def _stamp(self, data: dict[str, Any], now: float) -> dict[str, Any]:
        """``data`` plus the liveness fields, as of ``now``; _state_lock held."""
        payload = dict(data)
        payload.update(schema=SCHEMA, time=time.time(), pid=os.getpid(), interval_s=self._interval,
                       heartbeat_s=self.heartbeat_s, busy_s=round(now - self._open[0], 3) if self._open else 0.0)
        self._seq += 1
        payload["_seq"] = self._seq
        return payload

    def _build_locked(self, now: float) -> dict[str, Any] | None:
        """Build the owner's data; _state_lock held. None (and a logged failure) if build() raised."""
        try:
            data = self._build()
        except Exception as e:  # noqa: BLE001 - observability must never take the engine down
            self._failed(e)
            return None
        data["built"] = time.time()
        self._payload = data
        return self._stamp(data, now)

    def _write_locked(self, payload: dict[str, Any]) -> bool:
        """Write ``payload`` unless a newer one was written; _write_lock held."""
        seq = payload.pop("_seq")
        if seq < self._written_seq:
            return False
        try:
            write_atomic(self.path, payload)
        except Exception as e:  # noqa: BLE001
            self._failed(e)
            return False
        self._written_seq = seq
        self._last_write = self._clock()
        return True

    def _failed(self, e: Exception) -> None:
        with self._fail_lock:
            self.failures += 1
            n = self.failures
        if n == 1 or n % 1000 == 0:
            logger.warning("tpuoffload: cannot write stats snapshot %s (%d failures so far): %s", self.path, n, e)

    # ---------------------------------------------------------------- the heartbeat thread
    def _heartbeat(self) -> None:
        """Rewrite the file if nothing was written for ``heartbeat_s``: fresh data when no step is
        open and the owner allows it, else the last data with fresh liveness fields."""
        with self._write_lock:
            now = self._clock()
            if now - self._last_write < self.heartbeat_s:
                return
            with self._state_lock:
                if self._build_when_idle and not self._open:
                    payload = self._build_locked(now)
                elif self._payload is not None:
                    payload = self._stamp(self._payload, now)
                else:
                    payload = None  # nothing built yet: the owner's first write comes with its first step
            if payload is not None:
                self._write_locked(payload)


def read_snapshots(stats_dir: str, prefix: str = "") -> dict[str, dict[str, Any]]:
    """The snapshots in ``stats_dir`` whose names start with ``prefix``, by file name in order;
    none when the directory does not exist. Every file read is whole (``write_atomic``)."""
    if not os.path.isdir(stats_dir):
        return {}
    out = {}
    for name in sorted(n for n in os.listdir(stats_dir) if n.startswith(prefix) and n.endswith(".json")):
        with open(os.path.join(stats_dir, name)) as f:
            out[name] = json.load(f)
    return out


def read_rank_snapshots(stats_dir: str) -> dict[str, dict[str, Any]]:
    """The snapshots DP ranks' scheduler halves wrote in ``stats_dir`` (``scheduler-dp<rank>.json``,
    ``DPRank.snapshot_name``), by file name in rank order."""
    return read_snapshots(stats_dir, prefix="scheduler-dp")


def _heartbeat_loop(ref: "weakref.ref[SnapshotWriter]", stop: threading.Event, period: float) -> None:
    """Holds the writer only weakly between beats, so a dropped writer ends its thread."""
    tick = max(0.005, min(period, 1.0) / 2)
    while not stop.wait(tick):
        writer = ref()
        if writer is None:
            return
        try:
            writer._heartbeat()
        except Exception:  # noqa: BLE001 - the heartbeat thread must not die silently mid-run
            logger.exception("tpuoffload: stats heartbeat failed for %s", writer.path)
        del writer
