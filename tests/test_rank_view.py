"""The DP ranks' shared READY view (tpuoffload/manager/rank_view.py): news from a rank's index, applied
by the others in any order, lookups that mix a rank's own chunks with another's, failures and resets."""

from __future__ import annotations

import hashlib
import itertools
import random

import numpy as np

from tpuoffload.manager.index import ChunkIndex
from tpuoffload.manager.hash_table import HashKeys
from tpuoffload.manager.rank_view import RankNews, RankView
from tpuoffload.manager.events import NO_EVENTS
from tpuoffload.messages import RANK_SAVE_ID_SHIFT

SLOTS = 8  # per rank


def _h(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def _owner(rank: int) -> tuple[ChunkIndex, RankNews]:
    """A rank's index whose sink keeps news."""
    news = RankNews(NO_EVENTS)
    return ChunkIndex(SLOTS, events=news), news


def _save_ready(index: ChunkIndex, hashes: list[bytes], first_id: int) -> np.ndarray:
    keys = HashKeys.of(hashes)
    slots = index.allocate(len(hashes))
    index.add_saving(keys, slots, first_id)
    index.mark_ready(slots, np.arange(first_id, first_id + len(hashes)))
    return slots


def _view(rank: int, ranks: int = 2) -> RankView:
    view = RankView(ranks, SLOTS)
    view.rank = rank
    return view


def test_news_of_ready_and_evicted_chunks_reach_the_other_rank_in_any_order():
    """Rank 0 saves 8 chunks, evicts 3 of them for 3 new ones. Its news, applied by rank 1 in
    every order (and twice), ends in the same view: exactly rank 0's READY chunks, by their slot
    and save id in rank 0's range, as rank 1 names them."""
    index, news = _owner(0)
    _save_ready(index, [_h(i) for i in range(8)], 0)
    first = news.take_news(0)
    _save_ready(index, [_h(i) for i in range(100, 103)], 8)  # evicts the 3 least recently used
    second = news.take_news(0)
    assert first and second and second.gone
    ready = {h: index.ready_slot(h) for h in [_h(i) for i in range(8)] + [_h(i) for i in range(100, 103)]}
    ready = {h: s for h, s in ready.items() if s >= 0}
    assert len(ready) == SLOTS
    parts = [{(0, 1): first}, {(0, 2): second}, {(0, 1): first, (0, 2): second}]
    for order in itertools.permutations(parts):
        view = _view(1)
        for part in order:
            view.apply(part)
        assert len(view) == SLOTS
        for h, slot in ready.items():
            found = view.extend(ChunkIndex(SLOTS), [h], 0, 1, ChunkIndex(SLOTS).ready_prefix_saved([h], 0, 1))
            assert found.slots.tolist() == [slot - SLOTS]  # rank 0's slot named from rank 1
            assert found.save_ids.tolist() == [index.save_id_of(slot) - (1 << RANK_SAVE_ID_SHIFT)]


def test_a_rank_ignores_its_own_news_and_news_of_another_epoch():
    index, news = _owner(0)
    _save_ready(index, [_h(1)], 0)
    part = news.take_news(0)
    own = _view(0)
    own.apply({(0, 0): part})
    assert len(own) == 0
    other = _view(1)
    other.reset()  # a connector reset reached rank 1: rank 0's news from before it is stale
    other.apply({(0, 0): part})
    assert len(other) == 0
    unknown = RankView(2, SLOTS)  # its rank not known yet (no report so far)
    unknown.apply({(0, 0): part})
    assert len(unknown) == 0


def test_lookup_mixes_own_and_other_ranks_chunks_block_by_block():
    """Blocks 0-1 on rank 1 only, 2-3 on rank 0 (its own), 4 on rank 1, 5 nowhere: rank 0's hit
    is blocks 0-4, each from where it is, its own first."""
    hashes = [_h(i) for i in range(6)]
    theirs, news = _owner(1)
    _save_ready(theirs, [hashes[0], hashes[1], hashes[4], hashes[2]], 0)
    mine = ChunkIndex(SLOTS)
    own_slots = _save_ready(mine, [hashes[2], hashes[3]], 0)
    view = _view(0)
    view.apply({(1, 0): news.take_news(0)})
    found = view.extend(mine, hashes, 0, 6, mine.ready_prefix_saved(hashes, 0, 6))
    s = [theirs.ready_slot(h) + SLOTS for h in (hashes[0], hashes[1])]
    assert found.slots.tolist() == s + own_slots.tolist() + [theirs.ready_slot(hashes[4]) + SLOTS]
    ids = found.save_ids.tolist()
    assert ids[2:4] == [0, 1] and all(i >> RANK_SAVE_ID_SHIFT == 1 for i in ids[:2] + ids[4:])


def test_discard_forgets_a_chunk_that_failed_to_load_and_late_news_does_not_bring_it_back():
    theirs, news = _owner(1)
    _save_ready(theirs, [_h(7)], 0)
    part = news.take_news(0)
    view = _view(0)
    view.apply({(1, 0): part})
    found = view.extend(ChunkIndex(SLOTS), [_h(7)], 0, 1, ChunkIndex(SLOTS).ready_prefix_saved([_h(7)], 0, 1))
    slot, save_id = int(found.slots[0]), int(found.save_ids[0])
    assert not view.discard(slot, save_id + 1)  # another chunk: kept
    version = view.version
    assert view.discard(slot, save_id) and len(view) == 0 and view.version > version
    view.apply({(1, 0): part})  # the same news again (a duplicated report)
    assert len(view) == 0


def test_view_matches_the_owners_ready_set_under_random_churn():
    """Two owner ranks churn (saves evicting LRU chunks, discards, resets); a third rank applies
    their news a random number of steps late and shuffled. Once everything is applied the view
    holds exactly the owners' READY chunks of the current epoch."""
    rng = random.Random(5)
    owners = [_owner(r) for r in range(2)]
    view = _view(2, ranks=3)
    backlog: list[dict] = []
    next_id = [0, 0]
    for step in range(200):
        for r, (index, news) in enumerate(owners):
            n = rng.randint(0, 3)
            fresh = [h for h in (_h(1000 * r + rng.randrange(40)) for _ in range(n)) if index.slot_of(h) is None]
            fresh = list(dict.fromkeys(fresh))
            if fresh:
                _save_ready(index, fresh, next_id[r])
                next_id[r] += len(fresh)
            if rng.random() < 0.1 and len(index):
                slot = rng.choice(index.named_slots().tolist())
                index.discard(slot, index.save_id_of(slot))
            backlog.append({(r, step): news.take_news(view.epoch)})
        if rng.random() < 0.02:  # a reset reaches every rank between steps
            for index, news in owners:
                index.revoke_all()
                news.take_news(view.epoch)
            view.reset()
        rng.shuffle(backlog)
        for part in backlog[:rng.randint(0, len(backlog))]:
            view.apply(part)
            backlog.remove(part)
    for part in backlog:
        view.apply(part)
    expected = {}
    for r, (index, _) in enumerate(owners):
        for slot in index.named_slots().tolist():
            keys = index.keys_of(np.array([slot]))
            expected[(int(keys.k1[0]), int(keys.k2[0]))] = (r * SLOTS + slot, (r << RANK_SAVE_ID_SHIFT) + index.save_id_of(slot))
    got = {(key, slot, int(view._save_id[slot])) for key, slots in view._slots_of.items() for slot in slots}
    assert got == {(key, slot, save_id) for key, (slot, save_id) in expected.items()}


def test_a_hybrid_hit_takes_every_groups_chunks_from_its_own_index_or_the_view():
    """Several KV cache groups (full attention, a sliding window of 2 blocks): rank 1 holds both
    groups' chunks of blocks 0-3, rank 0 only the full group's chunks of blocks 0-1. Rank 0's hit
    is all 4 blocks: its own full chunks first, the rest from rank 1, named from rank 0's range,
    each group's chunk keyed by hash AND group (the window group's keys are not its hashes). Without
    the view (as before hybrid models ran under DPScheduler) rank 0 has no hit at all."""
    from tpuoffload.manager.kv_groups import KVCacheGroups, chunk_hash

    groups = KVCacheGroups(windows=(None, 2))
    hashes = [_h(i) for i in range(5)]
    theirs, news = _owner(1)
    _save_ready(theirs, [chunk_hash(h, g) for h in hashes[:4] for g in (0, 1)], 0)
    mine = ChunkIndex(SLOTS)
    own_slots = _save_ready(mine, [chunk_hash(h, 0) for h in hashes[:2]], 0)
    view = _view(0)
    view.apply({(1, 0): news.take_news(0)})
    assert groups.find_hit(mine, hashes, 0, 5).n == 0
    hit = groups.find_hit(mine, hashes, 0, 5, view)
    assert hit.n == 4 and hit.first == (0, 2)
    full = own_slots.tolist() + [theirs.ready_slot(chunk_hash(h, 0)) + SLOTS for h in hashes[2:4]]
    window = [theirs.ready_slot(chunk_hash(h, 1)) + SLOTS for h in hashes[2:4]]
    assert hit.slots[0].tolist() == full and hit.slots[1].tolist() == window
    assert hit.save_ids[0].tolist()[:2] == [0, 1]  # rank 0's own ids
    assert all(i >> RANK_SAVE_ID_SHIFT == 1 for i in hit.save_ids[0].tolist()[2:] + hit.save_ids[1].tolist())
    other = _view(1)  # the owner's own view: its own news is not in it
    other.apply({(1, 0): news.take_news(0)})
    assert groups.find_hit(ChunkIndex(SLOTS), hashes, 0, 5, other).n == 0
