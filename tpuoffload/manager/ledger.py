"""Cross-host completion ledger: a chunk becomes loadable only after every reporting host confirmed
its save (invariant 7), and no odd report ever raises (invariant 8).

Save ids are handed out densely, one contiguous range per save batch (``open_batch``), so the
ledger keeps one entry per batch, not per chunk, and applies each host's report (ranges of save
ids) with a few numpy operations per batch. A report about save id ``i`` from host ``h`` is:

* ``i`` pending, ``h`` new, ok     -> a confirmation (READY once all ``num_hosts`` hosts confirmed)
* ``i`` pending, not ok            -> FAILED at once (the chunk must never be loadable)
* ``i`` pending, ``h`` seen before  -> ``ledger_duplicate`` (counted, ignored)
* ``i`` below the next id, not pending -> ``ledger_late`` (already resolved: ready, failed or expired)
* ``i`` at or above the next id    -> ``ledger_early``: staged, replayed when its batch opens
* ``h`` outside 0..num_hosts-1     -> ``ledger_unknown_host`` (and a loud error, once per host id)

Expected versus real reporters: a host id at or above ``num_hosts`` is logged as an error the first
time it reports; an expected host that has never reported anything while another host has already
confirmed a save that is ``mismatch_steps`` steps old is logged as an error and counted in
``reporters_missing``. Either way the cause is named, never a silent 0% hit rate.
"""

from __future__ import annotations

import bisect
import logging
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from tpuoffload import counters as C

logger = logging.getLogger(__name__)

_EMPTY = np.zeros(0, dtype=np.int64)
Range = tuple[int, int]  # save ids [start, stop)


@dataclass(eq=False)
class _Batch:
    """One save batch: save ids ``base .. base + len(slots) - 1``.

    The usual report confirms a whole batch at once (a host saved every chunk of it), so a batch
    starts with no per-save state: ``whole`` lists the hosts that confirmed all of it. Any other
    report (part of the batch, a failure) first builds the per-save arrays (``detail``)."""

    base: int
    slots: np.ndarray  # slot of each save id: handed back with its resolution
    deadline: float
    step: int
    n_open: int
    whole: set[int] = field(default_factory=set)  # hosts that confirmed every save (no detail yet)
    detail: "_Detail | None" = None

    @property
    def stop(self) -> int:
        return self.base + len(self.slots)

    def any_confirmed(self) -> bool:
        return bool(self.whole) if self.detail is None else bool(self.detail.count.any())


@dataclass(eq=False)
class _Detail:
    """Per-save state of a batch, built at its first report that is not a whole-batch confirmation."""

    count: np.ndarray  # hosts that confirmed each save
    seen: np.ndarray  # [host, i]: host confirmed save base + i
    open: np.ndarray  # save base + i is not resolved yet


@dataclass(frozen=True, slots=True)
class Resolved:
    """Saves resolved since the last ``take_resolved``: READY ones and dropped (failed or expired)."""

    ready_ids: np.ndarray
    ready_slots: np.ndarray
    dropped_ids: np.ndarray
    dropped_slots: np.ndarray

    def __len__(self) -> int:
        return len(self.ready_ids) + len(self.dropped_ids)


_NOTHING = Resolved(_EMPTY, _EMPTY, _EMPTY, _EMPTY)


