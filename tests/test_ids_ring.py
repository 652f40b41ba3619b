"""IdsRing (worker/ids_ring.py): a call's ids are written into a preallocated host buffer only
when every program that read that buffer before has finished; otherwise the call gets a fresh
array and the busy buffer keeps the ids its program is still to copy."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tpuoffload.worker.ids_ring import IdsRing


class Token:
    """Stands for a program's token output: ready or still running."""

    def __init__(self, ready: bool) -> None:
        self.ready = ready

    def is_ready(self) -> bool:
        return self.ready


def ring(depth: int) -> IdsRing:
    mesh = Mesh(np.array(jax.devices()[:4]), ("model",))
    return IdsRing(NamedSharding(mesh, PartitionSpec(), memory_kind="pinned_host"), depth=depth)


def ids(value: int) -> np.ndarray:
    return np.full((3, 8), value, np.int32)


def test_busy_buffer_is_never_overwritten():
    r = ring(depth=2)
    first, entry1 = r.put(ids(1))
    r.read_by(entry1, [Token(True), Token(False)])  # one group's program still runs
    second, entry2 = r.put(ids(2))
    r.read_by(entry2, [Token(False)])
    third, entry3 = r.put(ids(3))  # the ring wraps onto the first buffer, still being read
    assert entry3 is None and r.fallbacks == 1
    assert third is not first and np.array_equal(np.asarray(third), ids(3))
    for shard in first.addressable_shards:  # every device's copy still holds the first call's ids
        assert np.array_equal(np.asarray(shard.data), ids(1))
    assert np.array_equal(np.asarray(second), ids(2))


def test_buffer_reused_once_its_programs_finished():
    r = ring(depth=2)
    tokens = [Token(False)]
    first, entry1 = r.put(ids(1))
    r.read_by(entry1, tokens)
    r.read_by(r.put(ids(2))[1], [Token(True)])
    tokens[0].ready = True
    again, entry = r.put(ids(3))
    assert again is first and entry is entry1 and r.fallbacks == 0
    for shard in again.addressable_shards:
        assert np.array_equal(np.asarray(shard.data), ids(3))


def test_platform_whose_programs_do_not_see_the_writes_falls_back_to_transfers(monkeypatch, caplog):
    """If writes through a buffer's address are not what a program reads (here: views onto copies),
    the start-up check turns the ring off and every call transfers its ids: correct, only slower."""
    allocate = IdsRing._allocate

    def detached(self, shape):
        entry = allocate(self, shape)
        entry.views = [np.zeros(shape, np.int32) for _ in entry.views]  # not the buffers programs read
        return entry

    monkeypatch.setattr(IdsRing, "_allocate", detached)
    r = ring(depth=2)
    out, entry = r.put(ids(5))
    assert entry is None and not r.enabled and "transferred per call" in caplog.text
    assert np.array_equal(np.asarray(out), ids(5))
    assert np.array_equal(np.asarray(r.put(ids(6))[0]), ids(6))


def test_start_up_check_passes_here():
    r = ring(depth=2)
    out, entry = r.put(ids(7))
    assert r.enabled and entry is not None and np.array_equal(np.asarray(out), ids(7))


def test_buffer_handed_out_but_never_reported_read_is_not_reused():
    """A dispatch that raised after some programs took the buffer never calls ``read_by``: the
    buffer must stay untouched (those programs may still copy it), later calls fall back."""
    r = ring(depth=1)
    first, entry = r.put(ids(1))  # ... and the caller's dispatch fails: no read_by
    again, entry2 = r.put(ids(2))
    assert entry2 is None and r.fallbacks == 1 and np.array_equal(np.asarray(again), ids(2))
    for shard in first.addressable_shards:
        assert np.array_equal(np.asarray(shard.data), ids(1))
