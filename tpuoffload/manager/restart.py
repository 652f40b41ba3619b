"""Warm restart, the scheduler's side: adopt what every host restored; plan checkpoints.

Warm restart is a ``Tier`` (manager/tier.py) named "persist": it plans ``PersistPlan`` parts and
reads ``PersistReport`` parts.

Restore. Each host restores its slots before the first step (worker/persistence.py) and reports,
once, the chunks it restored (``PersistReport.restored``: ``RESTORED_ROW`` rows of slot,
checkpointed save id, hash keys and slot pool). When every host has reported, a chunk becomes
READY in the index under save id ``restored_save_id(pool, slot)`` only if every host restored the
same row, pool included (a chunk one host had not confirmed when the checkpoint was taken is
dropped), its slot exists in its pool and is still FREE (the first steps' saves may already have
reused it: their bytes replaced the restored ones) and its hash is not held already. A row's slot
is its pool's own (a GDN/mamba state pool's slot ``s`` is the index's slot ``kv + s``), so a
restored state chunk is adopted into the state pool only, at the slot the hosts hold its bytes
in (the disk tier's per-pool adoption, ``DiskIndex.adopt``, is the same rule); a slot named by
two rows is adopted for neither. Restored chunks enter the LRU order oldest save first. Until
every host reported (the first step's outputs) no save is planned, so no save takes a restored
slot, and restored chunks are not loadable; if a report never comes (``timeout_s``), or a connector reset
comes first, nothing is adopted (counted in ``restored_dropped``). The disk tier's files kept over
a restart are that tier's own business (``DiskTierPlanner``).

Checkpoints. An operator request (``CHECKPOINT_REQUEST`` in ``persist_path``, polled once a
second) or ``persist_interval_s`` makes ``plan`` put ``checkpoint=True`` in the step's plan:
every host writes its part at the start of that step. Until every host reported the checkpoint
resolved (or ``timeout_s`` passed), no save is planned (``skipped_checkpoint``): a save donates
the stores the checkpoint is reading. So the interval counts from the end of the last checkpoint
and is never shorter than that checkpoint took (``_settle``): saves run at least half the time.
The answer to an operator request is ``CHECKPOINT_DONE``.
The checkpoint at shutdown is the hosts' own (vLLM stops stepping first).

Under DPScheduler every rank's half runs this tier over its own index: it adopts the rows its own
part of each host's checkpoint reports (worker/persistence.py: one checkpoint per host holds every
rank's slots, split by rank at restore) and revokes its own range at a reset. Only rank 0's half
plans checkpoints (``plans_checkpoints``: the operator's request file and the interval are one per
deployment, and one checkpoint of a host covers every rank); another rank's save planned while
it is written waits for it on the hosts (``before_donate``).

Reset. After a connector reset, the next plan carries ``revoke_below``: every host forgets all
its chunks and never commits a save issued before the reset, so no later checkpoint holds them.

KV events. A restored chunk becomes loadable with the event record it was saved with (the index's
event sink finds it in the records written beside the checkpoints, manager/event_meta.py), and is
announced then; with events on, a restored chunk without a record is dropped, so that what the
events say is loadable stays exact. ``on_checkpoint`` is called whenever a checkpoint is planned
(it writes those records).
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from typing_extensions import override
import numpy as np

from tpuoffload import counters as C
from tpuoffload.messages import RESTORED_ROW, PersistPlan, PersistReport, restored_save_id
from tpuoffload.persist import CheckpointRequest, RequestWatcher
from tpuoffload.manager.hash_table import HashKeys
from tpuoffload.manager.index import ChunkIndex
from tpuoffload.manager.tier import Tier

logger = logging.getLogger(__name__)


@dataclass
class _Checkpoint:
    """A planned checkpoint until every host reported it."""

    step: int
    planned_at: float
    deadline: float
    waiting: set[int]  # hosts that have not reported it
    request: CheckpointRequest | None
    ok: bool = True
    seq: int | None = None
    failed_hosts: list[int] = field(default_factory=list)


class WarmRestart(Tier):
    """The warm-restart tier on the scheduler's side: plans checkpoints (every ``persist_interval_s``,
    on an operator's request, at shutdown), blocks saves while hosts read their stores, and
    adopts into the host-RAM index only the rows every host restored alike (``_adopt``,
    invariant 7)."""

    name = "persist"

    def __init__(self, persist_path: str, interval_s: float, timeout_s: float, index: ChunkIndex,
                 num_hosts: int, counters: Counter[str], clock: Callable[[], float],
                 on_checkpoint: Callable[[], None] = lambda: None,
                 plans_checkpoints: Callable[[], bool] = lambda: True) -> None:
        """``plans_checkpoints``: whether this half plans the deployment's checkpoints now (one
        scheduler: always; under DPScheduler rank 0's half, once the workers said which it is)."""
        self.index = index
        self._plans_checkpoints = plans_checkpoints
        self._on_checkpoint = on_checkpoint
        self.num_hosts = num_hosts
        self.counters = counters
        self.clock = clock
        self.timeout_s = timeout_s
        self._interval = interval_s
        self._watcher = RequestWatcher(persist_path, clock=clock)
        now = clock()
        self._next_due = now + interval_s if interval_s else math.inf
        self._restore_deadline = now + timeout_s
        self._restored: dict[int, np.ndarray] | None = {}  # host -> RESTORED_ROW rows; None: settled
        self._checkpoint: _Checkpoint | None = None
        self._checkpoint_now = False  # this step's plan asks for a checkpoint
        self._warned_slow = False  # a checkpoint took longer than the interval (said once)
        self._revoke_below: int | None = None

    # ---------------------------------------------------------------- the Tier hooks
    @property
    @override
    def blocks_saves(self) -> bool:
        return self.saves_blocked

    @property
    @override
    def keeps_engine_stepping(self) -> bool:
        """A checkpoint planned and not yet reported by every host (its ``timeout_s`` bounds it), or
        the restore reports still due: without it an operator's checkpoint asked as traffic ends,
        or one planned in the last step before the engine idled, would be answered only when the
        next request comes, and restored chunks would not be loadable for the first requests."""
        return self.saves_blocked

    @override
    def start_step(self, step: int) -> None:
        self._checkpoint_now = self.plan(step)

    @override
    def finish_step(self, step: int) -> PersistPlan | None:
        plan = PersistPlan(self._checkpoint_now, self.saves_blocked, self.take_revoke())
        return plan if plan != PersistPlan() else None

    @override
    def reset(self, next_save_id: int) -> None:
        self.on_reset(next_save_id)

    # ---------------------------------------------------------------- per step
    @property
    def saves_blocked(self) -> bool:
        """Plan no save while a checkpoint is being written (a save would donate the stores it
        reads) or the hosts' restore reports are still due (a save could take a restored slot)."""
        return self._checkpoint is not None or self._restored is not None

    def plan(self, step: int) -> bool:
        """Whether the plan of ``step`` asks every host for a checkpoint."""
        now = self.clock()
        self._expire(now)
        if not self._plans_checkpoints():
            return False
        request = self._watcher.poll()
        if self._checkpoint is not None:
            if request is not None:
                self._watcher.complete(request, False, None, "a checkpoint was already being written; ask again")
            return False
        if request is None and now < self._next_due:
            return False
        self._next_due = math.inf  # set when this one settles
        self._checkpoint = _Checkpoint(step, now, now + self.timeout_s, set(range(self.num_hosts)), request)
        self.counters[C.CHECKPOINTS_PLANNED] += 1
        self._on_checkpoint()
        logger.info("tpuoffload persist: checkpoint planned (%s)", f"request {request.id}" if request else "interval")
        return True

    def take_revoke(self) -> int | None:
        out, self._revoke_below = self._revoke_below, None
        return out

    def on_reset(self, next_save_id: int) -> None:
        self._revoke_below = next_save_id
        self._give_up_restore("a connector reset came first")

    # ---------------------------------------------------------------- reports
    @override
    def on_report(self, parts: dict[int, PersistReport]) -> None:
        for host, part in parts.items():
            if self._restored is not None and part.restored is not None and 0 <= host < self.num_hosts:
                self._restored[host] = np.frombuffer(part.restored, RESTORED_ROW)
            for step, seq, ok in part.checkpoints:
                self._checkpoint_reported(host, step, seq, ok)
        if self._restored is not None and len(self._restored) == self.num_hosts:
            self._adopt(self._restored)
            self._restored = None

    def _adopt(self, rows: dict[int, np.ndarray]) -> None:
        common = rows[0]
        for host in range(1, self.num_hosts):
            common = np.intersect1d(common, rows[host], assume_unique=True)
        offered = max(len(r) for r in rows.values())
        common = common[np.argsort(common["save_id"], kind="stable")]  # LRU order: oldest save first
        sizes = self.index.pool_sizes
        starts = np.cumsum((0,) + sizes[:-1])
        pool, slots = common["pool"], common["slot"]
        ok = (pool >= 0) & (pool < len(sizes))  # a pool this deployment has, a slot that exists in it
        ok[ok] = (slots[ok] >= 0) & (slots[ok] < np.asarray(sizes)[pool[ok]])
        at = np.where(ok, starts[np.where(ok, pool, 0)] + slots, -1)  # the index's slot of each row
        named, count = np.unique(at[ok], return_counts=True)
        ok[ok] = ~np.isin(at[ok], named[count > 1])  # a slot named twice holds neither for sure
        ok[ok] = self.index.free_slots_mask(at[ok])
        keys, valid = HashKeys.of_rows(common[ok])
        common, at = common[ok][valid], at[ok][valid]
        keys, keep, _, _ = self.index.select_new(keys)  # one chunk per hash, none already held (invariant 5)
        common, at = common[keep], at[keep]
        events = self.index.events
        records, described = events.lookup(keys)  # KV events: only chunks it can announce
        if not described.all():
            common, at, keys = common[described], at[described], keys.take(described)
            records = events.subset(records, described)
        self.index.adopt(keys, at, restored_save_id(common["pool"], common["slot"]), records)
        self.counters[C.RESTORED_READY] += len(common)
        self.counters[C.RESTORED_DROPPED] += offered - len(common)
        logger.info("tpuoffload persist: %d restored chunks loadable (%d dropped: not on every host alike, "
                    "or their slot was reused first)", len(common), offered - len(common))

    def _give_up_restore(self, why: str) -> None:
        if self._restored is None:
            return
        offered = max((len(r) for r in self._restored.values()), default=0)
        self.counters[C.RESTORED_DROPPED] += offered
        logger.warning("tpuoffload persist: restored chunks not used: %s (hosts reported: %s)", why,
                       sorted(self._restored))
        self._restored = None

    def _checkpoint_reported(self, host: int, step: int, seq: int, ok: bool) -> None:
        cp = self._checkpoint
        if cp is None or host not in cp.waiting or step != cp.step:
            return  # a repeated or late report, or a checkpoint given up on
        cp.waiting.discard(host)
        cp.seq = seq if cp.seq is None else cp.seq
        if not ok or seq != cp.seq:
            cp.ok = False
            cp.failed_hosts.append(host)
        if not cp.waiting:
            self._settle(cp, "" if cp.ok else f"failed on host(s) {cp.failed_hosts}")

    def _expire(self, now: float) -> None:
        if self._restored is not None and now > self._restore_deadline:
            self._give_up_restore(f"not every host reported within {self.timeout_s:.0f} s")
        cp = self._checkpoint
        if cp is not None and now > cp.deadline:
            cp.ok = False
            self._settle(cp, f"host(s) {sorted(cp.waiting)} did not report it within {self.timeout_s:.0f} s")

    def _settle(self, cp: _Checkpoint, reason: str) -> None:
        """End ``cp``; the interval counts from now, and is at least as long as ``cp`` took, so
        saves (blocked while a checkpoint is written) run at least half the time."""
        self._checkpoint = None
        now = self.clock()
        if self._interval:
            took = now - cp.planned_at
            self._next_due = now + max(self._interval, took)
            if took > self._interval and not self._warned_slow:
                self._warned_slow = True
                logger.warning("tpuoffload persist: a checkpoint took %.1f s, longer than persist_interval_s "
                               "(%.1f s): the next one waits as long (saves stop while one is written)",
                               took, self._interval)
        self.counters[C.CHECKPOINTS_COMMITTED if cp.ok else C.CHECKPOINTS_FAILED] += 1
        if cp.ok:
            logger.info("tpuoffload persist: checkpoint %s committed by every host", cp.seq)
        else:
            logger.warning("tpuoffload persist: checkpoint %s failed: %s", cp.seq, reason)
        if cp.request is not None:
            self._watcher.complete(cp.request, cp.ok, cp.seq, reason)
