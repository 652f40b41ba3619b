"""Scheduler-side bookkeeping: SlotPool, StagingBudget, ChunkIndex, CompletionLedger."""

from __future__ import annotations

import random

import pytest

from tpuoffload.manager import ChunkIndex, ChunkState, CompletionLedger, Resolution, SaveAllocation, SlotPool, StagingBudget


def h(i: int) -> bytes:
    return i.to_bytes(8, "big")


# ---------------------------------------------------------------- SlotPool
def test_slot_pool_allocates_each_slot_once_then_none():
    pool = SlotPool(5)
    got = [pool.allocate() for _ in range(5)]
    assert sorted(got) == [0, 1, 2, 3, 4]
    assert pool.num_free == 0
    assert pool.allocate() is None
    assert pool.allocate() is None  # stays None, never grows
    pool.free(3)
    assert pool.num_free == 1
    assert pool.allocate() == 3
    assert pool.allocate() is None


def test_slot_pool_double_free_and_bad_free_raise():
    pool = SlotPool(3)
    s = pool.allocate()
    pool.free(s)
    with pytest.raises(ValueError):
        pool.free(s)
    with pytest.raises(ValueError):
        pool.free(2)  # never allocated
    for bad in (-1, 3, 100):
        with pytest.raises(ValueError):
            pool.free(bad)
    assert pool.num_free == 3


@pytest.mark.parametrize("size", [0, -1, 1.5, "4", None])
def test_slot_pool_bad_size(size):
    with pytest.raises(ValueError, match="num_slots"):
        SlotPool(size)


# ---------------------------------------------------------------- StagingBudget
def test_staging_budget_never_exceeds_capacity_and_refuses_whole():
    b = StagingBudget(100)
    assert b.try_reserve(60)
    assert not b.try_reserve(41)  # would exceed: refused whole, nothing taken
    assert b.in_use == 60
    assert b.try_reserve(40)
    assert b.in_use == 100
    assert not b.try_reserve(1)
    assert b.try_reserve(0)
    b.release(100)
    assert b.in_use == 0
    assert not b.try_reserve(101)
    assert b.in_use == 0


def test_staging_budget_random_never_exceeds():
    rng = random.Random(1)
    b = StagingBudget(1000)
    held = []
    for _ in range(5000):
        if held and rng.random() < 0.45:
            b.release(held.pop(rng.randrange(len(held))))
        else:
            n = rng.randrange(0, 400)
            before = b.in_use
            if b.try_reserve(n):
                held.append(n)
            else:
                assert before + n > 1000 and b.in_use == before
        assert 0 <= b.in_use <= b.capacity
        assert b.in_use == sum(held)


def test_staging_budget_release_and_reserve_errors():
    b = StagingBudget(10)
    b.try_reserve(5)
    with pytest.raises(ValueError):
        b.release(6)  # more than in use
    with pytest.raises(ValueError):
        b.release(-1)
    with pytest.raises(ValueError):
        b.try_reserve(-1)
    assert b.in_use == 5


@pytest.mark.parametrize("cap", [0, -5, 1.0, None])
def test_staging_budget_bad_capacity_names_setting(cap):
    with pytest.raises(ValueError, match="staging_bytes"):
        StagingBudget(cap)


# ---------------------------------------------------------------- ChunkIndex
def ready(index: ChunkIndex, hashes) -> list[SaveAllocation]:
    allocs = index.allocate_for_save(hashes)
    for a in allocs:
        assert index.mark_ready(a.save_id) is not None
    return allocs


def test_chunk_index_lru_evicts_oldest_ready_unpinned():
    idx = ChunkIndex(3)
    ready(idx, [h(1), h(2), h(3)])
    assert idx.num_free_slots == 0
    slot1 = idx.get(h(1)).slot
    (a,) = idx.allocate_for_save([h(4)])
    assert idx.get(h(1)) is None  # oldest went first
    assert a.slot == slot1  # and its slot was reused
    assert idx.counters["evicted"] == 1
    idx.mark_ready(a.save_id)
    idx.allocate_for_save([h(5)])
    assert idx.get(h(2)) is None and idx.get(h(3)) is not None


