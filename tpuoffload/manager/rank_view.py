"""Under DPScheduler: what the other DP ranks hold READY in host RAM, for cross-rank hits.

tpu-inference's ``DPScheduler`` runs one scheduler half per DP rank, each in its own forked
process, each owning its batch shard's slots (manager/topology.py:DPRank). It routes a
request by its HBM prefix hit on each rank, else by load, so a prefix one rank saved is often asked
for on another. The halves share no memory and DPScheduler offers them one channel only: the
workers' report, which it hands whole to every rank. So:

* ``RankNews``, a rank's index's event sink, keeps what changed in its READY set (chunks that
  became READY: slot, save id, hash key; chunks that stopped being READY: slot, save id). The rank's
  next plan carries it (``StepPlan.news``), every host echoes it in its report
  (``OffloadWorkerReport.news``), and every rank receives it.
* ``RankView`` applies the other ranks' news into a read-only map from hash key to (the other
  rank's slot, save id). A lookup takes the rank's own READY chunks first and the view's where its
  own index has none (``LoadTracker``; with several KV cache groups each group's chunk, keyed by
  hash and group, in ``KVCacheGroups.find_hit``); a load names a view chunk by its offset from the
  rank's own range (messages.py:LoadRequest), so the workers place it in the owner's range.

The view is advice, not a claim: it lags the owner (a step or two, more with async scheduling),
news can be lost (a dropped report), and the owner reuses its slots without asking anyone: no rank
pins another rank's chunk (no cross-process pins). What makes a stale view harmless is the
workers' check (worker/transfer_engine.py:TransferEngine._unusable): on every host, before the load
is dispatched, the slot must still hold the save id the plan names, and a save into the slot
dispatched earlier is waited for first; a failed check is a load error on that host (the same
program runs everywhere, the row scatters zeros and vLLM recomputes the block). A save dispatched
after the load takes the store version the load read from, so it cannot change what the load reads.
A failed cross-rank load drops the chunk from the view (``discard``), so it is not offered again.

Ordering: save ids of one rank grow, and a slot's next chunk has a larger save id than its last,
so each view entry keeps the newest save id it heard of per slot and the highest save id heard gone
(``_dead``): news applied in any order, or twice, ends in the same view. A connector reset reaches
every rank (DPScheduler forwards ``reset_prefix_cache``): each rank clears its view and counts an
epoch, and news from another epoch is ignored, so nothing saved before a reset is loaded after it.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from typing_extensions import override
import numpy as np

from tpuoffload.manager.events import ChunkEvents, Origins
from tpuoffload.manager.hash_table import HashKeys
from tpuoffload.messages import NEWS_GONE_ROW, NEWS_READY_ROW, RANK_SAVE_ID_SHIFT, ChunkNews

if TYPE_CHECKING:
    from tpuoffload.manager.index import ChunkIndex, SavedPrefix

_TWO_WORDS = struct.Struct("<QQ").unpack_from  # a hash's key words, as hash_table.py reads them


class RankNews(ChunkEvents):
    """A DP rank's host-RAM index sink: hands every call to ``inner`` (the KV events sink) and
    keeps the READY set's changes until ``take_news``."""

    def __init__(self, inner: ChunkEvents) -> None:
        self.inner = inner
        self._index: "ChunkIndex | None" = None
        self._ready: list[np.ndarray] = []
        self._gone: list[np.ndarray] = []

    @override
    def bind(self, index: "ChunkIndex") -> None:
        self._index = index
        self.inner.bind(index)

    @override
    def record(self, slots: np.ndarray, positions: np.ndarray, origins: Origins) -> None:
        self.inner.record(slots, positions, origins)

    @override
    def rows(self, slots: np.ndarray) -> Any:
        return self.inner.rows(slots)

    @override
    def copy_in(self, slots: np.ndarray, rows: Any) -> None:
        self.inner.copy_in(slots, rows)

    @override
    def lookup(self, keys: HashKeys) -> tuple[Any, np.ndarray]:
        return self.inner.lookup(keys)

    def entries(self, slots: np.ndarray) -> np.ndarray:
        """The inner sink's records (the restart file's, with KV events and warm restart on)."""
        return self.inner.entries(slots)

    @override
    def ready(self, slots: np.ndarray, save_ids: np.ndarray) -> None:
        self.inner.ready(slots, save_ids)
        keys = self._index.keys_of(slots)
        rows = np.empty(len(slots), NEWS_READY_ROW)
        rows["slot"], rows["save_id"], rows["k1"], rows["k2"] = slots, save_ids, keys.k1, keys.k2
        self._ready.append(rows)

    @override
    def removed(self, slots: np.ndarray) -> None:
        self.inner.removed(slots)  # (called while the slots still hold their chunk)
        rows = np.empty(len(slots), NEWS_GONE_ROW)
        rows["slot"], rows["save_id"] = slots, self._index.save_ids(slots)
        self._gone.append(rows)

    @override
    def take_news(self, epoch: int) -> ChunkNews:
        if not (self._ready or self._gone):
            return ChunkNews(epoch)
        news = ChunkNews(epoch, b"".join(r.tobytes() for r in self._ready), b"".join(r.tobytes() for r in self._gone))
        self._ready, self._gone = [], []
        return news


