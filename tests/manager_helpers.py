"""Helpers shared by the tests of the scheduler half's parts (tests/test_manager_*.py)."""

from __future__ import annotations

import numpy as np

from tpuoffload.manager.hash_table import HashKeys
from tpuoffload.manager.index import ChunkIndex


def h(i: int) -> bytes:
    return i.to_bytes(8, "big")


def arr(*xs) -> np.ndarray:
    return np.array(xs, dtype=np.int64)


def save(index: ChunkIndex, hashes, first_id: int) -> np.ndarray:
    slots = index.allocate(len(hashes))
    index.add_saving(HashKeys.of(list(hashes[:len(slots)])), slots, first_id)
    return slots


def ready(index: ChunkIndex, hashes, first_id: int = 0) -> np.ndarray:
    slots = save(index, hashes, first_id)
    assert index.mark_ready(slots, index.save_ids(slots)) == len(slots)
    return slots
