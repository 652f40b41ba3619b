"""tpuoffload/manager/recency.py: RecencyLog keeps LRU order, checked against a list."""

from __future__ import annotations

import random

import numpy as np

from tpuoffload.manager.recency import RecencyLog


def test_recency_log_against_a_list_with_compaction():
    rng = random.Random(2)
    n = 16
    log = RecencyLog(n)
    model: list[int] = []  # least recently used first
    pinned: set[int] = set()
    for _ in range(4000):
        op = rng.random()
        if op < 0.45:
            slots = [rng.randrange(n) for _ in range(rng.randrange(1, 6))]
            log.touch(np.array(slots))
            for s in slots:
                if s in model:
                    model.remove(s)
                model.append(s)
        elif op < 0.55:
            slots = [rng.randrange(n) for _ in range(rng.randrange(1, 4))]
            log.forget(np.array(slots))
            model = [s for s in model if s not in slots]
        elif op < 0.65:
            pinned = {rng.randrange(n) for _ in range(rng.randrange(0, 4))}
        else:
            k = rng.randrange(0, 5)
            got = log.pop_oldest(k, lambda s: np.array([x not in pinned for x in s.tolist()], dtype=bool))
            want = [s for s in model if s not in pinned][:k]
            assert got.tolist() == want
            if k:
                # Everything met up to the last slot taken leaves the order: taken, or (pinned)
                # dropped until whoever pinned it touches it again.
                model = model[model.index(want[-1]) + 1:] if len(want) == k else []
        assert log.order().tolist() == model
    assert log._logged <= 2 * n + 4096 + 8  # compaction keeps the log bounded