def test_chunk_index_pin_unpin_moves_to_mru():
    idx = ChunkIndex(3)
    ready(idx, [h(1), h(2), h(3)])
    chunks = idx.pin([h(1)])  # h1 was LRU
    idx.unpin(chunks)  # now most recently used
    idx.allocate_for_save([h(4)])
    assert idx.get(h(2)) is None  # h2 is the oldest now
    assert idx.get(h(1)) is not None
    idx.allocate_for_save([h(5)])
    assert idx.get(h(3)) is None
    assert idx.get(h(1)) is not None


def test_chunk_index_pinned_chunks_never_evicted():
    idx = ChunkIndex(2)
    ready(idx, [h(1), h(2)])
    p1 = idx.pin([h(1)])
    p2 = idx.pin([h(2)])
    assert idx.allocate_for_save([h(3), h(4)]) == []
    assert idx.counters["skipped_no_space"] == 2
    assert idx.counters["evicted"] == 0
    assert idx.get(h(1)).state is ChunkState.READY and idx.get(h(2)).state is ChunkState.READY
    idx.unpin(p2)
    (a,) = idx.allocate_for_save([h(3)])
    assert idx.get(h(2)) is None and idx.get(h(1)) is not None
    idx.unpin(p1)
    with pytest.raises(ValueError):
        idx.unpin(p1)  # not pinned any more


def test_chunk_index_pin_twice_needs_two_unpins():
    idx = ChunkIndex(1)
    ready(idx, [h(1)])
    a = idx.pin([h(1)])
    b = idx.pin([h(1)])
    idx.unpin(a)
    assert idx.allocate_for_save([h(2)]) == []  # still pinned once
    idx.unpin(b)
    assert len(idx.allocate_for_save([h(2)])) == 1


def test_chunk_index_pin_not_ready_raises_and_pins_nothing():
    idx = ChunkIndex(4)
    ready(idx, [h(1)])
    idx.allocate_for_save([h(2)])  # saving
    with pytest.raises(KeyError):
        idx.pin([h(1), h(2)])
    with pytest.raises(KeyError):
        idx.pin([h(9)])
    assert idx.get(h(1)).pins == 0  # all-or-nothing


def test_chunk_index_saving_chunks_never_evicted():
    idx = ChunkIndex(4)
    saving = idx.allocate_for_save([h(i) for i in range(4)])
    assert len(saving) == 4 and idx.num_saving() == 4
    out = idx.allocate_for_save([h(10), h(11), h(11), h(12)])
    assert out == []
    assert idx.counters["skipped_no_space"] == 3  # unique hashes left over
    assert idx.counters["evicted"] == 0
    assert all(idx.get(h(i)).state is ChunkState.SAVING for i in range(4))
    # Partially full: allocation returns fewer than asked.
    idx.drop_save(saving[0].save_id)
    out = idx.allocate_for_save([h(20), h(21), h(22)])
    assert [a.hash for a in out] == [h(20)]
    assert idx.counters["skipped_no_space"] == 3 + 2


def test_chunk_index_mixed_eviction_skips_saving_and_pinned():
    idx = ChunkIndex(4)
    r = ready(idx, [h(1), h(2)])
    idx.allocate_for_save([h(3)])  # saving
    ready(idx, [h(4)])
    idx.pin([h(1)])
    # Only h2 and h4 are evictable, in that order.
    out = idx.allocate_for_save([h(5), h(6), h(7)])
    assert [a.hash for a in out] == [h(5), h(6)]
    assert idx.get(h(2)) is None and idx.get(h(4)) is None
    assert idx.get(h(1)) is not None and idx.get(h(3)) is not None
    assert idx.counters["evicted"] == 2 and idx.counters["skipped_no_space"] == 1
    assert r[0].slot == idx.get(h(1)).slot


def test_chunk_index_dedup_within_batch():
    idx = ChunkIndex(8)
    out = idx.allocate_for_save([h(1), h(2), h(1), h(1), h(3), h(2)])
    assert [a.hash for a in out] == [h(1), h(2), h(3)]
    assert len({a.slot for a in out}) == 3
    assert len({a.save_id for a in out}) == 3
    assert idx.counters["dedup_batch"] == 3
    assert idx.num_free_slots == 5


