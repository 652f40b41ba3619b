"""The threads that complete saves in the background (worker/transfer_engine.py), and their handles.

The engine's main thread hands each save call's completion (wait for its programs, record its
slots) to one of a few threads. ``concurrent.futures.ThreadPoolExecutor.submit`` cost that thread
0.04-0.06 ms per save on an H200 host (tools/probe_save_latency.py), more with cold CPU caches
(right after a large transfer or the benchmark's byte check); here a submit is one lock made and
taken plus one ``queue.SimpleQueue.put``. A handle (``Done``) is a lock held until its completion
ran: ``done()`` asks whether it is free, waiting takes it (with a timeout) and frees it again.

Completions run in submission order of their start (one FIFO queue); each may still wait for
earlier ones (the engine chains writes to the same slot), which started before it, so a chain
never waits for work stuck behind it in the queue.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable

logger = logging.getLogger(__name__)


class Done:
    """Finished once the completion it was handed out for ran (whatever it raised)."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()

    def done(self) -> bool:
        return not self._lock.locked()

    def wait(self, timeout: float | None = None) -> bool:
        """True once finished; False if ``timeout`` seconds passed first."""
        if not self._lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            return False
        self._lock.release()
        return True

    def _finish(self) -> None:
        self._lock.release()


def wait_all(handles: Iterable[Done], timeout: float | None = None) -> set[Done]:
    """Wait until every handle is done or ``timeout`` seconds passed; returns those not done."""
    deadline = None if timeout is None else time.monotonic() + timeout
    late = set()
    for h in handles:
        if h.done():
            continue
        left = None if deadline is None else deadline - time.monotonic()
        if not h.wait(left):
            late.add(h)
    return late


def _serve(tasks: queue.SimpleQueue) -> None:
    while True:
        task = tasks.get()
        if task is None:
            return
        fn, args, done = task
        try:
            fn(*args)
        except BaseException:  # noqa: BLE001 - the completion logs its own failures; never lose the thread
            logger.exception("tpuoffload: a background save completion raised")
        finally:
            done._finish()
        del task, fn, args, done  # hold nothing of a finished save while waiting for the next


def _stop(tasks: queue.SimpleQueue, threads: list[threading.Thread]) -> None:
    for _ in threads:
        tasks.put(None)


class CompletionPool:
    """``threads`` daemon threads serving one FIFO queue of completions; stopped by ``shutdown``,
    or when the pool is collected or the interpreter exits."""

    def __init__(self, threads: int, name: str) -> None:
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=_serve, args=(self._tasks,), name=f"{name}_{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()
        self._stop = weakref.finalize(self, _stop, self._tasks, self._threads)

    def submit(self, fn: Callable, *args) -> Done:
        done = Done()
        self._tasks.put((fn, args, done))
        return done

    def shutdown(self, wait: bool = True) -> None:
        """Finish what was submitted, then stop the threads (joined if ``wait``)."""
        self._stop()
        if wait:
            for t in self._threads:
                t.join()
