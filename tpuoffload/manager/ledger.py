"""Cross-host completion ledger: a chunk becomes loadable only after every host confirmed its save.

Save ids are handed out densely and registered in increasing order by the scheduler, so a report
can be classified without keeping history:

* pending id, new host, ok      -> confirmation (READY once ``num_hosts`` hosts confirmed)
* pending id, not ok            -> FAILED at once (the chunk must never be loadable)
* pending id, host seen before  -> ``duplicate`` (counted, ignored)
* id <= highest registered      -> ``late`` (already resolved: ready, failed or expired)
* id > highest registered       -> ``early``: staged and replayed at registration
* host outside 0..num_hosts-1   -> ``unknown_host``

Nothing here raises on an odd signal: every one is counted in ``counters`` (invariant 8).
"""

from __future__ import annotations

import enum
from collections import Counter, OrderedDict
from dataclasses import dataclass, field


class Resolution(enum.Enum):
    READY = "ready"
    FAILED = "failed"
    EXPIRED = "expired"


@dataclass(slots=True)
class _Pending:
    deadline: float
    confirmed: set[int] = field(default_factory=set)


class CompletionLedger:
    def __init__(self, num_hosts: int, max_early: int = 1 << 16) -> None:
        if not isinstance(num_hosts, int) or num_hosts <= 0:
            raise ValueError(f"num_hosts must be a positive int, got {num_hosts!r}")
        self.num_hosts = num_hosts
        self._pending: OrderedDict[int, _Pending] = OrderedDict()  # registration order
        self._early: OrderedDict[int, list[tuple[int, bool]]] = OrderedDict()
        self._max_early = max_early
        self._highest_registered = -1
        self.counters: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._pending)

    def register(self, save_id: int, deadline: float) -> list[tuple[int, Resolution]]:
        """Start waiting for ``save_id`` until ``deadline`` (a time.monotonic() value). Returns the
        resolutions that staged early reports already decide."""
        if save_id <= self._highest_registered:
            raise ValueError(f"save ids must be registered in increasing order: {save_id} <= {self._highest_registered}")
        self._highest_registered = save_id
        self._pending[save_id] = _Pending(deadline)
        if not self._early:
            return []
        out = []
        for host, ok in self._early.pop(save_id, ()):
            res = self.report(host, save_id, ok)
            if res is not None:
                out.append((save_id, res))
        return out

    def report(self, host: int, save_id: int, ok: bool) -> Resolution | None:
        """Record one host's outcome for one save. Returns the resolution if this report decided it."""
        if not 0 <= host < self.num_hosts:
            self.counters["unknown_host"] += 1
            return None
        pending = self._pending.get(save_id)
        if pending is None:
            if save_id <= self._highest_registered:
                self.counters["late"] += 1
            else:
                self._stage_early(host, save_id, ok)
            return None
        if host in pending.confirmed:
            self.counters["duplicate"] += 1
            return None
        if not ok:
            del self._pending[save_id]
            self.counters["failed"] += 1
            return Resolution.FAILED
        pending.confirmed.add(host)
        if len(pending.confirmed) == self.num_hosts:
            del self._pending[save_id]
            self.counters["confirmed"] += 1
            return Resolution.READY
        return None

    def expire(self, now: float) -> list[int]:
        """Give up on saves whose deadline passed (a host never answered). Deadlines are registered
        in increasing order, so this only looks at the oldest entries."""
        out = []
        while self._pending:
            save_id, pending = next(iter(self._pending.items()))
            if pending.deadline > now:
                break
            del self._pending[save_id]
            out.append(save_id)
        self.counters["expired"] += len(out)
        return out

    def oldest_deadline(self) -> float | None:
        return next(iter(self._pending.values())).deadline if self._pending else None

    def _stage_early(self, host: int, save_id: int, ok: bool) -> None:
        self.counters["early"] += 1
        self._early.setdefault(save_id, []).append((host, ok))
        while len(self._early) > self._max_early:  # never registered: bound the memory
            self._early.popitem(last=False)
            self.counters["unknown"] += 1
