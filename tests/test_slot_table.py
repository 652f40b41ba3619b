"""SlotTable, the host's slot table: exact capacity in whole slots of tpu-inference's real chunk
sizes, slot and length checks, tag semantics (an empty, invalidated or overwritten slot is never
readable; the source block is recorded with the chunk), and commits racing lookups without ever
pairing a chunk with another chunk's record.

The chunk sizes come from ``CacheLayout`` on caches that tpu-inference's own ``create_kv_caches``
allocates (``tpuoffload.sim.tpu_layouts``); the bytes themselves live in the transfer engine's
store (tests/test_engine_*.py check them).
"""

from __future__ import annotations

import contextlib
import itertools
import random
import threading
import time
from functools import cache

import numpy as np
import pytest

from tpuoffload.backend import SlotTable
from tpuoffload.backend.slot_table import EMPTY_SLOT
from tpuoffload.layout import CacheLayout
from tpuoffload.sim.tpu_layouts import LAYOUTS, create_caches

NAMES = ["bf16-8kv-tp4", "fp8-8kv-tp4", "bf16-mixed-hd256-512-tp4", "mla-tp4", "bf16-attndp4-tp2"]


@cache
def chunk_bytes(name: str) -> int:
    """What one chunk takes in this host's memory for the layout ``name`` (replicas included)."""
    return CacheLayout.from_caches(create_caches(LAYOUTS[name])[0]).device_bytes_per_chunk


def backend(slots: int = 4, name: str = "bf16-8kv-tp4") -> SlotTable:
    return SlotTable(slots * chunk_bytes(name), chunk_bytes(name))


# ---------------------------------------------------------------- capacity
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("extra", [0, 1, -1])
@pytest.mark.parametrize("slots", [1, 3, 10])
def test_capacity_is_whole_slots_within_budget(name, slots, extra):
    size = chunk_bytes(name)
    cap = slots * size + (extra % size)  # -1: one byte short of another slot
    b = SlotTable(cap, size)
    assert b.num_slots == cap // size == slots
    assert b.slot_bytes == size
    assert b.nbytes == slots * size <= cap
    assert b.num_used() == 0


@pytest.mark.parametrize("cap", [0, -1, -(1 << 20), 1, "chunk-1", 2.0 * (1 << 30), None, "1000000000"])
def test_bad_capacity_names_setting(cap):
    size = chunk_bytes("bf16-8kv-tp4")
    if cap == "chunk-1":
        cap = size - 1
    with pytest.raises(ValueError, match="cpu_bytes_to_use"):
        SlotTable(cap, size)


@pytest.mark.parametrize("slot_bytes", [0, -1])
def test_empty_slot_rejected(slot_bytes):
    with pytest.raises(ValueError, match="slot"):
        SlotTable(1 << 20, slot_bytes)


# ---------------------------------------------------------------- slot range and lengths
def test_out_of_range_slots_raise():
    b = backend(4)
    for bad in ([4], [-1], [0, 4], [100]):
        n = len(bad)
        with pytest.raises(ValueError, match="out of range"):
            b.check_slots(bad)
        with pytest.raises(ValueError, match="out of range"):
            b.commit(bad, list(range(n)), list(range(n)))
        with pytest.raises(ValueError, match="out of range"):
            b.invalidate(bad)
        with pytest.raises(ValueError, match="out of range"):
            b.lookup(bad, list(range(n)))
    for bad in (4, -1):
        with pytest.raises(ValueError, match="out of range"):
            b.tag(bad)
    assert b.num_used() == 0 and all(b.tag(s) == EMPTY_SLOT for s in range(4))
    assert b.check_slots([0, 3, 3]).tolist() == [0, 3, 3]


def test_length_mismatches_raise():
    b = backend(4)
    with pytest.raises(ValueError, match="same length"):
        b.commit([0, 1], [5], [1, 2])
    with pytest.raises(ValueError, match="same length"):
        b.commit([0, 1], [5, 6], [1])
    with pytest.raises(ValueError, match="same length"):
        b.lookup([0, 1], [5])
    for call in (lambda: b.lookup([[0, 1]], [[5, 6]]), lambda: b.commit([[0, 1]], [5, 6], [1, 2]),
                 lambda: b.invalidate([[0]])):
        with pytest.raises(ValueError, match="flat"):
            call()
    assert b.num_used() == 0


# ---------------------------------------------------------------- tags
def test_commit_lookup_and_source_blocks():
    b = backend(4)
    b.commit([3, 1], [300, 100], [17, 5])
    assert b.tag(3) == 300 and b.tag(1) == 100 and b.num_used() == 2
    ok, sources = b.lookup([1, 3, 3], [100, 300, 301])
    assert ok.tolist() == [True, True, False]  # 301: not the chunk the slot holds
    assert sources[:2].tolist() == [5, 17]
    # Recommitting a slot replaces both its tag and its source block.
    b.commit([3], [302], [60])
    ok, sources = b.lookup([3, 3], [300, 302])
    assert ok.tolist() == [False, True] and sources[1] == 60
    assert b.num_used() == 2


def test_empty_invalidated_and_overwritten_slots_never_readable():
    b = backend(4)
    b.commit([0, 1, 3], [100, 101, 103], [0, 1, 3])  # slot 2: never committed
    b.invalidate([3])  # slot 3 committed, then invalidated (its write failed / is being replaced)
    ok, _ = b.lookup([0, 1, 2, 3], [100, 999, 102, 103])
    assert ok.tolist() == [True, False, False, False]  # wrong save id, uncommitted, invalidated
    # An empty or invalidated slot is never readable, whatever the caller expects.
    ok, _ = b.lookup([2, 3], [EMPTY_SLOT, EMPTY_SLOT])
    assert not ok.any()
    assert b.tag(2) == EMPTY_SLOT and b.tag(3) == EMPTY_SLOT and b.num_used() == 2
    # Nor does committing EMPTY_SLOT make a slot readable.
    b.commit([1], [EMPTY_SLOT], [1])
    assert not b.lookup([1], [EMPTY_SLOT])[0].any() and b.num_used() == 1
    # Invalidating is idempotent and touches only its slots.
    b.invalidate([1, 1, 2])
    assert b.lookup([0], [100])[0].all() and b.num_used() == 1


