"""tpuoffload/manager/ledger.py: CompletionLedger, READY only after every host confirmed; odd reports
staged or counted; randomized against a reference model."""

from __future__ import annotations

import logging
import random
from collections import Counter

import numpy as np
import pytest

from tpuoffload import counters as C
from tpuoffload.messages import id_ranges
from tpuoffload.manager.ledger import CompletionLedger

from manager_helpers import arr


def resolved(led: CompletionLedger) -> tuple[list[int], list[int]]:
    r = led.take_resolved()
    return r.ready_ids.tolist(), r.dropped_ids.tolist()


def test_ledger_ready_only_after_every_host():
    led = CompletionLedger(3)
    assert led.open_batch(arr(7, 8), deadline=100.0, step=0) == 0
    led.report(0, ok=[(0, 2)])
    led.report(2, ok=[(0, 2)])
    assert resolved(led) == ([], []) and len(led) == 2
    led.report(1, ok=[(1, 2)])
    r = led.take_resolved()
    assert r.ready_ids.tolist() == [1] and r.ready_slots.tolist() == [8]
    assert len(led) == 1 and led.counters[C.LEDGER_CONFIRMED] == 1


def test_ledger_failure_resolves_at_once_and_later_reports_are_late():
    led = CompletionLedger(4)
    led.open_batch(arr(0), 100.0, 0)
    led.report(1, ok=[(0, 1)])
    led.report(3, failed=[(0, 1)])
    assert resolved(led) == ([], [0]) and len(led) == 0
    led.report(0, ok=[(0, 1)])
    led.report(2, ok=[(0, 1)])
    assert resolved(led) == ([], [])
    assert led.counters[C.LEDGER_LATE] == 2 and led.counters[C.LEDGER_FAILED] == 1


def test_ledger_duplicates_counted_never_as_another_host():
    led = CompletionLedger(2)
    led.open_batch(arr(0, 1, 2), 100.0, 0)
    led.report(0, ok=[(0, 3)])
    led.report(0, ok=[(0, 3)])  # a report merged twice
    assert led.counters[C.LEDGER_DUPLICATE] == 3 and len(led) == 3
    led.report(1, ok=[(0, 3)])
    assert resolved(led) == ([2, 1, 0], [])  # newest first


def test_ledger_early_reports_staged_and_replayed_when_their_batch_opens():
    led = CompletionLedger(2)
    led.open_batch(arr(0), 100.0, 0)  # id 0
    led.report(0, ok=[(5, 7)])  # ids 5, 6 not handed out yet
    led.report(1, ok=[(5, 6)], failed=[(6, 7)])
    assert led.counters[C.LEDGER_EARLY] == 4
    assert led.open_batch(arr(1, 2, 3, 4), 100.0, 1) == 1  # ids 1..4
    assert resolved(led) == ([], [])
    assert led.open_batch(arr(5, 6), 100.0, 2) == 5
    assert resolved(led) == ([5], [6]) and len(led) == 5


def test_ledger_early_staging_is_bounded():
    led = CompletionLedger(1, max_early=4)
    for sid in range(10, 20):
        led.report(0, ok=[(sid, sid + 1)])
    assert led.counters[C.LEDGER_UNKNOWN] == 6
    led.open_batch(np.arange(20), 1.0, 0)
    assert sorted(resolved(led)[0]) == [16, 17, 18, 19]


def test_ledger_unknown_host_counted_and_logged_once(caplog):
    led = CompletionLedger(2, source="test")
    led.open_batch(arr(0), 100.0, 0)
    with caplog.at_level(logging.ERROR, logger="tpuoffload.manager.ledger"):
        led.report(2, ok=[(0, 1)])
        led.report(2, failed=[(0, 1)])  # a failure from an unknown host does not fail it
        led.report(-1, ok=[(0, 1)])
    assert led.counters[C.LEDGER_UNKNOWN_HOST] == 3 and len(led) == 1
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2 and "host 2" in errors[0].getMessage() and "num_hosts" in errors[0].getMessage()
    led.report(0, ok=[(0, 1)])
    led.report(1, ok=[(0, 1)])
    assert resolved(led) == ([0], [])


def test_ledger_expires_oldest_batches_only():
    led = CompletionLedger(2)
    for i, dl in enumerate((1.0, 2.0, 3.0)):
        led.open_batch(arr(2 * i, 2 * i + 1), dl, i)  # ids 2i, 2i+1
    led.report(0, ok=[(2, 4)])
    led.report(1, ok=[(2, 3)])  # id 2 READY; id 3 half confirmed
    assert led.oldest_deadline() == 1.0
    assert led.expire(0.5) == 0
    assert led.expire(2.0) == 3  # ids 0, 1, 3
    assert resolved(led) == ([2], [0, 1, 3])
    assert led.expire(100.0) == 2 and led.oldest_deadline() is None and resolved(led) == ([], [4, 5])
    assert led.counters[C.LEDGER_EXPIRED] == 5
    led.report(1, ok=[(3, 4)])
    assert led.counters[C.LEDGER_LATE] == 1 and resolved(led) == ([], [])


