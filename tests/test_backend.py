"""HostBackend on tpu-inference's real cache layouts: exact capacity, slot and length checks, tiles
of every layer group round trip, tag semantics, and concurrent access without torn reads.

Slots are opaque byte rows; a group's view of them comes from ``CacheLayout`` built on caches that
tpu-inference's own ``create_kv_caches`` allocates (``tpuoffload.sim.tpu_layouts``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import random
import threading
import time
from functools import cache

import numpy as np
import pytest

from tpuoffload.backend import HostBackend
from tpuoffload.backend.host_backend import EMPTY
from tpuoffload.layout import CacheLayout
from tpuoffload.sim.tpu_layouts import LAYOUTS, create_caches

MIXED = "bf16-mixed-hd256-512-tp4"  # two layer groups (head_dim 256 and 512), 4 tiles each


@cache
def layout_of(name: str) -> CacheLayout:
    return CacheLayout.from_caches(create_caches(LAYOUTS[name])[0])


def tile_rows(group, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` random rows for one tile of ``group``: (n, layers, *tile_shape) in its wire dtype."""
    shape = (n, len(group.layers), *group.tile_shape)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * group.wire_dtype.itemsize, dtype=np.uint8)
    return raw.view(group.wire_dtype).reshape(shape)


def read(backend: HostBackend, group, slots, tile: int) -> np.ndarray:
    out = np.empty((len(slots), len(group.layers), *group.tile_shape), group.wire_dtype)
    backend.read_tile(group, slots, tile, out)
    return out


def write_slot_pattern(backend: HostBackend, layout: CacheLayout, slots, values) -> None:
    """Every element of every tile of every group in ``slots[i]`` set to ``values[i]``."""
    for g in layout.groups:
        rows = np.empty((len(slots), len(g.layers), *g.tile_shape), g.wire_dtype)
        for i, v in enumerate(values):
            rows[i] = v
        for t in range(len(g.tiles)):
            backend.write_tile(g, slots, t, rows)


# ---------------------------------------------------------------- capacity
@pytest.mark.parametrize("name", ["bf16-8kv-tp4", "fp8-8kv-tp4", MIXED, "mla-tp4", "bf16-attndp4-tp2"])
@pytest.mark.parametrize("extra", [0, 1, -1])
@pytest.mark.parametrize("slots", [1, 3, 10])
def test_capacity_is_whole_slots_within_budget(name, slots, extra):
    slot_bytes = layout_of(name).slot_bytes
    cap = slots * slot_bytes + (extra % slot_bytes)  # -1: one byte short of another slot
    b = HostBackend(cap, slot_bytes)
    assert b.num_slots == cap // slot_bytes == slots
    assert b.slot_bytes == slot_bytes
    assert b.nbytes == slots * slot_bytes <= cap
    assert b.num_used() == 0


def test_slot_bytes_is_every_group_once():
    """A slot is the groups' tiles back to back: offsets contiguous, no overlap, nothing left over."""
    layout = layout_of(MIXED)
    assert len(layout.groups) == 2
    end = 0
    for g in layout.groups:
        assert g.offset == end
        end += g.nbytes
    assert end == layout.slot_bytes


@pytest.mark.parametrize("cap", [0, -1, -(1 << 20), 1, "slot-1", 2.0 * (1 << 20), None, "1000000"])
def test_bad_capacity_names_setting(cap):
    slot_bytes = layout_of("bf16-8kv-tp4").slot_bytes
    if cap == "slot-1":
        cap = slot_bytes - 1
    with pytest.raises(ValueError, match="cpu_bytes_to_use"):
        HostBackend(cap, slot_bytes)


@pytest.mark.parametrize("slot_bytes", [0, -1])
def test_empty_slot_rejected(slot_bytes):
    with pytest.raises(ValueError, match="slot"):
        HostBackend(1 << 20, slot_bytes)


