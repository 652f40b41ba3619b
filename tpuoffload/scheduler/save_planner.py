"""The save planner: the one place that decides which chunks are saved, and where.

Given one step's save candidates (block id, content hash), in priority order::

    dedup within the batch -> dedup against the index (held or being saved) -> staging budget ->
    host slots (evicting LRU chunks) -> one ledger batch of contiguous save ids -> a SaveBatch

Every candidate lands in exactly one counter: ``dedup_batch``, ``dedup_index``,
``skipped_staging``, ``skipped_no_space`` or ``saves_issued`` (invariant 5: one physical chunk
per content hash, deduplicated within a batch, against the index and against saves in flight;
invariant 10: staging and host RAM are bounded, a save that does not fit is skipped and counted,
never waited for). The per-chunk work is C-level (dict construction, ``filterfalse``, ``map``); the
rest is a fixed number of numpy and dict calls per batch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from itertools import filterfalse

from tpuoffload import counters as C
from tpuoffload.messages import SaveBatch
from tpuoffload.scheduler.index import ChunkHash, ChunkIndex
from tpuoffload.scheduler.ledger import CompletionLedger
from tpuoffload.scheduler.staging import StagingBudget

EMPTY = SaveBatch()


class SavePlanner:
    def __init__(self, index: ChunkIndex, ledger: CompletionLedger, staging: StagingBudget, *,
                 chunk_bytes: int, save_timeout_s: float, clock: Callable[[], float],
                 counters: Counter[str]) -> None:
        self.index = index
        self.ledger = ledger
        self.staging = staging
        self.chunk_bytes = chunk_bytes
        self.save_timeout_s = save_timeout_s
        self.clock = clock
        self.counters = counters

    def plan(self, block_ids: Sequence[int], hashes: Sequence[ChunkHash], step: int) -> SaveBatch:
        """Chunks to save among the candidates ``zip(block_ids, hashes)``, earliest first. The
        blocks must hold their content until the workers gather them in this step's plan."""
        n = len(hashes)
        if not n:
            return EMPTY
        # Within the batch: one block per hash (any of them: equal hashes mean equal content, and
        # every candidate block is computed by the time the workers gather it). dict keeps the
        # first occurrence's position, so the order stays the candidates' order.
        by_hash = dict(zip(hashes, block_ids))
        fresh = list(filterfalse(self.index.contains, by_hash))
        counters = self.counters
        counters[C.DEDUP_BATCH] += n - len(by_hash)
        counters[C.DEDUP_INDEX] += len(by_hash) - len(fresh)
        if not fresh:
            return EMPTY
        granted = self.staging.reserve_up_to(len(fresh), self.chunk_bytes)
        if granted < len(fresh):
            counters[C.SKIPPED_STAGING] += len(fresh) - granted
            del fresh[granted:]
        if not granted:
            return EMPTY
        slots = self.index.allocate(granted)
        got = len(slots)
        if got < granted:
            counters[C.SKIPPED_NO_SPACE] += granted - got
            self.staging.release((granted - got) * self.chunk_bytes)
            del fresh[got:]
        if not got:
            return EMPTY
        base = self.ledger.open_batch(slots, self.clock() + self.save_timeout_s, step)
        self.index.add_saving(fresh, slots, base)
        counters[C.SAVES_ISSUED] += got
        return SaveBatch(block_ids=tuple(map(by_hash.__getitem__, fresh)), slots=tuple(slots.tolist()),
                         save_ids=range(base, base + got))
