"""Host-RAM backend: ``num_slots`` fixed slots of ``slot_bytes`` each, this host's part of one chunk.

Every slot remembers the save id of the chunk it holds (-1: empty or invalidated) and the block it
was gathered from, so a load can check that the slot still holds exactly the chunk the scheduler
thinks it does, and that the bytes this host needs for the destination block are there (with
blocks split across hosts by data parallelism a host only holds its own blocks' bytes). A slot
that was never written here, failed, or was overwritten is reported, never read as garbage.

One lock guards the tags and every copy into or out of the storage, so concurrent writers and
readers never see a half-written slot (invariant 6). Ordering *between* writes to the same slot is
not this class's job: the transfer engine chains them (invariant 3).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from tpuoffload.layout import GroupLayout

EMPTY = -1


class HostBackend:
    def __init__(self, capacity_bytes: int, slot_bytes: int) -> None:
        if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"cpu_bytes_to_use must be a positive int, got {capacity_bytes!r}")
        if slot_bytes <= 0:
            raise ValueError(f"a slot must hold bytes, got slot_bytes={slot_bytes}")
        num_slots = capacity_bytes // slot_bytes
        if num_slots == 0:
            raise ValueError(
                f"cpu_bytes_to_use={capacity_bytes} is smaller than one chunk on this host ({slot_bytes} bytes)")
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        # Whole slots only: the allocation never exceeds the configured bytes.
        self._storage = np.zeros((num_slots, slot_bytes), np.uint8)
        self._tags = np.full(num_slots, EMPTY, np.int64)
        self._sources = np.zeros(num_slots, np.int64)  # block id each slot's chunk was gathered from
        self._lock = threading.Lock()  # guards _storage, _tags and _sources

    @property
    def nbytes(self) -> int:
        return self._storage.nbytes

    def _check_slots(self, slots: Sequence[int]) -> np.ndarray:
        idx = np.asarray(slots, dtype=np.int64)
        if idx.ndim != 1:
            raise ValueError("slots must be a flat sequence of ints")
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_slots):
            raise ValueError(f"slot out of range 0..{self.num_slots - 1}: {idx.tolist()}")
        return idx

    def write_tile(self, group: GroupLayout, slots: Sequence[int], tile: int, rows: np.ndarray) -> None:
        """Copy ``rows[i]`` (layers, *tile_shape) into tile ``tile`` of ``group`` in ``slots[i]``. The
        slots stay unloadable until ``commit``: call ``invalidate`` first when overwriting, so a
        reader never takes a half-written slot for a whole one."""
        idx = self._check_slots(slots)
        if rows.shape[0] != idx.size:
            raise ValueError(f"{rows.shape[0]} rows for {idx.size} slots")
        with self._lock:
            group.slot_view(self._storage)[idx, :, tile] = rows

    def read_tile(self, group: GroupLayout, slots: Sequence[int], tile: int, out: np.ndarray) -> None:
        """Copy tile ``tile`` of ``group`` from ``slots[i]`` into ``out[i]``."""
        idx = self._check_slots(slots)
        if out.shape[0] != idx.size:  # numpy would broadcast one slot into every row
            raise ValueError(f"{out.shape[0]} output rows for {idx.size} slots")
        with self._lock:
            out[...] = group.slot_view(self._storage)[idx, :, tile]

    def commit(self, slots: Sequence[int], save_ids: Sequence[int], source_blocks: Sequence[int]) -> None:
        """Declare the slots to hold the chunks ``save_ids``, gathered from ``source_blocks``."""
        idx = self._check_slots(slots)
        if not len(save_ids) == len(source_blocks) == idx.size:
            raise ValueError("slots, save_ids and source_blocks must have the same length")
        with self._lock:
            self._tags[idx] = save_ids
            self._sources[idx] = source_blocks

    def invalidate(self, slots: Sequence[int]) -> None:
        """Forget what the slots hold (a failed write must never be loadable)."""
        idx = self._check_slots(slots)
        with self._lock:
            self._tags[idx] = EMPTY

    def lookup(self, slots: Sequence[int], save_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """``(ok, source_blocks)``: ``ok[i]`` is True when ``slots[i]`` holds chunk ``save_ids[i]``."""
        idx = self._check_slots(slots)
        expected = np.asarray(save_ids, dtype=np.int64)
        if expected.shape != idx.shape:
            raise ValueError("slots and save_ids must have the same length")
        with self._lock:
            tags = self._tags[idx]
            sources = self._sources[idx]
        # An empty/invalidated slot is never readable, even by a caller that "expects" EMPTY.
        return (tags == expected) & (tags != EMPTY), sources

    def num_used(self) -> int:
        """Slots holding a committed chunk."""
        with self._lock:
            return int(np.count_nonzero(self._tags != EMPTY))

    def tag(self, slot: int) -> int:
        self._check_slots([slot])
        with self._lock:
            return int(self._tags[slot])
