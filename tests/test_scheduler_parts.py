"""The scheduler half's parts, each on its own: SlotPool, StagingBudget, RecencyLog, ChunkIndex,
CompletionLedger, SavePlanner. Randomized tests compare each against a plain reference model."""

from __future__ import annotations

import logging
import random
from collections import Counter

import numpy as np
import pytest

from tpuoffload import counters as C
from tpuoffload.messages import OffloadWorkerReport, compact_ints, id_ranges, merge_ranges
from tpuoffload.scheduler.hash_table import HashKeys, HashTable, PackedHashes
from tpuoffload.scheduler.index import READY, REVOKED, SAVING, ChunkIndex
from tpuoffload.scheduler.ledger import CompletionLedger
from tpuoffload.scheduler.recency import RecencyLog
from tpuoffload.scheduler.save_planner import SavePlanner
from tpuoffload.scheduler.slot_pool import SlotPool
from tpuoffload.scheduler.staging import StagingBudget


def h(i: int) -> bytes:
    return i.to_bytes(8, "big")


def arr(*xs) -> np.ndarray:
    return np.array(xs, dtype=np.int64)


# ---------------------------------------------------------------- SlotPool
def test_slot_pool_hands_out_each_slot_once_lowest_first_then_nothing():
    pool = SlotPool(5)
    assert pool.take(3).tolist() == [0, 1, 2]
    assert pool.take(9).tolist() == [3, 4]
    assert pool.num_free == 0
    assert pool.take(1).tolist() == [] and pool.take(0).tolist() == []
    pool.give(arr(3, 1))
    assert pool.num_free == 2
    assert sorted(pool.take(5).tolist()) == [1, 3]


def test_slot_pool_bad_frees_raise_and_change_nothing():
    pool = SlotPool(4)
    got = pool.take(2)
    pool.give(got[:1])
    for bad in (got[:1], arr(3), arr(-1), arr(4), arr(1, 1)):
        with pytest.raises(ValueError):
            pool.give(bad)
    assert pool.num_free == 3
    assert sorted(pool.take(4).tolist()) == [0, 2, 3]


@pytest.mark.parametrize("size", [0, -1, 1.5, "4", None, True])
def test_slot_pool_bad_size(size):
    with pytest.raises(ValueError, match="num_slots"):
        SlotPool(size)


# ---------------------------------------------------------------- StagingBudget
def test_staging_budget_never_exceeds_capacity_and_refuses_whole():
    b = StagingBudget(100)
    assert b.try_reserve(60)
    assert not b.try_reserve(41) and b.in_use == 60  # refused whole, nothing taken
    assert b.try_reserve(40) and b.in_use == 100
    assert not b.try_reserve(1) and b.try_reserve(0)
    b.release(100)
    assert not b.try_reserve(101) and b.in_use == 0


def test_staging_budget_reserve_up_to_grants_what_fits():
    b = StagingBudget(100)
    assert b.reserve_up_to(3, 30) == 3 and b.in_use == 90
    assert b.reserve_up_to(5, 30) == 0 and b.in_use == 90  # 10 bytes left: not one unit
    assert b.reserve_up_to(5, 10) == 1 and b.in_use == 100
    b.release(40)
    assert b.reserve_up_to(0, 10) == 0 and b.reserve_up_to(10, 20) == 2 and b.in_use == 100
    with pytest.raises(ValueError):
        b.reserve_up_to(-1, 10)
    with pytest.raises(ValueError):
        b.reserve_up_to(1, 0)


