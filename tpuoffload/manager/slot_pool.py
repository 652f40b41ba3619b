"""A fixed pool of host slots, each able to hold one chunk (this host's shard of one KV block)."""

from __future__ import annotations

from collections import deque


class SlotPool:
    """Free list of slot numbers ``0 .. num_slots - 1``.

    Contract: ``allocate`` returns a slot that is not currently allocated, or ``None`` when every
    slot is taken (never blocks, never grows). ``free`` of a slot that is not allocated raises:
    a double free is a bookkeeping bug that would hand one slot to two chunks.
    """

    def __init__(self, num_slots: int) -> None:
        if not isinstance(num_slots, int) or num_slots <= 0:
            raise ValueError(f"num_slots must be a positive int, got {num_slots!r}")
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))
        self._allocated = bytearray(num_slots)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        if not self._free:
            return None
        slot = self._free.popleft()
        self._allocated[slot] = 1
        return slot

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or not self._allocated[slot]:
            raise ValueError(f"slot {slot} is not allocated")
        self._allocated[slot] = 0
        self._free.append(slot)