def test_ledger_reports_missing_hosts_within_a_few_steps(caplog):
    led = CompletionLedger(8, source="world_size 8", mismatch_steps=3)
    led.open_batch(arr(0, 1), 100.0, step=0)
    led.report(0, ok=[(0, 2)])
    with caplog.at_level(logging.ERROR, logger="tpuoffload.manager.ledger"):
        assert led.check_reporters(2) is None  # not old enough yet
        msg = led.check_reporters(3)
        assert led.check_reporters(4) is None  # once
    assert msg and "8 reporting workers" in msg and "[1, 2, 3, 4, 5, 6, 7]" in msg and "num_hosts" in msg
    assert led.counters[C.REPORTERS_MISSING] == 1
    assert any(r.levelno == logging.ERROR for r in caplog.records)


def test_ledger_no_missing_report_when_every_host_reports_or_none_yet():
    led = CompletionLedger(2, mismatch_steps=1)
    led.open_batch(arr(0), 100.0, step=0)
    assert led.check_reporters(5) is None  # nobody confirmed anything yet: no evidence
    led.report(0, ok=[(0, 1)])
    led.report(1, ok=[(0, 1)])
    led.open_batch(arr(1), 100.0, step=6)
    led.report(0, ok=[(1, 2)])
    assert led.check_reporters(20) is None and not led.counters[C.REPORTERS_MISSING]


@pytest.mark.parametrize("n", [0, -1, 1.5, None, True])
def test_ledger_bad_num_hosts(n):
    with pytest.raises(ValueError, match="num_hosts"):
        CompletionLedger(n)


class LedgerModel:
    """Reference ledger, one save id at a time."""

    def __init__(self, num_hosts):
        self.num_hosts = num_hosts
        self.next_id = 0
        self.pending: dict[int, tuple[float, set[int]]] = {}
        self.early: list[tuple[int, bool, int]] = []
        self.ready: list[int] = []
        self.dropped: list[int] = []
        self.counters = Counter()

    def open(self, n, deadline):
        base = self.next_id
        self.next_id += n
        for i in range(base, base + n):
            self.pending[i] = (deadline, set())
        staged, self.early = self.early, []
        for host, ok, i in staged:
            if base <= i < base + n:
                self.one(host, i, ok)
            else:
                self.early.append((host, ok, i))
        return base

    def one(self, host, i, ok):
        if not 0 <= host < self.num_hosts:
            self.counters[C.LEDGER_UNKNOWN_HOST] += 1
        elif i >= self.next_id:
            self.counters[C.LEDGER_EARLY] += 1
            self.early.append((host, ok, i))
        elif i not in self.pending:
            self.counters[C.LEDGER_LATE] += 1
        elif not ok:
            del self.pending[i]
            self.dropped.append(i)
            self.counters[C.LEDGER_FAILED] += 1
        elif host in self.pending[i][1]:
            self.counters[C.LEDGER_DUPLICATE] += 1
        else:
            self.pending[i][1].add(host)
            if len(self.pending[i][1]) == self.num_hosts:
                del self.pending[i]
                self.ready.append(i)
                self.counters[C.LEDGER_CONFIRMED] += 1

    def expire(self, now):
        for i in sorted(self.pending):
            if self.pending[i][0] <= now:
                del self.pending[i]
                self.dropped.append(i)
                self.counters[C.LEDGER_EXPIRED] += 1


@pytest.mark.parametrize("seed", range(5))
def test_ledger_randomized_against_model(seed):
    rng = random.Random(seed)
    hosts = rng.choice([1, 2, 3, 5])
    led = CompletionLedger(hosts, max_early=1 << 20)
    model = LedgerModel(hosts)
    now = last_deadline = 0.0
    batches = []
    for _ in range(1500):
        op = rng.random()
        if op < 0.15:
            n = rng.randrange(1, 6)
            last_deadline = max(last_deadline, now + rng.uniform(0, 5))  # deadlines never decrease
            base = model.next_id
            assert led.open_batch(np.arange(base, base + n) + 1000, last_deadline, 0) == model.open(n, last_deadline)
            batches.append((base, base + n))
        elif op < 0.2:
            now += rng.uniform(0, 2)
            led.expire(now)
            model.expire(now)
        elif op < 0.5 and batches:
            # The usual report: one host confirms a whole batch (the ledger's fast path), often
            # a recent one, sometimes twice or after a partial report.
            a, b = batches[-1 - min(int(rng.expovariate(0.7)), len(batches) - 1)]
            host = rng.randrange(-1, hosts + 1)
            led.report(host, ok=[(a, b)])
            for i in range(a, b):
                model.one(host, i, True)
        else:
            host = rng.randrange(-1, hosts + 1)
            ok_ids = sorted({rng.randrange(-2, model.next_id + 4) for _ in range(rng.randrange(0, 6))})
            bad_ids = sorted({rng.randrange(-2, model.next_id + 4) for _ in range(rng.randrange(0, 2))})
            led.report(host, ok=id_ranges(ok_ids), failed=id_ranges(bad_ids))
            for i in ok_ids:
                model.one(host, i, True)
            for i in bad_ids:
                model.one(host, i, False)
        r = led.take_resolved()
        assert sorted(r.ready_ids.tolist()) == sorted(model.ready) and sorted(r.dropped_ids.tolist()) == sorted(model.dropped)
        assert (r.ready_slots == r.ready_ids + 1000).all() and (r.dropped_slots == r.dropped_ids + 1000).all()
        model.ready, model.dropped = [], []
        assert len(led) == len(model.pending)
        assert {k: led.counters[k] for k in model.counters} == dict(model.counters)