def test_chunk_index_dedup_against_index_and_saves_in_flight():
    idx = ChunkIndex(8)
    (a1,) = ready(idx, [h(1)])
    (a2,) = idx.allocate_for_save([h(2)])  # in flight
    out = idx.allocate_for_save([h(1), h(2), h(3)])
    assert [a.hash for a in out] == [h(3)]
    assert idx.counters["dedup_index"] == 2
    assert idx.get(h(1)).slot == a1.slot and idx.get(h(2)).save_id == a2.save_id
    assert idx.contains(h(1)) and idx.contains(h(2)) and not idx.contains(h(9))


def test_chunk_index_drop_save_frees_slot_not_loadable():
    idx = ChunkIndex(2)
    (a,) = idx.allocate_for_save([h(1)])
    assert idx.count_ready_prefix([h(1)]) == 0
    dropped = idx.drop_save(a.save_id)
    assert dropped is not None and dropped.slot == a.slot
    assert idx.get(h(1)) is None and not idx.contains(h(1))
    assert idx.num_free_slots == 2
    assert idx.mark_ready(a.save_id) is None  # a late confirmation cannot resurrect it
    assert idx.count_ready_prefix([h(1)]) == 0
    with pytest.raises(KeyError):
        idx.pin([h(1)])
    assert idx.drop_save(a.save_id) is None  # second drop: no double free
    assert idx.num_free_slots == 2
    # The hash can be saved again, under a new save id.
    (b,) = idx.allocate_for_save([h(1)])
    assert b.save_id != a.save_id


def test_chunk_index_mark_ready_then_drop_is_noop():
    idx = ChunkIndex(2)
    (a,) = ready(idx, [h(1)])
    assert idx.drop_save(a.save_id) is None
    assert idx.get(h(1)).state is ChunkState.READY


def test_count_ready_prefix_has_no_side_effects():
    idx = ChunkIndex(3)
    ready(idx, [h(1), h(2), h(3)])
    before = list(idx._evictable)
    for _ in range(5):
        assert idx.count_ready_prefix([h(1), h(2), h(3)]) == 3
        assert idx.count_ready_prefix([h(1), h(9), h(3)]) == 1
        assert idx.count_ready_prefix([h(9)]) == 0
        assert idx.count_ready_prefix([]) == 0
    assert list(idx._evictable) == before
    assert all(idx.get(h(i)).pins == 0 for i in (1, 2, 3))
    assert idx.counters == {} or all(v == 0 for v in idx.counters.values())
    idx.allocate_for_save([h(4)])
    assert idx.get(h(1)) is None  # h1 is still the LRU one despite being "looked at" most


def test_count_ready_prefix_stops_at_saving():
    idx = ChunkIndex(4)
    ready(idx, [h(1)])
    idx.allocate_for_save([h(2)])
    ready(idx, [h(3)])
    assert idx.count_ready_prefix([h(1), h(2), h(3)]) == 1


def test_chunk_index_discard_unpinned_frees_slot():
    idx = ChunkIndex(2)
    (a,) = ready(idx, [h(1)])
    assert not idx.discard(h(1), a.save_id + 1)  # another chunk's id: refused
    assert idx.discard(h(1), a.save_id)
    assert idx.get(h(1)) is None and idx.count_ready_prefix([h(1)]) == 0
    assert idx.num_free_slots == 2
    assert not idx.discard(h(1), a.save_id)  # twice: no double free
    assert idx.counters["discarded"] == 1


def test_chunk_index_discard_saving_refused():
    idx = ChunkIndex(2)
    (a,) = idx.allocate_for_save([h(1)])
    assert not idx.discard(h(1), a.save_id)
    assert idx.get(h(1)).state is ChunkState.SAVING


def test_chunk_index_discard_pinned_keeps_slot_until_last_unpin():
    idx = ChunkIndex(2)
    (a,) = ready(idx, [h(1)])
    p1 = idx.pin([h(1)])
    p2 = idx.pin([h(1)])
    assert idx.discard(h(1), a.save_id)
    assert idx.get(h(1)) is None
    assert idx.num_free_slots == 1  # still owned by the pinned, discarded chunk
    (b,) = idx.allocate_for_save([h(1)])  # the same hash saved again gets another slot
    assert b.slot != a.slot
    assert idx.allocate_for_save([h(2)]) == []  # no slot to spare: the ghost is not evictable
    idx.unpin(p1)
    assert idx.num_free_slots == 0
    idx.unpin(p2)  # last unpin of the discarded chunk frees its slot, not the new chunk's
    assert idx.num_free_slots == 1
    assert idx.get(h(1)).slot == b.slot and idx.get(h(1)).state is ChunkState.SAVING
    (c,) = idx.allocate_for_save([h(2)])
    assert c.slot == a.slot


