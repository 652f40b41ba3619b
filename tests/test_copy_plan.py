"""worker/copy_plan.py: the copy structure of a plan's rows (runs of consecutive slots,
power-of-two copies and counts, covering copies where a copy costs more than the rows it moves
twice). The engine's byte-exact round trips with these plans are in test_transfer_engine.py."""

from __future__ import annotations

import numpy as np
import pytest

from tpuoffload.worker.copy_plan import copy_plan, copy_rows


def moved(slots, plan) -> np.ndarray:
    """The slot each program row moves."""
    n = len(slots)
    return np.asarray(slots, np.int64)[np.arange(n) if plan.order is None else plan.order]


def check_plan(slots, plan) -> None:
    """The structure's contract: every copy is ``width`` consecutive ascending slots of the plan;
    the rows not marked repeated move every plan row exactly once; widths descend and counts are
    powers of two."""
    n = len(slots)
    rows = copy_rows(plan.copies)
    order = np.arange(n) if plan.order is None else plan.order
    repeats = np.zeros(rows, bool) if plan.repeats is None else plan.repeats
    assert len(order) == rows == len(repeats)
    assert sorted(order[~repeats].tolist()) == list(range(n)), (slots, plan)
    widths = [w for w, _ in plan.copies]
    assert widths == sorted(widths, reverse=True) and all(c & (c - 1) == 0 for _, c in plan.copies)
    ss, at = moved(slots, plan), 0
    for w, c in plan.copies:
        for _ in range(c):
            assert (ss[at:at + w] == ss[at] + np.arange(w)).all(), (slots, plan)
            at += w


@pytest.mark.parametrize("slots,copies", [
    (list(range(26)), ((16, 1), (8, 1), (2, 1))),  # one run, no power of two: 3 copies, no padding
    (list(range(25, -1, -1)), ((16, 1), (8, 1), (2, 1))),  # the same run descending
    ([30, 31, 0, 1, 2, 3, 4, 5], ((4, 1), (2, 2))),  # wraps: runs 0..5 and 30..31
    ([9, 8, 7, 1, 2, 3], ((2, 2), (1, 2))),  # a descending and an ascending run of 3
    ([3, 3, 4, 5], ((2, 1), (1, 2))),  # a slot read twice (a load) breaks the run
    ([7, 3, 11, 0, 30], ((1, 8),)),  # scattered: 5 copies of one, padded to 8
    ([6], ((1, 1),)), ([], ()),
])
def test_copy_plan_examples(slots, copies):
    plan = copy_plan(slots)
    assert plan.copies == copies
    check_plan(slots, plan)


def runs_of(lengths, gap=3, start=5) -> list[int]:
    out, base = [], start
    for length in lengths:
        out += list(range(base, base + length))
        base += length + gap
    return out


@pytest.mark.parametrize("slots,cost,copies,repeated", [
    # 23 = 16 + 4 + 2 + 1; at 2 rows per copy, 16 + 8 with the 8 reaching back one slot.
    (list(range(23)), 2, ((16, 1), (8, 1)), [15]),
    (list(range(23)), 0.5, ((16, 1), (4, 1), (2, 1), (1, 1)), []),  # a copy is worth less than a row
    (list(range(26)), 8, ((16, 2),), list(range(10, 16))),  # 26: 16 + 16, six slots twice
    (list(range(26)), 5, ((16, 1), (8, 1), (2, 1)), []),  # ... not worth 6 rows at 5 per copy
    (list(range(40, 17, -1)), 2, ((16, 1), (8, 1)), [33]),  # the descending run of 23 (slots 18..40)
    # Seven runs of 4: a count of 7 repeats its last copy (one copy and 4 rows) where a copy
    # costs at least 2 rows; at 0 it splits three copies into six of 2, then two into four of 1.
    (runs_of([4] * 7), 2, ((4, 8),), runs_of([4] * 7)[-4:]),
    (runs_of([4] * 7), 0, ((4, 4), (2, 4), (1, 4)), []),
])
def test_covering_copies_examples(slots, cost, copies, repeated):
    """Covering copies and repeated copies: the structure, and which slots a second row moves."""
    plan = copy_plan(slots, cost)
    check_plan(slots, plan)
    assert plan.copies == copies
    twice = [] if plan.repeats is None else sorted(moved(slots, plan)[plan.repeats].tolist())
    assert twice == sorted(repeated)


def random_slots(rng, trial: int) -> list[int]:
    """Runs of random lengths in either direction, shuffled, some slots listed twice."""
    runs, base = [], 0
    for _ in range(int(rng.integers(1, 12))):
        length = int(rng.integers(1, 40))
        base += int(rng.integers(1, 30))
        run = list(range(base, base + length))
        runs.append(run[::-1] if rng.random() < 0.5 else run)
        base += length
    order = rng.permutation(len(runs))
    slots = [s for k in order for s in runs[k]]
    if trial % 5 == 0:
        slots += [slots[0]]  # a load may read one slot twice
    return slots


@pytest.mark.parametrize("cost", [0, 0.5, 2, 8, 64])
def test_copy_plan_contract_on_random_plans(cost):
    """Random plans at every copy cost keep the contract (``check_plan``); a list and an array of
    the same slots give the same plan (the same programs on every host). Without covering
    (cost 0) nothing but width-1 padding at the end repeats, under half the plan."""
    rng = np.random.default_rng(int(cost * 10))
    for trial in range(300):
        slots = random_slots(rng, trial)
        n = len(slots)
        plan = copy_plan(slots, cost)
        check_plan(slots, plan)
        again = copy_plan(np.asarray(slots, np.int32), cost)
        assert again.copies == plan.copies
        for a, b in ((plan.order, again.order), (plan.repeats, again.repeats)):
            assert (a is None and b is None) or np.array_equal(a, b)
        if cost == 0:
            rows = copy_rows(plan.copies)
            assert rows - n < max(1, n // 2)
            assert plan.repeats is None or not plan.repeats[:n].any()


def test_covering_copies_never_cost_more_than_they_save():
    """Over the model the plan optimises (``cost`` per copy plus one per row), covering never
    makes a single run dearer than its set bits, and on runs of mixed lengths it issues fewer
    copies."""
    for cost in (0.5, 2, 8):
        for length in range(1, 300):
            plain, cover = copy_plan(range(length)), copy_plan(range(length), cost)
            price = [sum(c for _, c in p.copies) * cost + copy_rows(p.copies) for p in (plain, cover)]
            assert price[1] <= price[0], (length, cost)
    slots = runs_of([23, 31, 15, 27, 7, 29, 19, 30])
    assert sum(c for _, c in copy_plan(slots, 4).copies) < sum(c for _, c in copy_plan(slots).copies)
