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


# ---------------------------------------------------------------------------------------- ExtentLru
from tpuoffload.manager.recency import ExtentLru  # noqa: E402


class _ExtentModel:
    """ExtentLru's contract as lists: extents least recently used first, the open extents, and
    eviction extent by extent in slot order."""

    def __init__(self, first, n, e):
        self.first, self.n, self.e = first, n, e
        self.order: list[int] = []
        self.open: list[int] = []

    def slots(self, x):
        lo = self.first + x * self.e
        return list(range(lo, min(lo + self.e, self.first + self.n)))

    def touch(self, slots):
        for s in slots:
            x = (s - self.first) // self.e
            if x in self.order:
                self.order.remove(x)
            self.order.append(x)

    def victims(self, need, ok):
        out = []
        while need > 0:
            self.open = [x for x in self.open if x not in self.order]
            if not self.open:
                want, taken, met = -(-need // self.e), [], 0
                for x in self.order:
                    if len(taken) == want:
                        break
                    met += 1
                    if any(ok(s) for s in self.slots(x)):
                        taken.append(x)
                self.order = self.order[met:]
                self.open = taken
                if not taken:
                    break
            flat = [s for x in self.open for s in self.slots(x) if ok(s)][:need]
            out += flat
            need -= len(flat)
            if need == 0 and flat:
                last = (flat[-1] - self.first) // self.e
                self.open = self.open[self.open.index(last):]
            else:
                self.open = []
        return sorted(out)


def test_extent_lru_against_a_list_model():
    rng = random.Random(5)
    for first, n, e in ((0, 40, 4), (7, 37, 8), (3, 16, 1)):
        lru, model = ExtentLru(first, n, e), _ExtentModel(first, n, e)
        held = set(range(first, first + n))  # evictable slots (the rest: pinned, saving, free)
        for _ in range(3000):
            op = rng.random()
            if op < 0.4:
                slots = [rng.randrange(first, first + n) for _ in range(rng.randrange(1, 9))]
                lru.touch(np.array(slots))
                model.touch(slots)
                held.update(slots)  # a touch follows a confirmation or an unpin: evictable again
            elif op < 0.55:
                held -= {rng.randrange(first, first + n) for _ in range(rng.randrange(1, 5))}
            else:
                need = rng.randrange(1, 2 * e + 3)
                got = lru.victims(need, lambda s: np.isin(s, list(held)))
                want = model.victims(need, lambda s: s in held)
                assert got.tolist() == want
                held -= set(want)  # evicted: their slots take new chunks, saving
            live = set(lru._log.order().tolist())
            assert [x for x in model.order] == lru._log.order().tolist()
            assert [x for x in model.open if x not in live] == [x for x in lru._open.tolist() if x not in live]


def test_extent_lru_hands_out_whole_extents_in_runs_and_a_touch_saves_an_extent():
    lru = ExtentLru(0, 32, 8)
    lru.touch(np.arange(32))  # extents 0, 1, 2, 3 in that order
    lru.touch(np.array([3]))  # extent 0 recently used again
    taken: list[int] = []  # handed out: saving from then on, not evictable

    def victims(k):
        got = lru.victims(k, lambda s: ~np.isin(s, taken)).tolist()
        taken.extend(got)
        return got

    assert victims(12) == list(range(8, 20))  # extent 1, then half of extent 2
    assert victims(4) == list(range(20, 24))  # the open extent continues
    assert victims(9) == [0] + list(range(24, 32))  # extent 3, then extent 0 (handed out ascending)
    assert lru.order().tolist() == list(range(0, 8))  # extent 0 still open (its slots 1.. remain)
    lru.touch(np.array([0]))  # its new chunk confirmed: extent 0 is recently used, back in the order
    assert victims(3) == [1, 2, 3]  # the only extent in the order
    lru.touch(np.arange(8, 24))  # extents 1 and 2 confirmed: in the order, after extent 0
    assert victims(5) == [4, 5, 6, 7]  # extent 0's rest; 1 and 2 hold nothing evictable ...
    assert lru.order().tolist() == []  # ... so they left the order (a touch brings them back)