class Rec:
    def __init__(self, hash_, save_id):
        self.hash, self.save_id, self.state, self.pins = hash_, save_id, "saving", 0
        self.slot = None  # filled in from the index's answer (slot choice is the pool's business)


class RefModel:
    """Plain reference model: hash -> Rec, an LRU list of evictable hashes, and "ghosts":
    discarded chunks that stay pinned and so still own their slot."""

    def __init__(self, num_slots):
        self.num_slots = num_slots
        self.chunks: dict[bytes, Rec] = {}
        self.lru: list[bytes] = []
        self.save_ids: dict[int, Rec] = {}
        self.ghosts: list[Rec] = []
        self.next_id = 0
        self.counters = {"evicted": 0, "skipped_no_space": 0, "dedup_batch": 0, "dedup_index": 0, "discarded": 0}

    def slots_used(self):
        return len(self.chunks) + len(self.ghosts)

    def allocate(self, hashes):
        out, seen = [], []
        for i, x in enumerate(hashes):
            if x in seen:
                self.counters["dedup_batch"] += 1
                continue
            seen.append(x)
            if x in self.chunks:
                self.counters["dedup_index"] += 1
                continue
            if self.slots_used() == self.num_slots:
                if not self.lru:
                    rest = []
                    for y in hashes[i:]:
                        if y not in self.chunks and (y == x or y not in seen) and y not in rest:
                            rest.append(y)
                    self.counters["skipped_no_space"] += len(rest)
                    break
                victim = self.lru.pop(0)
                del self.chunks[victim]
                self.counters["evicted"] += 1
            rec = Rec(x, self.next_id)
            self.chunks[x] = rec
            self.save_ids[self.next_id] = rec
            out.append((x, self.next_id))
            self.next_id += 1
        return out

    def mark_ready(self, sid):
        rec = self.save_ids.pop(sid, None)
        if rec is None:
            return False
        rec.state = "ready"
        self.lru.append(rec.hash)
        return True

    def drop(self, sid):
        rec = self.save_ids.pop(sid, None)
        if rec is None:
            return False
        del self.chunks[rec.hash]
        return True

    def pin(self, x):
        rec = self.chunks[x]
        rec.pins += 1
        if x in self.lru:
            self.lru.remove(x)
        return rec

    def unpin(self, rec):
        rec.pins -= 1
        if rec.pins:
            return
        if self.chunks.get(rec.hash) is rec:
            self.lru.append(rec.hash)
        else:
            self.ghosts.remove(rec)

    def discard(self, x, sid):
        rec = self.chunks.get(x)
        if rec is None or rec.save_id != sid or rec.state != "ready":
            return False
        del self.chunks[x]
        if x in self.lru:
            self.lru.remove(x)
        if rec.pins:
            self.ghosts.append(rec)
        self.counters["discarded"] += 1
        return True