class RankView:
    """The other DP ranks' READY chunks as this rank last heard of them (module doc). Entries are
    numbered by engine slot (``rank * rank_slots + slot``) and hold the owner's save id as the
    workers number it (``rank << RANK_SAVE_ID_SHIFT`` + the owner's own id). Single-threaded: it
    lives on the rank's scheduler thread."""

    def __init__(self, ranks: int, rank_slots: int, counters=None) -> None:
        self.rank_slots = rank_slots
        self.rank: int | None = None  # this half's DP rank, once the workers said it
        self.epoch = 0  # connector resets so far
        self.version = 0  # changes whenever an entry may have left (lookups memoised before are stale)
        n = ranks * rank_slots if ranks > 1 else 0
        # (k1, k2) -> engine slots holding that content (usually one; a content may be in several
        # ranks, or in two slots of one rank while the news of the older one's eviction is on its way)
        self._slots_of: dict[tuple[int, int], list[int]] = {}
        self._key: list[tuple[int, int] | None] = [None] * n
        self._save_id = np.full(n, -1, np.int64)  # engine save id of each entry's chunk; -1: none
        self._dead = np.full(n, -1, np.int64)  # highest engine save id heard gone, per slot

    def __len__(self) -> int:
        return len(self._slots_of)

    # ------------------------------------------------------------------ news
    def apply(self, news: dict[tuple[int, int], ChunkNews]) -> None:
        """The other ranks' news from one report (``OffloadWorkerReport.news``)."""
        if self.rank is None:
            return
        for (rank, _), part in sorted(news.items()):
            if rank != self.rank and part.epoch == self.epoch:
                self._gone(rank, np.frombuffer(part.gone, NEWS_GONE_ROW))
                self._ready(rank, np.frombuffer(part.ready, NEWS_READY_ROW))

    def _gone(self, rank: int, rows: np.ndarray) -> None:
        base, id_base = rank * self.rank_slots, rank << RANK_SAVE_ID_SHIFT
        for slot, save_id in zip((rows["slot"] + base).tolist(), (rows["save_id"] + id_base).tolist()):
            if save_id > self._dead[slot]:
                self._dead[slot] = save_id
            if self._save_id[slot] == save_id:
                self._forget(slot)

    def _ready(self, rank: int, rows: np.ndarray) -> None:
        base, id_base = rank * self.rank_slots, rank << RANK_SAVE_ID_SHIFT
        for slot, save_id, k1, k2 in zip((rows["slot"] + base).tolist(), (rows["save_id"] + id_base).tolist(),
                                         rows["k1"].tolist(), rows["k2"].tolist()):
            if save_id <= self._dead[slot] or save_id <= self._save_id[slot]:
                continue  # heard gone already, or older than what the entry holds
            if self._save_id[slot] >= 0:
                self._forget(slot)
            key = (k1, k2)
            self._slots_of.setdefault(key, []).append(slot)
            self._key[slot] = key
            self._save_id[slot] = save_id

    def _forget(self, slot: int) -> None:
        key = self._key[slot]
        slots = self._slots_of[key]
        slots.remove(slot)
        if not slots:
            del self._slots_of[key]
        self._key[slot] = None
        self._save_id[slot] = -1
        self.version += 1

    def reset(self) -> None:
        """A connector reset (every rank gets one): forget everything; news from before is ignored."""
        self._slots_of.clear()
        self._key = [None] * len(self._key)
        self._save_id[:] = -1
        self._dead[:] = -1
        self.epoch += 1
        self.version += 1

    # ------------------------------------------------------------------ lookups and failures
    def extend(self, index: "ChunkIndex", hashes: Sequence[bytes], start: int, stop: int,
               own: "SavedPrefix") -> "SavedPrefix":
        """The longest READY prefix of ``hashes[start:stop]`` from this rank's index (``own``, the
        index's answer from ``start``) and the view, block by block: the rank's own chunk where it
        has one, else another rank's, as a load names it (messages.py:LoadRequest)."""
        from tpuoffload.manager.index import SavedPrefix

        slots, ids = [own.slots], [own.save_ids]
        pos = start + len(own.slots)
        while pos < stop:
            theirs = self._run(index, hashes, pos, stop)
            if not len(theirs):
                break
            slots.append(theirs - self.rank * self.rank_slots)
            ids.append(self._save_id[theirs] - (self.rank << RANK_SAVE_ID_SHIFT))
            pos += len(theirs)
            mine = index.ready_prefix_saved(hashes, pos, stop)
            slots.append(mine.slots)
            ids.append(mine.save_ids)
            pos += len(mine.slots)
            if not len(mine.slots):
                break
        if len(slots) == 1:
            return own
        return SavedPrefix(np.concatenate(slots), np.concatenate(ids))

    def _run(self, index: "ChunkIndex", hashes: Sequence[bytes], start: int, stop: int) -> np.ndarray:
        """Engine slots of the view's chunks for ``hashes[start:]``, up to the first it lacks or
        the rank's own index holds (its own copy is preferred: no move across the batch axes)."""
        out = []
        for h in hashes[start:stop]:
            slot = self._newest(h)
            if slot < 0 or (out and index.ready_slot(h) >= 0):
                break
            out.append(slot)
        return np.array(out, dtype=np.int64)

    def _newest(self, key: bytes) -> int:
        """The engine slot of the newest chunk of ``key`` the view heard of (-1: none)."""
        k1, k2 = _TWO_WORDS(bytes(key[:16]).ljust(16, b"\0") if len(key) < 16 else key)
        slots = self._slots_of.get((k1 if k1 > 1 else 2, k2))
        return -1 if slots is None else slots[-1]

    def holds(self, key: bytes) -> bool:
        """Whether the view has a chunk of ``key`` (a chunk key: hash and KV cache group)."""
        return bool(self._slots_of) and self._newest(key) >= 0

    def named(self, keys: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per chunk key: whether the view has it, and its (slot, save id) as a load names them
        (offsets from this rank's range, messages.py:LoadRequest); the hit path of several KV cache
        groups (kv_groups.py:KVCacheGroups.find_hit), which looks each group's keys up at once."""
        if not self._slots_of or self.rank is None:
            n = len(keys)
            return np.zeros(n, bool), np.zeros(n, np.int64), np.full(n, -1, np.int64)
        engine = np.array([self._newest(k) for k in keys], dtype=np.int64)
        held = engine >= 0
        slots = np.where(held, engine - self.rank * self.rank_slots, 0)
        ids = np.where(held, self._save_id[np.maximum(engine, 0)] - (self.rank << RANK_SAVE_ID_SHIFT), -1)
        return held, slots, ids

    def discard(self, slot: int, save_id: int) -> bool:
        """A load of this chunk (named as a load names it) failed somewhere: forget it, so it is not
        offered again. False if the view does not hold it."""
        if self.rank is None:
            return False
        engine_slot = slot + self.rank * self.rank_slots
        if not 0 <= engine_slot < len(self._save_id) or \
                self._save_id[engine_slot] != save_id + (self.rank << RANK_SAVE_ID_SHIFT):
            return False
        self._dead[engine_slot] = max(self._dead[engine_slot], self._save_id[engine_slot])
        self._forget(engine_slot)
        return True
