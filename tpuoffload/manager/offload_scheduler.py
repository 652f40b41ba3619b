"""``OffloadScheduler``: the scheduler half of the connector, one plan per engine step.

Runs on vLLM's scheduler thread, on every step's critical path. It only routes vLLM's hooks to the
parts that do the work, each with one job:

* ``RequestLifecycle`` (lifecycle.py): vLLM's view of each request, reconciled in any hook order;
  which blocks are still to be saved (eager) or flushed (lazy).
* ``LoadTracker`` (load_tracker.py): lookups, loads planned at admission, loads in flight.
* ``SavePlanner`` (save_planner.py): the one place that deduplicates and sizes saves.
* ``ChunkIndex`` (index.py): content hash -> host slot, LRU eviction, pins, reset.
* ``CompletionLedger`` (ledger.py): which hosts confirmed which saves; expected-reporter checks.
* ``StagingBudget`` (staging.py): bytes of saves in flight.
* ``EventLog`` (events.py): KV events, what host RAM and disk can serve, for ``take_events``
  (only when vLLM publishes KV events: otherwise every index's sink is ``NO_EVENTS``).

Per-step work is proportional to what changed (requests with blocks left to save, new loads,
reports), never to the number of running requests or of chunks held, and per-chunk work is
batched: one call of a compiled loop (kernels.py, numba) per batch for the index, a few numpy
calls for the rest, one ledger entry per save batch.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
from vllm.v1.request import RequestStatus

from tpuoffload import counters as C
from tpuoffload.config import OffloadConfig
from tpuoffload.backend.slot_table import SHARD_SPARE_ROWS
from tpuoffload.messages import OffloadMetadata, OffloadWorkerReport, SaveBatch, StepPlan
from tpuoffload.manager.admission import NO_LIMIT, LoadAdmission
from tpuoffload.manager.disk_index import DiskIndex, DiskTierPlanner, FetchPlanner
from tpuoffload.manager.shared_tier import SharedTierPlanner
from tpuoffload.backend.shared_store import SharedURL
from tpuoffload.manager.event_meta import NO_META_WRITER, MetaWriter, load_meta, meta_file
from tpuoffload.manager.events import (MEDIUM_CPU, MEDIUM_STORAGE, NO_EVENTS, ChunkEvents, EventFormat, EventLog,
                                       TierEvents)
from tpuoffload.manager.index import ChunkIndex
from tpuoffload.manager.kv_groups import KVCacheGroups
from tpuoffload.manager.ledger import CompletionLedger
from tpuoffload.manager.lifecycle import RequestLifecycle
from tpuoffload.manager.load_tracker import LoadTracker
from tpuoffload.manager.rank_view import RankNews, RankView
from tpuoffload.manager.restart import WarmRestart
from tpuoffload.manager.save_planner import NO_SAVES, SavePlanner
from tpuoffload.manager.staging import StagingBudget
from tpuoffload.manager.step_saves import SaveCandidates, StepSaves
from tpuoffload.manager.tier import Tier
from tpuoffload.manager.topology import DPRank
from tpuoffload.snapshot import SnapshotWriter
from tpuoffload.stats import OffloadStats, make_report

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


def _no_events() -> tuple:
    """``take_events`` when vLLM publishes no KV events."""
    return ()


def _no_note(candidates, batch) -> None:
    """``note_saves`` without the shared tier, or with one KV cache group (every chunk group 0's)."""


def waits_for_load(request: "Request") -> bool:
    """vLLM waits for a load of this request (and asserts on a load it does not wait for)."""
    return request.status == RequestStatus.WAITING_FOR_REMOTE_KVS


class OffloadScheduler:
    """The scheduler half of one vLLM scheduler (one per DP rank under DPScheduler): turns vLLM's
    scheduler hooks into one ``StepPlan`` per step and the workers' reports into what is loadable.
    The shape of the deployment (save policy and KV cache groups: ``StepSaves``; DP placement:
    ``DPRank``; tiers: ``Tier``) is decided once here, at construction."""

    def __init__(self, config: OffloadConfig, *, block_size: int, chunk_bytes: int, num_hosts: int,
                 hosts_source: str = "", clock: Callable[[], float] = time.monotonic,
                 dp: DPRank | None = None, kv_groups: KVCacheGroups = KVCacheGroups(),
                 events: EventFormat | None = None, state_chunk_bytes: int = 0,
                 admission: LoadAdmission = NO_LIMIT) -> None:
        """``chunk_bytes``: a KV chunk's bytes on one host; ``state_chunk_bytes``: a GDN/mamba
        state chunk's (``kv_groups`` with a state group: the second slot pool). ``admission``:
        how many loaded requests may wait to run (admission.py; ``load_admission``)."""
        if block_size <= 0 or chunk_bytes <= 0:
            raise ValueError(f"block_size ({block_size}) and chunk_bytes ({chunk_bytes}) must be positive")
        self.config = config
        self.block_size = block_size
        self.chunk_bytes = chunk_bytes
        # Under DPScheduler each rank's half plans over its own batch shard's slots.
        self.dp = dp or DPRank()
        # vLLM's KV cache groups (HMA): a chunk is keyed by content hash and group (kv_groups.py).
        self.kv_groups = kv_groups
        # vLLM takes load failures by block id (``invalid_block_ids``) or by request
        # (``failed_recving``): by request when block ids do not say whose (several KV cache
        # groups; rank-local ids under DPScheduler).
        self._failures_by_request = kv_groups.several or self.dp.failures_by_request
        pools = self._pool_sizes(chunk_bytes, state_chunk_bytes)
        num_slots = sum(pools)
        #: The scheduler's monotonic clock (save deadlines); replaceable, e.g. by tests.
        self.clock = clock
        # Every part counts into this one Counter (registry names: tpuoffload.counters), emptied
        # by each take_stats.
        self.counters: Counter[str] = Counter()
        self.totals: Counter[str] = Counter()  # since start, for snapshots
        # KV events (events.py), decided once: ``events`` is vLLM's, None when it publishes none.
        self._events_log = EventLog(events) if events is not None else None
        self._restored_meta = (load_meta(config.persist_path, self._events_log)
                               if events is not None and config.persist_path is not None else None)
        sink = self._sink(num_slots, MEDIUM_CPU)
        # Under DPScheduler the other ranks hear of this rank's READY chunks (rank_view.py), and
        # this rank's view of theirs serves hits its own index lacks; with one scheduler it is empty.
        self.view = RankView(self.dp.ranks, num_slots)
        self._state_slots = pools[1] if len(pools) > 1 else 0  # the last slots (StepPlan.state_slots)
        self.index = ChunkIndex(num_slots, counters=self.counters,
                                events=RankNews(sink) if self.dp.ranks > 1 else sink, pools=pools)
        # Warm restart with events: the records of every named chunk go beside the checkpoints.
        self._meta_writer = (MetaWriter(config.persist_path, self._events_log, self._event_records, self._meta_file)
                             if events is not None and config.persist_path is not None else NO_META_WRITER)
        self.ledger = CompletionLedger(num_hosts, source=hosts_source, counters=self.counters)
        self.staging = StagingBudget(config.staging_capacity(chunk_bytes))
        self.saves = SavePlanner(self.index, self.ledger, self.staging, chunk_bytes=chunk_bytes,
                                 state_chunk_bytes=state_chunk_bytes,
                                 save_timeout_s=config.save_timeout_s, clock=lambda: self.clock(),
                                 counters=self.counters, with_keys=config.persist_path is not None)
        self.loads = LoadTracker(self.index, block_size, self.counters, kv_groups, self.view)
        self.admission = admission
        self.requests = RequestLifecycle(block_size, lazy=config.lazy_offload,
                                         save_decode_blocks=config.save_decode_blocks)
        # What each step's forward leaves to save (step_saves.py): eager or lazy, one KV cache group
        # or several, decided here once.
        self._step_saves = StepSaves.of(self.requests, kv_groups, config.lazy_offload)
        self.tiers: list[Tier] = self._make_tiers(config, num_hosts)
        # Several KV cache groups and the shared tier: it learns each save's group (shared_tier.py).
        shared = self.tier("shared")
        self._note_saves = shared.note_saves if shared is not None and kv_groups.several else _no_note
        self.take_events = self._events_log.take if self._events_log is not None else _no_events
        self._kv_cache_manager: KVCacheManager | None = None
        self._step = 0
        self._stats_seq = 0
        self.dp_rank: int | None = None if self.dp.ranks > 1 else 0  # known from the first report (DP)
        self._snapshot: SnapshotWriter | None = None
        self._open_snapshot()

    def _pool_sizes(self, chunk_bytes: int, state_chunk_bytes: int) -> tuple[int, ...]:
        """The slots of each pool: KV chunks, then (with a GDN/mamba state group) state chunks,
        from ``config.pool_bytes`` (the workers split their host RAM alike)."""
        pool_bytes = self.config.pool_bytes(chunk_bytes, self.kv_groups.num_pools)
        kv = self.dp.num_slots(pool_bytes[0] // chunk_bytes)
        if kv <= 0:
            raise ValueError(f"cpu_bytes_to_use={pool_bytes[0]} is smaller than "
                             f"{1 if self.dp.ranks == 1 else SHARD_SPARE_ROWS + 1} chunks ({chunk_bytes} bytes per host)")
        if len(pool_bytes) == 1:
            return (kv,)
        if state_chunk_bytes <= 0:
            raise ValueError("a GDN/mamba state group needs the state chunk's bytes (state_chunk_bytes)")
        state = self.dp.num_slots(pool_bytes[1] // state_chunk_bytes)  # the state pool splits like the KV pool
        if state <= 0:
            raise ValueError(f"state_ram_fraction={self.config.state_ram_fraction} of host RAM ({pool_bytes[1]} bytes) "
                             f"holds no state chunk of {state_chunk_bytes} bytes: give it more host RAM or a larger "
                             "fraction")
        return kv, state

    def _sink(self, num_entries: int, medium: str) -> ChunkEvents:
        """An index's event sink: records and announces its chunks when events are on."""
        if self._events_log is None:
            return NO_EVENTS
        return TierEvents(self._events_log, num_entries, medium, self._restored_meta)

    def _make_tiers(self, config: OffloadConfig, num_hosts: int) -> list[Tier]:
        """The tiers beside host RAM, in the order their hooks run (manager/tier.py)."""
        tiers: list[Tier] = []
        # Chunk files per slot pool, each pool its share of the disk (OffloadConfig.disk_pool_bytes).
        disk_chunks = tuple(DiskIndex.capacity(b, chunk, self.dp.ranks) for b, chunk in
                            zip(config.disk_pool_bytes(self.kv_groups.num_pools), self.saves.pool_chunk_bytes)
                            ) if config.disk_path else (0,)
        disk_events = self._sink(sum(disk_chunks), MEDIUM_STORAGE)
        if config.persist_path is not None:
            tiers.append(WarmRestart(config.persist_path, config.persist_interval_s, config.persist_timeout_s,
                                     self.index, num_hosts, self.counters, lambda: self.clock(),
                                     on_checkpoint=self._meta_writer.write,
                                     plans_checkpoints=lambda: self.dp_rank == 0))
        if config.disk_path is not None:
            if min(disk_chunks) == 0:
                raise ValueError(f"disk_bytes_to_use={config.disk_bytes_to_use} is smaller than one chunk file"
                                 + (f" of each slot pool (KV, state: {disk_chunks} files)" if len(disk_chunks) > 1 else ""))
            disk = DiskIndex(disk_chunks, num_hosts, self.counters, lambda: self.clock(), config.save_timeout_s,
                             events=disk_events)
            fetches = FetchPlanner(self.saves, disk, self.block_size, self.counters, self.loads.take_lookup,
                                   self.kv_groups)
            tiers.append(DiskTierPlanner(disk, fetches, self.index, num_hosts, self.counters, lambda: self.clock(),
                                         config.persist_timeout_s, keeps_files=config.persist_path is not None))
        if config.shared_url is not None:  # the store every replica shares (manager/shared_tier.py)
            tiers.append(SharedTierPlanner(self.saves, self.ledger, num_hosts, self.block_size, self.counters,
                                           lambda: self.clock(), SharedURL.parse(config.shared_url).timeout_s,
                                           self.loads.take_lookup, self.kv_groups))
        return tiers

    def _meta_file(self) -> str | None:
        """The restart file of this half's event records: under DPScheduler its rank's, once the
        workers said which rank it is (until then it holds no chunk: nothing to write)."""
        if self.dp.ranks == 1:
            return meta_file(None)
        return meta_file(self.dp_rank) if self.dp_rank is not None else None

    def _event_records(self) -> np.ndarray:
        """The event records of every chunk named in host RAM and on disk (for the restart file)."""
        indexes = [self.index] + [t.disk.index for t in self.tiers if isinstance(t, DiskTierPlanner)]
        return np.concatenate([i.events.entries(i.named_slots()) for i in indexes])

    def tier(self, name: str) -> Tier | None:
        """The tier of that name, if configured (operators' and tests' view)."""
        return next((t for t in self.tiers if t.name == name), None)

    def _saves_blocked(self) -> bool:
        return any(t.blocks_saves for t in self.tiers)

    def has_pending_push_work(self) -> bool:
        """Whether vLLM should keep stepping with no request in flight (``Tier.keeps_engine_stepping``)."""
        return any(t.keeps_engine_stepping for t in self.tiers)

    def _open_snapshot(self) -> None:
        name = self.dp.snapshot_name(self.dp_rank)
        if self.config.stats_dir and name is not None:
            self._snapshot = SnapshotWriter(self.config.stats_dir, name, self.config.stats_interval_s, self.snapshot)

    @property
    def num_hosts(self) -> int:
        return self.ledger.num_hosts

    # ------------------------------------------------------------------ wiring
    def bind_kv_cache_manager(self, kv_cache_manager: "KVCacheManager") -> None:
        self._kv_cache_manager = kv_cache_manager

    def _block_ids(self, req_id: str):
        """The request's block ids: group 0's list, or with several KV cache groups all of them."""
        return self.kv_groups.ours(self._kv_cache_manager.get_block_ids(req_id))

    # ------------------------------------------------------------------ admission
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond the local hit that host RAM can supply, and whether they load
        asynchronously (always, when there are any: vLLM then caches the loaded blocks in its
        prefix cache only once every host loaded them, and never a failed load's). No side
        effect: vLLM asks again every step until it admits the request."""
        hits = self.loads.lookup(request, num_computed_tokens)
        if self.tiers and any(t.wants(request, num_computed_tokens // self.block_size, hits) for t in self.tiers):
            return None, False  # e.g. its prefix continues on disk: ask again once it is back in host RAM
        if hits and not self.admission.may_load():
            self.counters[C.LOADS_DEFERRED] += 1
            return None, False  # loaded requests wait to run: ask again once one has (admission.py)
        return hits * self.block_size, hits > 0

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks | None",
                                 num_external_tokens: int) -> None:
        """vLLM allocated ``blocks`` for ``request`` (admission or resumption), expecting
        ``num_external_tokens`` tokens from host RAM (``blocks`` None: ask the KV cache manager)."""
        self.requests.admit(request)
        for t in self.tiers:
            t.forget(request.request_id)
        lookup = self.loads.take_lookup(request.request_id)
        if num_external_tokens == 0:
            if lookup is not None:
                self.counters[C.LOOKUP_TOKENS] += request.num_tokens
            return
        self.counters[C.LOOKUP_TOKENS] += request.num_tokens
        self.counters[C.HIT_TOKENS] += num_external_tokens
        self.admission.admitted(request.request_id)
        if blocks is None:
            block_ids = self._block_ids(request.request_id)
        else:
            block_ids = self.kv_groups.ours(blocks.get_block_ids())
        self.loads.plan(request, lookup, num_external_tokens // self.block_size, block_ids)

    # ------------------------------------------------------------------ per-step plan
    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> OffloadMetadata:
        """The step's plan. Order matters: vLLM's view first (preemptions applied exactly once,
        loads sent iff vLLM waits for them), then the flush of blocks vLLM may already have freed
        (gathered first on every host, invariant 9), then this step's saves, with the loaded
        slots pinned so no eviction hands them to a save in the same plan (invariant 7/11)."""
        step = self._step
        self.ledger.expire(self.clock())
        self._apply_resolved()
        self.ledger.check_reporters(step)
        # Reconcile vLLM's view first: preemptions since the last plan (a reset may have preempted
        # a request that this same schedule() already admitted again).
        preempted = scheduler_output.preempted_req_ids or ()
        self.counters[C.REQUESTS_PREEMPTED] += len(preempted)
        self.requests.preempted(preempted)
        self.admission.ran(scheduler_output.num_scheduled_tokens)
        loads, load_slots = self.loads.emit(waits_for_load)
        # A newly scheduled request's block ids are in the output already (vLLM built them for the
        # workers); the others come from the KV cache manager.
        ours = self.kv_groups.ours
        new_blocks = {r.req_id: ours(r.block_ids) for r in getattr(scheduler_output, "scheduled_new_reqs", ())}

        def block_ids_of(req_id: str) -> list[int]:
            ids = new_blocks.get(req_id)
            return ids if ids is not None else self._block_ids(req_id)

        # The workers read the loaded slots in this step, before any later step can write to
        # them, so the pins only have to outlive this plan's slot allocations.
        for t in self.tiers:
            t.start_step(step)
        blocked = self._saves_blocked()
        plan = self._skip_saves if blocked else self.saves.plan

        def planned(c: SaveCandidates | None) -> SaveBatch:
            """Save candidates planned into slots, each saved chunk's group noted for the shared tier."""
            if c is None:
                return NO_SAVES
            batch = plan(c.block_ids, c.keys, step, c.origins, c.pools)
            self._note_saves(c, batch)
            return batch

        self.index.pin(load_slots)
        try:
            if not blocked:
                for t in self.tiers:
                    t.plan_into_ram(step)
            flush = planned(self._step_saves.flush(self.requests.take_flush()))
            save = planned(self._step_saves.candidates(scheduler_output, block_ids_of))
        finally:
            self.index.unpin(load_slots)
        parts = {t.name: part for t in self.tiers if (part := t.finish_step(step)) is not None}
        self._apply_resolved()  # early reports replayed by the new batches
        plan = StepPlan(step, self.index.num_slots, flush, save, loads, self.requests.take_release(),
                        tiers=parts, source=self.dp.source, num_blocks=self.dp.num_blocks,
                        failures_by_request=self._failures_by_request,
                        news=self.index.events.take_news(self.view.epoch), state_slots=self._state_slots,
                        state_rows=self.dp.state_rows)
        self._step += 1
        if self._snapshot is not None:
            self._snapshot.maybe_write()
        return OffloadMetadata([plan])

    def _skip_saves(self, block_ids, hashes, step: int, origins=(), pools=None) -> SaveBatch:
        """While a checkpoint is written no save is planned (it would donate the stores)."""
        self.counters[C.SKIPPED_CHECKPOINT] += len(hashes)
        return NO_SAVES

    # ------------------------------------------------------------------ finish
    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Returns (delay_free, params). Blocks are held only when a flush of them has not been
        dispatched yet (lazy mode): every save already in a plan is dispatched by the workers
        before any later step can reuse the blocks."""
        req_id = request.request_id
        self.admission.finished(req_id)
        load_in_flight = self.loads.forget(req_id)
        for t in self.tiers:
            t.forget(req_id)
        return self.requests.finish(request, block_ids, load_in_flight), None

    def request_finished_all_groups(self, request: "Request",
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid KV cache manager (``SupportsHMA``) calls this instead of
        ``request_finished``, with the block ids of every group. The ids only say whether vLLM
        still holds the blocks (not after a preemption): a lazy flush saves the ids it remembered of
        the groups that hold every block until the finish (step_saves.py)."""
        return self.request_finished(request, block_ids[0] if block_ids else [])

    # ------------------------------------------------------------------ reports from workers
    def update_connector_output(self, output: "KVConnectorOutput") -> None:
        """The workers' merged outputs: save outcomes into the ledger (invariants 7, 8), load
        errors discard their chunks (invariant 11), completions of requests this half does not
        own are taken out of ``output`` and counted (invariant 8).

        vLLM calls this before it walks ``finished_recving`` / ``finished_sending``, asserting that
        each id is one of its requests. Under DPScheduler every rank's scheduler gets its own copy
        of the whole output, every rank's completions included: each rank's half leaves in it only
        the loads it has in flight and the releases it awaits, so a rank's vLLM scheduler sees its
        own ids only (with one scheduler the same rule drops only ids nobody expects)."""
        report = getattr(output, "kv_connector_worker_meta", None)
        # The exact type first: isinstance against vLLM's abstract base class takes the slow path
        # of abc (tens of microseconds when abc's caches were invalidated meanwhile).
        if report is not None and (type(report) is OffloadWorkerReport or isinstance(report, OffloadWorkerReport)):
            if self.dp_rank is None and self.dp.source in report.ranks:
                self.dp_rank = report.ranks[self.dp.source]
                logger.info("tpuoffload scheduler (source %d) plans for DP rank %d", self.dp.source, self.dp_rank)
                self._open_snapshot()
                self.view.rank = self.dp_rank
            # Under DPScheduler the report holds every rank's saves: only this half's are read;
            # the other ranks' news goes into the view.
            for host, saved, failed in report.outcomes(self.dp.source):
                self.ledger.report(host, ok=saved, failed=failed)
            self.view.apply(report.news)
            for t in self.tiers:
                t.on_report(report.tier_parts(t.name, self.dp.source))
            self._apply_resolved()
        # A chunk that failed to load on some host is not offered again (vLLM recomputes it).
        # Failures by request (several KV cache groups, DPScheduler): every chunk its load read goes.
        failed_recving = getattr(output, "failed_recving", None)
        if failed_recving:
            self._discard(self.loads.failed_requests(failed_recving))
        if output.invalid_block_ids:
            self._discard(self.loads.failed_blocks(output.invalid_block_ids))
        unknown = 0
        if output.finished_recving:
            mine = self.loads.finished(output.finished_recving)
            unknown += len(output.finished_recving) - len(mine)
            output.finished_recving = mine
        if output.finished_sending:
            mine = self.requests.released(output.finished_sending)
            unknown += len(output.finished_sending) - len(mine)
            output.finished_sending = mine
        if unknown:
            self.counters[C.UNKNOWN_REQUEST] += unknown

    def _discard(self, chunks) -> None:
        """Chunks whose load failed on some host, as the loads named them: the rank's own leave its
        index, another rank's leave its view (under DPScheduler)."""
        for slot, save_id in chunks:
            if not self.index.discard(slot, save_id) and self.view.discard(slot, save_id):
                self.counters[C.CROSS_RANK_DISCARDED] += 1

    def _apply_resolved(self) -> None:
        if not self.ledger.has_resolved():
            return
        res = self.ledger.take_resolved()
        if len(res.ready_ids):
            self.index.mark_ready(res.ready_slots, res.ready_ids)
        if len(res.dropped_ids):
            self.index.drop(res.dropped_slots, res.dropped_ids)
        for t in self.tiers:
            t.on_resolved(res)
        self.staging.release(self.saves.staged_bytes(res.ready_slots) + self.saves.staged_bytes(res.dropped_slots))

    # ------------------------------------------------------------------ reset
    def reset_cache(self) -> bool:
        """Nothing saved before this call is ever loaded after it, saves in flight included (their
        late confirmations free their slots instead of making them loadable), and lazy mode never
        saves blocks computed before it. vLLM calls it from
        ``reset_prefix_cache(reset_connector=True)``, between steps."""
        revoked = self.index.revoke_all()
        # Under DPScheduler every rank resets at once: the news of chunks from before the reset is
        # dropped, and news from before it is ignored when it arrives (the view's epoch).
        self.index.events.take_news(self.view.epoch)
        self.view.reset()
        for t in self.tiers:
            t.reset(self.ledger.next_save_id)
        self.loads.clear_lookups()
        self.requests.forget_unsaved()
        self.counters[C.RESETS] += 1
        logger.info("tpuoffload: connector cache reset; %d chunks revoked", revoked)
        return True

    def close(self) -> None:
        """The engine shuts down (vLLM's scheduler, after its executor: the hosts' last checkpoint
        is written): the snapshot file gets this half's last state (what it still holds once the
        last requests finished), for ``tpuoffload stats`` and leak checks; with KV events and warm
        restart, the records of the chunks named now are written beside the checkpoints."""
        if self._snapshot is not None:
            self._snapshot.maybe_write(force=True)
        self._meta_writer.close()

    # ------------------------------------------------------------------ observability
    def take_stats(self) -> OffloadStats | None:
        values = self.counters
        if not values:
            return None
        totals = self.totals
        for name, value in values.items():  # (Counter.update asks abc whether values is a Mapping: slow)
            totals[name] += value
        self._stats_seq += 1
        report = make_report(self.dp.stats_source(self.dp_rank), self._stats_seq, values)
        values.clear()
        return OffloadStats(report) if report else None

    def leak_report(self) -> dict[str, int]:
        """What this half holds right now; every value is zero when the engine is idle and every
        save resolved. The public gauges (no private fields needed): chunks pinned by loads, saves
        in flight, staging in use, requests held, and what is queued between steps."""
        return {
            "requests": self.requests.num_held(),
            "awaiting_release": self.requests.num_awaiting_release(),
            "queued_flush_or_release": self.requests.num_pending(),
            "loads_planned": self.loads.num_planned(),
            "loads_in_flight": self.loads.num_in_flight(),
            "loads_waiting_to_run": self.admission.waiting,
            "pinned_chunks": self.index.num_pinned(),
            "saving_chunks": self.index.num_saving(),
            "ledger_pending": len(self.ledger),
            "staging_bytes": self.staging.in_use,
            **{k: v for t in self.tiers for k, v in t.leak_report().items()},
        }

    def snapshot(self) -> dict[str, Any]:
        """The scheduler half's view, for ``scheduler.json``."""
        totals = self.totals + self.counters
        leaks = self.leak_report()
        return {
            "kind": "scheduler",
            "dp_rank": self.dp_rank,
            "step": self._step - 1,
            "num_hosts": self.ledger.num_hosts,
            "totals": dict(totals),
            "slots_total": self.index.num_slots,
            "slots_used": len(self.index),
            "staging_capacity": self.staging.capacity,
            "leak_gauges": sorted(leaks),
            **leaks,
        }


def leaks_in(snapshot: dict[str, Any]) -> dict[str, int]:
    """``leak_report()`` as a scheduler half's snapshot recorded it (e.g. a DP rank's, read from its
    ``scheduler-dp<rank>.json``)."""
    return {k: snapshot[k] for k in snapshot["leak_gauges"]}
