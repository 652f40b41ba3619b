"""Ordering by data dependency in the engine: write-after-write (the newest save of a slot wins),
read-after-write (a load waits for the slot's write in flight, and on timeout fails with zeros,
never stale bytes), failed writes and missing chunks.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from tpuoffload.backend.slot_table import EMPTY_SLOT
from tpuoffload.sim.tpu_layouts import LAYOUTS
from tpuoffload.worker.faults import FaultInjector, FaultPoint
from tpuoffload.worker.transfer_engine import SaveResult

from engine_helpers import (
    BF16, random_caches, host, chunk, save_ok, op_names, small_load_ops, same_step, Injected)


# ---------------------------------------------------------------- write-after-write
class SlowOlder(FaultInjector):
    """Sleeps while completing the 1-chunk save (A) only, just before A records what its slot
    holds; records when that sleep ended and when the 2-chunk save (B) started completing (its
    first fault point, after its write chain)."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.times: dict[str, float] = {}

    def hit(self, point: FaultPoint, n: int) -> set[int]:
        if point is FaultPoint.SAVE_RECORD and n == 1:
            time.sleep(self.delay)
            self.times["a_end"] = time.monotonic()
        elif point is FaultPoint.SAVE_PROGRAM and n == 2:
            self.times["b_start"] = time.monotonic()
        return set()


def _waw_run(engines, chain: bool, delay: float):
    caches = random_caches(BF16, 20)
    faults = SlowOlder(delay)
    eng = engines(caches, faults=faults, save_threads=4)
    if not chain:
        eng._earlier_writes = lambda slots: {}  # mutation: no write chains
    eng.save(caches, [5], [7], [1])  # A: older, slow
    eng.save(caches, [9, 10], [7, 8], [2, 3])  # B: newer, another block, same slot 7
    assert eng.wait_idle(30)
    assert {r.save_id: r.ok for r in eng.drain_results()} == {1: True, 2: True, 3: True}
    src = host(caches)
    out, failed_b = eng.load(random_caches(BF16, 21), [30], [7], [2])
    out, failed_a = eng.load(out, [31], [7], [1])
    return eng, faults, src, host(out), failed_b, failed_a


def test_write_after_write_newest_wins(engines):
    eng, faults, src, after, failed_b, failed_a = _waw_run(engines, chain=True, delay=0.5)
    assert eng.slot_table.tag(7) == 2
    assert failed_b == []
    assert np.array_equal(chunk(after, 30), chunk(src, 9))  # B's bytes
    # B's completion began only after A's had finished.
    assert faults.times["b_start"] >= faults.times["a_end"]
    # A is gone for good: never served, and block 31 holds zeros.
    assert failed_a == [31] and not chunk(after, 31).any()


def test_write_after_write_negative_control_without_chaining(engines):
    """With the chain removed, the same sequence ends with the slot recorded as A's chunk while it
    holds B's bytes: a load asking for A gets B's block as if it were A's. The test above is
    sensitive to the chaining."""
    eng, faults, src, after, failed_b, failed_a = _waw_run(engines, chain=False, delay=1.0)
    assert faults.times["b_start"] < faults.times["a_end"]
    assert eng.slot_table.tag(7) == 1
    assert failed_b == [30]
    assert failed_a == [] and np.array_equal(chunk(after, 31), chunk(src, 9))  # wrong chunk served
    assert not np.array_equal(chunk(src, 9), chunk(src, 5))


