"""A fixed pool of host slots, each able to hold one chunk (this host's share of one KV block)."""

from __future__ import annotations

import numpy as np

from tpuoffload.manager.kernels import kernels


class SlotPool:
    """Free list of slot numbers ``first .. first + num_slots - 1``, handed out and taken back in
    batches.

    Contract: ``take(n)`` returns up to ``n`` distinct slots that are not currently allocated
    (fewer only when the pool runs out; never blocks, never grows), lowest numbers first on a
    fresh pool. ``give`` of a slot that is not allocated, out of range, or listed twice raises:
    a double free is a bookkeeping bug that would hand one slot to two chunks.
    """

    def __init__(self, num_slots: int, first: int = 0) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots <= 0:
            raise ValueError(f"num_slots must be a positive int, got {num_slots!r}")
        self.num_slots = num_slots
        self.first = first
        self.stop = first + num_slots
        # A stack: free slots are _stack[:_top], the next one handed out is _stack[_top - 1].
        self._stack = np.arange(self.stop - 1, first - 1, -1, dtype=np.int64)
        self._top = num_slots
        self._allocated = np.zeros(self.stop, dtype=bool)  # indexed by slot number

    @property
    def num_free(self) -> int:
        return self._top

    def take(self, n: int) -> np.ndarray:
        k = min(max(n, 0), self._top)
        out = kernels().pool_take(self._stack, self._allocated, self._top, k)  # one compiled pass
        self._top -= k
        return out

    def free_stack(self) -> tuple[np.ndarray, np.ndarray, int]:
        """``(stack, allocated, top)`` for a compiled loop that takes slots exactly as ``take`` does
        (kernels.py ``_pool_take``, inside a larger call); it must report how many with ``took``."""
        return self._stack, self._allocated, self._top

    def took(self, k: int) -> None:
        """A compiled loop took the top ``k`` slots of ``free_stack()`` (and marked them allocated)."""
        if not 0 <= k <= self._top:
            raise ValueError(f"took {k} slots with {self._top} free")
        self._top -= k

    def give(self, slots: np.ndarray) -> None:
        slots = np.asarray(slots, dtype=np.int64)
        k = len(slots)
        if not k:
            return
        if slots.min() < self.first or slots.max() >= self.stop:
            bad = (slots < self.first) | (slots >= self.stop)
            raise ValueError(f"slots out of range {self.first}..{self.stop - 1}: {slots[bad][:8]}")
        if not self._allocated[slots].all():
            raise ValueError(f"slots not allocated: {slots[~self._allocated[slots]][:8]}")
        if k > 1 and len(np.unique(slots)) != k:
            raise ValueError("a slot is freed twice in one batch")
        self._allocated[slots] = False
        self._stack[self._top:self._top + k] = slots[::-1]
        self._top += k

    def take_these(self, slots: np.ndarray) -> None:
        """Allocate exactly ``slots`` (free, distinct), e.g. the slots of restored chunks. O(num_slots)."""
        slots = np.asarray(slots, dtype=np.int64)
        if not len(slots):
            return
        if slots.min() < self.first or slots.max() >= self.stop:
            raise ValueError(f"take_these: slots out of range {self.first}..{self.stop - 1}")
        if self._allocated[slots].any() or len(np.unique(slots)) != len(slots):
            raise ValueError("take_these: a slot is allocated already or listed twice")
        self._allocated[slots] = True
        free = self._stack[:self._top]
        keep = free[~self._allocated[free]]
        self._stack[:len(keep)] = keep
        self._top = len(keep)
