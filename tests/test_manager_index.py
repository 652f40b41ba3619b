"""tpuoffload/manager/index.py: ChunkIndex, the content-hash index of host RAM (LRU, pins, drop,
discard, revoke), alone and randomized against a reference model."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tpuoffload import counters as C
from tpuoffload.messages import compact_ints
from tpuoffload.manager.hash_table import HashKeys, PackedHashes
from tpuoffload.manager.index import READY, REVOKED, SAVING, ChunkIndex

from manager_helpers import h, arr, save, ready


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


# ---------------------------------------------------------------------------------------- extents
def test_extent_slots_rule(monkeypatch):
    from tpuoffload.manager import index as index_mod

    assert [index_mod.extent_slots(n, 32) for n in (1, 15, 16, 31, 32, 63, 64, 100, 512, 513, 10**6)] == \
        [1, 1, 1, 1, 2, 2, 4, 4, 32, 32, 32]
    assert ChunkIndex(10**4).extent_of_pool(0) == index_mod.EXTENT_SLOTS
    monkeypatch.setattr(index_mod, "EXTENT_SLOTS", 32)
    assert ChunkIndex(8).extent_of_pool(0) == 1  # small pools: per-chunk LRU
    two = ChunkIndex(1024 + 64, pools=(1024, 64))
    assert (two.extent_of_pool(0), two.extent_of_pool(1)) == (32, 1)  # a GDN state pool: per chunk


@pytest.mark.parametrize("seed", range(4))
def test_extent_store_randomized_invariants(seed, monkeypatch):
    """Eviction by extent (pools of 64 slots: extents of 4) under random saves, confirmations,
    drops, pins, unpins, discards and resets: ``allocate`` hands out exactly min(n, free +
    evictable) slots, the victims were READY and unpinned, no slot ever holds two chunks, and the
    free count matches the states."""
    from tpuoffload.manager import index as index_mod

    monkeypatch.setattr(index_mod, "EXTENT_SLOTS", 32)
    rng = random.Random(seed)
    n = 64
    idx = ChunkIndex(n)
    assert idx.extent_of_pool(0) == 4
    universe = [h(i) for i in range(4 * n)]
    next_id = 0
    pinned: list[int] = []
    for _ in range(2500):
        op = rng.random()
        state = np.array([idx.state_of(s) for s in range(n)])
        pins = np.bincount(np.array(pinned, np.int64), minlength=n)
        if op < 0.35:
            fresh = [x for x in dict.fromkeys(rng.sample(universe, rng.randrange(1, 12))) if not idx.contains(x)]
            evictable = {s for s in range(n) if state[s] == READY and pins[s] == 0}
            free = int((state == 0).sum())
            slots = idx.allocate(len(fresh))
            assert len(slots) == min(len(fresh), free + len(evictable))
            victims = [s for s in slots.tolist() if state[s] != 0]  # after the free slots, ascending
            assert len(set(slots.tolist())) == len(slots) and victims == sorted(victims)
            assert all(s in evictable for s in victims)
            idx.add_saving(HashKeys.of(fresh[:len(slots)]), slots, next_id)
            next_id += len(slots)
        elif op < 0.6:
            saving = np.flatnonzero((state == SAVING) | (state == REVOKED))
            if len(saving):
                pick = rng.sample(saving.tolist(), rng.randrange(1, len(saving) + 1))
                (idx.mark_ready if rng.random() < 0.85 else idx.drop)(arr(*pick), idx.save_ids(arr(*pick)))
        elif op < 0.75:
            ready_ = np.flatnonzero(state == READY).tolist()
            if ready_:
                pick = rng.sample(ready_, rng.randrange(1, min(6, len(ready_)) + 1))
                idx.pin(arr(*pick))
                pinned += pick
        elif op < 0.9:
            if pinned:
                k = rng.randrange(1, len(pinned) + 1)
                out, pinned = pinned[:k], pinned[k:]
                idx.unpin(arr(*out))
        elif op < 0.98:
            ready_ = np.flatnonzero(state == READY).tolist()
            if ready_:
                s = rng.choice(ready_)
                assert idx.discard(s, idx.save_id_of(s))
        else:
            idx.revoke_all()
        state = np.array([idx.state_of(s) for s in range(n)])
        assert idx.num_free_slots == int((state == 0).sum())
        assert len(idx) == int(((state == SAVING) | (state == READY)).sum())
        named = idx.named_slots().tolist()
        keys = idx.keys_of(arr(*named)) if named else None
        if named:
            assert len(set(zip(keys.k1.tolist(), keys.k2.tolist()))) == len(named)  # one slot per hash


def test_extent_store_keeps_a_churned_store_in_long_runs_negative_control_per_chunk_lru(monkeypatch):
    """tools/churn_slots.py's steady state (the real ChunkIndex driven as the save planner and the
    load path drive it) on 1024 slots: with extents (32) a step's saves come in long runs; with
    extents of one slot (per-chunk LRU, the store before) in short ones."""
    import sys
    from pathlib import Path

    from tpuoffload.manager import index as index_mod

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    import churn_slots

    monkeypatch.setattr(index_mod, "EXTENT_SLOTS", 32)
    runs = churn_slots.simulate(1024, 64, seed=3)["steady"]
    assert min(runs["save_mean_run_first_half"], runs["save_mean_run_second_half"]) >= 20
    monkeypatch.setattr(index_mod, "EXTENT_SLOTS", 1)
    lru = churn_slots.simulate(1024, 64, seed=3)["steady"]
    assert max(lru["save_mean_run_first_half"], lru["save_mean_run_second_half"]) < 12
