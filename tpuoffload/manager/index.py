"""Which host slot holds which chunk: the content-hash index of host RAM, with eviction by extent.

Lifecycle of a slot::

    FREE --allocate + add_saving--> SAVING --mark_ready (every host confirmed)--> READY --evict (LRU extent)--> FREE
                                       \\--drop (a host failed / expired)--> FREE        \\--discard--> FREE
    revoke_all (connector reset): READY -> FREE (or REVOKED while pinned), SAVING -> REVOKED;
    REVOKED --(its save resolves / its last pin goes)--> FREE, never READY.

The slots may form several pools (``pools``: consecutive ranges, e.g. KV chunks and GDN state
chunks, whose slots differ in size on the workers): each pool has its own free list and LRU order,
a save names slots of one pool (``select_and_name`` / ``allocate``), and eviction makes room in
that pool only. Everything else (hashes, states, pins, save ids) is one table over every slot.

Only READY chunks can be loaded (invariant 7: loadable only after every host confirmed) and only
READY chunks with no pin can be evicted, so a chunk being saved or being loaded is never evicted.
A REVOKED slot keeps its slot until nothing can be writing or reading it, but no hash names it, so
nothing saved before a reset is ever offered again.

The store keeps a step's chunks in long runs of consecutive slots (extents), so that the workers
move a step's saves, and a prefix's loads, in few wide copies however long the store has churned:
each pool's slots form aligned extents of ``extent_slots(pool size)`` slots, the LRU order is kept
per extent (``ExtentLru``: a touch of any chunk makes its extent recently used), and eviction takes
the least recently used extent's evictable chunks in slot order, then the next extent's. A fresh
store hands out its free slots in one ascending run (``SlotPool``), and so does a store after a
reset. Which chunks go is decided per extent, not per chunk: tools/replay_hit_rates.py measures
what that costs in hit rate against per-chunk LRU on vLLM's real scheduler (docs/performance.md).

Per-slot fields live in one array of 32-byte records (state, save id, pins, the hash's second key
word, its table cell); hashes map to slots through a ``HashTable``; the LRU order is an
``ExtentLru`` per pool (a ``RecencyLog`` over extents). Every operation takes or returns slot
arrays and costs one call of a compiled loop (kernels.py) or a fixed number of numpy calls per
batch, not Python work per chunk, so its cost does not grow with the number of chunks held.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from tpuoffload import counters as C
from tpuoffload.messages import compact_ints
from tpuoffload.manager.events import NO_EVENTS, ChunkEvents
from tpuoffload.manager.hash_table import HashKeys, HashTable, PackedHashes, _i64, _u64
from tpuoffload.manager.kernels import kernels
from tpuoffload.manager.recency import ExtentLru
from tpuoffload.manager.slot_pool import SlotPool

ChunkHash = bytes
FREE, SAVING, READY, REVOKED = 0, 1, 2, 3  # a slot's state
# Extents: the KV pool's slots are evicted and reused EXTENT_SLOTS at a time, in pools of at least
# MIN_EXTENTS extents (a smaller pool takes smaller extents, down to one slot: per-chunk LRU).
# 1: per-chunk LRU, since every larger extent measured lost more than a point of hit rate on
# vLLM's real scheduler (docs/performance.md, "The host store by extent").
EXTENT_SLOTS = 1
MIN_EXTENTS = 16


def extent_slots(num_slots: int, cap: int | None = None) -> int:
    """The extent of a pool of ``num_slots`` slots: the largest power of two up to ``cap``
    (default ``EXTENT_SLOTS``) that leaves the pool at least ``MIN_EXTENTS`` extents; at least 1."""
    cap = EXTENT_SLOTS if cap is None else cap
    most = max(1, min(cap, num_slots // MIN_EXTENTS))
    return 1 << (most.bit_length() - 1)
_EMPTY = np.zeros(0, dtype=np.int64)  # shared: empty, so nothing can be written into it
_SLOT = np.dtype([("key2", np.uint64), ("cell", np.int64), ("save_id", np.int64), ("pins", np.int32),
                  ("state", np.uint8)], align=True)  # 32 bytes


class SavedPrefix(NamedTuple):
    """The READY chunks a lookup found (``ChunkIndex.ready_prefix_saved``), as a load lists them."""

    slots: np.ndarray
    save_ids: np.ndarray  # of each slot
    slot_step: int = 0  # 1 or -1 when the slots ascend or descend by one (kernels._run_step), else 0
    id_step: int = 0  # the same for the save ids

    def listed(self, k: int) -> tuple[Sequence[int], Sequence[int]]:
        """The first ``k`` slots and save ids as a load sends them (``compact_ints``; a prefix of
        a run is a run)."""
        return compact_ints(self.slots[:k], self.slot_step), compact_ints(self.save_ids[:k], self.id_step)


_NO_PREFIX = SavedPrefix(_EMPTY, _EMPTY)


class ChunkIndex:
    """Maps content hash -> host slot. Single-threaded: it lives on vLLM's scheduler thread.

    ``version`` changes whenever the set of READY chunks may have shrunk (eviction, drop, discard,
    revoke), so a caller can tell whether a lookup it memoised is still exact.
    ``counters`` holds ``evicted``, ``discarded`` and ``revoked`` (registry names).
    ``events`` hears every change of the set of READY chunks (manager/events.py: KV events), and
    keeps what describes each slot's chunk; ``NO_EVENTS`` (the default) does nothing.
    """

    def __init__(self, num_slots: int, counters: Counter[str] | None = None,
                 events: ChunkEvents = NO_EVENTS, pools: tuple[int, ...] = ()) -> None:
        """``pools``: the slots of each pool, in slot order (default: one pool of ``num_slots``)."""
        pools = pools or (num_slots,)
        if sum(pools) != num_slots or min(pools) <= 0:
            raise ValueError(f"slot pools {pools} do not split {num_slots} slots")
        starts = np.cumsum((0,) + pools[:-1])
        self._pools = [SlotPool(n, int(first)) for n, first in zip(pools, starts)]
        # Eviction order per pool. The KV pool (the first) evicts by extent; a GDN state pool
        # (the others) per chunk: a state chunk is read alone, one per hit, so runs buy it nothing.
        self._lrus = [ExtentLru(int(first), n, extent_slots(n) if i == 0 else 1)
                      for i, (n, first) in enumerate(zip(pools, starts))]
        self._starts = starts[1:]  # first slot of each pool but the first
        self._table = HashTable(num_slots)  # k1 of a hash -> slot, for SAVING and READY chunks
        # Per-slot fields side by side in one record of 32 bytes (the views below are its
        # columns): a save or a confirmation writes several fields of each of its slots, one
        # cache line per two slots instead of one per field.
        self._slots = np.zeros(num_slots, dtype=_SLOT)
        self._key2 = self._slots["key2"]  # k2 of the slot's hash (confirms a table match)
        self._cell = self._slots["cell"]  # the slot's cell in the table
        self._save_id = self._slots["save_id"]
        self._save_id[:] = -1
        self._pins = self._slots["pins"]
        self._state_np = self._slots["state"]  # FREE/SAVING/READY/REVOKED
        self._counts = [num_slots, 0, 0, 0]  # slots per state
        self.version = 0
        self.counters: Counter[str] = Counter() if counters is None else counters  # may be shared
        self.events = events
        # (slots, save ids, keys, event records) of the chunks evicted since the last take_evicted,
        # when kept (record_evictions): what the disk tier spills.
        self._evicted: list[tuple[np.ndarray, np.ndarray, HashKeys, object]] | None = None
        self._k = kernels()
        events.bind(self)

    # ------------------------------------------------------------------ queries (no side effects)
    @property
    def num_slots(self) -> int:
        return self._pools[-1].stop

    @property
    def pool_sizes(self) -> tuple[int, ...]:
        return tuple(p.num_slots for p in self._pools)

    @property
    def num_free_slots(self) -> int:
        return sum(p.num_free for p in self._pools)

    def pool_of(self, slots: np.ndarray) -> np.ndarray:
        """The pool of each slot."""
        return np.searchsorted(self._starts, slots, side="right")

    def __len__(self) -> int:
        """Chunks a hash names (READY or SAVING)."""
        return len(self._table)

    def num_saving(self) -> int:
        """Slots held for a save in flight or a pin, no hash naming them or not: SAVING + REVOKED."""
        return self._counts[SAVING] + self._counts[REVOKED]

    def num_ready(self) -> int:
        """Chunks that are loadable (READY)."""
        return self._counts[READY]

    def num_pinned(self) -> int:
        """Chunks pinned by loads being planned (zero between scheduler steps). O(num_slots)."""
        return int(np.count_nonzero(self._pins))

    def slot_of(self, chunk_hash: ChunkHash) -> int | None:
        """The slot of a chunk held or being saved (None if there is none)."""
        slot, k2 = self._table.find_hash(chunk_hash)
        return slot if slot >= 0 and int(self._key2[slot]) == k2 else None

    def contains(self, chunk_hash: ChunkHash) -> bool:
        """True if the hash is held or being saved (a save of it would be a duplicate)."""
        return self.slot_of(chunk_hash) is not None

    def find(self, keys: HashKeys) -> np.ndarray:
        """Slot of each key held or being saved, -1 for the others."""
        out = np.empty(len(keys), dtype=np.int64)
        if len(out):
            self._k.find_confirmed(self._table.buckets, self._key2, _u64(keys.k1), _u64(keys.k2), out)
        return out

    def select_new(self, keys: HashKeys) -> tuple[HashKeys, np.ndarray, int, int]:
        """Deduplicate a batch of candidates (invariant 5), in one pass: returns (the keys that are
        neither held nor being saved nor equal to an earlier key of the batch; their positions,
        ascending; how many were equal to an earlier key; how many are held or being saved). The
        save planner does the same, and names the new chunks, in ``select_and_name``."""
        keep, k1, k2, n_dup = self._k.select_new(self._table.buckets, self._key2, _u64(keys.k1), _u64(keys.k2))
        return HashKeys(k1, k2), keep, n_dup, len(keys) - len(keep) - n_dup

    def select_and_name(self, packed: PackedHashes, limit: int, first_save_id: int,
                        pool: int = 0) -> tuple[HashKeys, np.ndarray, int, int, np.ndarray, int]:
        """``select_new`` of a batch of save candidates, then ``allocate`` + ``add_saving`` of its
        first kept keys from ``pool``'s free slots only (no eviction), in one compiled call: up to
        ``limit`` keys are named SAVING under save ids ``first_save_id ..``. Returns (the kept keys,
        their positions, batch duplicates, held, the slots named, ``add_saving``'s run step). Fewer
        slots than ``min(kept, limit)`` means the pool ran out: ``allocate`` + ``add_saving`` the
        next kept keys (evicting)."""
        slot_pool = self._pools[pool]
        stack, allocated, top = slot_pool.free_stack()
        table = self._table
        table.check_room(min(len(packed), limit, top))
        keep, k1, k2, n_dup, slots, reused, run_step = self._k.plan_saves(
            table.buckets, self._key2, self._cell, self._state_np, self._save_id, stack, allocated, top,
            packed.buf, packed.width, limit, first_save_id)
        n = len(slots)
        slot_pool.took(n)
        if n:
            table.inserted(n, reused)
            self._counts[FREE] -= n
            self._counts[SAVING] += n
        return HashKeys(k1, k2), keep, n_dup, len(packed) - len(keep) - n_dup, slots, run_step

    def state_of(self, slot: int) -> int:
        return int(self._state_np[slot])

    def save_id_of(self, slot: int) -> int:
        return int(self._save_id[slot])

    def save_ids(self, slots: np.ndarray) -> np.ndarray:
        return self._save_id[slots]

    def keys_of(self, slots: np.ndarray) -> HashKeys:
        """The hash keys of the chunks named in ``slots`` (SAVING or READY)."""
        return HashKeys(self._table.k1_at(self._cell[slots]), self._key2[slots].copy())

    def lru_order(self) -> list[int]:
        """Slots of the READY chunks in eviction order, least recently used extent first, each
        extent's in slot order. O(num_slots): for reports and tests. (A pinned chunk may still be
        listed; it is skipped when met.)"""
        out = []
        for lru in self._lrus:
            s = lru.order()
            out += s[self._state_np[s] == READY].tolist()
        return out

    def extent_of_pool(self, pool: int = 0) -> int:
        """Slots per extent of ``pool`` (1: per-chunk LRU)."""
        return self._lrus[pool].extent

    def ready_prefix(self, hashes: Sequence[ChunkHash], start: int = 0, stop: int | None = None) -> list[int]:
        """Slots of the leading hashes of ``hashes[start:stop]`` that are READY (stops at the
        first that is not). Does not touch the LRU order."""
        return self.ready_prefix_saved(hashes, start, stop).slots.tolist()

    def ready_slot(self, chunk_hash: ChunkHash) -> int:
        """The slot of the chunk if it is READY (loadable), else -1; in plain Python: about a
        microsecond, for the first block of a lookup (a miss there is the usual answer)."""
        slot, k2 = self._table.find_hash(chunk_hash)
        return slot if slot >= 0 and int(self._key2[slot]) == k2 and self._state_np[slot] == READY else -1

    def ready_slots(self, keys: HashKeys) -> np.ndarray:
        """Slot of each key that is READY (loadable), -1 for the others; no effect on the index."""
        slots = self.find(keys)
        held = slots >= 0
        slots[held] = np.where(self._state_np[slots[held]] == READY, slots[held], -1)
        return slots

    def ready_prefix_saved(self, hashes: Sequence[ChunkHash], start: int = 0, stop: int | None = None) -> "SavedPrefix":
        """``ready_prefix`` as a load lists it: the slots, their save ids, and whether each is a
        run. The first hash is looked up in plain Python (``ready_slot``); after a hit, the rest,
        the save ids and the run steps in one compiled call."""
        if stop is None or stop > len(hashes):
            stop = len(hashes)
        first = self.ready_slot(hashes[start]) if start < stop else -1
        if first < 0:
            return _NO_PREFIX
        if stop - start == 1:
            return SavedPrefix(np.array([first], dtype=np.int64), np.array([self._save_id[first]], dtype=np.int64))
        packed = PackedHashes.of(hashes[start:stop])
        return SavedPrefix(*self._k.ready_prefix(self._table.buckets, self._key2, self._state_np, self._save_id,
                                                 packed.buf, packed.width))

    # ------------------------------------------------------------------ saves
    def allocate(self, n: int, pool: int = 0) -> np.ndarray:
        """Up to ``n`` slots of ``pool`` for new saves: free slots first, then slots of READY
        unpinned chunks of the pool's least recently used extents, evicted here (counted in
        ``evicted``). Invariant 10: host RAM is a fixed number of slots, never exceeded; a chunk
        being saved, loaded (pinned) or revoked is never evicted. Fewer only when host RAM is full
        of chunks that are saving, pinned or revoked. The slots stay FREE until ``add_saving``.

        The victims come extent by extent, each extent's in slot order, handed out sorted
        ascending: a step's saves name runs of consecutive slots, extent after extent, so the
        worker moves them in a few wide copies (worker/programs.py) however the store churned;
        an extent not emptied is where the next eviction continues (``ExtentLru``)."""
        slots = self._pools[pool].take(n)
        short = n - len(slots)
        if short > 0:
            state, pins = self._state_np, self._pins
            victims = self._lrus[pool].victims(short, lambda s: (state[s] == READY) & (pins[s] == 0))
            if len(victims):
                self._evict(victims)
                # The pool stays out of it: the victims go straight from their old chunk to the new.
                slots = np.concatenate((slots, victims)) if len(slots) else victims
        return slots

    def add_saving(self, keys: HashKeys, slots: np.ndarray, first_save_id: int) -> int:
        """Name ``slots`` (from ``allocate``) by ``keys``, SAVING under save ids
        ``first_save_id, first_save_id + 1, ...``. The keys must be distinct and new to the index
        (``find`` says -1): the save planner checks. Returns 1 if ``slots`` ascend by one, -1 if
        they descend by one, else 0 (found in the same pass: the planner sends a run as a range)."""
        n = len(slots)
        if len(keys) != n:
            raise ValueError(f"{len(keys)} keys for {n} slots")
        if not n:
            return 0
        table = self._table
        table.check_room(n)
        reused, run_step = self._k.name(table.buckets, _u64(keys.k1), _u64(keys.k2), _i64(slots),
                                        self._cell, self._key2, self._state_np, self._save_id, first_save_id)
        table.inserted(n, reused)
        self._counts[FREE] -= n
        self._counts[SAVING] += n
        return run_step

    def mark_ready(self, slots: np.ndarray, save_ids: np.ndarray) -> int:
        """Every host confirmed these saves: SAVING chunks become READY and most recently used
        (the last listed most of all); REVOKED ones are freed. The way a saved chunk becomes
        loadable (invariant 7: the ledger calls for it once every reporting host confirmed); the
        one other way in is ``adopt`` (warm restart, rows every host restored alike). Slots whose
        save id no longer matches are ignored. Returns how many became READY."""
        slots = _i64(slots)
        if not len(slots):
            return 0
        if self._k.mark_ready(self._state_np, self._save_id, slots, _i64(save_ids)):
            self._counts[SAVING] -= len(slots)
            self._counts[READY] += len(slots)
            self._touch(slots)
            self.events.ready(slots, save_ids)
            return len(slots)
        slots, states = self._matching(slots, save_ids)
        if not len(slots):
            return 0
        saving = states == SAVING
        ready = slots if saving.all() else slots[saving]
        self._state_np[ready] = READY
        self._counts[SAVING] -= len(ready)
        self._counts[READY] += len(ready)
        self._touch(ready)
        self.events.ready(ready, self._save_id[ready])
        if len(ready) < len(slots):
            self._free(slots[~saving], REVOKED)
        return len(ready)

    def drop(self, slots: np.ndarray, save_ids: np.ndarray) -> int:
        """These saves failed or expired: forget their chunks and free their slots. They were
        never loadable, so no load can be reading them (invariant 11: a failed save frees its
        chunk and is never loadable). Returns how many were dropped."""
        slots, states = self._matching(slots, save_ids)
        if not len(slots):
            return 0
        saving = slots[states == SAVING]
        if len(saving):
            self._unname(saving)
            self._free(saving, SAVING)
        revoked = slots[states == REVOKED]
        if len(revoked):
            self._free(revoked, REVOKED)
        self.version += 1
        return len(slots)

    # ------------------------------------------------------------------ warm restart
    def free_slots_mask(self, slots: np.ndarray) -> np.ndarray:
        """True where the slot is FREE (no chunk, no save, nothing pinned)."""
        return self._state_np[slots] == FREE

    def adopt(self, keys: HashKeys, slots: np.ndarray, save_ids: np.ndarray, rows=None) -> None:
        """Warm restart: chunks every host restored become READY in ``slots`` under ``save_ids``,
        the last listed the most recently used, described by the event records ``rows``
        (``events.lookup``; None without events). The slots must be FREE and distinct, the keys
        distinct and new to the index (manager/restart.py checks)."""
        slots = np.asarray(slots, dtype=np.int64)
        n = len(slots)
        if len(keys) != n or len(save_ids) != n:
            raise ValueError(f"{len(keys)} keys and {len(save_ids)} save ids for {n} slots")
        if not n:
            return
        if not self.free_slots_mask(slots).all():
            raise ValueError("adopt: a slot is not FREE")
        for pool, part in self._by_pool(slots):
            self._pools[pool].take_these(part)
        self._cell[slots] = self._table.insert(keys.k1, slots)
        self._key2[slots] = keys.k2
        self._state_np[slots] = READY
        self._save_id[slots] = save_ids
        self._counts[FREE] -= n
        self._counts[READY] += n
        self._touch(slots)
        self.events.copy_in(slots, rows)
        self.events.ready(slots, save_ids)

    # ------------------------------------------------------------------ loads
    def pin(self, slots: np.ndarray) -> None:
        """Pin READY chunks for a load: they cannot be evicted until unpinned. A slot listed
        twice is pinned twice. Raises if one is not READY."""
        if not len(slots):
            return
        slots = np.asarray(slots, dtype=np.int64)
        if not self._k.pin(self._pins, self._state_np, slots):
            bad = self._state_np[slots] != READY
            raise ValueError(f"cannot pin slots that are not READY: {slots[bad][:8]}")

    def unpin(self, slots: np.ndarray) -> None:
        """Release one pin per listed slot. ``slots`` lists each load's chunks in prefix order; the
        released chunks become most recently used in reverse, so each prefix's first chunk (and
        its extent) ends the most recently used: eviction then eats prefixes from the tail, extent
        by extent, and what remains of a prefix stays loadable. A revoked or discarded chunk's slot is freed at its last unpin."""
        if not len(slots):
            return
        released = np.empty(len(slots), dtype=np.int64)
        k = self._k.unpin(self._pins, _i64(slots), released)
        if k < 0:
            raise ValueError("unpin of a slot that is not pinned")
        released = released[:k]
        states = self._state_np[released]
        ready = states == READY
        if ready.all():  # the usual case: nothing was revoked or discarded meanwhile
            self._touch(released)
            return
        self._touch(released[ready])
        gone = np.unique(released[states == REVOKED])
        if len(gone):
            self._free(gone, REVOKED)

    def discard(self, slot: int, save_id: int) -> bool:
        """Forget a READY chunk that failed to load somewhere, so it is not offered again
        (invariant 11: vLLM recomputes it; no load loops on a lost chunk). A
        pinned chunk leaves the index at once but keeps its slot until its last unpin. Returns
        False if the slot now holds another chunk (or none)."""
        if not 0 <= slot < self.num_slots or self._state_np[slot] != READY or self._save_id[slot] != save_id:
            return False
        one = np.array([slot], dtype=np.int64)
        self.events.removed(one)
        self._unname(one)
        if self._pins[slot]:
            self._set_state(one, READY, REVOKED)
        else:
            self._free(one, READY)
        self.counters[C.DISCARDED] += 1
        self.version += 1
        return True

    # ------------------------------------------------------------------ reset
    def revoke_all(self) -> int:
        """Nothing held or being saved may ever be loaded again (connector reset). READY chunks
        are freed (or REVOKED while pinned); SAVING chunks become REVOKED and keep their slot
        until their save resolves. Returns how many chunks were revoked. O(num_slots)."""
        n = len(self._table)
        state = self._state_np
        ready = np.flatnonzero(state == READY)
        self.events.removed(ready)
        for lru in self._lrus:
            lru.forget_all()
        pinned = ready[self._pins[ready] > 0]
        if len(pinned):
            self._set_state(pinned, READY, REVOKED)
        idle = ready[self._pins[ready] == 0]
        saving = np.flatnonzero(state == SAVING)
        if len(saving):
            self._set_state(saving, SAVING, REVOKED)
        self._table.clear()
        if len(idle):
            self._free(idle, READY)
        self.counters[C.REVOKED] += n
        self.version += 1
        return n

    def named_slots(self) -> np.ndarray:
        """Slots whose chunk a hash names (SAVING or READY). O(num_slots)."""
        state = self._state_np
        return np.flatnonzero((state == SAVING) | (state == READY))

    # ------------------------------------------------------------------ internals
    def _matching(self, slots: np.ndarray, save_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The listed slots that still hold the listed save (SAVING or REVOKED), and their states."""
        slots = np.asarray(slots, dtype=np.int64)
        keep = self._save_id[slots] == save_ids
        if not keep.all():
            slots = slots[keep]
        states = self._state_np[slots]
        live = (states == SAVING) | (states == REVOKED)
        if not live.all():
            slots, states = slots[live], states[live]
        return slots, states

    def record_evictions(self) -> None:
        """From now on keep what every eviction removes, for ``take_evicted``."""
        self._evicted = []

    def take_evicted(self) -> tuple[np.ndarray, np.ndarray, HashKeys, object]:
        """(slots, save ids, keys, event records) of the chunks evicted since the last call, oldest
        first."""
        parts = self._evicted
        if not parts:
            return _EMPTY, _EMPTY, HashKeys.of([]), self.events.concat([])
        self._evicted = []
        return (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
                HashKeys(np.concatenate([p[2].k1 for p in parts]), np.concatenate([p[2].k2 for p in parts])),
                self.events.concat([p[3] for p in parts]))

    def _evict(self, victims: np.ndarray) -> None:
        """Victims (READY, unpinned, from ``ExtentLru.victims``) lose their chunk; their slots stay
        allocated for the caller."""
        self.events.removed(victims)
        if self._evicted is not None:
            keys = HashKeys(self._table.k1_at(self._cell[victims]), self._key2[victims].copy())
            self._evicted.append((victims.copy(), self._save_id[victims].copy(), keys, self.events.rows(victims)))
        table = self._table
        markers = self._k.evict(table.buckets, self._cell, self._state_np, self._save_id, victims)
        if table.removed(len(victims), markers):
            self._rebuild()
        self._counts[READY] -= len(victims)
        self._counts[FREE] += len(victims)
        self.counters[C.EVICTED] += len(victims)
        self.version += 1

    def _unname(self, slots: np.ndarray) -> None:
        """Remove the keys that name ``slots`` from the hash table (by cell: no lookup)."""
        if self._table.delete_cells(self._cell[slots]):
            self._rebuild()

    def _rebuild(self) -> None:
        """The table's deleted markers piled up: rebuild it (cells move)."""
        vals, cells = self._table.rebuild()
        self._cell[vals] = cells

    def _by_pool(self, slots: np.ndarray):
        """(pool, its slots in the given order) for each pool that ``slots`` touch."""
        if len(self._pools) == 1:
            return ((0, slots),)
        pool = self.pool_of(slots)
        return ((p, slots[pool == p]) for p in range(len(self._pools)) if (pool == p).any())

    def _touch(self, slots: np.ndarray) -> None:
        """Make ``slots`` the most recently used of their pools (the last listed most of all)."""
        for pool, part in self._by_pool(slots):
            self._lrus[pool].touch(part)

    def _set_state(self, slots: np.ndarray, old: int, new: int) -> None:
        self._state_np[slots] = new
        self._counts[old] -= len(slots)
        self._counts[new] += len(slots)

    def _free(self, slots: np.ndarray, old: int) -> None:
        self._set_state(slots, old, FREE)
        self._save_id[slots] = -1
        for pool, part in self._by_pool(slots):
            self._pools[pool].give(part)