def test_fresh_backend_has_nothing_loadable():
    b = backend(3)
    ok, _ = b.lookup([0, 1, 2], [0, 1, 2])
    assert not ok.any()
    assert all(b.tag(s) == EMPTY_SLOT for s in range(3)) and b.num_used() == 0
    ok, _ = b.lookup([], [])
    assert ok.size == 0


# ---------------------------------------------------------------- concurrency
SOURCE = 7  # the source block recorded with save id ``sid`` is ``sid * SOURCE``
STRESS_SLOTS = 12000
BATCH = (500, 2000)  # chunks per commit / lookup: one transfer piece of the engine


def stress(b: SlotTable, duration: float, writers: int = 3, readers: int = 3, seed: int = 0,
           enough=lambda stats: True):
    """The engine's use of the table from several threads at once, in batches as large as the
    engine's (one save or load piece).

    Writers play save completions: each owns a share of the slots (the engine chains writes per
    slot, so one slot never has two writers at once), picks a batch of them, invalidates it,
    announces the save ids it is about to commit (a load may expect a chunk whose save is still
    completing) and commits them with their source blocks, or, now and then, leaves the batch
    invalidated (a failed write). Readers play the main thread's load checks: they look a batch
    of slots up expecting the announced ids, and whenever ``lookup`` says a slot holds chunk
    ``sid`` it must pair it with ``sid``'s source block. A record torn between two commits, or a
    commit seen half done, would serve one chunk's bytes as another's, or from the wrong shard.
    The threads run ``duration`` seconds, and on (at most a minute more) until ``enough(stats)``:
    on a loaded machine a fixed time may do too little work to mean anything.
    """
    announced = np.full(b.num_slots, EMPTY_SLOT, np.int64)  # newest save id per slot (benign races: a hint)
    next_id = itertools.count(1)
    ids_lock = threading.Lock()  # guards next_id
    stop = time.monotonic() + duration
    cap = stop + 60.0
    errors: list[str] = []
    stats = {"commits": 0, "failed_writes": 0, "lookups": 0, "confirmed": 0}
    stats_lock = threading.Lock()  # guards stats

    def running() -> bool:
        now = time.monotonic()
        if errors or now >= cap:
            return False
        if now < stop:
            return True
        with stats_lock:
            return not enough(stats)

    def writer(k: int, r: random.Random):
        own = list(range(k, b.num_slots, writers))
        while running():
            slots = np.array(r.sample(own, r.randint(*BATCH)))
            with ids_lock:
                first = next(next_id)
                for _ in range(len(slots) - 1):
                    next(next_id)
            sids = np.arange(first, first + len(slots))
            b.invalidate(slots)
            if r.random() < 0.1:
                kind = "failed_writes"
            else:
                announced[slots] = sids
                b.commit(slots, sids, sids * SOURCE)
                kind = "commits"
            with stats_lock:
                stats[kind] += 1

    def reader(r: random.Random):
        while running():
            slots = np.array(r.sample(range(b.num_slots), r.randint(*BATCH)))
            expected = announced[slots].copy()
            ok, sources = b.lookup(slots, expected)
            torn = ok & ((sources != expected * SOURCE) | (expected == EMPTY_SLOT))
            if torn.any():
                i = int(np.flatnonzero(torn)[0])
                errors.append(f"{int(torn.sum())} slots paired with another chunk's record, e.g. slot "
                              f"{slots[i]}: chunk {expected[i]} with block {sources[i]}")
                return
            with stats_lock:
                stats["lookups"] += 1
                stats["confirmed"] += int(ok.sum())

    ts = [threading.Thread(target=writer, args=(k, random.Random(seed * 1000 + k)), daemon=True)
          for k in range(writers)]
    ts += [threading.Thread(target=reader, args=(random.Random(seed * 1000 + 100 + k),), daemon=True)
           for k in range(readers)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(duration + 90)
    assert not any(t.is_alive() for t in ts), "stress threads hung"
    return stats, errors


def test_concurrent_commits_and_lookups_never_torn():
    b = backend(STRESS_SLOTS)
    def enough(s) -> bool:
        return s["commits"] > 50 and s["failed_writes"] > 2 and s["confirmed"] > 10_000

    stats, errors = stress(b, duration=1.5, enough=enough)
    assert errors == []
    assert enough(stats), stats
    # Every slot ends whole: committed with its own source block, or empty.
    tags = np.array([b.tag(s) for s in range(b.num_slots)])
    ok, sources = b.lookup(range(b.num_slots), tags)
    assert np.array_equal(ok, tags != EMPTY_SLOT)
    assert np.array_equal(sources[ok], tags[ok] * SOURCE)
    assert b.num_used() == int(ok.sum())


def test_stress_detects_torn_records_without_the_lock():
    """Negative control: the same stress with the table's lock replaced by a no-op must catch a
    torn record, so the test above would fail if the lock went missing."""
    b = backend(STRESS_SLOTS)
    b._lock = contextlib.nullcontext()
    stats, errors = stress(b, duration=15.0, seed=1)  # stops at the first torn record (ms usually)
    assert errors, f"no torn record observed without the lock: {stats}"
