"""The background completion threads and their handles (tpuoffload/worker/completions.py)."""

from __future__ import annotations

import gc
import threading
import time
import weakref

from tpuoffload.worker.completions import CompletionPool, Done, wait_all


def test_a_handle_is_done_once_finished_and_waits_with_a_timeout():
    h = Done()
    assert not h.done()
    t0 = time.monotonic()
    assert not h.wait(0.05) and time.monotonic() - t0 >= 0.04
    threading.Timer(0.05, h._finish).start()
    assert h.wait(5) and h.done()
    assert h.wait(0) and h.wait()  # stays done; waiting again never blocks


def test_wait_all_returns_the_handles_not_done_within_the_timeout():
    a, b, c = Done(), Done(), Done()
    a._finish()
    threading.Timer(0.05, b._finish).start()
    assert wait_all([a, b, c], 0.5) == {c}
    c._finish()
    assert wait_all([a, b, c]) == set()


def test_a_completion_that_raises_still_finishes_its_handle_and_keeps_its_thread():
    pool = CompletionPool(1, "test")
    ran = []

    def boom():
        raise RuntimeError("injected")

    bad = pool.submit(boom)
    good = pool.submit(ran.append, 1)
    assert bad.wait(5), "the handle of a completion that raised never finished"
    assert good.wait(5) and ran == [1]
    pool.shutdown()


def test_completions_start_in_submission_order_so_a_chain_never_waits_behind_itself():
    """One thread: B waits for A's handle (as the engine chains writes to one slot); A was queued
    first, so it runs first and B's wait ends."""
    pool = CompletionPool(1, "test")
    order = []

    def a():
        time.sleep(0.05)
        order.append("a")

    first = pool.submit(a)
    second = pool.submit(lambda: (first.wait(5), order.append("b")))
    assert second.wait(5) and order == ["a", "b"]
    pool.shutdown()


def test_shutdown_finishes_what_was_submitted_then_stops_the_threads():
    pool = CompletionPool(3, "test")
    ran = []
    handles = [pool.submit(lambda i=i: (time.sleep(0.01), ran.append(i))) for i in range(10)]
    threads = list(pool._threads)
    pool.shutdown(wait=True)
    assert sorted(ran) == list(range(10)) and all(h.done() for h in handles)
    assert not any(t.is_alive() for t in threads)


def test_a_pool_dropped_without_shutdown_stops_its_threads():
    pool = CompletionPool(2, "test")
    threads = list(pool._threads)
    ref = weakref.ref(pool)
    del pool
    gc.collect()
    assert ref() is None
    for t in threads:
        t.join(5)
    assert not any(t.is_alive() for t in threads)
