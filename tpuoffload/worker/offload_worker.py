"""Worker half of the connector: executes each step's plan on this host.

Per step (the order vLLM's KVConnectorModelRunnerMixin calls it)::

    bind(meta)        flush saves (blocks of preempted/finished requests), then this step's loads,
                      both before the forward (see below)
    start_load()      nothing left to do: the loads were dispatched in bind
    <forward>
    wait_for_save()   saves of blocks this step's forward filled: one gather, one device-to-host
    get_finished / take_load_errors / build_report / take_stats
    clear()           close the step's dispatch digest

Every dispatch happens on the calling (engine main) thread in an order fixed by the metadata, so
every host issues the same programs (invariant 1); local trouble only changes what is reported.

Loads are dispatched in ``bind``, before the forward, whatever vLLM's mixin does with
``start_load_kv``: the runner reads ``runner.kv_caches`` for its forward after ``bind`` and, with
tpu-inference's continue-decode loop, donates them inside the connector context and assigns the new
ones only after it exits, so a load issued later would read deleted arrays or be overwritten. A
save after a forward that donated the caches without handing them back (continue-decode) cannot
gather; every host sees the same, so every host skips it and reports those chunks failed.

A GDN/mamba hybrid's caches hold two block pools (layout.py:CachePools): the engine keeps a store
per pool (worker/pooled_engine.py), and each plan names a slot of either through one numbering
(``StepPlan.state_slots``). The disk tier and warm restart keep each pool's chunks in that pool
(worker/disk_stage.py, worker/persistence.py).
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter, deque
from collections.abc import Sequence
from typing import Protocol

import jax
import numpy as np

from tpuoffload import counters as C
from tpuoffload.config import OffloadConfig, check_fits_in_ram
from tpuoffload.layout import CacheLayout, CachePools, KVGroupMap
from tpuoffload.messages import (
    RANK_SAVE_ID_SHIFT,
    ChunkNews,
    LoadRequest,
    OffloadMetadata,
    OffloadWorkerReport,
    SaveBatch,
    StepPlan,
)
from tpuoffload.snapshot import SnapshotWriter
from tpuoffload.stats import OffloadStats, make_report
from tpuoffload.worker.dispatch_log import StepDigest
from tpuoffload.worker.faults import FaultInjector
from tpuoffload.backend.disk_tier import DiskFaults, files_per_rank
from tpuoffload.persist import Fingerprint, PersistFaults
from tpuoffload.worker.disk_stage import DiskStage, clear_other_ranks, rank_path
from tpuoffload.worker.shared_stage import SharedStage
from tpuoffload.backend.shared_store import SharedURL
from tpuoffload.worker.persistence import Deployment, HostPersistence, RankPersistence, fingerprint
from tpuoffload.worker.tier import Placement, WorkerTier
from tpuoffload.worker.pooled_engine import PooledEngine

logger = logging.getLogger(__name__)


class CachesDonated(RuntimeError):
    """The runner's caches were donated by its forward and not yet replaced."""


class CacheOwner(Protocol):
    """What tpu-inference's runner offers: the per-layer caches, replaced by functions that donate them."""

    kv_caches: list  # a jax.Array per attention layer, a (conv, ssm) tuple per GDN layer