# ---------------------------------------------------------------- slot range and lengths
def test_out_of_range_slots_raise():
    layout = layout_of(MIXED)
    g = layout.groups[0]
    b = HostBackend(4 * layout.slot_bytes, layout.slot_bytes)
    rng = np.random.default_rng(0)
    for bad in ([4], [-1], [0, 4], [100]):
        n = len(bad)
        with pytest.raises(ValueError, match="out of range"):
            b.write_tile(g, bad, 0, tile_rows(g, n, rng))
        with pytest.raises(ValueError, match="out of range"):
            b.read_tile(g, bad, 0, np.empty((n, len(g.layers), *g.tile_shape), g.wire_dtype))
        with pytest.raises(ValueError, match="out of range"):
            b.commit(bad, list(range(n)), list(range(n)))
        with pytest.raises(ValueError, match="out of range"):
            b.invalidate(bad)
        with pytest.raises(ValueError, match="out of range"):
            b.lookup(bad, list(range(n)))
    for bad in (4, -1):
        with pytest.raises(ValueError, match="out of range"):
            b.tag(bad)
    assert b.num_used() == 0


def test_length_mismatches_raise():
    layout = layout_of(MIXED)
    g = layout.groups[1]
    b = HostBackend(4 * layout.slot_bytes, layout.slot_bytes)
    rng = np.random.default_rng(1)
    with pytest.raises(ValueError, match="rows"):
        b.write_tile(g, [0, 1], 0, tile_rows(g, 1, rng))
    with pytest.raises(ValueError, match="rows"):
        b.write_tile(g, [0], 0, tile_rows(g, 2, rng))
    with pytest.raises(ValueError):
        b.write_tile(g, [[0, 1]], 0, tile_rows(g, 2, rng))
    for n_out in (1, 3):  # an output buffer that does not have one row per slot
        with pytest.raises(ValueError):
            b.read_tile(g, [0, 1], 0, np.empty((n_out, len(g.layers), *g.tile_shape), g.wire_dtype))
    with pytest.raises(ValueError):
        b.read_tile(g, [0], 0, np.empty((2, len(g.layers), *g.tile_shape), g.wire_dtype))
    with pytest.raises(ValueError, match="same length"):
        b.commit([0, 1], [5], [1, 2])
    with pytest.raises(ValueError, match="same length"):
        b.commit([0, 1], [5, 6], [1])
    with pytest.raises(ValueError, match="same length"):
        b.lookup([0, 1], [5])
    with pytest.raises(ValueError):
        b.lookup([[0, 1]], [[5, 6]])
    assert b.num_used() == 0


# ---------------------------------------------------------------- tiles
@pytest.mark.parametrize("name", [MIXED, "fp8-8kv-tp4", "mla-tp4", "bf16-attndp4-tp2"])
def test_write_read_tile_round_trip_every_group_and_tile(name):
    """Distinct random bytes in every (group, tile) of several slots read back exactly: the
    group views do not overlap each other or other slots."""
    layout = layout_of(name)
    b = HostBackend(5 * layout.slot_bytes, layout.slot_bytes)
    rng = np.random.default_rng(2)
    slots = [3, 0, 4]
    written = {}
    for gi, g in enumerate(layout.groups):
        for t in range(len(g.tiles)):
            written[gi, t] = tile_rows(g, len(slots), rng)
            b.write_tile(g, slots, t, written[gi, t])
    for gi, g in enumerate(layout.groups):
        for t in range(len(g.tiles)):
            assert np.array_equal(read(b, g, slots, t), written[gi, t]), (gi, t)
            assert np.array_equal(read(b, g, slots[::-1], t), written[gi, t][::-1]), (gi, t)
            assert not read(b, g, [1, 2], t).any()  # slots nobody wrote stay zero
    # Writes are not visible as chunks until committed.
    assert b.num_used() == 0
    assert not b.lookup(slots, [0, 0, 0])[0].any()


def test_write_tile_touches_only_its_tile_and_group():
    layout = layout_of(MIXED)
    b = HostBackend(2 * layout.slot_bytes, layout.slot_bytes)
    rng = np.random.default_rng(3)
    g0, g1 = layout.groups
    rows = tile_rows(g0, 1, rng)
    b.write_tile(g0, [1], 2, rows)
    for gi, g in enumerate(layout.groups):
        for t in range(len(g.tiles)):
            got = read(b, g, [0, 1], t)
            assert not got[0].any(), "another slot changed"
            if (gi, t) == (0, 2):
                assert np.array_equal(got[1], rows[0])
            else:
                assert not got[1].any(), f"group {gi} tile {t} changed"


