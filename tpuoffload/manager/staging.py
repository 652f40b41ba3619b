"""Byte budget for saves in flight (device-to-host transfers not yet resolved by every host)."""

from __future__ import annotations


class StagingBudget:
    """Reserve and release bytes against a fixed capacity; nothing here ever blocks.

    Contract: ``in_use`` never exceeds ``capacity`` (invariant 10). A reservation that does not
    fit is refused whole (``try_reserve`` returns False and takes nothing); ``reserve_up_to``
    grants the largest whole number of units that fits and says how many (``room`` says it
    first). The caller spends only what it was granted and counts the rest as skipped.
    """

    def __init__(self, capacity_bytes: int) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"staging_bytes (staging capacity) must be a positive int, got {capacity_bytes!r}")
        self.capacity = capacity_bytes
        self.in_use = 0

    @property
    def available(self) -> int:
        return self.capacity - self.in_use

    def try_reserve(self, nbytes: int) -> bool:
        if nbytes < 0:
            raise ValueError(f"cannot reserve {nbytes} bytes")
        if self.in_use + nbytes > self.capacity:
            return False
        self.in_use += nbytes
        return True

    def room(self, unit: int) -> int:
        """How many units of ``unit`` bytes ``reserve_up_to`` would grant now (nothing reserved)."""
        if unit <= 0:
            raise ValueError(f"unit must be positive, got {unit}")
        return self.available // unit

    def reserve_up_to(self, count: int, unit: int) -> int:
        """Reserve ``k * unit`` bytes for the largest ``k <= count`` that fits; returns ``k``."""
        if count < 0 or unit <= 0:
            raise ValueError(f"cannot reserve {count} units of {unit} bytes")
        k = min(count, self.available // unit)
        self.in_use += k * unit
        return k

    def release(self, nbytes: int) -> None:
        if nbytes < 0 or nbytes > self.in_use:
            raise ValueError(f"cannot release {nbytes} bytes with {self.in_use} in use")
        self.in_use -= nbytes