class OffloadWorker:
    """The worker half on one host: executes each step's plans (``bind`` .. ``clear``, in vLLM's
    mixin order) on this host's shard of the KV cache through one ``PooledEngine``, and reports
    what happened (save outcomes, loads finished or failed, each tier's part). It decides nothing:
    every dispatch is a function of the plans, so every host dispatches alike (invariants 1, 2)."""

    def __init__(self, config: OffloadConfig, host_id: int | None = None, faults: FaultInjector | None = None,
                 digest_history: int = 64, deployment: Deployment = Deployment(),
                 disk_faults: DiskFaults | None = None, persist_faults: PersistFaults | None = None,
                 kv_cache_config=None) -> None:
        self.config = config
        self.kv_cache_config = kv_cache_config  # vLLM's (its KV cache groups), when given
        self.deployment = deployment
        self.host_id = jax.process_index() if host_id is None else host_id
        self._faults = faults
        self._runner: CacheOwner | None = None
        self.engine: PooledEngine | None = None
        self._pools: CachePools | None = None
        self._boundary = 0  # the step's first state slot (StepPlan.state_slots)
        self._meta: OffloadMetadata | None = None
        self._placed: list[_Placed] = []  # the step's plans in the engine's numbering
        self._checked_shape: tuple | None = None  # the plans' slot counts and placement, last checked
        self._sources: dict[int, int] = {}  # DP rank -> the source of its scheduler half
        self._news: dict[tuple[int, int], ChunkNews] = {}  # (rank, step) -> the plan's news, to echo
        self._saved = False
        self._finished_recving: set[str] = set()
        self._failed_recving: set[str] = set()  # failed loads, by request (StepPlan.failures_by_request)
        self._load_errors: set[int] = set()
        self._report_failures: list[int] = []
        self._stats_seq = 0
        self.totals: Counter[str] = Counter()  # since start, for snapshots
        self._unreported: Counter[str] = Counter()  # since the last take_stats
        self._snapshot: SnapshotWriter | None = None
        self.digests: deque[StepDigest] = deque(maxlen=digest_history)
        self.tiers: list[WorkerTier] = []  # beside host RAM, in the order they act (worker/tier.py)
        self._disk_faults = disk_faults
        self._persist_faults = persist_faults

    # ------------------------------------------------------------------ setup
    def register_runner(self, runner: CacheOwner) -> None:
        """Describe the runner's caches (UnsupportedCache names what cannot be offloaded), size the
        host stores (one per block pool, layout.py:CachePools) and start the tiers."""
        caches = list(runner.kv_caches)
        pools = CachePools.of(caches)
        layouts = [CacheLayout.from_caches(pools.arrays(caches, p)) for p in range(pools.num)]
        self._check_kv_groups(runner, pools, len(caches))
        pool_bytes = self.config.pool_bytes(layouts[0].device_bytes_per_chunk, pools.num)
        check_fits_in_ram(sum(pool_bytes))
        self._runner = runner
        self._pools = pools
        self.engine = PooledEngine(
            pools,
            caches,
            pool_bytes,
            layouts,
            host_memory_kind=self.config.host_memory_kind,
            save_threads=self.config.save_threads,
            load_wait_timeout_s=self.config.load_wait_timeout_s,
            faults=self._faults,
            transfer_buffer_bytes=self.config.transfer_buffer_bytes,
        )
        tables = self.engine.tables
        # What _Placed needs of the stores, fixed from here on: batch shards, each pool's slots per shard.
        self._store_shape = (tables[0].shards, tuple(t.shard_slots for t in tables))
        deployment = fingerprint(layouts[0], self.deployment, jax.process_count(), *layouts[1:])
        if self.config.persist_path:
            self.tiers += self._start_persistence(deployment)
        if self.config.disk_path:
            self.tiers += self._start_disk(deployment)
        if self.config.shared_url:  # the store every replica shares: a stage per DP rank (worker/shared_stage.py)
            engines = self.engine.engines
            self.tiers += [SharedStage(engines, SharedURL.parse(self.config.shared_url), self.host_id,
                                       json.dumps(deployment.to_json(), sort_keys=True),
                                       before_donate=self._before_donate, rank=r)
                           for r in range(engines[0].slot_table.shards)]
        if self.config.stats_dir:
            # build_when_idle: everything snapshot() reads changes only between bind() and clear()
            # on this thread, or under the engine's and the backend's locks.
            self._snapshot = SnapshotWriter(self.config.stats_dir, f"host-{self.host_id}.json",
                                            self.config.stats_interval_s, self.snapshot, build_when_idle=True)
        for p, (engine, layout) in enumerate(zip(self.engine.engines, layouts)):
            table = engine.slot_table
            logger.info("tpuoffload worker %d, pool %d: %d host slots of %d bytes (%d bytes of host RAM); accelerator "
                        "transfer buffer <= %d bytes (%d chunks per transfer, transfer_buffer_bytes=%d); cache: %s",
                        self.host_id, p, table.num_slots, table.slot_bytes, table.nbytes,
                        engine.max_chunks_per_transfer * layout.device_bytes_per_chunk,
                        engine.max_chunks_per_transfer, self.config.transfer_buffer_bytes, layout.describe())

    def _check_kv_groups(self, runner: CacheOwner, pools: CachePools, num_arrays: int) -> None:
        """With several KV cache groups and one pool, refuse arrays tpu-inference did not share
        between the groups (KVGroupMap.of); nothing else needs the map: a chunk (one block of every
        array) serves every group alike. With a state pool the attention arrays are one per layer,
        not shared: each pool's chunk serves its own groups (the scheduler half keys them)."""
        groups = getattr(self.kv_cache_config, "kv_cache_groups", None) or ()
        if pools.num > 1:
            logger.info("tpuoffload worker %d: %d KV cache groups; %s", self.host_id, len(groups), pools.describe())
        elif len(groups) > 1:
            group_map = KVGroupMap.of(self.kv_cache_config, getattr(runner, "layer_name_to_kvcache_index", {}),
                                      num_arrays)
            logger.info("tpuoffload worker %d: %d KV cache groups; %s", self.host_id, len(groups),
                        group_map.describe())

    def tier(self, name: str) -> WorkerTier | None:
        """The tier of that name, if configured."""
        return next((t for t in self.tiers if t.name == name), None)

    def _start_persistence(self, deployment: Fingerprint) -> list[RankPersistence]:
        """Warm restart: restore the newest matching checkpoint now, before the first step. One
        checkpoint per host holds every rank's slots; each DP rank's half hears of its own rows
        through its own part (worker/persistence.py)."""
        if self.host_id != jax.process_index():
            raise ValueError(f"persist_path needs one worker per JAX process (host {self.host_id} runs in "
                             f"process {jax.process_index()})")
        persistence = HostPersistence(self.config.persist_path, self.engine.engines, deployment, self.host_id,
                                      self.config.persist_timeout_s, self._persist_faults,
                                      state_slot=lambda: self._boundary)
        persistence.restore()
        return persistence.parts

    def _start_disk(self, deployment: Fingerprint) -> list[DiskStage]:
        """The disk tier: one stage, or under DPScheduler one per rank (batch shard), each with its
        own files under ``rank-<r>`` (worker/disk_stage.py); with warm restart it keeps the chunk
        files of the same deployment, and the manager indexes those that every host kept alike
        (manager/disk_index.py)."""
        keep = json.dumps(deployment.to_json(), sort_keys=True) if self.config.persist_path else None
        engines = self.engine.engines
        ranks = engines[0].slot_table.shards
        path = self.config.disk_path.replace("{host}", str(self.host_id))
        cleared = clear_other_ranks(path, ranks)
        if cleared:
            logger.info("tpuoffload disk tier at %s: %d chunk files of another DP size deleted", path, cleared)
        # Each slot pool's files within its share of the disk (OffloadConfig.disk_pool_bytes).
        files = [files_per_rank(budget, sum(e.disk_chunk_bytes(r) for r in range(e.slot_table.shards)), ranks)
                 for budget, e in zip(self.config.disk_pool_bytes(len(engines)), engines)]
        return [DiskStage(engines, rank_path(path, r, ranks), files,
                          self.config.load_wait_timeout_s, self._disk_faults, deployment=keep,
                          before_donate=self._before_donate, rank=r)
                for r in range(ranks)]

    def _before_donate(self) -> None:
        for t in self.tiers:
            t.before_donate()

    # ------------------------------------------------------------------ per step
    def bind(self, meta: OffloadMetadata) -> None:
        if self.engine is None:
            raise RuntimeError("tpuoffload: register_runner() must be called before the first step")
        plans = meta.requests_meta
        if not plans:
            raise ValueError("tpuoffload: the step's metadata carries no plan")
        placed = [_Placed(plan, *self._store_shape) for plan in plans]
        shape = tuple((p.plan.num_slots, p.plan.state_slots, p.plan.num_blocks, p.slot_offset) for p in placed)
        if shape != self._checked_shape:  # the plans' shape is the deployment's: checked when it changes
            self._check_slots(placed)
            self._checked_shape = shape
        if self._snapshot is not None:
            self._snapshot.step_begin()  # the heartbeat now reports this step's age (a hang shows)
        self._meta = meta
        self._placed = placed
        self._saved = False
        for p in placed:
            self._sources[p.rank] = p.plan.source
            if p.plan.news:
                self._news[p.rank, p.plan.step] = p.plan.news
        self._boundary = placed[0].state_base  # one pool: unused (every slot is pool 0's)
        self.engine.log.record("step", n=plans[0].step)
        self._act_tiers(placed)
        self._save(_concat_saves([p.flush for p in placed]))
        self._load(placed)

    def _act_tiers(self, placed: list["_Placed"]) -> None:
        """Every tier acts on its part of its rank's plan, in tier order, before the step's saves
        and loads."""
        unknown = {(p.rank, name) for p in placed for name in p.plan.tiers} - {(t.rank, t.name) for t in self.tiers}
        if unknown:
            raise ValueError(f"the scheduler plans work for tier(s) {sorted(unknown)} (rank, name) that host "
                             f"{self.host_id} does not have: the two halves were configured differently")
        by_rank = {p.rank: p for p in placed}
        step = placed[0].plan.step
        for t in self.tiers:
            p = by_rank.get(t.rank)
            if p is None:
                t.act(step, None)
            else:
                t.act(step, p.plan.tiers.get(t.name), Placement(p.slot_offset, p.id_offset, p.state_offset))

    def _check_slots(self, placed: list["_Placed"]) -> None:
        """Each plan's slots fit this host's stores: pool 0 takes ``num_slots - state_slots`` of
        them, the state pool ``state_slots`` (module doc of worker/pooled_engine.py)."""
        have, shards = self.engine.num_slots(0), self.engine.tables[0].shards
        if shards > 1 and not placed[0].plan.num_blocks:
            raise ValueError(f"this cache splits its blocks over {shards} batch shards (data parallelism), whose "
                             "chunks tpuoffload keeps per shard: it needs tpu-inference's DPScheduler (one scheduler "
                             "per DP rank), not one scheduler for the whole engine")
        self._check_state_slots(placed)
        for p in placed:
            need = p.slot_offset + p.plan.num_slots - p.plan.state_slots
            if need > have:
                raise ValueError(
                    f"the scheduler plans host slots up to {need} but this host (host {self.host_id}) has {have}: "
                    f"the scheduler and workers disagree on the chunk size (this host stores "
                    f"{self.engine.tables[0].slot_bytes} bytes per chunk, replicas included). Set "
                    f"num_cpu_chunks={have} in kv_connector_extra_config instead of cpu_bytes_to_use")
        plan = placed[0].plan
        if plan.step == 0 and len(placed) == 1 and plan.num_slots - plan.state_slots < have:
            logger.warning("tpuoffload host %d: the scheduler plans %d of this host's %d slots; the chunk sizes "
                           "the two halves computed differ", self.host_id, plan.num_slots - plan.state_slots, have)

    def _check_state_slots(self, placed: list["_Placed"]) -> None:
        """The state pool's part of ``_check_slots``: state slots planned iff the runner has state
        layers, each rank's fitting its batch shard's part of this host's stores (under DPScheduler
        a rank's KV slots too: ``_Placed`` numbers them by shard), its state rows its share."""
        if self._pools.num == 1:
            if any(p.plan.state_slots for p in placed):
                raise ValueError("the scheduler plans state slots (GDN/mamba state layers) but the runner's caches "
                                 "hold none: the two halves disagree on the cache's pools")
            return
        plan, have = placed[0].plan, self.engine.num_slots(1)
        if not plan.state_slots:
            raise ValueError(f"the runner's caches hold GDN/mamba state layers ({self._pools.describe()}) but the "
                             "scheduler plans no state slots: the two halves disagree on the cache's pools")
        shards, rows = self.engine.tables[1].shards, self.engine.engines[1].num_blocks
        if shards != self.engine.tables[0].shards or (shards > 1 and plan.state_rows * shards != rows):
            raise ValueError(f"the state pool's {rows} rows split over {shards} batch shards, the KV pool's blocks over "
                             f"{self.engine.tables[0].shards}, and the scheduler's rank plans {plan.state_rows} state "
                             "rows: tpuoffload places a DP rank's state rows as its share of the pool "
                             "(mamba_num_blocks // ranks, StepPlan.state_rows)")
        if shards > 1 and plan.num_slots - plan.state_slots > self.engine.tables[0].shard_slots:
            raise ValueError(f"the scheduler plans {plan.num_slots - plan.state_slots} KV slots per rank but this host "
                             f"(host {self.host_id}) has {self.engine.tables[0].shard_slots} per batch shard: the "
                             f"two halves disagree on the chunk size (this host stores "
                             f"{self.engine.tables[0].slot_bytes} bytes per chunk)")
        if plan.state_slots > self.engine.tables[1].shard_slots:
            per = f" per batch shard ({have} in all)" if shards > 1 else ""
            raise ValueError(f"the scheduler plans {plan.state_slots} state slots but this host (host {self.host_id}) "
                             f"has {self.engine.tables[1].shard_slots}{per}: the two halves disagree on the state "
                             f"chunk's size (this host stores {self.engine.tables[1].slot_bytes} bytes per state chunk)")
        if plan.step == 0 and len(placed) == 1 and plan.state_slots * shards < have:
            logger.warning("tpuoffload host %d: the scheduler plans %d of this host's %d state slots; the state chunk "
                           "sizes the two halves computed differ", self.host_id, plan.state_slots * shards, have)

    def start_load(self) -> None:
        """Nothing to do: this step's loads were dispatched in ``bind`` (see the module doc)."""

    def _load(self, placed: list["_Placed"]) -> None:
        """Every plan's loads in one engine call; a load fails where any of its rows failed (by
        block, in each plan's own ids, or by request: ``StepPlan.failures_by_request``). Every
        load is reported finished in this step's ``get_finished``: vLLM schedules the request's
        forward in a later step, which the runtime orders after this load."""
        if not any(p.loads for p in placed):
            return
        blocks, slots, save_ids, sources = _concat_loads(placed)
        try:
            caches, failed = self.engine.load(self._live_caches(), blocks, slots, save_ids, sources, self._boundary)
            self._runner.kv_caches = caches
        except Exception:
            logger.exception("tpuoffload: load dispatch failed on host %d", self.host_id)
            failed = set(range(len(blocks)))
            self._count(C.LOAD_ERRORS, len(blocks))
        start = 0  # the position of each load's first row in the engine call
        for p in placed:
            by_request = p.plan.failures_by_request
            for load in p.loads:
                rows = range(start, start + len(load.block_ids))
                start = rows.stop
                missed = bool(load.unavailable_block_ids) or bool(failed) and not failed.isdisjoint(rows)
                if by_request:
                    if missed:
                        self._failed_recving.add(load.req_id)
                elif missed:  # (the usual step has none: no per-block work on the main thread then)
                    self._load_errors.update(blocks[i] - p.block_offset for i in rows if i in failed)
                    self._load_errors.update(load.unavailable_block_ids)
                self._finished_recving.add(load.req_id)

    def _live_caches(self) -> list:
        caches = list(self._runner.kv_caches)
        if any(a.is_deleted() for p in range(self._pools.num) for a in self._pools.arrays(caches, p)):
            raise CachesDonated("runner.kv_caches were donated and not yet handed back (continue-decode)")
        return caches

    def wait_for_save(self) -> None:
        if self._meta is None or self._saved:
            return
        self._saved = True
        self._save(_concat_saves([p.save for p in self._placed]))

    def _save(self, batch: SaveBatch) -> None:
        if not batch:
            return
        try:
            for t in self.tiers:
                t.before_donate()
                t.saving(batch)
            self.engine.save(self._live_caches(), batch.block_ids, batch.slots, batch.save_ids, self._boundary)
        except CachesDonated as exc:
            logger.warning("tpuoffload: %d saves skipped on host %d: %s", len(batch), self.host_id, exc)
            self._report_failures.extend(batch.save_ids)
        except Exception:
            logger.exception("tpuoffload: save dispatch failed on host %d", self.host_id)
            self._report_failures.extend(batch.save_ids)

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        sending = {r for p in self._placed for r in p.plan.release_req_ids} if self._meta is not None else set()
        recving, self._finished_recving = self._finished_recving, set()
        return sending or None, recving or None

    def take_failed_recving(self) -> set[str]:
        """Requests whose load failed on this host (``StepPlan.failures_by_request``); each is also
        in this step's ``get_finished`` loads, as vLLM requires."""
        out, self._failed_recving = self._failed_recving, set()
        return out

    def take_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def build_report(self) -> OffloadWorkerReport | None:
        results = self.engine.drain_results() if self.engine is not None else []
        saved = [r.save_id for r in results if r.ok]
        failed = [r.save_id for r in results if not r.ok] + self._report_failures
        self._count(C.SAVE_FAILURES, len(self._report_failures))
        self._report_failures = []
        report = self._save_report(saved, failed)
        report.news, self._news = self._news, {}  # every rank's news, to every rank (DPScheduler)
        for t in self.tiers:
            part = t.report()
            if part is not None:
                report.tiers.setdefault(t.name, {})[self._sources.get(t.rank, 0), self.host_id] = part
        return report if report else None

    def _save_report(self, saved: list[int], failed: list[int]) -> OffloadWorkerReport:
        """Outcomes under the source and save ids of the plan that asked for each save."""
        if len(self._sources) <= 1:  # one scheduler: its ids are the engine's
            return OffloadWorkerReport.from_host(self.host_id, saved, failed, source=self._sources.get(0, 0))
        report = OffloadWorkerReport()
        mask = (1 << RANK_SAVE_ID_SHIFT) - 1
        for rank, source in self._sources.items():
            mine = lambda ids: [i & mask for i in ids if i >> RANK_SAVE_ID_SHIFT == rank]  # noqa: E731
            report = report.aggregate(OffloadWorkerReport.from_host(self.host_id, mine(saved), mine(failed), source))
        report.ranks = {source: rank for rank, source in self._sources.items()}
        return report

    def _count(self, name: str, n: int) -> None:
        """Count what the worker itself decided (dispatch-level failures); the engine counts the rest."""
        if n:
            self.totals[name] += n
            self._unreported[name] += n

    def _collect_counters(self) -> None:
        delta = self.engine.take_counters()
        for t in self.tiers:
            delta.update(t.take_counters())
        self.totals.update(delta)
        self._unreported.update(delta)

    def take_stats(self) -> OffloadStats | None:
        if self.engine is None:
            return None
        self._collect_counters()
        if not self._unreported:
            return None
        self._stats_seq += 1
        values, self._unreported = self._unreported, Counter()
        return OffloadStats(make_report(self.host_id, self._stats_seq, values))

    def clear(self) -> StepDigest | None:
        if self._meta is None:
            return None
        self._meta = None
        self._placed = []
        digest = self.engine.finish_step()
        self.digests.append(digest)
        if self._snapshot is not None:
            self._snapshot.step_end()  # and write the snapshot if one is due
        return digest

    def snapshot(self) -> dict:
        """What this host has done and holds, for the per-host stats file."""
        self._collect_counters()
        chunks, staging, oldest = self.engine.inflight()
        last = self.digests[-1] if self.digests else None
        return {
            "kind": "host",
            "host": self.host_id,
            "step": last.step if last else -1,
            "digest": last.digest if last else "",
            "recent_digests": [[d.step, d.digest] for d in list(self.digests)[-16:]],
            "totals": dict(self.totals),
            "slots_total": sum(t.num_slots for t in self.engine.tables),
            "slots_used": sum(t.num_used() for t in self.engine.tables),
            "backend_bytes": sum(t.nbytes for t in self.engine.tables),
            "staging_bytes": staging,
            "inflight_chunks": chunks,
            "oldest_inflight_age_s": (time.monotonic() - oldest) if oldest is not None else 0.0,
        }

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Wait for this host's background work: saves, and spills to disk."""
        idle = self.engine.wait_idle(timeout)
        return all([t.wait_idle(timeout) for t in self.tiers]) and idle

    def idle_report(self) -> dict[str, int]:
        """What this host still has under way; all zero when it is idle (public gauges for
        operators and tests)."""
        chunks, staging, _ = self.engine.inflight() if self.engine is not None else (0, 0, None)
        tiers: Counter[str] = Counter()
        for t in self.tiers:  # a per-rank tier (DPScheduler) reports once per rank: summed
            tiers.update(t.idle_report())
        return {
            "inflight_saves": chunks,
            "staging_bytes": staging,
            "unreported_save_failures": len(self._report_failures),
            "pending_load_reports": len(self._finished_recving) + len(self._failed_recving),
            **tiers,
        }

    def close(self) -> None:
        """Clean shutdown: the last checkpoint (warm restart), then the engine's threads."""
        for t in self.tiers:  # warm restart's last checkpoint first
            t.close()
        if self.engine is not None:
            self.engine.close()
            self._collect_counters()  # totals are final
            if self._snapshot is not None:
                self._snapshot.close()
                self._snapshot.maybe_write(force=True)


