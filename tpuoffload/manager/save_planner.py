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

With two slot pools (GDN/mamba state chunks beside KV chunks: manager/kv_groups.py) each
candidate names its pool, and each pool's candidates are claimed apart (``claim_pools``): its own
free slots, its own LRU victims, its own chunk size against the staging budget; the claims' save
ids follow each other, so the step still saves one SaveBatch of contiguous save ids.

``SavePlanner.claim`` is the only way a host-RAM slot becomes SAVING: a save and a tier bringing
chunks back into host RAM (the disk tier's fetches) both claim their slots through it, so both
take the same staging room, the same LRU eviction and one ledger batch, and the RAM ledger makes
them READY alike.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from tpuoffload import counters as C
from tpuoffload.messages import SaveBatch, compact_ints, pack_keys
from tpuoffload.manager.events import Origins
from tpuoffload.manager.hash_table import HashKeys, PackedHashes
from tpuoffload.manager.index import ChunkHash, ChunkIndex
from tpuoffload.manager.ledger import CompletionLedger
from tpuoffload.manager.staging import StagingBudget

NO_SAVES = SaveBatch()  # a plan that saves nothing


@dataclass(frozen=True)
class Claim:
    """Host-RAM slots a batch of chunks took (``SavePlanner.claim``): ``slots[i]`` is SAVING for
    ``keys[i]``, the batch's candidate ``keep[i]``, under save id ``first_save_id + i``."""

    keys: HashKeys
    keep: np.ndarray  # positions in the batch, ascending
    slots: np.ndarray
    run_step: int | None  # slots ascend (1) / descend (-1) by one, else 0; None: not known
    first_save_id: int
    n_dup: int  # equal to an earlier candidate of the batch
    n_held: int  # held or being saved already
    n_staging: int  # new, but the staging budget had no room
    n_no_space: int  # new, with room, but host RAM is full of saving, pinned or revoked chunks


class SavePlanner:
    """Turns a step's save candidates into claimed host-RAM slots: deduplicates (invariant 5), cuts to
    the staging budget (invariant 10), names free or evicted slots and opens one ledger batch.
    ``claim`` is the only way a host-RAM slot becomes SAVING, for saves and disk fetches alike."""

    def __init__(self, index: ChunkIndex, ledger: CompletionLedger, staging: StagingBudget, *,
                 state_chunk_bytes: int = 0,
                 chunk_bytes: int, save_timeout_s: float, clock: Callable[[], float],
                 counters: Counter[str], with_keys: bool = False) -> None:
        self.index = index
        self.with_keys = with_keys  # warm restart: the hosts keep each slot's hash keys
        self.ledger = ledger
        self.staging = staging
        self.chunk_bytes = chunk_bytes
        # Bytes of one chunk of each slot pool (KV, GDN state): what a save takes of staging.
        self.pool_chunk_bytes = (chunk_bytes, state_chunk_bytes)[:len(index.pool_sizes)]
        self.save_timeout_s = save_timeout_s
        self.clock = clock
        self.counters = counters

    def plan(self, block_ids: Sequence[int], hashes: "Sequence[ChunkHash] | PackedHashes", step: int,
             origins: Origins = (), pools: np.ndarray | None = None) -> SaveBatch:
        """Chunks to save among the candidates ``zip(block_ids, hashes)``, earliest first. The
        blocks must hold their content until the workers gather them in this step's plan.
        ``hashes`` may also be given packed already; ``origins`` say which request blocks the
        candidates are, in order (what the index's event sink records of each new chunk);
        ``pools`` each candidate's slot pool (None: all the KV pool's).

        Enforces invariant 5 (the only deduplication: within the batch, against chunks held and
        against saves in flight) and invariant 10 (the staging budget's room and the slots that exist
        bound what is named; the rest is skipped and counted)."""
        n = len(hashes)
        if not n:
            return NO_SAVES
        packed = hashes if type(hashes) is PackedHashes else PackedHashes.of(hashes)
        split = pools is not None and bool(pools.any())  # then the claim lists its chunks pool by pool
        c = self.claim_pools(packed, pools, step) if split else self.claim(packed, step)
        counters = self.counters
        for name, k in ((C.DEDUP_BATCH, c.n_dup), (C.DEDUP_INDEX, c.n_held), (C.SKIPPED_STAGING, c.n_staging),
                        (C.SKIPPED_NO_SPACE, c.n_no_space)):
            if k:
                counters[name] += k
        got = len(c.slots)
        if not got:
            return NO_SAVES
        counters[C.SAVES_ISSUED] += got
        self.record(c, origins, in_order=not split)
        blocks = tuple(block_ids) if got == n and not split else tuple(map(block_ids.__getitem__, c.keep.tolist()))
        keys, base = c.keys, c.first_save_id
        return SaveBatch(block_ids=blocks, slots=compact_ints(c.slots, c.run_step), save_ids=range(base, base + got),
                         keys=pack_keys(keys.k1, keys.k2) if self.with_keys else b"")

    def record(self, claim: Claim, origins: Origins, in_order: bool | None = None) -> None:
        """The index's event sink records the chunks ``claim`` named (``origins``: the batch's
        candidates, in order). The sink reads candidates in batch order, and a claim of several
        pools (``claim_pools``) lists each pool's chunks apart: they go back in batch order. Every
        save and every fetch into host RAM from the store records through here. ``in_order``: the
        caller knows whether the claim is in batch order (a step's saves, on the hot path: no check)."""
        keep = claim.keep
        if in_order is None:
            in_order = len(keep) < 2 or not bool((keep[1:] < keep[:-1]).any())
        if not in_order:
            order = np.argsort(keep, kind="stable")
            self.index.events.record(claim.slots[order], keep[order], origins)
        else:
            self.index.events.record(claim.slots, keep, origins)

    def claim_pools(self, packed: PackedHashes, pools: np.ndarray, step: int) -> Claim:
        """``claim`` of each pool's candidates (``pools``: each candidate's slot pool) in turn, as
        one Claim: its chunks are pool 0's claimed chunks then pool 1's, under consecutive save
        ids (``keep`` says which candidate each is). The KV pool claims first: a state chunk
        serves a hit only with every attention chunk before it. Saves and disk fetches alike."""
        rows = np.frombuffer(packed.buf, np.uint8).reshape(len(packed), packed.width)
        claims, positions = [], []
        for pool in np.unique(pools).tolist():
            pos = np.flatnonzero(pools == pool)
            claims.append(self.claim(PackedHashes(rows[pos].tobytes(), packed.width), step, pool))
            positions.append(pos)
        if not claims:
            return self.claim(packed, step)
        if len(claims) == 1:
            c = claims[0]
            return Claim(c.keys, positions[0][c.keep], c.slots, c.run_step, c.first_save_id, c.n_dup, c.n_held,
                         c.n_staging, c.n_no_space)
        return Claim(HashKeys(np.concatenate([c.keys.k1 for c in claims]), np.concatenate([c.keys.k2 for c in claims])),
                     np.concatenate([pos[c.keep] for pos, c in zip(positions, claims)]),
                     np.concatenate([c.slots for c in claims]), None, claims[0].first_save_id,
                     *(sum(getattr(c, f) for c in claims) for f in ("n_dup", "n_held", "n_staging", "n_no_space")))

    def staged_bytes(self, slots: np.ndarray) -> int:
        """Staging bytes the saves into ``slots`` took (each its pool's chunk size)."""
        if len(self.pool_chunk_bytes) == 1:
            return len(slots) * self.chunk_bytes
        return int(np.asarray(self.pool_chunk_bytes)[self.index.pool_of(slots)].sum())

    def claim(self, packed: PackedHashes, step: int, pool: int = 0) -> Claim:
        """Host-RAM slots for the new chunks among ``packed``, as many as the staging budget and
        host RAM allow, earliest first: deduplicated (within the batch, against chunks held and
        saves in flight), free slots first, then LRU chunks evicted, staging reserved, one ledger
        batch opened, the chunks SAVING under its save ids. The only way a slot becomes SAVING."""
        # One pass over the batch (compiled): a key equal to an earlier candidate's is a batch
        # duplicate (equal hashes mean equal content; the first block is as good as any, and every
        # candidate block is computed by the time the workers gather it), a key held or being
        # saved is an index duplicate (in flight included). Deduplication and the free slots'
        # naming are one call (the usual case); kept keys beyond what free slots covered are
        # named below, on slots of evicted chunks.
        unit = self.pool_chunk_bytes[pool]
        limit = self.staging.room(unit)  # chunks the staging budget takes now
        first = self.ledger.next_save_id
        keys, keep, n_dup, n_held, slots, run_step = self.index.select_and_name(packed, limit, first, pool)
        n_keep = len(keep)
        granted = min(n_keep, limit)
        got = len(slots)
        if got < granted:  # host RAM is full: LRU chunks make room
            victims = self.index.allocate(granted - got, pool)
            if len(victims):
                self.index.add_saving(keys.take(slice(got, got + len(victims))), victims, first + got)
                slots = np.concatenate((slots, victims)) if got else victims
                got, run_step = len(slots), None
        if got < n_keep:
            keep, keys = keep[:got], keys.take(slice(0, got))
        if got:
            reserved = self.staging.reserve_up_to(got, unit)
            assert reserved == got, (reserved, got)  # got <= room(), and nothing reserved since
            base = self.ledger.open_batch(slots, self.clock() + self.save_timeout_s, step)
            assert base == first, (base, first)  # the save ids the chunks were named under
        return Claim(keys, keep, slots, run_step, first, n_dup, n_held, n_keep - granted, granted - got)
