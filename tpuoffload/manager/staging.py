"""Byte budget for saves in flight (device-to-host transfers not yet confirmed by every host)."""

from __future__ import annotations


class StagingBudget:
    """Reserve and release bytes against a fixed capacity; ``try_reserve`` never blocks.

    Contract: ``in_use`` never exceeds ``capacity``; a reservation that does not fit is refused
    whole (the caller shrinks or skips the save and counts it).
    """

    def __init__(self, capacity_bytes: int) -> None:
        if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"staging_bytes (staging capacity) must be a positive int, got {capacity_bytes!r}")
        self.capacity = capacity_bytes
        self.in_use = 0

    def try_reserve(self, nbytes: int) -> bool:
        if nbytes < 0:
            raise ValueError(f"cannot reserve {nbytes} bytes")
        if self.in_use + nbytes > self.capacity:
            return False
        self.in_use += nbytes
        return True

    def release(self, nbytes: int) -> None:
        if nbytes < 0 or nbytes > self.in_use:
            raise ValueError(f"cannot release {nbytes} bytes with {self.in_use} in use")
        self.in_use -= nbytes