def test_read_tile_hands_out_a_copy():
    layout = layout_of(MIXED)
    g = layout.groups[0]
    b = HostBackend(2 * layout.slot_bytes, layout.slot_bytes)
    rows = tile_rows(g, 1, np.random.default_rng(4))
    b.write_tile(g, [0], 1, rows)
    got = read(b, g, [0], 1)
    got[...] = 0
    rows[...] = 0  # nor does the backend keep the caller's buffer
    assert read(b, g, [0], 1).any()


# ---------------------------------------------------------------- tags
def test_commit_lookup_and_source_blocks():
    layout = layout_of(MIXED)
    b = HostBackend(4 * layout.slot_bytes, layout.slot_bytes)
    write_slot_pattern(b, layout, [3, 1], [30, 10])
    b.commit([3, 1], [300, 100], [17, 5])
    assert b.tag(3) == 300 and b.tag(1) == 100 and b.num_used() == 2
    ok, sources = b.lookup([1, 3, 3], [100, 300, 301])
    assert ok.tolist() == [True, True, False]  # 301: not the chunk the slot holds
    assert sources[:2].tolist() == [5, 17]
    # Recommitting a slot replaces both its tag and its source block.
    b.commit([3], [302], [60])
    ok, sources = b.lookup([3, 3], [300, 302])
    assert ok.tolist() == [False, True] and sources[1] == 60


def test_empty_invalidated_and_uncommitted_slots_never_readable():
    layout = layout_of(MIXED)
    b = HostBackend(4 * layout.slot_bytes, layout.slot_bytes)
    write_slot_pattern(b, layout, [0, 1, 2, 3], [5, 5, 5, 5])
    b.commit([0, 1, 3], [100, 101, 103], [0, 1, 3])  # slot 2 written but never committed
    b.invalidate([3])  # slot 3 committed, then invalidated
    ok, _ = b.lookup([0, 1, 2, 3], [100, 999, 102, 103])
    assert ok.tolist() == [True, False, False, False]  # wrong save id, uncommitted, invalidated
    # An empty or invalidated slot is never readable, whatever the caller expects.
    ok, _ = b.lookup([2, 3], [EMPTY, EMPTY])
    assert not ok.any()
    assert b.tag(2) == EMPTY and b.tag(3) == EMPTY and b.num_used() == 2
    # A failed write's commit must not resurrect: committing EMPTY leaves the slot unreadable.
    b.commit([1], [EMPTY], [1])
    assert not b.lookup([1], [EMPTY])[0].any() and b.num_used() == 1


def test_fresh_backend_has_nothing_loadable():
    layout = layout_of("bf16-8kv-tp4")
    b = HostBackend(3 * layout.slot_bytes, layout.slot_bytes)
    ok, _ = b.lookup([0, 1, 2], [0, 1, 2])
    assert not ok.any()
    assert all(b.tag(s) == EMPTY for s in range(3)) and b.num_used() == 0
    for g in layout.groups:
        for t in range(len(g.tiles)):
            assert not read(b, g, [0, 1, 2], t).any()


# ---------------------------------------------------------------- concurrency
# Bigger blocks than the stock layout (same tpu-inference allocation code) so that one tile copy
# takes long enough (256 KiB) for copies on different threads to overlap.
STRESS_SPEC = dataclasses.replace(LAYOUTS[MIXED], name="stress", block_size=64, num_blocks=8)
STRESS_SLOTS = 6
SOURCE = 7  # the source block recorded with save id ``sid`` is ``sid * SOURCE``


@cache
def stress_layout() -> CacheLayout:
    return CacheLayout.from_caches(create_caches(STRESS_SPEC)[0])


