"""Operator checkpoint requests: a request file the engine polls, and its answer.

    tpuoffload checkpoint DIR [--wait SECONDS]      (or: python -m tpuoffload.persist checkpoint DIR)

drops ``DIR/CHECKPOINT_REQUEST`` (JSON: id, time, who; written to a temp file and renamed, so the
engine never reads half a request; ``touch DIR/CHECKPOINT_REQUEST`` works too). DIR is the
deployment's ``persist_path``. The checkpoint is taken at the engine's next step: an idle engine
(no request in flight: vLLM runs no step then) takes it when the next request arrives. The
scheduler polls it with ``RequestWatcher.poll()`` every step:
between polls (``poll_interval_s``, default 1 s) a poll is one clock read, and a poll that finds the
file unchanged is one ``os.stat``. When the checkpoint is committed by every host (or failed), the
engine calls ``RequestWatcher.complete``: it writes ``DIR/CHECKPOINT_DONE`` (JSON: id, ok,
checkpoint number, reason) and removes the request if it was not replaced meanwhile. ``--wait``
waits for the DONE file with the request's id. Exit status: 0 committed, 1 failed, 2 timed out or
unusable directory.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import socket
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass

from tpuoffload.snapshot import write_atomic

REQUEST_NAME = "CHECKPOINT_REQUEST"
POLL_INTERVAL_S = 1.0  # the scheduler reads the request file at most this often
DONE_NAME = "CHECKPOINT_DONE"


@dataclass(frozen=True)
class CheckpointRequest:
    """An operator's checkpoint request (``tpuoffload checkpoint``), written as a file under
    ``persist_path`` for the scheduler to pick up."""

    id: str
    requested_unix: float
    by: str = ""


@dataclass(frozen=True)
class CheckpointDone:
    """An operator's checkpoint request answered: committed or not, the checkpoint number, the reason,
    when."""

    id: str
    ok: bool
    seq: int | None
    reason: str
    finished_unix: float


def request_checkpoint(directory: str) -> CheckpointRequest:
    """Ask the engine watching ``directory`` for a checkpoint (replaces a pending request)."""
    os.makedirs(directory, exist_ok=True)
    try:
        who = f"{getpass.getuser()}@{socket.gethostname()}"
    except Exception:  # noqa: BLE001 - no user name in some containers
        who = socket.gethostname()
    req = CheckpointRequest(uuid.uuid4().hex, time.time(), who)
    write_atomic(os.path.join(directory, REQUEST_NAME), asdict(req))
    return req


def read_done(directory: str) -> CheckpointDone | None:
    try:
        with open(os.path.join(directory, DONE_NAME)) as f:
            return CheckpointDone(**json.load(f))
    except (OSError, ValueError, TypeError):
        return None


def wait_done(directory: str, request_id: str, timeout_s: float, interval_s: float = 0.2) -> CheckpointDone | None:
    """The engine's answer to request ``request_id``, or None after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        done = read_done(directory)
        if done is not None and done.id == request_id:
            return done
        if time.monotonic() >= deadline:
            return None
        time.sleep(interval_s)


class RequestWatcher:
    """Polled by the scheduler each step; returns each request once. Never raises: an unreadable
    directory or file is no request."""

    def __init__(self, directory: str, poll_interval_s: float = POLL_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = os.path.join(directory, REQUEST_NAME)
        self.directory = directory
        self.poll_interval_s = poll_interval_s
        self._clock = clock
        self._next_poll = float("-inf")
        self._seen_stat: tuple[int, int, int] | None = None  # (inode, mtime_ns, size) last read
        self._served: set[str] = set()  # request ids already returned

    def poll(self) -> CheckpointRequest | None:
        now = self._clock()
        if now < self._next_poll:
            return None
        self._next_poll = now + self.poll_interval_s
        try:
            st = os.stat(self.path)
        except OSError:
            self._seen_stat = None
            return None
        stat_key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if stat_key == self._seen_stat:
            return None
        self._seen_stat = stat_key
        req = self._read(st)
        if req is None or req.id in self._served:
            return None
        self._served.add(req.id)
        return req

    def _read(self, st: os.stat_result) -> CheckpointRequest | None:
        try:
            with open(self.path) as f:
                text = f.read()
        except OSError:
            return None
        try:
            data = json.loads(text)
            return CheckpointRequest(str(data["id"]), float(data.get("requested_unix", st.st_mtime)),
                                     str(data.get("by", "")))
        except (ValueError, TypeError, KeyError):  # an empty or hand-made file: a request all the same
            return CheckpointRequest(f"file-{st.st_ino}-{st.st_mtime_ns}", st.st_mtime, "")

    def complete(self, request: CheckpointRequest, ok: bool, seq: int | None, reason: str = "") -> None:
        """Publish the outcome; remove the request file unless a newer request replaced it."""
        try:
            write_atomic(os.path.join(self.directory, DONE_NAME),
                          asdict(CheckpointDone(request.id, ok, seq, reason, time.time())))
            st = os.stat(self.path)
            current = self._read(st)
            if current is not None and current.id == request.id:
                os.unlink(self.path)
                self._seen_stat = None
        except OSError:
            pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tpuoffload checkpoint",
                                     description="ask a running tpuoffload engine for a warm-restart checkpoint")
    parser.add_argument("directory", help="the deployment's persist_path")
    parser.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                        help="wait this long for the checkpoint to be committed by every host")
    args = parser.parse_args(argv)
    return checkpoint_command(args.directory, args.wait)


def checkpoint_command(directory: str, wait: float) -> int:
    """``tpuoffload checkpoint DIR [--wait S]``: 0 committed (or asked, without --wait), 1 failed,
    2 no answer or unusable directory."""
    try:
        req = request_checkpoint(directory)
    except OSError as e:
        print(f"cannot write a request in {directory}: {e}", file=sys.stderr)
        return 2
    print(f"requested checkpoint {req.id} in {directory}", flush=True)
    if wait <= 0:
        return 0
    done = wait_done(directory, req.id, wait)
    if done is None:
        print(f"no answer within {wait:.0f} s (is an engine with persist_path={directory} running? The "
              "checkpoint is taken at the engine's next step, and vLLM runs no step while no request is "
              "in flight)", file=sys.stderr)
        return 2
    if done.ok:
        print(f"checkpoint {done.seq} committed by every host")
        return 0
    print(f"checkpoint failed: {done.reason}", file=sys.stderr)
    return 1