@pytest.mark.parametrize("seed", range(6))
def test_chunk_index_randomized_against_model(seed):
    rng = random.Random(seed)
    num_slots = rng.choice([1, 2, 5, 8])
    idx = ChunkIndex(num_slots)
    model = RefModel(num_slots)
    universe = [h(i) for i in range(3 * num_slots + 2)]
    pinned: list = []  # (Chunk, Rec) per pin currently held

    def pick_save_id():
        if model.save_ids and rng.random() < 0.85:
            return rng.choice(sorted(model.save_ids))  # an in-flight save
        return rng.randrange(-1, model.next_id + 2)  # resolved, unknown or future: must be a no-op

    for step in range(1500):
        op = rng.random()
        protected = {x for x, r in model.chunks.items() if r.state == "saving" or r.pins}
        ghost_slots = {r.slot for r in model.ghosts}
        if op < 0.33:
            batch = [rng.choice(universe) for _ in range(rng.randrange(0, 6))]
            got = idx.allocate_for_save(batch)
            want = model.allocate(batch)
            assert [(a.hash, a.save_id) for a in got] == want
            for a in got:
                model.chunks[a.hash].slot = a.slot
            for x in protected:
                assert idx.get(x) is not None, "a saving or pinned chunk was evicted"
            assert not ghost_slots & {a.slot for a in got}, "slot of a pinned discarded chunk reused"
        elif op < 0.52:
            sid = pick_save_id()
            assert (idx.mark_ready(sid) is not None) == model.mark_ready(sid)
        elif op < 0.6:
            sid = pick_save_id()
            assert (idx.drop_save(sid) is not None) == model.drop(sid)
        elif op < 0.74:
            ready_hashes = [x for x, r in model.chunks.items() if r.state == "ready"]
            if ready_hashes:
                x = rng.choice(ready_hashes)
                (c,) = idx.pin([x])
                pinned.append((c, model.pin(x)))
        elif op < 0.88:
            if pinned:
                c, rec = pinned.pop(rng.randrange(len(pinned)))
                idx.unpin([c])
                model.unpin(rec)
        elif op < 0.94:
            x = rng.choice(universe)
            rec = model.chunks.get(x)
            sid = rec.save_id if rec is not None and rng.random() < 0.8 else rng.randrange(-1, model.next_id + 2)
            assert idx.discard(x, sid) == model.discard(x, sid)
        else:
            q = [rng.choice(universe) for _ in range(4)]
            n = idx.count_ready_prefix(q)
            m = 0
            for x in q:
                r = model.chunks.get(x)
                if r is None or r.state != "ready":
                    break
                m += 1
            assert n == m

        # ---- invariants after every operation ----
        chunks = idx._chunks
        assert set(chunks) == set(model.chunks)
        held = [c.slot for c in chunks.values()] + [r.slot for r in model.ghosts]
        assert len(held) == len(set(held)), "two chunks share a slot"
        assert all(0 <= s < num_slots for s in held)
        assert idx.num_free_slots + len(idx) + len(model.ghosts) == num_slots
        for x, c in chunks.items():
            r = model.chunks[x]
            assert c.state.value == r.state and c.pins == r.pins and c.save_id == r.save_id and c.slot == r.slot
        assert list(idx._evictable) == model.lru
        assert idx.num_saving() == len(model.save_ids)
        assert {k: idx.counters[k] for k in model.counters} == model.counters


# ---------------------------------------------------------------- CompletionLedger
def test_ledger_ready_only_after_all_hosts():
    led = CompletionLedger(3)
    assert led.register(0, deadline=100.0) == []
    assert led.report(0, 0, True) is None
    assert led.report(2, 0, True) is None
    assert len(led) == 1
    assert led.report(1, 0, True) is Resolution.READY
    assert len(led) == 0
    assert led.counters["confirmed"] == 1


def test_ledger_single_host():
    led = CompletionLedger(1)
    led.register(7, 1.0)
    assert led.report(0, 7, True) is Resolution.READY


def test_ledger_failure_resolves_at_once():
    led = CompletionLedger(4)
    led.register(0, 100.0)
    assert led.report(1, 0, True) is None
    assert led.report(3, 0, False) is Resolution.FAILED
    assert len(led) == 0
    # Remaining hosts' reports arrive after the resolution: late, never READY.
    assert led.report(0, 0, True) is None
    assert led.report(2, 0, True) is None
    assert led.counters["late"] == 2 and led.counters["failed"] == 1


def test_ledger_duplicate_counted_not_double_counted():
    led = CompletionLedger(2)
    led.register(0, 100.0)
    assert led.report(0, 0, True) is None
    assert led.report(0, 0, True) is None  # duplicate must not count as the second host
    assert led.report(0, 0, False) is None  # even a contradicting duplicate
    assert led.counters["duplicate"] == 2
    assert len(led) == 1
    assert led.report(1, 0, True) is Resolution.READY


def test_ledger_late_report_counted():
    led = CompletionLedger(1)
    led.register(0, 100.0)
    led.report(0, 0, True)
    assert led.report(0, 0, True) is None
    assert led.report(0, 0, False) is None
    assert led.counters["late"] == 2


