"""tpuoffload/manager/save_planner.py: SavePlanner deduplicates, respects the staging budget and
host RAM, and names slots in candidate order."""

from __future__ import annotations

from collections import Counter

from tpuoffload import counters as C
from tpuoffload.manager.index import SAVING, ChunkIndex
from tpuoffload.manager.ledger import CompletionLedger
from tpuoffload.manager.save_planner import SavePlanner
from tpuoffload.manager.staging import StagingBudget

from manager_helpers import h, save, ready


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