class CompletionLedger:
    """Single-threaded: it lives on vLLM's scheduler thread."""

    def __init__(self, num_hosts: int, *, source: str = "", max_early: int = 1 << 16,
                 mismatch_steps: int = 8, counters: Counter[str] | None = None) -> None:
        if isinstance(num_hosts, bool) or not isinstance(num_hosts, int) or num_hosts <= 0:
            raise ValueError(f"num_hosts must be a positive int, got {num_hosts!r}")
        self.num_hosts = num_hosts
        self.source = source  # where num_hosts came from, for the mismatch messages
        self._batches: dict[int, _Batch] = {}  # base -> batch, in registration order
        self._bases: list[int] = []  # sorted (registration order is increasing)
        self._next_id = 0
        self._n_open = 0
        self._early: deque[tuple[int, bool, int, int]] = deque()  # (host, ok, start, stop)
        self._n_early = 0
        self._max_early = max_early
        self._mismatch_steps = mismatch_steps
        self._hosts_seen = [False] * num_hosts  # (a list: read every report, at list speed)
        self._n_hosts_seen = 0
        self._unexpected_hosts: set[int] = set()
        self._missing_reported = False
        self._res: list[tuple[bool, np.ndarray, np.ndarray]] = []  # (ready?, ids, slots)
        self.counters: Counter[str] = Counter() if counters is None else counters  # may be shared

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        """Saves registered and not resolved."""
        return self._n_open

    @property
    def next_save_id(self) -> int:
        return self._next_id

    def oldest_deadline(self) -> float | None:
        return next(iter(self._batches.values())).deadline if self._batches else None

    # ------------------------------------------------------------------ registration
    def open_batch(self, slots: np.ndarray, deadline: float, step: int) -> int:
        """Start waiting for ``len(slots)`` new saves until ``deadline`` (a clock value; deadlines
        must not decrease from one batch to the next). Returns the first save id; the batch holds
        ids ``first .. first + len(slots) - 1``. Early reports of these ids are applied now."""
        n = len(slots)
        base = self._next_id
        if not n:
            return base
        self._next_id = base + n
        batch = _Batch(base, slots if type(slots) is np.ndarray else np.asarray(slots, dtype=np.int64), deadline, step, n)
        self._batches[base] = batch
        self._bases.append(base)
        self._n_open += n
        if self._early:
            self._replay_early(base, base + n)
        return base

    # ------------------------------------------------------------------ reports
    def report(self, host: int, ok: Iterable[Range] = (), failed: Iterable[Range] = ()) -> None:
        """One host's outcomes: ranges of save ids saved, and ranges that failed. Invariant 7: a
        save resolves READY only when all ``num_hosts`` hosts confirmed it, a failure from any
        host resolves it FAILED; invariant 8: duplicate, late, early and unknown-host reports are
        counted (early ones staged), never raised."""
        if not 0 <= host < self.num_hosts:
            n = sum(max(0, b - a) for a, b in (*ok, *failed))
            self.counters[C.LEDGER_UNKNOWN_HOST] += n
            self._unexpected(host)
            return
        if not self._hosts_seen[host]:
            self._hosts_seen[host] = True
            self._n_hosts_seen += 1
            if self._missing_reported:
                logger.warning("tpuoffload: host %d reports at last (it was reported missing)", host)
        for a, b in ok:
            self._apply(host, int(a), int(b), True)
        for a, b in failed:
            self._apply(host, int(a), int(b), False)

    def expire(self, now: float) -> int:
        """Give up on saves whose deadline passed (a host never answered): they resolve as
        dropped. Deadlines grow with the batches, so only the oldest batches are looked at."""
        n = 0
        while self._batches:
            batch = next(iter(self._batches.values()))
            if batch.deadline > now:
                break
            n += batch.n_open
            self._resolve_rest(batch, False)  # removes the batch: every id is resolved now
        if n:  # (a zero would still add a key, and make every step's stats non-empty)
            self.counters[C.LEDGER_EXPIRED] += n
        return n

    def has_resolved(self) -> bool:
        """Whether ``take_resolved`` has anything to give."""
        return bool(self._res)

    def take_resolved(self) -> Resolved:
        """READY and dropped saves since the last call, READY ones newest first (so a prefix's
        first chunk, saved first, ends up the most recently used)."""
        res, self._res = self._res, []
        if not res:
            return _NOTHING
        if len(res) == 1 and res[0][0]:  # the usual case: one batch confirmed, one ascending run
            return Resolved(res[0][1][::-1], res[0][2][::-1], _EMPTY, _EMPTY)
        ready = [(i, s) for r, i, s in res if r]
        dropped = [(i, s) for r, i, s in res if not r]
        if len(ready) == 1:  # one ascending run: reverse it
            ri, rs = ready[0][0][::-1], ready[0][1][::-1]
        else:
            ri, rs = _cat(ready)
            if len(ri) > 1:
                order = np.argsort(-ri, kind="stable")
                ri, rs = ri[order], rs[order]
        di, ds = _cat(dropped)
        return Resolved(ri, rs, di, ds)

    # ------------------------------------------------------------------ reporter check
    def check_reporters(self, step: int) -> str | None:
        """Once an expected host has never reported while another host confirmed a save that has
        waited ``mismatch_steps`` steps, log (error) and count it. Returns the message when it
        fires."""
        if self._missing_reported or not self._batches:
            return None
        oldest = next(iter(self._batches.values()))
        if (step - oldest.step < self._mismatch_steps or self._n_hosts_seen == self.num_hosts
                or not oldest.any_confirmed()):
            return None
        missing = [h for h, ok in enumerate(self._hosts_seen) if not ok]
        seen = [h for h, ok in enumerate(self._hosts_seen) if ok]
        msg = (f"tpuoffload: the scheduler expects {self.num_hosts} reporting workers ({self.source or 'configured'}) "
               f"but after {step - oldest.step} steps only host(s) {seen} ever confirmed a save; host(s) {missing} "
               f"never reported. No save can become loadable: every save will expire and the hit rate stays 0. "
               f"If {self.num_hosts} is not the number of worker processes (one per host for tpu-inference), "
               f"set kv_connector_extra_config['num_hosts'] to it. If it is, the engine passes the scheduler "
               f"only some workers' outputs (tpu-inference 0.32's DPScheduler on several hosts builds no KV "
               f"output aggregator, so the Ray executor returns the output rank's alone): do NOT lower "
               f"num_hosts then, which would make a chunk loadable on one host's word; that engine cannot "
               f"offload until it aggregates every worker's KV connector output.")
        logger.error(msg)
        self.counters[C.REPORTERS_MISSING] += 1
        self._missing_reported = True
        return msg

    def _unexpected(self, host: int) -> None:
        if host in self._unexpected_hosts:
            return
        self._unexpected_hosts.add(host)
        logger.error(
            "tpuoffload: a worker reported as host %r but the scheduler expects %d reporting workers (%s): "
            "hosts 0..%d. Its reports are dropped, so chunks may become loadable before that host holds them. "
            "Set kv_connector_extra_config['num_hosts'] to the number of worker processes.",
            host, self.num_hosts, self.source or "configured", self.num_hosts - 1)

    # ------------------------------------------------------------------ internals
    def _apply(self, host: int, a: int, b: int, ok: bool) -> None:
        if b <= a:
            return
        if b > self._next_id:
            start = max(a, self._next_id)
            self._stage_early(host, ok, start, b)
            b = start
            if b <= a:
                return
        covered = 0
        bases = self._bases
        i = max(bisect.bisect_right(bases, a) - 1, 0)
        hit = []
        while i < len(bases) and bases[i] < b:
            batch = self._batches[bases[i]]
            lo, hi = max(a, batch.base), min(b, batch.stop)
            if lo < hi:
                hit.append((batch, lo - batch.base, hi - batch.base))
            i += 1
        for batch, i0, i1 in hit:
            covered += i1 - i0
            self._apply_batch(batch, host, i0, i1, ok)
        if covered < b - a:
            self.counters[C.LEDGER_LATE] += b - a - covered

    def _apply_batch(self, batch: _Batch, host: int, i0: int, i1: int, ok: bool) -> None:
        if batch.detail is None:
            if ok and i0 == 0 and i1 == len(batch.slots):  # the usual report: a few Python operations
                self._confirm_whole(batch, host)
                return
            self._build_detail(batch)
        detail = batch.detail
        open_ = detail.open[i0:i1]
        n_open = int(np.count_nonzero(open_))
        if n_open < i1 - i0:
            self.counters[C.LEDGER_LATE] += (i1 - i0) - n_open
        if not n_open:
            return
        if not ok:
            self._resolve(batch, i0 + np.flatnonzero(open_), False)
            self.counters[C.LEDGER_FAILED] += n_open
            return
        if self.num_hosts == 1:  # an open save confirmed by the only host is ready
            idx = np.arange(i0, i1) if n_open == i1 - i0 else i0 + np.flatnonzero(open_)
            self.counters[C.LEDGER_CONFIRMED] += n_open
            self._resolve(batch, idx, True)
            return
        seen = detail.seen[host, i0:i1]  # a view: updated in place
        new = open_ & ~seen
        n_new = int(np.count_nonzero(new))
        if n_new < n_open:
            self.counters[C.LEDGER_DUPLICATE] += n_open - n_new
        if not n_new:
            return
        seen |= new
        count = detail.count[i0:i1]
        count += new
        done = new & (count >= self.num_hosts)
        if done.any():
            idx = i0 + np.flatnonzero(done)
            self.counters[C.LEDGER_CONFIRMED] += len(idx)
            self._resolve(batch, idx, True)

    def _confirm_whole(self, batch: _Batch, host: int) -> None:
        """``host`` confirmed every save of a batch that has no per-save state yet."""
        n = len(batch.slots)
        if host in batch.whole:
            self.counters[C.LEDGER_DUPLICATE] += n
            return
        batch.whole.add(host)
        if len(batch.whole) == self.num_hosts:
            self.counters[C.LEDGER_CONFIRMED] += n
            self._resolve_rest(batch, True)

    def _build_detail(self, batch: _Batch) -> None:
        n = len(batch.slots)
        seen = np.zeros((self.num_hosts, n), dtype=bool)
        for host in batch.whole:
            seen[host] = True
        batch.detail = _Detail(np.full(n, len(batch.whole), dtype=np.int32), seen, np.ones(n, dtype=bool))

    def _resolve_rest(self, batch: _Batch, ready: bool) -> None:
        """Resolve every save of the batch still open, and remove it."""
        if batch.detail is not None:
            self._resolve(batch, np.flatnonzero(batch.detail.open), ready)
            return
        self._n_open -= batch.n_open
        batch.n_open = 0
        self._res.append((ready, np.arange(batch.base, batch.stop), batch.slots))
        self._remove(batch)

    def _resolve(self, batch: _Batch, idx: np.ndarray, ready: bool) -> None:
        if not len(idx):
            if not batch.n_open:
                self._remove(batch)
            return
        batch.detail.open[idx] = False
        batch.n_open -= len(idx)
        self._n_open -= len(idx)
        self._res.append((ready, batch.base + idx, batch.slots[idx]))
        if not batch.n_open:
            self._remove(batch)

    def _remove(self, batch: _Batch) -> None:
        del self._batches[batch.base]
        pos = bisect.bisect_left(self._bases, batch.base)
        del self._bases[pos]

    def _stage_early(self, host: int, ok: bool, a: int, b: int) -> None:
        self.counters[C.LEDGER_EARLY] += b - a
        self._early.append((host, ok, a, b))
        self._n_early += b - a
        while self._n_early > self._max_early:  # never registered: bound the memory
            _, _, x, y = self._early.popleft()
            self._n_early -= y - x
            self.counters[C.LEDGER_UNKNOWN] += y - x

    def _replay_early(self, base: int, stop: int) -> None:
        keep: deque[tuple[int, bool, int, int]] = deque()
        replay = []
        for host, ok, a, b in self._early:
            lo, hi = max(a, base), min(b, stop)
            if lo >= hi:
                keep.append((host, ok, a, b))
                continue
            # Staged ids were at or above the next id when staged, so a >= base: only a tail can remain.
            replay.append((host, ok, lo, hi))
            self._n_early -= hi - lo
            if hi < b:
                keep.append((host, ok, hi, b))
        self._early = keep
        for host, ok, lo, hi in replay:
            self._apply(host, lo, hi, ok)


def _cat(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    if not parts:
        return _EMPTY, _EMPTY
    if len(parts) == 1:
        return parts[0]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
