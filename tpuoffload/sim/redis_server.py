"""A throwaway ``redis-server`` (Debian's package, installed by scripts/setup.sh) for tests and
benchmarks of the shared tier's Redis backend: a free port, no persistence, optional ``maxmemory``
with LRU eviction, in its own process group under an outside ``timeout``, killed by ``stop``
(also at interpreter exit). Simulation only: never imported by the connector's code."""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """``RedisServer(maxmemory=...)``; ``url``; ``stop()`` kills it; ``start()`` again on the same port
    (the store "coming back", empty)."""

    def __init__(self, maxmemory: int | None = None, port: int | None = None, lifetime_s: int = 3600) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise RuntimeError("redis-server is not installed: run scripts/setup.sh (it installs Debian's redis-server)")
        self.port = port or free_port()
        self.maxmemory = maxmemory
        self.lifetime_s = lifetime_s
        self.dir = tempfile.mkdtemp(prefix="tpuoffload-redis-")
        self.proc: subprocess.Popen | None = None
        atexit.register(self.stop)
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 20.0) -> None:
        args = ["timeout", "-s", "KILL", str(self.lifetime_s), self.binary, "--port", str(self.port),
                "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", self.dir, "--protected-mode", "no"]
        if self.maxmemory is not None:
            args += ["--maxmemory", str(self.maxmemory), "--maxmemory-policy", "allkeys-lru"]
        log = open(os.path.join(self.dir, "redis.log"), "ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}; see {self.dir}/redis.log")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout} s")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait(timeout=10)

    def __enter__(self) -> "RedisServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
