"""tpuoffload/manager/slot_pool.py: SlotPool hands out each slot once, lowest first, and refuses bad frees."""

from __future__ import annotations

import pytest

from tpuoffload.manager.slot_pool import SlotPool

from manager_helpers import arr


def test_slot_pool_hands_out_each_slot_once_lowest_first_then_nothing():
    pool = SlotPool(5)
    assert pool.take(3).tolist() == [0, 1, 2]
    assert pool.take(9).tolist() == [3, 4]
    assert pool.num_free == 0
    assert pool.take(1).tolist() == [] and pool.take(0).tolist() == []
    pool.give(arr(3, 1))
    assert pool.num_free == 2
    assert sorted(pool.take(5).tolist()) == [1, 3]


def test_slot_pool_bad_frees_raise_and_change_nothing():
    pool = SlotPool(4)
    got = pool.take(2)
    pool.give(got[:1])
    for bad in (got[:1], arr(3), arr(-1), arr(4), arr(1, 1)):
        with pytest.raises(ValueError):
            pool.give(bad)
    assert pool.num_free == 3
    assert sorted(pool.take(4).tolist()) == [0, 2, 3]


@pytest.mark.parametrize("size", [0, -1, 1.5, "4", None, True])
def test_slot_pool_bad_size(size):
    with pytest.raises(ValueError, match="num_slots"):
        SlotPool(size)
