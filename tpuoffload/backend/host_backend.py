"""Host-RAM backend: ``num_slots`` fixed slots, each holding this host's shard of one chunk.

Every slot remembers the save id of the chunk it holds (-1: empty or invalidated), so a load can
check that the slot still holds exactly the chunk the scheduler thinks it does; a slot that was
never written here, failed, or was overwritten is reported, never read as garbage.

One lock guards the structure (the tags) and every copy into or out of the storage, so concurrent
writers and readers never see a half-written slot (invariant 6). Ordering *between* writes to the
same slot is not this class's job: the transfer engine chains them (invariant 3).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

EMPTY = -1


class SlotMismatch(Exception):
    """A slot does not hold the chunk a load expected."""


class HostBackend:
    def __init__(self, capacity_bytes: int, slot_shape: tuple[int, ...], dtype) -> None:
        dtype = np.dtype(dtype)
        slot_bytes = int(np.prod(slot_shape)) * dtype.itemsize
        if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"cpu_bytes_to_use must be a positive int, got {capacity_bytes!r}")
        if slot_bytes <= 0:
            raise ValueError(f"slot_shape {slot_shape} holds no bytes")
        num_slots = capacity_bytes // slot_bytes
        if num_slots == 0:
            raise ValueError(
                f"cpu_bytes_to_use={capacity_bytes} is smaller than one chunk on this host ({slot_bytes} bytes)"
            )
        self.slot_shape = tuple(slot_shape)
        self.dtype = dtype
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        # Whole slots only: the allocation never exceeds the configured bytes.
        self._storage = np.zeros((num_slots, *slot_shape), dtype)
        self._tags = np.full(num_slots, EMPTY, np.int64)
        self._lock = threading.Lock()

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

    def write_rows(self, slots: Sequence[int], rows: np.ndarray, heads: slice = slice(None)) -> None:
        """Copy ``rows[i]`` into ``slots[i]``, optionally only a range of this host's heads (axis 2
        of a slot). The slots stay unloadable until ``commit``: call ``invalidate`` first when
        overwriting, so a reader never takes a half-written slot for a whole one."""
        idx = self._check_slots(slots)
        if rows.shape[0] != idx.size:
            raise ValueError(f"{rows.shape[0]} rows for {idx.size} slots")
        with self._lock:
            self._storage[idx, :, :, heads] = rows

    def commit(self, slots: Sequence[int], save_ids: Sequence[int]) -> None:
        """Declare the slots to hold the chunks ``save_ids`` (they become readable)."""
        idx = self._check_slots(slots)
        if len(save_ids) != idx.size:
            raise ValueError("slots and save_ids must have the same length")
        with self._lock:
            self._tags[idx] = save_ids

    def invalidate(self, slots: Sequence[int]) -> None:
        """Forget what the slots hold (a failed write must never be loadable)."""
        idx = self._check_slots(slots)
        with self._lock:
            self._tags[idx] = EMPTY

    def read(self, slots: Sequence[int], save_ids: Sequence[int], pad_to: int = 0) -> tuple[np.ndarray, list[int]]:
        """Copy the slots out into a new array the caller owns, with zero rows appended up to
        ``pad_to``. Returns ``(data, bad)``: ``bad`` lists the positions whose slot does not hold
        the expected save id; their rows are zeros."""
        idx = self._check_slots(slots)
        expected = np.asarray(save_ids, dtype=np.int64)
        if expected.shape != idx.shape:
            raise ValueError("slots and save_ids must have the same length")
        data = np.zeros((max(pad_to, idx.size), *self.slot_shape), self.dtype)
        with self._lock:
            np.take(self._storage, idx, axis=0, out=data[: idx.size])
            tags = self._tags[idx]
        # An empty/invalidated slot is never readable, even by a caller that "expects" EMPTY.
        bad = np.nonzero((tags != expected) | (tags == EMPTY))[0].tolist()
        if bad:
            data[bad] = 0
        return data, bad

    def num_used(self) -> int:
        """Slots holding a committed chunk."""
        with self._lock:
            return int(np.count_nonzero(self._tags != EMPTY))

    def tag(self, slot: int) -> int:
        self._check_slots([slot])
        with self._lock:
            return int(self._tags[slot])
