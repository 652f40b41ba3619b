"""Pod-slice worker processes, forked from one server that imported their modules once.

A worker needs vLLM, tpu-inference and tpuoffload imported before it can join its slice: about
15 s of CPU on the CI machine, paid by every worker of every slice the suite starts. Python's
``forkserver``, preloaded with those modules, forks each worker from a process that has them
already. Nothing in the server creates a JAX backend, so each worker still sets its own device
count (``XLA_FLAGS``) and joins ``jax.distributed`` as a fresh process would.

What a worker sees is what ``python -m`` gave it: the driver's frames on fd 0, its own on fd 1,
its log on fd 2, its own session (the driver kills its process group), the slice's environment.
The driver's handle (``WorkerProcess``) answers as ``subprocess.Popen`` did: ``pid``, ``stdin``,
``stdout``, ``poll``, ``wait``.

Simulation support: product code never imports it.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess

#: What the server imports once for every worker (slice_worker.py's own imports and the ones it
#: makes when a slice starts).
PRELOAD = ("tpuoffload.sim.slice_worker", "tpuoffload.connector", "tpuoffload.sim.runner",
           "tpuoffload.worker.offload_worker")

_context = None  # the forkserver context, made on first use


def _forkserver():
    global _context
    if _context is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(list(PRELOAD))
        _context = ctx
    return _context


class WorkerProcess:
    """The driver's handle on one worker process, as ``subprocess.Popen`` gave it."""

    def __init__(self, process, stdin, stdout) -> None:
        self._process = process
        self.pid = process.pid
        self.stdin = stdin  # the driver writes frames here (a pipe's write end)
        self.stdout = stdout  # and reads the worker's here

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        """The exit code (minus the signal for a killed worker), as ``Popen.wait``."""
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"slice worker {self.pid}", timeout)
        return self._process.exitcode


def _run(rank: int, num_hosts: int, port: int, env: dict, log_path: str, frames_in, frames_out) -> None:
    os.setsid()
    os.environ.clear()
    os.environ.update(env)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for fd, target in ((frames_in.fileno(), 0), (frames_out.fileno(), 1), (log, 2)):
        os.dup2(fd, target)
    frames_in.close()
    frames_out.close()
    os.close(log)
    from tpuoffload.sim.slice_worker import worker_main

    worker_main(rank, num_hosts, port)


def start_worker(rank: int, num_hosts: int, port: int, env: dict, log_path: str) -> WorkerProcess:
    """Start host ``rank`` of a slice of ``num_hosts`` (coordinator on ``port``), logging to ``log_path``."""
    ctx = _forkserver()
    to_worker, driver_out = ctx.Pipe(duplex=False)  # (read end, write end)
    driver_in, from_worker = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_run, args=(rank, num_hosts, port, env, log_path, to_worker, from_worker),
                          name=f"slice-host{rank}", daemon=True)
    process.start()
    to_worker.close()
    from_worker.close()
    return WorkerProcess(process, driver_out, driver_in)
