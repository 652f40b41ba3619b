r"""Content-hash index of the chunks host RAM holds, with LRU eviction and a reference-count lifecycle.

Lifecycle of a chunk::

    allocate_for_save -> SAVING --(every host confirmed)--> READY --(evicted, LRU)--> gone
                            \--(any host failed / expired)--> gone

A READY chunk can be pinned by loads (``pins`` counts them). Only READY chunks with ``pins == 0``
are eviction candidates, so a chunk being saved or being loaded is never evicted. Every operation
is O(1) per chunk touched: the eviction order lives in an OrderedDict holding exactly the evictable
chunks.
"""

from __future__ import annotations

import enum
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tpuoffload.manager.slot_pool import SlotPool

ChunkHash = bytes


class ChunkState(enum.Enum):
    SAVING = "saving"
    READY = "ready"


@dataclass(slots=True)
class Chunk:
    hash: ChunkHash
    slot: int
    save_id: int
    state: ChunkState = ChunkState.SAVING
    pins: int = 0


@dataclass(frozen=True, slots=True)
class SaveAllocation:
    """One unique chunk to save: the hash, the host slot every host writes it to, and its save id."""

    hash: ChunkHash
    slot: int
    save_id: int


class ChunkIndex:
    """Maps content hash -> Chunk. Single-threaded: it lives in the scheduler process.

    ``counters`` records what a caller may want to log: ``evicted``, ``skipped_no_space``,
    ``dedup_batch`` (hash repeated inside one batch), ``dedup_index`` (hash already held or being
    saved).
    """

    def __init__(self, num_slots: int) -> None:
        self._pool = SlotPool(num_slots)
        self._chunks: dict[ChunkHash, Chunk] = {}
        self._by_save_id: dict[int, Chunk] = {}
        self._evictable: OrderedDict[ChunkHash, None] = OrderedDict()  # READY, unpinned; LRU first
        self._next_save_id = 0
        self.counters: Counter[str] = Counter()

    # ---- queries (no side effects) ----
    @property
    def num_slots(self) -> int:
        return self._pool.num_slots

    @property
    def num_free_slots(self) -> int:
        return self._pool.num_free

    def __len__(self) -> int:
        return len(self._chunks)

    def get(self, chunk_hash: ChunkHash) -> Chunk | None:
        return self._chunks.get(chunk_hash)

    def contains(self, chunk_hash: ChunkHash) -> bool:
        """True if the hash is held or being saved (a save of it would be a duplicate)."""
        return chunk_hash in self._chunks

    def count_ready_prefix(self, hashes: Sequence[ChunkHash]) -> int:
        """Number of leading hashes that are READY. Does not touch the LRU order."""
        n = 0
        for h in hashes:
            chunk = self._chunks.get(h)
            if chunk is None or chunk.state is not ChunkState.READY:
                break
            n += 1
        return n

    def num_pinned(self) -> int:
        return sum(1 for c in self._chunks.values() if c.pins)

    def num_saving(self) -> int:
        return len(self._by_save_id)

    # ---- saves ----
    def allocate_for_save(self, hashes: Iterable[ChunkHash]) -> list[SaveAllocation]:
        """Atomically give each hash that is neither held, nor being saved, nor repeated earlier in
        ``hashes`` one slot, evicting LRU READY unpinned chunks when the pool is empty.

        Allocation stops at the first hash that cannot get a slot (host RAM full of chunks that are
        saving or pinned); the rest are counted in ``skipped_no_space``. Returns the new
        allocations in input order.
        """
        out: list[SaveAllocation] = []
        seen: set[ChunkHash] = set()
        hashes = list(hashes)
        chunks, by_save_id, allocate = self._chunks, self._by_save_id, self._pool.allocate
        for i, h in enumerate(hashes):
            if h in seen:
                self.counters["dedup_batch"] += 1
                continue
            seen.add(h)
            if h in chunks:
                self.counters["dedup_index"] += 1
                continue
            slot = allocate()
            if slot is None and self._evict_one():
                slot = allocate()
            if slot is None:
                earlier = seen - {h}
                rest = {x for x in hashes[i:] if x not in self._chunks and x not in earlier}
                self.counters["skipped_no_space"] += len(rest)
                break
            save_id = self._next_save_id
            self._next_save_id = save_id + 1
            chunks[h] = by_save_id[save_id] = Chunk(h, slot, save_id)
            out.append(SaveAllocation(h, slot, save_id))
        return out

    def mark_ready(self, save_id: int) -> Chunk | None:
        """The save finished on every host: the chunk becomes loadable and evictable."""
        chunk = self._by_save_id.pop(save_id, None)
        if chunk is None:
            return None
        chunk.state = ChunkState.READY
        self._evictable[chunk.hash] = None
        return chunk

    def drop_save(self, save_id: int) -> Chunk | None:
        """The save failed or expired somewhere: forget the chunk and free its slot. It was never
        loadable, so no load can be reading the slot."""
        chunk = self._by_save_id.pop(save_id, None)
        if chunk is None:
            return None
        del self._chunks[chunk.hash]
        self._pool.free(chunk.slot)
        return chunk

    # ---- loads ----
    def pin(self, hashes: Sequence[ChunkHash]) -> list[Chunk]:
        """Pin READY chunks for a load (they cannot be evicted until unpinned) and mark them most
        recently used. Raises KeyError if one is not READY: callers pin what count_ready_prefix
        reported within the same scheduler call."""
        chunks = []
        for h in hashes:
            chunk = self._chunks.get(h)
            if chunk is None or chunk.state is not ChunkState.READY:
                raise KeyError(f"chunk {h.hex()[:16]} is not ready")
            chunks.append(chunk)
        for chunk in chunks:
            chunk.pins += 1
            self._evictable.pop(chunk.hash, None)
        return chunks

    def unpin(self, chunks: Sequence[Chunk]) -> None:
        """Release one pin of each chunk. ``chunks`` are in prefix order and are released last to
        first, so a prefix's first chunk becomes the most recently used: LRU eviction then eats
        prefixes from the tail, and what remains of a prefix stays loadable."""
        for chunk in reversed(chunks):
            if chunk.pins <= 0:
                raise ValueError(f"chunk {chunk.hash.hex()[:16]} is not pinned")
            chunk.pins -= 1
            if chunk.pins:
                continue
            if self._chunks.get(chunk.hash) is chunk:
                self._evictable[chunk.hash] = None  # most recently used end
            else:  # discarded while pinned: its slot is free only now
                self._pool.free(chunk.slot)

    def discard(self, chunk_hash: ChunkHash, save_id: int) -> bool:
        """Forget a READY chunk that failed to load somewhere (so it is not offered again). A
        pinned chunk leaves the index at once but keeps its slot until its last unpin. Returns
        False if the hash now names another chunk (or none)."""
        chunk = self._chunks.get(chunk_hash)
        if chunk is None or chunk.save_id != save_id or chunk.state is not ChunkState.READY:
            return False
        del self._chunks[chunk_hash]
        self._evictable.pop(chunk_hash, None)
        if chunk.pins == 0:
            self._pool.free(chunk.slot)
        self.counters["discarded"] += 1
        return True

    # ---- internals ----
    def _evict_one(self) -> bool:
        if not self._evictable:
            return False
        h, _ = self._evictable.popitem(last=False)
        chunk = self._chunks.pop(h)
        self._pool.free(chunk.slot)
        self.counters["evicted"] += 1
        return True
