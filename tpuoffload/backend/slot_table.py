"""Host-RAM slot table: what each of this host's ``num_slots`` slots holds.

The bytes live in the pinned host-memory store the transfer engine's programs write and read
(tpuoffload/worker/programs.py); this table is the host's own record of them. Every slot remembers
the save id of the chunk it holds (-1: empty or invalidated) and the block it was gathered from,
so a load can check that the slot still holds exactly the chunk the scheduler thinks it does, and
that the bytes this host needs for the destination block are there (with blocks split across
hosts by data parallelism a host only holds its own blocks' bytes). A slot that was never written
here, failed, or was overwritten is reported, never read as data.

Capacity is exact: ``rows = capacity_bytes // slot_bytes`` whole slot rows on every device, where
``slot_bytes`` is what one row of every local device takes in this host's memory (replicas
included). With the blocks split over ``shards`` batch shards (data parallelism), each device's
rows hold only its own shard's chunks: slot ``s`` is row ``s % shard_slots`` of shard ``s //
shard_slots``, so the host keeps ``shards * shard_slots`` slots in the same bytes, and each device
keeps ``SHARD_SPARE_ROWS`` rows for the copies of other shards' rows (worker/programs.py).

One lock guards the table (invariant 6): background threads commit and invalidate while the
engine's main thread looks slots up.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

EMPTY_SLOT = -1  # the save id of an empty or invalidated slot (also in checkpoints)

#: With the blocks split over batch shards (a DP rank's blocks are one shard), each device keeps this
#: many rows past its shard's slots, into which a save's copies of another shard's rows go
#: (worker/programs.py): a DP rank plans over a device's slot rows less these. It bounds the widest
#: copy such a save makes.
SHARD_SPARE_ROWS = 16


def shard_slots(rows: int, shards: int) -> int:
    """The slots of one batch shard when every device keeps ``rows`` slot rows."""
    return rows if shards == 1 else rows - SHARD_SPARE_ROWS


class SlotTable:
    """Which chunk each host slot holds: per slot its save id and the block it was saved from,
    committed by the engine's background completions and looked up by the main thread. One lock
    (``_lock``) around the table (invariant 6); the bytes themselves live in the programs'
    stores. With several batch shards slot ``s`` is row ``s % shard_slots`` of shard ``s //
    shard_slots``."""

    def __init__(self, capacity_bytes: int, slot_bytes: int, shards: int = 1) -> None:
        if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"cpu_bytes_to_use must be a positive int, got {capacity_bytes!r}")
        if slot_bytes <= 0:
            raise ValueError(f"a slot must hold bytes, got slot_bytes={slot_bytes}")
        rows = capacity_bytes // slot_bytes
        if rows == 0:
            raise ValueError(
                f"cpu_bytes_to_use={capacity_bytes} is smaller than one chunk on this host ({slot_bytes} bytes)")
        if shard_slots(rows, shards) <= 0:
            raise ValueError(f"cpu_bytes_to_use={capacity_bytes} holds {rows} slot rows of {slot_bytes} bytes on this "
                             f"host; with {shards} batch shards each device keeps {SHARD_SPARE_ROWS} spare rows: "
                             "give it more")
        self.slot_bytes = slot_bytes
        self.rows = rows  # slot rows on every device (the store's length)
        self.shards = shards  # batch shards the blocks are split over
        self.shard_slots = shard_slots(rows, shards)  # slots of one batch shard (its devices' first rows)
        self.num_slots = num_slots = shards * self.shard_slots
        self._tags = np.full(num_slots, EMPTY_SLOT, np.int64)
        self._sources = np.zeros(num_slots, np.int64)  # block id each slot's chunk was gathered from
        # Per batch shard: save ids below it were revoked by a connector reset, never committed again
        # (a DP rank numbers its saves in its own range, so each shard has its own floor).
        self._floor = np.zeros(shards, np.int64)
        self._lock = threading.Lock()  # guards _tags, _sources and _floor

    @property
    def nbytes(self) -> int:
        """Host memory the slots take (whole slots only: never more than the configured bytes)."""
        return self.rows * self.slot_bytes

    def check_slots(self, slots: Sequence[int]) -> np.ndarray:
        idx = np.asarray(slots, dtype=np.int64)
        if idx.ndim != 1:
            raise ValueError("slots must be a flat sequence of ints")
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_slots):
            raise ValueError(f"slot out of range 0..{self.num_slots - 1}: {idx.tolist()}")
        return idx

    def commit(self, slots: Sequence[int], save_ids: Sequence[int], source_blocks: Sequence[int]) -> None:
        """Declare the slots to hold the chunks ``save_ids``, gathered from ``source_blocks``."""
        idx = self.check_slots(slots)
        if not len(save_ids) == len(source_blocks) == idx.size:
            raise ValueError("slots, save_ids and source_blocks must have the same length")
        ids = np.asarray(save_ids, dtype=np.int64)
        with self._lock:
            # A save issued before a reset lands as nothing: its chunk must never be read again.
            self._tags[idx] = np.where(ids >= self._floor[idx // self.shard_slots], ids, EMPTY_SLOT)
            self._sources[idx] = source_blocks

    def invalidate(self, slots: Sequence[int]) -> None:
        """Forget what the slots hold (a failed write must never be loadable)."""
        idx = self.check_slots(slots)
        with self._lock:
            self._tags[idx] = EMPTY_SLOT

    def lookup(self, slots: Sequence[int], save_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """``(ok, source_blocks)``: ``ok[i]`` is True when ``slots[i]`` holds chunk ``save_ids[i]``."""
        idx = self.check_slots(slots)
        expected = np.asarray(save_ids, dtype=np.int64)
        if expected.shape != idx.shape:
            raise ValueError("slots and save_ids must have the same length")
        with self._lock:
            tags = self._tags[idx]
            sources = self._sources[idx]
        # An empty/invalidated slot is never readable, even by a caller that "expects" EMPTY_SLOT.
        return (tags == expected) & (tags != EMPTY_SLOT), sources

    def num_used(self) -> int:
        """Slots holding a committed chunk."""
        with self._lock:
            return int(np.count_nonzero(self._tags != EMPTY_SLOT))

    def tag(self, slot: int) -> int:
        self.check_slots([slot])
        with self._lock:
            return int(self._tags[slot])

    def revoke_below(self, save_id: int, shard: int | None = None) -> None:
        """A connector reset: forget every chunk held, and never commit a save id below
        ``save_id`` (the saves still in flight), so nothing from before the reset is read again,
        nor written into a later checkpoint. ``shard``: only that batch shard's slots and saves
        (a DP rank's reset, ``save_id`` in the engine's numbering); None: every shard."""
        part = slice(None) if shard is None else slice(shard * self.shard_slots, (shard + 1) * self.shard_slots)
        with self._lock:
            self._floor[part] = np.maximum(self._floor[part], save_id)
            self._tags[part] = EMPTY_SLOT

    def table(self) -> tuple[np.ndarray, np.ndarray]:
        """Copies of (tags, source blocks), for a checkpoint."""
        with self._lock:
            return self._tags.copy(), self._sources.copy()

    def restore(self, tags: np.ndarray, sources: np.ndarray) -> None:
        """Replace the table (warm restart, before the first step)."""
        if tags.shape != (self.num_slots,) or sources.shape != (self.num_slots,):
            raise ValueError(f"a restored table must have {self.num_slots} rows")
        with self._lock:
            self._tags[:] = tags
            self._sources[:] = sources
