"""tpuoffload/messages.py: save-id ranges, their union merge, and compact slot lists."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tpuoffload.messages import OffloadWorkerReport, compact_ints, id_ranges, merge_ranges


def test_id_ranges_and_merge():
    assert id_ranges([]) == ()
    assert id_ranges([5, 3, 4, 9, 3, 11, 10]) == ((3, 6), (9, 12))
    assert merge_ranges(((0, 2), (5, 6)), ((1, 3), (6, 8), (10, 11))) == ((0, 3), (5, 8), (10, 11))
    a = OffloadWorkerReport.from_host(0, [1, 2, 3], [7])
    b = OffloadWorkerReport.from_host(1, [1, 2, 3])
    assert a.aggregate(a).saved == a.saved  # idempotent
    ab = a.aggregate(b)
    assert ab.saved == b.aggregate(a).saved == {(0, 0): ((1, 4),), (0, 1): ((1, 4),)}  # two hosts stay two
    assert len(ab) == 7 and ab.failed == {(0, 0): ((7, 8),)}
    assert not OffloadWorkerReport.from_host(0)  # empty: vLLM drops it
    # The same save ids planned by another scheduler half (a DP rank) stay apart, and each half
    # reads only its own.
    other = ab.aggregate(OffloadWorkerReport.from_host(1, [1, 2], source=7))
    assert sorted(other.outcomes(0)) == [(0, ((1, 4),), ((7, 8),)), (1, ((1, 4),), ())]
    assert list(other.outcomes(7)) == [(1, ((1, 3),), ())]


@pytest.mark.parametrize("seed", range(3))
def test_compact_ints_is_the_same_sequence(seed):
    """Slots travel as a range when consecutive (either direction), else as a tuple; always the
    same values in the same order."""
    rng = random.Random(seed)
    cases = [[5], [3, 4, 5], [9, 8, 7, 6], [0, 2], [4, 3, 5], [1, 1], [7, 6, 5, 6]]
    for _ in range(200):
        n, a = rng.randrange(1, 9), rng.randrange(0, 50)
        run = list(range(a, a + n)) if rng.random() < 0.5 else list(range(a + n, a, -1))
        if rng.random() < 0.4:
            run[rng.randrange(n)] += rng.choice([-2, -1, 1, 2])
        cases.append(run)
    for case in cases:
        got = compact_ints(np.array(case, dtype=np.int64))
        assert list(got) == case
        consecutive = len(case) > 1 and all(b - a == case[1] - case[0] for a, b in zip(case, case[1:])) \
            and abs(case[1] - case[0]) == 1
        assert isinstance(got, range) == consecutive, case
