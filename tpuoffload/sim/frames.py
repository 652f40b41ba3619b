"""Framed pickles over a pod slice's pipes: the scheduler's non-blocking, deadline-driven end
(``HostPipe``) and a worker's blocking end (``send_frame``, ``recv_frame``)."""

from __future__ import annotations

import os
import pickle
import socket
import struct
from typing import TYPE_CHECKING, Any, BinaryIO

if TYPE_CHECKING:
    from tpuoffload.sim.launch import WorkerProcess

HEAD = struct.Struct("<Q")


def send_frame(stream: BinaryIO, obj: Any) -> None:
    """Blocking send (worker side)."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(HEAD.pack(len(data)) + data)
    stream.flush()


def read_exact(stream: BinaryIO, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = stream.read(n - len(buf))
        if not chunk:
            raise EOFError("peer closed the pipe")
        buf += chunk
    return buf


def recv_frame(stream: BinaryIO) -> Any:
    """Blocking receive (worker side)."""
    (n,) = HEAD.unpack(read_exact(stream, HEAD.size))
    return pickle.loads(read_exact(stream, n))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class HostPipe:
    """The scheduler's end of one worker's pipes: non-blocking, framed, deadline-driven."""

    def __init__(self, proc: "WorkerProcess") -> None:
        self.proc = proc
        self.rfd = proc.stdout.fileno()
        self.wfd = proc.stdin.fileno()
        os.set_blocking(self.rfd, False)
        os.set_blocking(self.wfd, False)
        self.inbuf = bytearray()
        self.out = memoryview(b"")
        self.eof = False

    def take_frame(self) -> tuple[bool, Any]:
        if len(self.inbuf) < HEAD.size:
            return False, None
        (n,) = HEAD.unpack_from(self.inbuf)
        if len(self.inbuf) < HEAD.size + n:
            return False, None
        data = bytes(self.inbuf[HEAD.size:HEAD.size + n])
        del self.inbuf[:HEAD.size + n]
        return True, pickle.loads(data)

    def fill(self) -> None:
        try:
            while True:
                chunk = os.read(self.rfd, 1 << 20)
                if not chunk:
                    self.eof = True
                    return
                self.inbuf += chunk
        except BlockingIOError:
            pass

    def flush(self) -> None:
        while self.out:
            try:
                n = os.write(self.wfd, self.out)
            except BlockingIOError:
                return
            self.out = self.out[n:]