def test_staging_budget_random_never_exceeds():
    rng = random.Random(1)
    b = StagingBudget(1000)
    held = []
    for _ in range(5000):
        if held and rng.random() < 0.45:
            b.release(held.pop(rng.randrange(len(held))))
        elif rng.random() < 0.5:
            n = rng.randrange(0, 400)
            before = b.in_use
            if b.try_reserve(n):
                held.append(n)
            else:
                assert before + n > 1000 and b.in_use == before
        else:
            unit, count = rng.randrange(1, 200), rng.randrange(0, 8)
            before = b.in_use
            k = b.reserve_up_to(count, unit)
            assert k == min(count, (1000 - before) // unit)
            held.extend([unit] * k)
        assert 0 <= b.in_use <= b.capacity and b.in_use == sum(held)


def test_staging_budget_release_errors():
    b = StagingBudget(10)
    b.try_reserve(5)
    for bad in (6, -1):
        with pytest.raises(ValueError):
            b.release(bad)
    with pytest.raises(ValueError):
        b.try_reserve(-1)
    assert b.in_use == 5


@pytest.mark.parametrize("cap", [0, -5, 1.0, None])
def test_staging_budget_bad_capacity_names_setting(cap):
    with pytest.raises(ValueError, match="staging_bytes"):
        StagingBudget(cap)


# ---------------------------------------------------------------- RecencyLog
def test_recency_log_against_a_list_with_compaction():
    rng = random.Random(2)
    n = 16
    log = RecencyLog(n)
    model: list[int] = []  # least recently used first
    pinned: set[int] = set()
    for _ in range(4000):
        op = rng.random()
        if op < 0.45:
            slots = [rng.randrange(n) for _ in range(rng.randrange(1, 6))]
            log.touch(np.array(slots))
            for s in slots:
                if s in model:
                    model.remove(s)
                model.append(s)
        elif op < 0.55:
            slots = [rng.randrange(n) for _ in range(rng.randrange(1, 4))]
            log.forget(np.array(slots))
            model = [s for s in model if s not in slots]
        elif op < 0.65:
            pinned = {rng.randrange(n) for _ in range(rng.randrange(0, 4))}
        else:
            k = rng.randrange(0, 5)
            got = log.pop_oldest(k, lambda s: np.array([x not in pinned for x in s.tolist()], dtype=bool))
            want = [s for s in model if s not in pinned][:k]
            assert got.tolist() == want
            if k:
                # Everything met up to the last slot taken leaves the order: taken, or (pinned)
                # dropped until whoever pinned it touches it again.
                model = model[model.index(want[-1]) + 1:] if len(want) == k else []
        assert log.order().tolist() == model
    assert log._logged <= 2 * n + 4096 + 8  # compaction keeps the log bounded


# ---------------------------------------------------------------- ChunkIndex
def save(index: ChunkIndex, hashes, first_id: int) -> np.ndarray:
    slots = index.allocate(len(hashes))
    index.add_saving(HashKeys.of(list(hashes[:len(slots)])), slots, first_id)
    return slots


def ready(index: ChunkIndex, hashes, first_id: int = 0) -> np.ndarray:
    slots = save(index, hashes, first_id)
    assert index.mark_ready(slots, index.save_ids(slots)) == len(slots)
    return slots


def test_index_lru_evicts_oldest_ready_unpinned_and_reuses_its_slot():
    idx = ChunkIndex(3)
    slots = ready(idx, [h(1), h(2), h(3)])
    assert idx.num_free_slots == 0
    got = idx.allocate(1)
    assert got.tolist() == [slots[0]] and idx.slot_of(h(1)) is None  # the oldest went first
    assert idx.counters[C.EVICTED] == 1
    idx.add_saving(HashKeys.of([h(4)]), got, 10)
    assert idx.state_of(int(got[0])) == SAVING and idx.save_id_of(int(got[0])) == 10
    assert idx.slot_of(h(4)) == int(got[0])


def test_index_allocate_hands_out_lru_victims_ascending_by_slot():
    """The LRU picks which chunks go; their slots come back sorted ascending (so a step's saves name
    runs of consecutive slots), free slots first; the evicted chunks are the same as before."""
    idx = ChunkIndex(8)
    slots = save(idx, [h(i) for i in range(8)], 0)
    assert slots.tolist() == list(range(8))
    order = [5, 2, 7, 0, 3, 6, 1, 4]  # recency: slot 5 oldest ... slot 4 newest
    assert idx.mark_ready(arr(*order), idx.save_ids(arr(*order))) == 8
    assert idx.lru_order() == order
    got = idx.allocate(5)
    assert got.tolist() == sorted(order[:5]) == [0, 2, 3, 5, 7]
    gone = {int(slots[i]) for i in range(8) if idx.slot_of(h(i)) is None}
    assert gone == set(order[:5]) and idx.counters[C.EVICTED] == 5
    assert idx.lru_order() == order[5:]
    idx.add_saving(HashKeys.of([h(10 + i) for i in range(5)]), got, 100)
    assert [idx.slot_of(h(10 + i)) for i in range(5)] == [0, 2, 3, 5, 7]  # i-th new chunk, i-th slot


def test_index_mark_ready_order_sets_recency():
    """The last listed becomes the most recently used (the scheduler lists newest saves first, so a
    prefix's first chunk ends the most recently used)."""
    idx = ChunkIndex(3)
    slots = save(idx, [h(1), h(2), h(3)], 0)
    idx.mark_ready(slots[::-1], idx.save_ids(slots[::-1]))
    assert idx.lru_order() == slots[::-1].tolist()


def test_index_saving_pinned_and_revoked_never_evicted():
    idx = ChunkIndex(4)
    r = ready(idx, [h(1), h(2)])
    save(idx, [h(3)], 5)  # saving
    ready(idx, [h(4)], 6)
    idx.pin(r[:1])  # h1 pinned
    got = idx.allocate(3)  # only h2 and h4 are evictable, in that order
    assert len(got) == 2 and idx.slot_of(h(2)) is None and idx.slot_of(h(4)) is None
    assert idx.slot_of(h(1)) is not None and idx.slot_of(h(3)) is not None
    assert idx.allocate(1).tolist() == []
    idx.add_saving(HashKeys.of([h(5), h(6)]), got, 7)
    idx.unpin(r[:1])
    assert idx.allocate(1).tolist() == [r[0]]  # unpinned: evictable again


def test_index_pin_twice_needs_two_unpins_and_bad_pins_raise():
    idx = ChunkIndex(2)
    s = ready(idx, [h(1)])
    save(idx, [h(2)], 1)
    idx.pin(s)
    idx.pin(s)
    idx.unpin(s)
    assert idx.allocate(1).tolist() == []  # still pinned once
    idx.unpin(s)
    with pytest.raises(ValueError):
        idx.unpin(s)  # not pinned any more
    with pytest.raises(ValueError):
        idx.pin(arr(int(idx.slot_of(h(2)))))  # saving: not READY
    assert idx.num_pinned() == 0
    assert len(idx.allocate(1)) == 1


def test_index_find_confirms_with_the_second_key_word():
    idx = ChunkIndex(4)
    a, b = b"A" * 8 + b"x" * 8, b"A" * 8 + b"y" * 8  # equal first 8 bytes (the table's key)
    (sa,) = ready(idx, [a])
    assert idx.slot_of(a) == sa and idx.slot_of(b) is None and not idx.contains(b)
    assert idx.find(HashKeys.of([b, a])).tolist() == [-1, sa]
    assert idx.ready_prefix([a, b]) == [sa]


def test_index_drop_frees_slot_and_late_confirmation_cannot_resurrect():
    idx = ChunkIndex(2)
    s = save(idx, [h(1)], 0)
    assert idx.ready_prefix([h(1)]) == []
    assert idx.drop(s, arr(0)) == 1
    assert idx.slot_of(h(1)) is None and not idx.contains(h(1)) and idx.num_free_slots == 2
    assert idx.mark_ready(s, arr(0)) == 0  # late: the slot holds no save 0 any more
    assert idx.drop(s, arr(0)) == 0  # no double free
    assert idx.num_free_slots == 2
    s2 = save(idx, [h(1)], 1)
    assert idx.mark_ready(s2, arr(0)) == 0  # a stale save id for a reused slot is ignored
    assert idx.state_of(int(s2[0])) == SAVING


def test_index_ready_prefix_has_no_side_effects():
    idx = ChunkIndex(4)
    ready(idx, [h(1), h(2), h(3)])
    before = idx.lru_order()
    for _ in range(3):
        assert len(idx.ready_prefix([h(1), h(2), h(3)])) == 3
        assert len(idx.ready_prefix([h(1), h(9), h(3)])) == 1
        assert idx.ready_prefix([]) == []
    assert idx.lru_order() == before and idx.num_pinned() == 0 and not idx.counters
    save(idx, [h(4)], 3)
    assert len(idx.ready_prefix([h(1), h(4)])) == 1  # stops at a saving chunk
    # A range of the list (LoadTracker passes a request's hashes with bounds, not a copy).
    assert idx.ready_prefix([h(9), h(1), h(2), h(3)], 1, 3) == idx.ready_prefix([h(1), h(2)])
    assert len(idx.ready_prefix([h(9), h(1), h(2), h(3)], 1)) == 3
    assert idx.ready_prefix([h(1), h(2)], 2) == [] and idx.ready_prefix([h(1), h(2)], 1, 1) == []
    # The form LoadTracker uses (a miss included) and ships: slots, their save ids, and every
    # prefix listed as compact_ints would list it (a run as a range).
    for hashes in ([h(1), h(2), h(9)], [h(9), h(1)], [h(3)], [h(1), h(2), h(3)], [h(3), h(2), h(1)]):
        got = idx.ready_prefix_saved(hashes)
        assert got.slots.dtype == np.int64 and got.slots.tolist() == idx.ready_prefix(hashes)
        assert got.save_ids.tolist() == [idx.save_id_of(s) for s in got.slots.tolist()]
        for k in range(len(got.slots) + 1):
            slots, ids = got.listed(k)
            assert list(slots) == got.slots[:k].tolist() and list(ids) == got.save_ids[:k].tolist()
            assert (type(slots), type(ids)) == (type(compact_ints(got.slots[:k])), type(compact_ints(got.save_ids[:k])))


def test_index_discard_pinned_keeps_slot_until_last_unpin():
    idx = ChunkIndex(2)
    (a,) = ready(idx, [h(1)])
    one = arr(int(a))
    assert not idx.discard(int(a), 99)  # another save id: refused
    idx.pin(one)
    idx.pin(one)
    v = idx.version
    assert idx.discard(int(a), 0) and idx.version != v
    assert idx.slot_of(h(1)) is None and idx.state_of(int(a)) == REVOKED
    assert idx.num_free_slots == 1  # still owned by the pinned, discarded chunk
    b = save(idx, [h(1)], 1)  # the same hash saved again gets another slot
    assert b.tolist() != [a]
    assert idx.allocate(1).tolist() == []  # nothing to spare: the revoked slot is not evictable
    idx.unpin(one)
    assert idx.num_free_slots == 0
    idx.unpin(one)  # last unpin frees the discarded chunk's slot, not the new chunk's
    assert idx.num_free_slots == 1 and idx.slot_of(h(1)) == int(b[0])
    assert not idx.discard(int(a), 0)  # twice: no double free
    assert idx.counters[C.DISCARDED] == 1


def test_index_revoke_all_makes_nothing_loadable_and_frees_each_slot_once():
    idx = ChunkIndex(6)
    r = ready(idx, [h(1), h(2), h(3)])
    s = save(idx, [h(4), h(5)], 3)
    idx.pin(r[:1])
    assert idx.revoke_all() == 5
    assert len(idx) == 0 and idx.ready_prefix([h(1)]) == [] and not idx.contains(h(4))
    assert idx.num_free_slots == 6 - 3  # the pinned one and the two saves in flight keep their slot
    assert idx.counters[C.REVOKED] == 5
    # Saves in flight confirmed after the reset: freed, never READY.
    assert idx.mark_ready(s, idx.save_ids(s)) == 0
    assert idx.num_free_slots == 5 and idx.ready_prefix([h(4)]) == []
    idx.unpin(r[:1])
    assert idx.num_free_slots == 6 and idx.num_saving() == 0
    # The same content can be saved again.
    ready(idx, [h(1), h(4)], 10)
    assert len(idx.ready_prefix([h(1)])) == 1


class _Rec:
    def __init__(self, hash_, save_id, slot):
        self.hash, self.save_id, self.slot, self.state, self.pins = hash_, save_id, slot, "saving", 0


class IndexModel:
    """Reference: hash -> record, an LRU list of evictable hashes, and ghosts (revoked or
    discarded records that still own their slot)."""

    def __init__(self, num_slots):
        self.num_slots = num_slots
        self.chunks: dict[bytes, _Rec] = {}
        self.lru: list[bytes] = []
        self.ghosts: list[_Rec] = []  # revoked/discarded: saving (until resolved) or pinned (until unpinned)
        self.evicted = 0

    def used(self):
        return len(self.chunks) + len(self.ghosts)

    def evictable(self):
        return [x for x in self.lru if self.chunks[x].pins == 0]


@pytest.mark.parametrize("seed", range(6))
def test_index_randomized_against_model(seed):
    rng = random.Random(seed)
    num_slots = rng.choice([1, 2, 5, 8])
    idx = ChunkIndex(num_slots)
    model = IndexModel(num_slots)
    universe = [h(i) for i in range(3 * num_slots + 2)]
    next_id = 0
    pins: list[_Rec] = []

    for _ in range(1500):
        op = rng.random()
        if op < 0.3:
            fresh = list(dict.fromkeys(x for x in rng.sample(universe, rng.randrange(0, 4)) if x not in model.chunks))
            slots = idx.allocate(len(fresh))
            free = num_slots - model.used()
            want_evict = model.evictable()[:max(0, len(fresh) - free)]
            assert len(slots) == min(len(fresh), free + len(model.evictable()))
            for x in want_evict:
                model.lru.remove(x)
                del model.chunks[x]
                model.evicted += 1
            idx.add_saving(HashKeys.of(fresh[:len(slots)]), slots, next_id)
            for x, s in zip(fresh, slots.tolist()):
                model.chunks[x] = _Rec(x, next_id, s)
                next_id += 1
        elif op < 0.58:
            cands = [r for r in [*model.chunks.values(), *model.ghosts] if r.state in ("saving", "revoked-saving")]
            if not cands:
                continue
            picked = rng.sample(cands, rng.randrange(1, len(cands) + 1))
            slots, ids = arr(*[r.slot for r in picked]), arr(*[r.save_id for r in picked])
            if rng.random() < 0.15:
                ids = ids + 10**9  # stale ids: ignored
                picked = []
            if op < 0.5:
                idx.mark_ready(slots, ids)
                for r in picked:
                    if r.state == "saving":
                        r.state = "ready"
                        model.lru.append(r.hash)
                    else:
                        model.ghosts = [g for g in model.ghosts if g is not r]
            else:
                idx.drop(slots, ids)
                for r in picked:
                    if r.state == "saving":
                        del model.chunks[r.hash]
                    else:
                        model.ghosts = [g for g in model.ghosts if g is not r]
        elif op < 0.7:
            rs = [r for r in model.chunks.values() if r.state == "ready"]
            if rs:
                picked = rng.sample(rs, rng.randrange(1, len(rs) + 1))
                idx.pin(arr(*[r.slot for r in picked]))
                for r in picked:
                    r.pins += 1
                    pins.append(r)
        elif op < 0.84:
            if pins:
                picked = [pins.pop(rng.randrange(len(pins))) for _ in range(rng.randrange(1, len(pins) + 1))]
                idx.unpin(arr(*[r.slot for r in picked]))
                for r in reversed(picked):
                    r.pins -= 1
                for r in reversed(picked):  # released last to first: the first listed ends MRU
                    if r.pins:
                        continue
                    if any(g is r for g in model.ghosts):
                        model.ghosts = [g for g in model.ghosts if g is not r]
                    elif model.chunks.get(r.hash) is r:
                        model.lru.remove(r.hash)
                        model.lru.append(r.hash)
        elif op < 0.93:
            rs = [r for r in model.chunks.values() if r.state == "ready"]
            if rs:
                r = rng.choice(rs)
                sid = r.save_id if rng.random() < 0.8 else r.save_id + 10**9
                ok = idx.discard(r.slot, sid)
                assert ok == (sid == r.save_id)
                if ok:
                    del model.chunks[r.hash]
                    model.lru.remove(r.hash)
                    if r.pins:
                        r.state = "revoked-pinned"
                        model.ghosts.append(r)
        elif op < 0.95:
            idx.revoke_all()
            for r in list(model.chunks.values()):
                if r.state == "saving":
                    r.state = "revoked-saving"
                    model.ghosts.append(r)
                elif r.pins:
                    r.state = "revoked-pinned"
                    model.ghosts.append(r)
            model.chunks.clear()
            model.lru.clear()
        else:
            q = [rng.choice(universe) for _ in range(rng.randrange(1, 7))]
            start = rng.randrange(0, len(q))
            want = []
            for x in q[start:]:
                r = model.chunks.get(x)
                if r is None or r.state != "ready":
                    break
                want.append(r.slot)
            assert idx.ready_prefix(q, start) == want
            if start == 0:
                assert idx.ready_prefix(q) == want
            # Batch dedup: first occurrences that no chunk (saving or ready) holds, in order.
            seen, keep, dup, held_ = set(), [], 0, 0
            for i, x in enumerate(q):
                if x in seen:
                    dup += 1
                elif x in model.chunks:
                    seen.add(x)
                    held_ += 1
                else:
                    seen.add(x)
                    keep.append(i)
            want_keys = HashKeys.of([q[i] for i in keep])
            # The same answer from keys, and from packed hashes through the planner's one call (limit 0:
            # nothing named)
            for got_keys, got_keep, got_dup, got_held in (idx.select_new(HashKeys.of(q)),
                                                          idx.select_and_name(PackedHashes.of(q), 0, 0)[:4]):
                assert (got_keep.tolist(), got_dup, got_held) == (keep, dup, held_)
                assert got_keys.k1.tolist() == want_keys.k1.tolist() and got_keys.k2.tolist() == want_keys.k2.tolist()
            assert idx.find(HashKeys.of(q)).tolist() == [model.chunks[x].slot if x in model.chunks else -1 for x in q]

        # ---- invariants after every operation ----
        assert len(idx) == len(model.chunks)
        for x, r in model.chunks.items():
            assert idx.slot_of(x) == r.slot and idx.save_id_of(r.slot) == r.save_id
            assert idx.state_of(r.slot) == (SAVING if r.state == "saving" else READY)
        for r in model.ghosts:
            assert idx.state_of(r.slot) == REVOKED
        held = [r.slot for r in [*model.chunks.values(), *model.ghosts]]
        assert len(held) == len(set(held)), "two chunks share a slot"
        assert idx.num_free_slots == num_slots - len(held)
        pinned_slots = {r.slot for r in model.chunks.values() if r.pins}
        assert [s for s in idx.lru_order() if s not in pinned_slots] == [model.chunks[x].slot for x in model.evictable()]
        assert idx.counters[C.EVICTED] == model.evicted
        assert idx.num_pinned() == len({r.slot for r in pins})


def test_lru_evicts_prefixes_from_the_tail():
    """After a prefix is loaded (pinned, then unpinned in prefix order), eviction takes its last
    chunk first, so what remains of the prefix is still a loadable prefix."""
    idx = ChunkIndex(3)
    hashes = [b"p0", b"p1", b"p2"]
    slots = ready(idx, hashes)
    idx.pin(slots)
    idx.unpin(slots)
    idx.add_saving(HashKeys.of([b"other"]), idx.allocate(1), 10)  # pool full: one eviction
    assert len(idx.ready_prefix(hashes)) == 2 and not idx.contains(b"p2")


# ---------------------------------------------------------------- CompletionLedger
def resolved(led: CompletionLedger) -> tuple[list[int], list[int]]:
    r = led.take_resolved()
    return r.ready_ids.tolist(), r.dropped_ids.tolist()


def test_ledger_ready_only_after_every_host():
    led = CompletionLedger(3)
    assert led.open_batch(arr(7, 8), deadline=100.0, step=0) == 0
    led.report(0, ok=[(0, 2)])
    led.report(2, ok=[(0, 2)])
    assert resolved(led) == ([], []) and len(led) == 2
    led.report(1, ok=[(1, 2)])
    r = led.take_resolved()
    assert r.ready_ids.tolist() == [1] and r.ready_slots.tolist() == [8]
    assert len(led) == 1 and led.counters[C.LEDGER_CONFIRMED] == 1


def test_ledger_failure_resolves_at_once_and_later_reports_are_late():
    led = CompletionLedger(4)
    led.open_batch(arr(0), 100.0, 0)
    led.report(1, ok=[(0, 1)])
    led.report(3, failed=[(0, 1)])
    assert resolved(led) == ([], [0]) and len(led) == 0
    led.report(0, ok=[(0, 1)])
    led.report(2, ok=[(0, 1)])
    assert resolved(led) == ([], [])
    assert led.counters[C.LEDGER_LATE] == 2 and led.counters[C.LEDGER_FAILED] == 1


def test_ledger_duplicates_counted_never_as_another_host():
    led = CompletionLedger(2)
    led.open_batch(arr(0, 1, 2), 100.0, 0)
    led.report(0, ok=[(0, 3)])
    led.report(0, ok=[(0, 3)])  # a report merged twice
    assert led.counters[C.LEDGER_DUPLICATE] == 3 and len(led) == 3
    led.report(1, ok=[(0, 3)])
    assert resolved(led) == ([2, 1, 0], [])  # newest first


def test_ledger_early_reports_staged_and_replayed_when_their_batch_opens():
    led = CompletionLedger(2)
    led.open_batch(arr(0), 100.0, 0)  # id 0
    led.report(0, ok=[(5, 7)])  # ids 5, 6 not handed out yet
    led.report(1, ok=[(5, 6)], failed=[(6, 7)])
    assert led.counters[C.LEDGER_EARLY] == 4
    assert led.open_batch(arr(1, 2, 3, 4), 100.0, 1) == 1  # ids 1..4
    assert resolved(led) == ([], [])
    assert led.open_batch(arr(5, 6), 100.0, 2) == 5
    assert resolved(led) == ([5], [6]) and len(led) == 5


def test_ledger_early_staging_is_bounded():
    led = CompletionLedger(1, max_early=4)
    for sid in range(10, 20):
        led.report(0, ok=[(sid, sid + 1)])
    assert led.counters[C.LEDGER_UNKNOWN] == 6
    led.open_batch(np.arange(20), 1.0, 0)
    assert sorted(resolved(led)[0]) == [16, 17, 18, 19]


def test_ledger_unknown_host_counted_and_logged_once(caplog):
    led = CompletionLedger(2, source="test")
    led.open_batch(arr(0), 100.0, 0)
    with caplog.at_level(logging.ERROR, logger="tpuoffload.scheduler.ledger"):
        led.report(2, ok=[(0, 1)])
        led.report(2, failed=[(0, 1)])  # a failure from an unknown host does not fail it
        led.report(-1, ok=[(0, 1)])
    assert led.counters[C.LEDGER_UNKNOWN_HOST] == 3 and len(led) == 1
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2 and "host 2" in errors[0].getMessage() and "num_hosts" in errors[0].getMessage()
    led.report(0, ok=[(0, 1)])
    led.report(1, ok=[(0, 1)])
    assert resolved(led) == ([0], [])


def test_ledger_expires_oldest_batches_only():
    led = CompletionLedger(2)
    for i, dl in enumerate((1.0, 2.0, 3.0)):
        led.open_batch(arr(2 * i, 2 * i + 1), dl, i)  # ids 2i, 2i+1
    led.report(0, ok=[(2, 4)])
    led.report(1, ok=[(2, 3)])  # id 2 READY; id 3 half confirmed
    assert led.oldest_deadline() == 1.0
    assert led.expire(0.5) == 0
    assert led.expire(2.0) == 3  # ids 0, 1, 3
    assert resolved(led) == ([2], [0, 1, 3])
    assert led.expire(100.0) == 2 and led.oldest_deadline() is None and resolved(led) == ([], [4, 5])
    assert led.counters[C.LEDGER_EXPIRED] == 5
    led.report(1, ok=[(3, 4)])
    assert led.counters[C.LEDGER_LATE] == 1 and resolved(led) == ([], [])


def test_ledger_reports_missing_hosts_within_a_few_steps(caplog):
    led = CompletionLedger(8, source="world_size 8", mismatch_steps=3)
    led.open_batch(arr(0, 1), 100.0, step=0)
    led.report(0, ok=[(0, 2)])
    with caplog.at_level(logging.ERROR, logger="tpuoffload.scheduler.ledger"):
        assert led.check_reporters(2) is None  # not old enough yet
        msg = led.check_reporters(3)
        assert led.check_reporters(4) is None  # once
    assert msg and "8 reporting workers" in msg and "[1, 2, 3, 4, 5, 6, 7]" in msg and "num_hosts" in msg
    assert led.counters[C.REPORTERS_MISSING] == 1
    assert any(r.levelno == logging.ERROR for r in caplog.records)


def test_ledger_no_missing_report_when_every_host_reports_or_none_yet():
    led = CompletionLedger(2, mismatch_steps=1)
    led.open_batch(arr(0), 100.0, step=0)
    assert led.check_reporters(5) is None  # nobody confirmed anything yet: no evidence
    led.report(0, ok=[(0, 1)])
    led.report(1, ok=[(0, 1)])
    led.open_batch(arr(1), 100.0, step=6)
    led.report(0, ok=[(1, 2)])
    assert led.check_reporters(20) is None and not led.counters[C.REPORTERS_MISSING]


@pytest.mark.parametrize("n", [0, -1, 1.5, None, True])
def test_ledger_bad_num_hosts(n):
    with pytest.raises(ValueError, match="num_hosts"):
        CompletionLedger(n)


class LedgerModel:
    """Reference ledger, one save id at a time."""

    def __init__(self, num_hosts):
        self.num_hosts = num_hosts
        self.next_id = 0
        self.pending: dict[int, tuple[float, set[int]]] = {}
        self.early: list[tuple[int, bool, int]] = []
        self.ready: list[int] = []
        self.dropped: list[int] = []
        self.counters = Counter()

    def open(self, n, deadline):
        base = self.next_id
        self.next_id += n
        for i in range(base, base + n):
            self.pending[i] = (deadline, set())
        staged, self.early = self.early, []
        for host, ok, i in staged:
            if base <= i < base + n:
                self.one(host, i, ok)
            else:
                self.early.append((host, ok, i))
        return base

    def one(self, host, i, ok):
        if not 0 <= host < self.num_hosts:
            self.counters[C.LEDGER_UNKNOWN_HOST] += 1
        elif i >= self.next_id:
            self.counters[C.LEDGER_EARLY] += 1
            self.early.append((host, ok, i))
        elif i not in self.pending:
            self.counters[C.LEDGER_LATE] += 1
        elif not ok:
            del self.pending[i]
            self.dropped.append(i)
            self.counters[C.LEDGER_FAILED] += 1
        elif host in self.pending[i][1]:
            self.counters[C.LEDGER_DUPLICATE] += 1
        else:
            self.pending[i][1].add(host)
            if len(self.pending[i][1]) == self.num_hosts:
                del self.pending[i]
                self.ready.append(i)
                self.counters[C.LEDGER_CONFIRMED] += 1

    def expire(self, now):
        for i in sorted(self.pending):
            if self.pending[i][0] <= now:
                del self.pending[i]
                self.dropped.append(i)
                self.counters[C.LEDGER_EXPIRED] += 1


@pytest.mark.parametrize("seed", range(5))
def test_ledger_randomized_against_model(seed):
    rng = random.Random(seed)
    hosts = rng.choice([1, 2, 3, 5])
    led = CompletionLedger(hosts, max_early=1 << 20)
    model = LedgerModel(hosts)
    now = last_deadline = 0.0
    batches = []
    for _ in range(1500):
        op = rng.random()
        if op < 0.15:
            n = rng.randrange(1, 6)
            last_deadline = max(last_deadline, now + rng.uniform(0, 5))  # deadlines never decrease
            base = model.next_id
            assert led.open_batch(np.arange(base, base + n) + 1000, last_deadline, 0) == model.open(n, last_deadline)
            batches.append((base, base + n))
        elif op < 0.2:
            now += rng.uniform(0, 2)
            led.expire(now)
            model.expire(now)
        elif op < 0.5 and batches:
            # The usual report: one host confirms a whole batch (the ledger's fast path), often
            # a recent one, sometimes twice or after a partial report.
            a, b = batches[-1 - min(int(rng.expovariate(0.7)), len(batches) - 1)]
            host = rng.randrange(-1, hosts + 1)
            led.report(host, ok=[(a, b)])
            for i in range(a, b):
                model.one(host, i, True)
        else:
            host = rng.randrange(-1, hosts + 1)
            ok_ids = sorted({rng.randrange(-2, model.next_id + 4) for _ in range(rng.randrange(0, 6))})
            bad_ids = sorted({rng.randrange(-2, model.next_id + 4) for _ in range(rng.randrange(0, 2))})
            led.report(host, ok=id_ranges(ok_ids), failed=id_ranges(bad_ids))
            for i in ok_ids:
                model.one(host, i, True)
            for i in bad_ids:
                model.one(host, i, False)
        r = led.take_resolved()
        assert sorted(r.ready_ids.tolist()) == sorted(model.ready) and sorted(r.dropped_ids.tolist()) == sorted(model.dropped)
        assert (r.ready_slots == r.ready_ids + 1000).all() and (r.dropped_slots == r.dropped_ids + 1000).all()
        model.ready, model.dropped = [], []
        assert len(led) == len(model.pending)
        assert {k: led.counters[k] for k in model.counters} == dict(model.counters)


# ---------------------------------------------------------------- report ranges
def test_id_ranges_and_merge():
    assert id_ranges([]) == ()
    assert id_ranges([5, 3, 4, 9, 3, 11, 10]) == ((3, 6), (9, 12))
    assert merge_ranges(((0, 2), (5, 6)), ((1, 3), (6, 8), (10, 11))) == ((0, 3), (5, 8), (10, 11))
    a = OffloadWorkerReport.from_host(0, [1, 2, 3], [7])
    b = OffloadWorkerReport.from_host(1, [1, 2, 3])
    assert a.aggregate(a).saved == a.saved  # idempotent
    ab = a.aggregate(b)
    assert ab.saved == b.aggregate(a).saved == {0: ((1, 4),), 1: ((1, 4),)}  # two hosts stay two
    assert len(ab) == 7 and ab.failed == {0: ((7, 8),)}
    assert not OffloadWorkerReport.from_host(0)  # empty: vLLM drops it


# ---------------------------------------------------------------- SavePlanner
def planner(num_slots=8, staging_chunks=100, hosts=1):
    idx = ChunkIndex(num_slots)
    led = CompletionLedger(hosts)
    budget = StagingBudget(staging_chunks * 10)
    counters = Counter()
    return SavePlanner(idx, led, budget, chunk_bytes=10, save_timeout_s=5.0, clock=lambda: 0.0,
                       counters=counters), idx, led, budget, counters


def test_planner_dedups_once_and_accounts_every_candidate():
    p, idx, led, budget, counters = planner()
    ready(idx, [h(1)], 1000)  # held
    save(idx, [h(2)], 1001)  # in flight
    blocks = [10, 11, 12, 13, 14, 15, 16]
    hashes = [h(1), h(2), h(3), h(3), h(4), h(3), h(5)]
    batch = p.plan(blocks, hashes, step=0)
    assert list(batch.slots) == [idx.slot_of(x) for x in (h(3), h(4), h(5))]
    assert batch.block_ids[1:] == (14, 16) and batch.block_ids[0] in (12, 13, 15)
    assert isinstance(batch.save_ids, range) and list(batch.save_ids) == [0, 1, 2]
    assert +counters == {C.DEDUP_INDEX: 2, C.DEDUP_BATCH: 2, C.SAVES_ISSUED: 3}
    assert budget.in_use == 30 and len(led) == 3


@pytest.mark.parametrize("seed", range(3))
def test_compact_ints_is_the_same_sequence(seed):
    """Slots travel as a range when consecutive (either direction), else as a tuple; always the
    same values in the same order."""
    rng = random.Random(seed)
    cases = [[5], [3, 4, 5], [9, 8, 7, 6], [0, 2], [4, 3, 5], [1, 1], [7, 6, 5, 6]]
    for _ in range(200):
        n, a = rng.randrange(1, 9), rng.randrange(0, 50)
        run = list(range(a, a + n)) if rng.random() < 0.5 else list(range(a + n, a, -1))
        if rng.random() < 0.4:
            run[rng.randrange(n)] += rng.choice([-2, -1, 1, 2])
        cases.append(run)
    for case in cases:
        got = compact_ints(np.array(case, dtype=np.int64))
        assert list(got) == case
        consecutive = len(case) > 1 and all(b - a == case[1] - case[0] for a, b in zip(case, case[1:])) \
            and abs(case[1] - case[0]) == 1
        assert isinstance(got, range) == consecutive, case


def test_planner_staging_cut_keeps_the_first_and_counts_the_rest():
    p, idx, led, budget, counters = planner(staging_chunks=2)
    batch = p.plan([1, 2, 3, 4], [h(1), h(2), h(1), h(3)], 0)
    assert list(batch.slots) == [idx.slot_of(h(1)), idx.slot_of(h(2))] and not idx.contains(h(3))
    assert +counters == {C.DEDUP_BATCH: 1, C.SKIPPED_STAGING: 1, C.SAVES_ISSUED: 2} and budget.in_use == 20
    assert len(p.plan([5], [h(9)], 1)) == 0 and counters[C.SKIPPED_STAGING] == 2


def test_planner_no_space_releases_unspent_staging():
    p, idx, led, budget, counters = planner(num_slots=2)
    save(idx, [h(100)], 500)  # one slot held by a save in flight
    batch = p.plan([1, 2, 3], [h(1), h(2), h(3)], 0)
    assert len(batch) == 1 and counters[C.SKIPPED_NO_SPACE] == 2
    assert budget.in_use == 10  # only what was issued stays reserved


def test_planner_names_free_slots_then_evicted_ones_in_candidate_order():
    """Free slots are named in the planner's one compiled call, the rest on slots of LRU chunks
    evicted for them: every kept chunk is named by its own hash, under the save id of its position
    in the batch, and the batch lists them in candidate order."""
    p, idx, led, budget, counters = planner(num_slots=6)
    old = ready(idx, [h(100), h(101), h(102), h(103)], 500)  # 2 slots left free; LRU: 100 first
    blocks, hashes = [1, 2, 3, 4, 5], [h(1), h(2), h(1), h(3), h(4)]
    batch = p.plan(blocks, hashes, 0)
    assert batch.block_ids == (1, 2, 4, 5) and list(batch.save_ids) == [0, 1, 2, 3]
    assert list(batch.slots)[2:] == [int(old[0]), int(old[1])]  # evicted oldest first
    for slot, x, sid in zip(batch.slots, (h(1), h(2), h(3), h(4)), batch.save_ids):
        assert idx.slot_of(x) == slot and idx.save_id_of(slot) == sid and idx.state_of(slot) == SAVING
    assert not idx.contains(h(100)) and not idx.contains(h(101)) and idx.contains(h(102))
    assert +counters == {C.DEDUP_BATCH: 1, C.SAVES_ISSUED: 4} and idx.counters[C.EVICTED] == 2
    assert budget.in_use == 40 and len(led) == 4
    led.report(0, ok=[(0, 4)])
    res = led.take_resolved()
    assert idx.mark_ready(res.ready_slots, res.ready_ids) == 4


# ---------------------------------------------------------------- HashTable
@pytest.mark.parametrize("seed", range(4))
def test_hash_table_randomized_against_a_dict(seed):
    """Small tables, clustered keys (many share a home bucket, so buckets fill, overflow, get
    deleted markers and rebuilds): every find agrees with a dict."""
    rng = random.Random(seed)
    cap = (4, 16, 64, 64)[seed]
    t = HashTable(cap)
    model: dict[int, int] = {}
    cells: dict[int, int] = {}
    universe = [2 + (rng.randrange(4) << 8) + (i << 20) if rng.random() < 0.7 else rng.randrange(2, 1 << 63)
                for i in range(4 * cap)]
    next_val = 0
    rebuilds = 0
    for _ in range(3000):
        op = rng.random()
        if op < 0.45:
            absent = [k for k in universe if k not in model]
            room = cap - len(model)
            new = rng.sample(absent, min(len(absent), room, rng.randrange(0, 6)))
            vals = np.arange(next_val, next_val + len(new))
            next_val += len(new)
            got = t.insert(np.array(new, dtype=np.uint64), vals)
            for k, v, c in zip(new, vals.tolist(), got.tolist()):
                model[k], cells[k] = v, c
        elif op < 0.8 and model:
            gone = rng.sample(sorted(model), rng.randrange(1, min(len(model), 5) + 1))
            if t.delete_cells(np.array([cells[k] for k in gone], dtype=np.int64)):
                vals, new_cells = t.rebuild()
                by_val = {v: k for k, v in model.items()}
                for v, c in zip(vals.tolist(), new_cells.tolist()):
                    cells[by_val[v]] = c
                rebuilds += 1
            for k in gone:
                del model[k], cells[k]
        q = rng.sample(universe, 8)
        assert t.find(np.array(q, dtype=np.uint64)).tolist() == [model.get(k, -1) for k in q]
        assert [t.find_one(k) for k in q] == [model.get(k, -1) for k in q]
        assert len(t) == len(model)
    if cap == 64:
        assert rebuilds > 0, "the test must reach the rebuild path"


def test_hash_table_overflow_past_full_buckets():
    w = HashTable.CELLS_PER_BUCKET
    t = HashTable(16)
    keys = np.array([2 + (i << 20) for i in range(20)], dtype=np.uint64)  # all home in bucket 0
    cells = t.insert(keys, np.arange(20))
    full, rest = divmod(20, w)
    assert sorted((cells // w).tolist()) == [b for b in range(full) for _ in range(w)] + [full] * rest
    assert t.find(keys).tolist() == list(range(20))
    gone = np.flatnonzero((cells // w) == 0)[:3]
    t.delete_cells(cells[gone])  # bucket 0 was full: deleted markers, lookups still go past it
    want = [-1 if i in gone else i for i in range(20)]
    assert t.find(keys).tolist() == want
    new = np.array([2 + (100 << 20)], dtype=np.uint64)
    assert (t.insert(new, [99]) // w).tolist() == [0]  # a deleted cell is reused
    assert t.find(np.concatenate((keys, new))).tolist() == want + [99]


def test_hash_keys_of_vllm_hashes_and_odd_input():
    hs = [bytes(range(i, i + 32)) for i in range(3)]
    k = HashKeys.of(hs)
    assert k.k1.tolist() == [int.from_bytes(x[:8], "little") for x in hs]
    assert k.k2.tolist() == [int.from_bytes(x[8:16], "little") for x in hs]
    t = HashTable(8)  # the per-request path splits one hash in plain Python: the same keys
    t.insert(k.k1, [10, 11, 12])
    assert [t.find_hash(x) for x in hs] == list(zip([10, 11, 12], k.k2.tolist()))
    assert t.find_hash(b"\0" * 16) == (-1, 0)  # k1 0 is looked up as 2, absent here
    assert HashKeys.of([b"\0" * 16]).k1.tolist() == [2]  # 0 and 1 mark empty/deleted cells
    odd = HashKeys.of([b"short", b"x" * 20])  # normalised to 16 bytes
    assert len(odd) == 2 and odd.k1[0] == max(int.from_bytes(b"short\0\0\0", "little"), 2)
    with pytest.raises(TypeError, match="bytes"):
        HashKeys.of([1, 2])


@pytest.mark.parametrize("seed", range(3))
def test_packed_hashes_of_runs_is_of_the_concatenation(seed):
    rng = random.Random(seed)
    for _ in range(50):
        width = rng.choice([16, 32])
        runs = [[rng.randbytes(width) for _ in range(rng.randrange(0, 5))] for _ in range(rng.randrange(1, 5))]
        if not any(runs):
            runs[0].append(rng.randbytes(width))
        flat = [x for r in runs for x in r]
        got, want = HashKeys.of(PackedHashes.of_runs(runs)), HashKeys.of(flat)
        assert got.k1.tolist() == want.k1.tolist() and got.k2.tolist() == want.k2.tolist()
    mixed = [[b"a" * 32], [b"b" * 16, b"short"]]  # lengths differ: normalised like ``of``
    got, want = HashKeys.of(PackedHashes.of_runs(mixed)), HashKeys.of([b"a" * 32, b"b" * 16, b"short"])
    assert got.k1.tolist() == want.k1.tolist() and got.k2.tolist() == want.k2.tolist()
    with pytest.raises(TypeError, match="bytes"):
        PackedHashes.of_runs([[b"x" * 16], [1]])
