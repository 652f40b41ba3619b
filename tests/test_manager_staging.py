"""tpuoffload/manager/staging.py: StagingBudget never exceeds its capacity; bad use raises."""

from __future__ import annotations

import random

import pytest

from tpuoffload.manager.staging import StagingBudget


def test_staging_budget_never_exceeds_capacity_and_refuses_whole():
    b = StagingBudget(100)
    assert b.try_reserve(60)
    assert not b.try_reserve(41) and b.in_use == 60  # refused whole, nothing taken
    assert b.try_reserve(40) and b.in_use == 100
    assert not b.try_reserve(1) and b.try_reserve(0)
    b.release(100)
    assert not b.try_reserve(101) and b.in_use == 0


def test_staging_budget_reserve_up_to_grants_what_fits():
    b = StagingBudget(100)
    assert b.reserve_up_to(3, 30) == 3 and b.in_use == 90
    assert b.reserve_up_to(5, 30) == 0 and b.in_use == 90  # 10 bytes left: not one unit
    assert b.reserve_up_to(5, 10) == 1 and b.in_use == 100
    b.release(40)
    assert b.reserve_up_to(0, 10) == 0 and b.reserve_up_to(10, 20) == 2 and b.in_use == 100
    with pytest.raises(ValueError):
        b.reserve_up_to(-1, 10)
    with pytest.raises(ValueError):
        b.reserve_up_to(1, 0)


def test_staging_budget_random_never_exceeds():
    rng = random.Random(1)
    b = StagingBudget(1000)
    held = []
    for _ in range(5000):
        if held and rng.random() < 0.45:
            b.release(held.pop(rng.randrange(len(held))))
        elif rng.random() < 0.5:
            n = rng.randrange(0, 400)
            before = b.in_use
            if b.try_reserve(n):
                held.append(n)
            else:
                assert before + n > 1000 and b.in_use == before
        else:
            unit, count = rng.randrange(1, 200), rng.randrange(0, 8)
            before = b.in_use
            k = b.reserve_up_to(count, unit)
            assert k == min(count, (1000 - before) // unit)
            held.extend([unit] * k)
        assert 0 <= b.in_use <= b.capacity and b.in_use == sum(held)


def test_staging_budget_release_errors():
    b = StagingBudget(10)
    b.try_reserve(5)
    for bad in (6, -1):
        with pytest.raises(ValueError):
            b.release(bad)
    with pytest.raises(ValueError):
        b.try_reserve(-1)
    assert b.in_use == 5


@pytest.mark.parametrize("cap", [0, -5, 1.0, None])
def test_staging_budget_bad_capacity_names_setting(cap):
    with pytest.raises(ValueError, match="staging_bytes"):
        StagingBudget(cap)