class _Placed:
    """One plan in the engine's numbering: a DP rank's blocks, slots and save ids moved to where
    DPScheduler and the rank's share of the host store put them (``StepPlan.placement``), and for
    each load, a block of the batch shard whose store rows hold each slot's bytes (``sources``).

    With a state pool (``StepPlan.state_slots``) under DPScheduler the engine numbers pool 0's
    slots of every batch shard first, then pool 1's from ``state_base`` (worker/pooled_engine.py;
    each store's slot ``s`` is row ``s % shard_slots`` of shard ``s // shard_slots``): a rank's KV
    slot ``s`` is ``rank * shard_slots[0] + s``, its state slot ``kv + t`` (``kv``: the plan's KV
    slots) is ``state_base + rank * shard_slots[1] + t``, and its state row ``b`` is the engine's
    ``rank * state_rows + b`` (DPScheduler gives each rank ``mamba_num_blocks // ranks`` rows of
    the compact pool, which the cache splits over the ranks along axis 0, as tpu-inference's
    runner reads them)."""

    def __init__(self, plan: StepPlan, shards: int = 1, shard_slots: tuple[int, ...] = (0,)) -> None:
        """``shards``: the batch shards (DP ranks); ``shard_slots``: each host store's slots per
        batch shard (SlotTable.shard_slots)."""
        self.plan = plan
        self.block_offset, self.slot_offset, self.id_offset = plan.placement()
        self.rank = self.id_offset >> RANK_SAVE_ID_SHIFT
        self.kv_slots = plan.num_slots - plan.state_slots
        self.shard_slots = shard_slots
        split = plan.num_blocks and plan.state_slots  # DPScheduler with a state pool
        # The engine's first state slot: past every shard's KV slots under DPScheduler, past the
        # plan's KV slots with one scheduler (whose numbering is the engine's).
        self.state_base = shards * shard_slots[0] if split else self.kv_slots
        # A state slot of the plan's own range in the state store (the tiers' pool 1, Placement):
        # the engine's slot less ``state_base``, the rank's share under DPScheduler.
        self.state_offset = (self.rank * shard_slots[1] if split else 0) - self.kv_slots
        if split:  # every rank moves
            self._place_pools()
        elif not (self.block_offset or self.slot_offset or self.id_offset):  # one scheduler: nothing moves
            self.flush, self.save, self.loads = plan.flush, plan.save, plan.loads
        else:
            b, s, i = self.block_offset, self.slot_offset, self.id_offset
            self.flush, self.save = (SaveBatch(_shift(x.block_ids, b), _shift(x.slots, s), _shift(x.save_ids, i),
                                               x.keys) for x in (plan.flush, plan.save))
            self.loads = tuple(LoadRequest(ld.req_id, tuple(_shift(ld.block_ids, b)), _shift(ld.slots, s),
                                           _shift(ld.save_ids, i), ld.unavailable_block_ids) for ld in plan.loads)
        # One scheduler for the engine: every chunk was saved from its destination's batch shard,
        # the engine's default (``TransferEngine.load``); nothing to compute per row.
        if not plan.num_blocks:
            self.sources = None
        elif not plan.state_slots:
            self.sources = tuple(self._sources(ld) for ld in self.loads)

    def _pools_of(self, slots) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Slots of the plan, each named from the planning rank's range (another rank's by its
        offset, ``LoadRequest``): their engine slots, their owner ranks and whether each is a
        state slot (class doc)."""
        plan = self.plan
        owner, local = np.divmod(np.asarray(slots, np.int64) + self.rank * plan.num_slots, plan.num_slots)
        state = local >= self.kv_slots
        engine = np.where(state, self.state_base + owner * self.shard_slots[1] + local - self.kv_slots,
                          owner * self.shard_slots[0] + local)
        return engine, owner, state

    def _blocks(self, block_ids, state: np.ndarray) -> np.ndarray:
        """The rank's block ids (state rows where ``state``) in the engine's numbering."""
        return np.asarray(block_ids, np.int64) + np.where(state, self.rank * self.plan.state_rows, self.block_offset)

    def _place_pools(self) -> None:
        """Place a DP rank's plan over both pools (class doc); a load's source is the owner rank's
        first KV block or first state row (``_sources``)."""
        plan, i = self.plan, self.id_offset
        self.slot_offset = self.rank * self.shard_slots[0]  # the rank's KV slots in the engine (tiers: pool 0)

        def batch(x: SaveBatch) -> SaveBatch:
            if not x:
                return x
            slots, _, state = self._pools_of(x.slots)
            return SaveBatch(tuple(self._blocks(x.block_ids, state).tolist()), tuple(slots.tolist()),
                             _shift(x.save_ids, i), x.keys)

        self.flush, self.save = batch(plan.flush), batch(plan.save)
        loads, sources = [], []
        for ld in plan.loads:
            slots, owner, state = self._pools_of(ld.slots)
            blocks = self._blocks(ld.block_ids, state)
            first = np.where(state, owner * plan.state_rows, owner * plan.num_blocks)
            loads.append(LoadRequest(ld.req_id, tuple(blocks.tolist()), tuple(slots.tolist()), _shift(ld.save_ids, i),
                                     ld.unavailable_block_ids))
            sources.append(np.where(owner == self.rank, blocks, first).tolist())
        self.loads, self.sources = tuple(loads), tuple(sources)

    def _sources(self, load: LoadRequest) -> Sequence[int]:
        """A chunk of the planning scheduler's own range was saved from the destination's batch
        shard (the check is the one a single scheduler always had). Under DPScheduler each rank
        saves from its own blocks into its own range of slots, so another rank's chunk (a
        cross-rank hit) sits in the shard of that rank's blocks: its first block names it."""
        owner = np.asarray(load.slots, np.int64) // self.plan.num_slots
        return np.where(owner == self.rank, np.asarray(load.block_ids, np.int64), owner * self.plan.num_blocks).tolist()


def _shift(ids, offset: int):
    if isinstance(ids, range):
        return range(ids.start + offset, ids.stop + offset, ids.step)
    return tuple(x + offset for x in ids)


def _concat_saves(batches: list[SaveBatch]) -> SaveBatch:
    batches = [b for b in batches if b]
    if len(batches) <= 1:
        return batches[0] if batches else SaveBatch()
    return SaveBatch(*(tuple(x for b in batches for x in getattr(b, f)) for f in ("block_ids", "slots", "save_ids")),
                     keys=b"".join(b.keys for b in batches))


def _concat_loads(placed: list[_Placed]) -> tuple[list[int], list[int], list[int], list[int] | None]:
    """The plans' loads as one: blocks, slots, save ids and, under DPScheduler, the source blocks
    (``_Placed.sources``; None with one scheduler, whose plan is the only one)."""
    blocks, slots, save_ids = [], [], []
    for p in placed:
        for load in p.loads:
            blocks.extend(load.block_ids)
            slots.extend(load.slots)
            save_ids.extend(load.save_ids)
    if placed[0].sources is None:
        return blocks, slots, save_ids, None
    return blocks, slots, save_ids, [b for p in placed for src in p.sources for b in src]