# ---------------------------------------------------------------- read-after-write
def test_read_after_write_waits_for_inflight_write(engines):
    caches = random_caches(BF16, 30)
    faults = Injected(FaultPoint.SAVE_RECORD, "block")
    eng = engines(caches, faults=faults)
    save_ok(eng, caches, [8], [4], [1])  # an older committed chunk in the slot
    out, _ = eng.load(random_caches(BF16, 31), [0], [4], [1])  # compile the load outside the timing
    src = host(out)
    faults.arm()
    eng.save(out, [12], [4], [2])  # slow overwrite
    chunks, _, oldest = eng.inflight()
    assert chunks == 1 and oldest is not None
    timer = threading.Timer(0.5, faults.release)  # the save completes 0.5 s from now
    timer.start()
    t0 = time.monotonic()
    out, failed = eng.load(out, [50], [4], [2])  # immediately
    waited = time.monotonic() - t0
    timer.join()
    assert failed == []
    assert np.array_equal(chunk(host(out), 50), chunk(src, 12))
    assert waited >= 0.4  # it really waited for the write


def test_read_after_write_timeout_fails_with_zeros_not_stale(engines):
    caches = random_caches(BF16, 40)
    src = host(caches)
    faults = Injected(FaultPoint.SAVE_RECORD, "block")
    eng = engines(caches, faults=faults, load_wait_timeout_s=0.1)
    save_ok(eng, caches, [8, 9], [4, 5], [1, 3])  # slot 4: older chunk (block 8), slot 5: healthy
    faults.arm()
    eng.save(caches, [12], [4], [2])  # an overwrite of slot 4 whose completion does not finish
    fresh = random_caches(BF16, 41)
    before = host(fresh)
    t0 = time.monotonic()
    out, failed = eng.load(fresh, [50, 51], [4, 5], [2, 3])
    took = time.monotonic() - t0
    assert took < 10, "the load must not wait for the whole write"
    assert failed == [50]
    after = host(out)
    assert not chunk(after, 50).any()  # zeros: not the old chunk, not the old cache block
    assert chunk(before, 50).any() and chunk(src, 8).any()
    assert np.array_equal(chunk(after, 51), chunk(src, 9))
    # Later, the slow write lands and the chunk becomes loadable.
    faults.disarm()
    assert eng.wait_idle(30)
    assert {r.save_id: r.ok for r in eng.drain_results()} == {2: True}
    out, failed = eng.load(out, [52], [4], [2])
    assert failed == []
    assert np.array_equal(chunk(host(out), 52), chunk(src, 12))


def _stale_slot_run(engines, *, wait: bool):
    """Slot 4 holds chunk 1 (block 8); its overwrite by chunk 2 (block 12) is queued behind another
    slow save (one save thread), so the slot table still says chunk 1 while the store, ordered by
    the runtime, already holds (or will before any later program reads it) block 12's bytes. Then
    a load asks for chunk 1 from slot 4."""
    caches = random_caches(BF16, 50)
    src = host(caches)
    faults = Injected(FaultPoint.SAVE_RECORD, "block")
    eng = engines(caches, faults=faults, save_threads=1, load_wait_timeout_s=0.1)
    if not wait:
        eng._wait_for_writes = lambda slots: set()  # mutation: no read-after-write wait
    save_ok(eng, caches, [8], [4], [1])  # old chunk in slot 4
    faults.arm()
    eng.save(caches, [20], [10], [5])  # occupies the only save thread
    eng.save(caches, [12], [4], [2])  # overwrite of slot 4: queued
    assert eng.slot_table.tag(4) == 1
    ok, sources = eng.slot_table.lookup([4], [1])
    assert ok.all() and sources.tolist() == [8]  # the slot table alone: "valid"
    out, failed = eng.load(random_caches(BF16, 51), [60], [4], [1])
    faults.disarm()
    assert eng.wait_idle(30)
    assert eng.slot_table.tag(4) == 2
    return src, host(out), failed


def test_read_after_write_timeout_never_serves_stale_chunk_backend_would_accept(engines):
    """Only the read-after-write wait protects this load: it times out, so block 60 is a load
    error with zeros, although the slot table alone would have accepted slot 4 as chunk 1."""
    src, after, failed = _stale_slot_run(engines, wait=True)
    assert failed == [60]
    assert not chunk(after, 60).any()


