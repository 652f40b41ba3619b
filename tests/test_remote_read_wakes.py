"""Shim 13 (``tpuoffload.sim.engine_shims.dequeue_waking_on_shutdown``) against vLLM's own
``MessageQueue``: the queue RayExecutorV2 reads a worker on another node through.

The serving launcher's killed-host case (tests/test_serve_stack.py) needs EngineCore to notice a
dead host. vLLM's executor shuts its response queues down when a worker dies, but a remote
reader's ``dequeue()`` polls its socket without a bound and never looks at ``shutting_down``, so a
host killed after host 0 answered a step and before it did leaves EngineCore blocked for ever
(CI saw /health answer 200 for the whole 180 s bound). The first test shows the defect on the
installed vLLM (if it fails, vLLM fixed it and shim 13 should go); the second, that the shim ends
the same read.
"""

from __future__ import annotations

import threading
import time

from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

from tpuoffload.sim.engine_shims import REMOTE_READ_SLICE_S, dequeue_waking_on_shutdown


def _remote_pair() -> tuple[MessageQueue, MessageQueue]:
    """A writer with one reader on "another node" (a TCP socket, as RayExecutorV2 makes for a worker
    whose node is not the driver's), both ready."""
    writer = MessageQueue(n_reader=1, n_local_reader=0, connect_ip="127.0.0.1")
    reader = MessageQueue.create_from_handle(writer.export_handle(), rank=0)
    ready = threading.Thread(target=reader.wait_until_ready, daemon=True)
    ready.start()
    writer.wait_until_ready()
    ready.join(10)
    assert not ready.is_alive() and reader._is_remote_reader
    return writer, reader


def _blocked_read(reader: MessageQueue, dequeue) -> tuple[threading.Thread, dict]:
    """``dequeue(reader)`` in a thread; what it returned or raised lands in the dict."""
    out: dict = {}

    def read():
        try:
            out["value"] = dequeue(reader)
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            out["raised"] = e

    t = threading.Thread(target=read, daemon=True)
    t.start()
    time.sleep(3 * REMOTE_READ_SLICE_S)
    assert t.is_alive() and not out, out  # nothing written yet: the read waits
    return t, out


def test_vllms_remote_read_is_not_woken_by_shutdown():
    """The defect on the installed vLLM: shutdown() leaves a remote reader's read blocked."""
    writer, reader = _remote_pair()
    t, out = _blocked_read(reader, MessageQueue.dequeue)
    reader.shutdown()
    t.join(4 * REMOTE_READ_SLICE_S + 2.0)
    still_blocked = t.is_alive()
    writer.enqueue("unblock")  # let the thread end either way
    t.join(10)
    assert still_blocked, f"vLLM's remote read ended on shutdown ({out}): drop engine_shims shim 13"
    assert out == {"value": "unblock"}


def test_shim_ends_a_remote_read_once_its_queue_is_shut_down():
    writer, reader = _remote_pair()
    waking = dequeue_waking_on_shutdown(MessageQueue.dequeue)
    # a message still arrives through the shim's read, unchanged
    writer.enqueue({"step": 1})
    assert waking(reader) == {"step": 1}
    t, out = _blocked_read(reader, waking)
    t0 = time.monotonic()
    reader.shutdown()
    t.join(4 * REMOTE_READ_SLICE_S + 2.0)
    assert not t.is_alive(), "the shimmed read is still blocked after shutdown"
    assert isinstance(out.get("raised"), RuntimeError) and str(out["raised"]) == "cancelled", out
    assert time.monotonic() - t0 < 2 * REMOTE_READ_SLICE_S + 1.0


def test_shim_keeps_the_reads_timeout():
    _, reader = _remote_pair()
    waking = dequeue_waking_on_shutdown(MessageQueue.dequeue)
    t0 = time.monotonic()
    try:
        waking(reader, timeout=1.2)
    except TimeoutError:
        pass
    else:
        raise AssertionError("a read with nothing written returned")
    assert 1.2 <= time.monotonic() - t0 < 1.2 + 2 * REMOTE_READ_SLICE_S + 1.0
