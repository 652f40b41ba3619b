"""The save planner: the one place that decides which chunks are saved, and where.

Given one step's save candidates (block id, content hash), in priority order::

    dedup within the batch -> dedup against the index (held or being saved) -> staging budget ->
    host slots (evicting LRU chunks) -> one ledger batch of contiguous save ids -> a SaveBatch

Every candidate lands in exactly one counter: ``dedup_batch``, ``dedup_index``,
``skipped_staging``, ``skipped_no_space`` or ``saves_issued`` (invariant 5: one physical chunk
per content hash, deduplicated within a batch, against the index and against saves in flight;
invariant 10: staging and host RAM are bounded, a save that does not fit is skipped and counted,
never waited for). The per-chunk work is compiled (``ChunkIndex.select_and_name``: one call that
deduplicates and names the chunks that free slots take; ``allocate`` and ``add_saving`` for the
rest, when eviction makes room; kernels.py); the rest is a fixed number of calls per batch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

from tpuoffload import counters as C
from tpuoffload.messages import SaveBatch, compact_ints, pack_keys
from tpuoffload.manager.events import Origins
from tpuoffload.manager.hash_table import PackedHashes
from tpuoffload.manager.index import ChunkHash, ChunkIndex
from tpuoffload.manager.ledger import CompletionLedger
from tpuoffload.manager.staging import StagingBudget

NO_SAVES = SaveBatch()  # a plan that saves nothing


class SavePlanner:
    def __init__(self, index: ChunkIndex, ledger: CompletionLedger, staging: StagingBudget, *,
                 chunk_bytes: int, save_timeout_s: float, clock: Callable[[], float],
                 counters: Counter[str], with_keys: bool = False) -> None:
        self.index = index
        self.with_keys = with_keys  # warm restart: the hosts keep each slot's hash keys
        self.ledger = ledger
        self.staging = staging
        self.chunk_bytes = chunk_bytes
        self.save_timeout_s = save_timeout_s
        self.clock = clock
        self.counters = counters

    def plan(self, block_ids: Sequence[int], hashes: "Sequence[ChunkHash] | PackedHashes", step: int,
             origins: Origins = ()) -> SaveBatch:
        """Chunks to save among the candidates ``zip(block_ids, hashes)``, earliest first. The
        blocks must hold their content until the workers gather them in this step's plan.
        ``hashes`` may also be given packed already; ``origins`` say which request blocks the
        candidates are, in order (what the index's event sink records of each new chunk).

        Enforces invariant 5 (the only deduplication: within the batch, against chunks held and
        against saves in flight) and invariant 10 (the staging budget's room and the slots that exist
        bound what is named; the rest is skipped and counted)."""
        n = len(hashes)
        if not n:
            return NO_SAVES
        # One pass over the batch (compiled): a key equal to an earlier candidate's is a batch
        # duplicate (equal hashes mean equal content; the first block is as good as any, and every
        # candidate block is computed by the time the workers gather it), a key held or being
        # saved is an index duplicate (in flight included).
        counters = self.counters
        packed = hashes if type(hashes) is PackedHashes else PackedHashes.of(hashes)
        limit = self.staging.room(self.chunk_bytes)  # chunks the staging budget takes now
        first = self.ledger.next_save_id
        # Deduplication and the free slots' naming in one compiled call (the usual case); kept
        # keys beyond what free slots covered are named below, on slots of evicted chunks.
        keys, keep, n_dup, n_held, slots, run_step = self.index.select_and_name(packed, limit, first)
        if n_dup:
            counters[C.DEDUP_BATCH] += n_dup
        if n_held:
            counters[C.DEDUP_INDEX] += n_held
        n_keep = len(keep)
        granted = min(n_keep, limit)
        if granted < n_keep:
            counters[C.SKIPPED_STAGING] += n_keep - granted
        got = len(slots)
        if got < granted:  # host RAM is full: LRU chunks make room
            victims = self.index.allocate(granted - got)
            if len(victims):
                self.index.add_saving(keys.take(slice(got, got + len(victims))), victims, first + got)
                slots = np.concatenate((slots, victims)) if got else victims
                got, run_step = len(slots), None
            if got < granted:
                counters[C.SKIPPED_NO_SPACE] += granted - got
        if not got:
            return NO_SAVES
        if got < n_keep:
            keep, keys = keep[:got], keys.take(slice(0, got))
        self.index.events.record(slots, packed, keep, origins)
        blocks = tuple(block_ids) if got == n else tuple(map(block_ids.__getitem__, keep.tolist()))
        reserved = self.staging.reserve_up_to(got, self.chunk_bytes)
        assert reserved == got, (reserved, got)  # got <= room(), and nothing reserved since
        base = self.ledger.open_batch(slots, self.clock() + self.save_timeout_s, step)
        assert base == first, (base, first)  # the save ids the chunks were named under
        counters[C.SAVES_ISSUED] += got
        return SaveBatch(block_ids=blocks, slots=compact_ints(slots, run_step), save_ids=range(base, base + got),
                         keys=pack_keys(keys.k1, keys.k2) if self.with_keys else b"")