def test_read_after_write_negative_control_without_wait(engines):
    """Without the wait the same load succeeds and serves block 12's bytes as chunk 1 (block 8):
    the test above is sensitive to the wait."""
    src, after, failed = _stale_slot_run(engines, wait=False)
    assert failed == []
    assert np.array_equal(chunk(after, 60), chunk(src, 12)) and not np.array_equal(chunk(src, 12), chunk(src, 8))


# ---------------------------------------------------------------- failed writes
def test_failed_write_reports_not_ok_and_is_not_loadable(engines):
    caches = random_caches(BF16, 60)
    faults = Injected(FaultPoint.SAVE_RECORD, "raise")
    eng = engines(caches, faults=faults)
    save_ok(eng, caches, [8], [4], [1])  # an older committed chunk in slot 4
    faults.arm()
    eng.save(caches, [12, 13], [4, 6], [2, 3])  # this batch fails
    assert eng.wait_idle(30)
    faults.disarm()
    assert sorted(eng.drain_results(), key=lambda r: r.save_id) == [SaveResult(2, False), SaveResult(3, False)]
    assert eng.slot_table.tag(4) == EMPTY_SLOT and eng.slot_table.tag(6) == EMPTY_SLOT
    out, failed = eng.load(caches, [50, 51, 52], [4, 6, 5], [2, 3, 1])
    assert failed == [50, 51, 52]  # slot 5 never written
    # The old chunk that used to be in slot 4 is not loadable either: the slot was being overwritten.
    out, failed = eng.load(out, [53], [4], [1])
    assert failed == [53]
    after = host(out)
    for b in (50, 51, 52, 53):
        assert not chunk(after, b).any()
    assert eng.inflight() == (0, 0, None)
    counters = eng.take_counters()
    assert (counters["save_failures"], counters["chunks_saved"], counters["load_errors"]) == (2, 1, 4)


def test_missing_chunks_error_exactly_those_blocks_with_same_digest(engines):
    caches1, caches2 = random_caches(BF16, 10), random_caches(BF16, 10)
    src = host(caches1)
    faults = Injected(FaultPoint.SAVE_RECORD, "raise")
    good = engines(caches1)
    local = engines(caches2, faults=faults)  # its save of id 12 fails; slot 1 is overwritten locally

    plan = [([1, 2], [0, 1], [10, 11]), ([3], [2], [12]), ([4], [3], [13])]
    for blocks, slots, ids in plan:
        if ids == [12]:
            faults.arm()
        for eng, caches in ((good, caches1), (local, caches2)):
            eng.save(caches, blocks, slots, ids)
            assert eng.wait_idle(30)
        faults.disarm()
    assert all(r.ok for r in good.drain_results())
    assert {r.save_id: r.ok for r in local.drain_results()} == {10: True, 11: True, 12: False, 13: True}
    local.slot_table.commit([1], [999], [7])
    same_step(good, local)

    # Plus one slot neither host ever wrote (slot 9), expected with save id 14.
    load_plan = ([20, 21, 22, 23, 24], [0, 1, 2, 3, 9], [10, 11, 12, 13, 14])
    caches1, caches2 = random_caches(BF16, 11), random_caches(BF16, 11)
    before = host(caches2)
    caches1, failed1 = good.load(caches1, *load_plan)
    caches2, failed2 = local.load(caches2, *load_plan)
    assert failed1 == [24]
    assert failed2 == [21, 22, 24]
    assert op_names(same_step(good, local).ops) == small_load_ops(1)
    after1, after2 = host(caches1), host(caches2)
    assert np.array_equal(chunk(after2, 20), chunk(src, 1))
    assert np.array_equal(chunk(after2, 23), chunk(src, 4))
    for b in (21, 22, 24):
        assert not chunk(after2, b).any(), b
    assert not chunk(after1, 24).any()
    rest = [x for x in range(LAYOUTS[BF16].num_blocks) if x not in load_plan[0]]
    for layer in range(len(caches2)):
        assert np.array_equal(after2[layer][rest], before[layer][rest])