def stress(backend: HostBackend, layout: CacheLayout, duration: float, threads: int = 8, seed: int = 0):
    """Writers and readers on a few overlapping slots.

    Writers follow the engine's protocol (invalidate; write every tile of every group, one
    ``write_tile`` call each; commit with the source block) and, like the engine's write chains,
    never write one slot from two threads at once. Every element written under save id ``sid``
    equals ``sid``. Readers do not coordinate with writers at all, and check:

    * per call: every row ``read_tile`` returns is one writer's pattern, whole (a torn copy mixes
      two values);
    * per slot: a slot whose tag was ``sid`` both before and after reading all its tiles holds
      ``sid`` everywhere, and ``lookup`` pairs it with its own source block.
    """
    slot_locks = [threading.Lock() for _ in range(backend.num_slots)]
    ids = itertools.count(1)
    stop = time.monotonic() + duration
    errors: list[str] = []
    stats = {"writes": 0, "rows": 0, "whole_slots": 0}
    stats_lock = threading.Lock()  # guards stats

    def writer(r: random.Random):
        while time.monotonic() < stop and not errors:
            slots = sorted(r.sample(range(backend.num_slots), r.randint(1, 3)))
            for s in slots:
                slot_locks[s].acquire()
            try:
                sids = [next(ids) for _ in slots]
                assert max(sids) < 0xFFFF, "save ids must fit the uint16 pattern"
                backend.invalidate(slots)
                write_slot_pattern(backend, layout, slots, sids)
                backend.commit(slots, sids, [sid * SOURCE for sid in sids])
            finally:
                for s in slots:
                    slot_locks[s].release()
            with stats_lock:
                stats["writes"] += 1

    def reader(r: random.Random):
        while time.monotonic() < stop and not errors:
            slots = r.sample(range(backend.num_slots), r.randint(1, 3))
            tags = [backend.tag(s) for s in slots]
            ok_before, sources = backend.lookup(slots, tags)
            whole = [True] * len(slots)
            for gi, g in enumerate(layout.groups):
                for t in range(len(g.tiles)):
                    got = read(backend, g, slots, t)
                    for i, row in enumerate(got):
                        first = row.flat[0]
                        if not (row == first).all():
                            errors.append(f"torn row: slot {slots[i]} group {gi} tile {t} holds "
                                          f"{np.unique(row)[:6].tolist()}")
                            return
                        whole[i] &= int(first) == tags[i]
                    with stats_lock:
                        stats["rows"] += len(slots)
            ok_after, _ = backend.lookup(slots, tags)
            for i, s in enumerate(slots):
                if ok_before[i] and ok_after[i]:
                    if not whole[i]:
                        errors.append(f"slot {s} tagged {tags[i]} throughout does not hold it everywhere")
                        return
                    if sources[i] != tags[i] * SOURCE:
                        errors.append(f"slot {s} tagged {tags[i]} paired with source {sources[i]}")
                        return
                    with stats_lock:
                        stats["whole_slots"] += 1

    rngs = [random.Random(seed * 1000 + i) for i in range(threads)]
    ts = [threading.Thread(target=writer if i % 2 == 0 else reader, args=(rngs[i],), daemon=True)
          for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(duration + 30)
    assert not any(t.is_alive() for t in ts), "stress threads hung"
    return stats, errors


def stress_backend() -> HostBackend:
    layout = stress_layout()
    return HostBackend(STRESS_SLOTS * layout.slot_bytes, layout.slot_bytes)


def test_concurrent_writes_and_reads_never_torn():
    layout = stress_layout()
    b = stress_backend()
    stats, errors = stress(b, layout, duration=2.0)
    assert errors == []
    assert stats["writes"] > 20 and stats["rows"] > 200 and stats["whole_slots"] > 5, stats
    # Every slot ends whole: committed with its pattern everywhere and its source block.
    tags = [b.tag(s) for s in range(b.num_slots)]
    ok, sources = b.lookup(range(b.num_slots), tags)
    assert ok.tolist() == [tag != EMPTY for tag in tags]
    for g in layout.groups:
        for t in range(len(g.tiles)):
            got = read(b, g, list(range(b.num_slots)), t)
            for s, tag in enumerate(tags):
                if tag != EMPTY:
                    assert (got[s] == tag).all() and sources[s] == tag * SOURCE


def test_stress_detects_torn_reads_without_the_lock():
    """Negative control: the same stress with the backend's lock replaced by a no-op must catch
    torn reads, so the test above would fail if the lock went missing."""
    layout = stress_layout()
    b = stress_backend()
    b._lock = contextlib.nullcontext()
    stats, errors = stress(b, layout, duration=15.0, seed=1)  # stops at the first torn read
    assert errors, f"no torn read observed without the lock: {stats}"