def test_ledger_early_report_staged_and_replayed():
    led = CompletionLedger(2)
    led.register(0, 100.0)
    assert led.report(0, 5, True) is None  # id 5 not registered yet
    assert led.report(1, 5, True) is None
    assert led.report(0, 6, False) is None
    assert led.counters["early"] == 3
    assert led.register(3, 100.0) == []
    assert led.register(5, 100.0) == [(5, Resolution.READY)]
    assert led.register(6, 100.0) == [(6, Resolution.FAILED)]
    assert len(led) == 2  # 0 and 3 still pending


def test_ledger_early_partial_then_rest():
    led = CompletionLedger(3)
    led.report(2, 0, True)
    led.report(2, 0, True)  # duplicate early report
    assert led.register(0, 100.0) == []
    assert led.counters["duplicate"] == 1
    assert led.report(0, 0, True) is None
    assert led.report(1, 0, True) is Resolution.READY


def test_ledger_early_staging_is_bounded():
    led = CompletionLedger(1, max_early=4)
    for sid in range(10, 20):
        led.report(0, sid, True)
    assert len(led._early) == 4
    assert led.counters["unknown"] == 6
    assert led.register(19, 1.0) == [(19, Resolution.READY)]


def test_ledger_unknown_host_counted():
    led = CompletionLedger(2)
    led.register(0, 100.0)
    assert led.report(2, 0, True) is None
    assert led.report(-1, 0, True) is None
    assert led.report(99, 0, False) is None  # a failure from an unknown host does not fail it
    assert led.counters["unknown_host"] == 3
    assert len(led) == 1
    led.report(0, 0, True)
    assert led.report(1, 0, True) is Resolution.READY


def test_ledger_expire_in_order():
    led = CompletionLedger(2)
    for sid, dl in ((0, 1.0), (1, 2.0), (2, 3.0), (3, 4.0)):
        led.register(sid, dl)
    led.report(0, 1, True)
    led.report(1, 1, True)  # 1 is READY: not expired later
    assert led.oldest_deadline() == 1.0
    assert led.expire(0.5) == []
    assert led.expire(3.0) == [0, 2]
    assert led.oldest_deadline() == 4.0
    assert led.expire(100.0) == [3]
    assert led.expire(100.0) == []
    assert led.oldest_deadline() is None
    assert led.counters["expired"] == 3
    assert led.report(0, 0, True) is None  # late after expiry
    assert led.counters["late"] == 1


def test_ledger_register_out_of_order_raises():
    led = CompletionLedger(2)
    led.register(5, 1.0)
    with pytest.raises(ValueError):
        led.register(5, 1.0)
    with pytest.raises(ValueError):
        led.register(3, 1.0)
    led.register(6, 1.0)


@pytest.mark.parametrize("n", [0, -1, 1.5, None])
def test_ledger_bad_num_hosts(n):
    with pytest.raises(ValueError, match="num_hosts"):
        CompletionLedger(n)


def test_ledger_odd_signals_never_raise():
    rng = random.Random(0)
    led = CompletionLedger(4, max_early=8)
    registered = 0
    for _ in range(3000):
        if rng.random() < 0.1:
            led.register(registered, float(registered))
            registered += 1
            continue
        if rng.random() < 0.05:
            led.expire(rng.uniform(0, registered))
            continue
        res = led.report(rng.randrange(-2, 7), rng.randrange(-3, registered + 10), rng.random() < 0.8)
        assert res in (None, Resolution.READY, Resolution.FAILED)
    assert sum(led.counters.values()) > 0


def test_lru_evicts_prefixes_from_the_tail():
    """After a prefix is loaded (pinned, then unpinned in prefix order), eviction takes its last
    chunk first, so what remains of the prefix is still a loadable prefix."""
    idx = ChunkIndex(3)
    hashes = [b"p0", b"p1", b"p2"]
    for a in idx.allocate_for_save(hashes):
        idx.mark_ready(a.save_id)
    idx.unpin(idx.pin(hashes))
    idx.allocate_for_save([b"other"])  # pool full: one eviction
    assert idx.count_ready_prefix(hashes) == 2
    assert not idx.contains(b"p2")
