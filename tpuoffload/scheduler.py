"""Scheduler half of the connector: decides what to save and load, one plan per engine step.

Runs on vLLM's scheduler thread, on every step's critical path, so the per-step work is
proportional to what changed (requests with blocks left to save, new loads, reports), never to
the number of running requests or of chunks held in host RAM.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tpuoffload.config import OffloadConfig
from tpuoffload.manager import ChunkIndex, CompletionLedger, Resolution, StagingBudget
from tpuoffload.manager.chunk_index import Chunk
from tpuoffload.messages import LoadRequest, OffloadMetadata, OffloadWorkerReport, SaveBatch
from tpuoffload.snapshot import SnapshotWriter
from tpuoffload.stats import OffloadStats, make_report

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


@dataclass
class _RequestState:
    request: "Request"
    # Blocks [0, watermark) were saved, found in host RAM, or skipped: never considered again.
    watermark: int = 0
    pending_load: LoadRequest | None = None
    pinned: list[Chunk] = field(default_factory=list)
    # Lazy mode: ids of the full blocks computed so far (up to the save limit). A preemption frees
    # them and zeroes num_computed_tokens before the connector hears of it, so remember them here.
    computed_block_ids: list[int] = field(default_factory=list)


class OffloadScheduler:
    def __init__(self, config: OffloadConfig, *, block_size: int, chunk_bytes: int, num_hosts: int,
                 clock=time.monotonic) -> None:
        if block_size <= 0 or chunk_bytes <= 0:
            raise ValueError(f"block_size ({block_size}) and chunk_bytes ({chunk_bytes}) must be positive")
        self.config = config
        self.block_size = block_size
        self.chunk_bytes = chunk_bytes
        host_bytes = config.host_bytes(chunk_bytes)
        num_slots = host_bytes // chunk_bytes
        if num_slots == 0:
            raise ValueError(f"cpu_bytes_to_use={host_bytes} is smaller than one chunk ({chunk_bytes} bytes per host)")
        self.index = ChunkIndex(num_slots)
        self.ledger = CompletionLedger(num_hosts)
        self.staging = StagingBudget(config.staging_capacity(chunk_bytes))
        self._clock = clock
        self._kv_cache_manager: KVCacheManager | None = None
        self._requests: dict[str, _RequestState] = {}
        self._saving: set[str] = set()  # requests that may still have blocks to save
        self._lookups: dict[str, tuple[int, int]] = {}  # req_id -> (local blocks, hit blocks)
        self._pending_loads: list[str] = []
        # Loads planned but not yet reported: block id -> (hash, save_id), and req_id -> block ids.
        self._loading_blocks: dict[int, tuple[bytes, int]] = {}
        self._loading_reqs: dict[str, list[int]] = {}
        self._flush_queue: list[tuple[str, list[int]]] = []  # (req_id, its first full block ids) to save before forward
        self._release_queue: list[str] = []
        self._awaiting_release: set[str] = set()
        self._step = 0
        self._stats_seq = 0
        self.counters: Counter[str] = Counter()
        self.totals: Counter[str] = Counter()  # since start, for snapshots
        self._snapshot = (SnapshotWriter(config.stats_dir, "scheduler.json", config.stats_interval_s, self.snapshot)
                          if config.stats_dir else None)

    # ------------------------------------------------------------------ wiring
    def bind_kv_cache_manager(self, kv_cache_manager: "KVCacheManager") -> None:
        self._kv_cache_manager = kv_cache_manager

    def _block_ids(self, req_id: str) -> list[int]:
        return self._kv_cache_manager.get_block_ids(req_id)[0]

    # ------------------------------------------------------------------ loads
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond the local hit that host RAM can supply. No side effect on the index (this
        is asked again every step until the request is admitted); the answer is memoised for
        update_state_after_alloc only."""
        local = num_computed_tokens // self.block_size
        # Leave at least one token to compute: vLLM needs a token to sample from.
        limit = (request.num_tokens - 1) // self.block_size
        hashes = request.block_hashes
        hits = self.index.count_ready_prefix(hashes[local:limit]) if limit > local else 0
        self._lookups[request.request_id] = (local, hits)
        return hits * self.block_size, hits > 0

    def update_state_after_alloc(self, request: "Request", num_external_tokens: int) -> None:
        req_id = request.request_id
        state = self._requests.get(req_id)
        if state is None:
            state = self._requests[req_id] = _RequestState(request)
            self._saving.add(req_id)
        lookup = self._lookups.pop(req_id, None)
        if num_external_tokens == 0:
            if lookup is not None:
                self.counters["lookup_tokens"] += request.num_tokens
            return
        local, hits = lookup if lookup is not None else (0, 0)
        n = num_external_tokens // self.block_size
        self.counters["lookup_tokens"] += request.num_tokens
        self.counters["hit_tokens"] += num_external_tokens
        hashes = request.block_hashes[local:local + n]
        ready = self.index.count_ready_prefix(hashes)
        state.pinned = self.index.pin(hashes[:ready])
        block_ids = self._block_ids(req_id)[local:local + n]
        state.pending_load = LoadRequest(
            req_id=req_id,
            block_ids=tuple(block_ids[:ready]),
            slots=tuple(c.slot for c in state.pinned),
            save_ids=tuple(c.save_id for c in state.pinned),
            unavailable_block_ids=tuple(block_ids[ready:]),
        )
        self._pending_loads.append(req_id)

    # ------------------------------------------------------------------ per-step plan
    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> OffloadMetadata:
        self._resolve(((sid, Resolution.EXPIRED) for sid in self.ledger.expire(self._clock())))
        for req_id in scheduler_output.preempted_req_ids or ():
            self._on_preempted(req_id)

        loads = []
        for req_id in self._pending_loads:
            state = self._requests.get(req_id)
            if state is not None and state.pending_load is not None:
                loads.append(state.pending_load)
                state.pending_load = None
        self._pending_loads = []

        flush = self._plan_flush()
        if self.config.lazy_offload:
            save = SaveBatch()
            self._track_computed(scheduler_output)
        else:
            save = self._plan_step_saves(scheduler_output)

        # The workers copy the loaded slots out during this step, before any later step can write
        # to them, so the pins only have to outlive this step's allocations (done above).
        for load in loads:
            state = self._requests.get(load.req_id)
            if state is not None:
                for block_id, chunk in zip(load.block_ids, state.pinned):
                    self._loading_blocks[block_id] = (chunk.hash, chunk.save_id)
                self._loading_reqs[load.req_id] = list(load.block_ids)
                self.index.unpin(state.pinned)
                state.pinned = []
        release, self._release_queue = tuple(self._release_queue), []
        meta = OffloadMetadata(self._step, self.index.num_slots, flush, save, tuple(loads), release)
        self._step += 1
        if self._snapshot is not None:
            self._snapshot.maybe_write()
        return meta

    def _filled_blocks(self, scheduler_output: "SchedulerOutput"):
        """Yield (req_id, state, full) for each scheduled request that may still have blocks to
        save, ``full`` being its full blocks once this step's forward ran; requests with nothing
        left to save stop being visited, so decode-only steps cost nothing here."""
        done = []
        scheduled = scheduler_output.num_scheduled_tokens
        for req_id in self._saving:
            n_sched = scheduled.get(req_id)
            if n_sched is None:
                continue
            state = self._requests[req_id]
            req = state.request
            limit = self._save_limit(req)
            full = min((req.num_computed_tokens + n_sched) // self.block_size, limit, len(req.block_hashes))
            yield req_id, state, full
            if full >= limit:
                done.append(req_id)
        self._saving.difference_update(done)

    def _plan_step_saves(self, scheduler_output: "SchedulerOutput") -> SaveBatch:
        """Eager mode: the full blocks this step's forward completes."""
        candidates: list[tuple[int, bytes]] = []
        for req_id, state, full in self._filled_blocks(scheduler_output):
            if full > state.watermark:
                block_ids = self._block_ids(req_id)
                hashes = state.request.block_hashes
                candidates.extend(zip(block_ids[state.watermark:full], hashes[state.watermark:full]))
                state.watermark = full
        return self._allocate(candidates)

    def _track_computed(self, scheduler_output: "SchedulerOutput") -> None:
        """Lazy mode: remember the ids of the full blocks each scheduled request has computed
        (including this step's), for a flush at finish or preemption."""
        for req_id, state, full in self._filled_blocks(scheduler_output):
            if full > len(state.computed_block_ids):
                state.computed_block_ids = self._block_ids(req_id)[:full]

    def _save_limit(self, req: "Request") -> int:
        if self.config.save_decode_blocks:
            return 1 << 62
        return req.num_prompt_tokens // self.block_size

    def _plan_flush(self) -> SaveBatch:
        candidates = []
        for req_id, block_ids in self._flush_queue:
            state = self._requests.get(req_id)
            full = len(block_ids)
            if state is None or full <= state.watermark:
                continue
            req = state.request
            candidates.extend(zip(block_ids[state.watermark:full], req.block_hashes[state.watermark:full]))
            state.watermark = full
        self._flush_queue = []
        return self._allocate(candidates)

    def _allocate(self, candidates: list[tuple[int, bytes]]) -> SaveBatch:
        if not candidates:
            return SaveBatch()
        fits = (self.staging.capacity - self.staging.in_use) // self.chunk_bytes
        # Deduplicate (against the index and within the batch: parallel-sampling siblings compute
        # the same blocks in one step) first, so staging is only spent and counted on real saves.
        contains = self.index.contains
        fresh, seen = [], set()
        for b, h in candidates:
            if h in seen or contains(h):
                continue
            seen.add(h)
            fresh.append((b, h))
        self.counters["dedup_index"] += len(candidates) - len(fresh)
        if len(fresh) > fits:
            self.counters["skipped_staging"] += len(fresh) - fits
            fresh = fresh[:fits]
        first_block = {}
        for b, h in fresh:
            first_block.setdefault(h, b)
        allocs = self.index.allocate_for_save(h for _, h in fresh)
        if not allocs:
            return SaveBatch()
        deadline = self._clock() + self.config.save_timeout_s
        # len(allocs) <= fits: one reservation for all of them always succeeds.
        self.staging.try_reserve(self.chunk_bytes * len(allocs))
        register = self.ledger.register
        save_ids = []
        for a in allocs:
            save_ids.append(a.save_id)
            early = register(a.save_id, deadline)
            if early:
                self._resolve([(a.save_id, res) for _, res in early])
        self.counters["saves_issued"] += len(allocs)
        return SaveBatch(
            block_ids=tuple([first_block[a.hash] for a in allocs]),
            slots=tuple([a.slot for a in allocs]),
            save_ids=tuple(save_ids),
        )

    # ------------------------------------------------------------------ request lifecycle
    def _on_preempted(self, req_id: str) -> None:
        state = self._requests.get(req_id)
        if state is None:
            return
        if state.pinned:  # admitted with a load, then preempted before the plan was built
            self.index.unpin(state.pinned)
            state.pinned = []
            state.pending_load = None
        if self.config.lazy_offload:
            # vLLM already freed the blocks, but nothing overwrites them before this step's
            # forward, and the flush is gathered before it. The request recomputes (or loads)
            # into new blocks when it resumes.
            if len(state.computed_block_ids) > state.watermark:
                self._flush_queue.append((req_id, state.computed_block_ids))
            state.computed_block_ids = []
            self._saving.add(req_id)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Returns (delay_free, params). Blocks are held only when a save of them has not been
        dispatched yet (lazy mode): every save already in a plan is dispatched by the workers before
        any later step can reuse the blocks."""
        req_id = request.request_id
        self._lookups.pop(req_id, None)
        state = self._requests.get(req_id)
        if state is None:
            return False, None
        if state.pinned:
            self.index.unpin(state.pinned)
            state.pinned = []
        delay = False
        if self.config.lazy_offload:
            # Only blocks a scheduled forward computed (a load not yet verified by a forward, e.g.
            # a request aborted while its load was in flight, may have failed: never save it).
            if len(state.computed_block_ids) > state.watermark:
                self._flush_queue.append((req_id, state.computed_block_ids))
                self._release_queue.append(req_id)
                self._awaiting_release.add(req_id)
                delay = True
        if not delay:
            self._forget(req_id)
        return delay, None

    def _forget(self, req_id: str) -> None:
        self._requests.pop(req_id, None)
        self._saving.discard(req_id)

    # ------------------------------------------------------------------ reports from workers
    def update_connector_output(self, output: "KVConnectorOutput") -> None:
        report = getattr(output, "kv_connector_worker_meta", None)
        if isinstance(report, OffloadWorkerReport):
            resolutions = []
            ledger_report = self.ledger.report
            for (host, save_id, ok) in report.results:
                res = ledger_report(host, save_id, ok)
                if res is not None:
                    resolutions.append((save_id, res))
            self._resolve(resolutions)
        # A chunk that failed to load on some host is not offered again (vLLM recomputes it).
        for block_id in output.invalid_block_ids or ():
            entry = self._loading_blocks.get(block_id)
            if entry is not None:
                self.index.discard(*entry)
        for req_id in output.finished_recving or ():
            for block_id in self._loading_reqs.pop(req_id, ()):
                self._loading_blocks.pop(block_id, None)
        for req_id in output.finished_sending or ():
            if req_id in self._awaiting_release:
                self._awaiting_release.discard(req_id)
                self._forget(req_id)
            else:
                self.counters["unknown_request"] += 1

    def _resolve(self, resolutions) -> None:
        mark_ready, drop_save = self.index.mark_ready, self.index.drop_save
        resolved = 0
        # Save ids grow along a request's blocks: resolving newest first leaves a prefix's first
        # chunk most recently used, so LRU evicts prefixes from the tail (see ChunkIndex.unpin).
        for save_id, res in sorted(resolutions, key=lambda r: r[0], reverse=True):
            chunk = mark_ready(save_id) if res is Resolution.READY else drop_save(save_id)
            if chunk is not None:
                resolved += 1
        if resolved:
            self.staging.release(self.chunk_bytes * resolved)

    # ------------------------------------------------------------------ observability
    def take_stats(self) -> OffloadStats | None:
        values = dict(self.counters)
        for name, v in self.index.counters.items():
            values[name] = values.get(name, 0) + v  # dedup_index is counted by both: add, never overwrite
        for name, v in self.ledger.counters.items():
            values[f"ledger_{name}"] = v
        self.counters.clear()
        self.index.counters.clear()
        self.ledger.counters.clear()
        self.totals.update(values)
        if not any(values.values()):
            return None
        self._stats_seq += 1
        return OffloadStats(make_report("sched", self._stats_seq, values))

    def snapshot(self) -> dict[str, Any]:
        """The scheduler half's view, for ``scheduler.json``."""
        totals = self.totals + self.counters + self.index.counters
        return {
            "kind": "scheduler",
            "step": self._step - 1,
            "num_hosts": self.ledger.num_hosts,
            "totals": dict(totals),
            "slots_total": self.index.num_slots,
            "slots_used": len(self.index),
            "saving_chunks": self.index.num_saving(),
            "staging_bytes": self.staging.in_use,
            "staging_capacity": self.staging.capacity,
            "ledger_pending": len(self.ledger),
            "requests": len(self._requests),
        }

    def leak_report(self) -> dict[str, int]:
        """What is still held; all zero when the engine is idle and every save resolved."""
        return {
            "requests": len(self._requests),
            "pinned_chunks": self.index.num_pinned(),
            "saving_chunks": self.index.num_saving(),
            "ledger_pending": len(self.ledger),
            "staging_bytes": self.staging.in_use,
            "awaiting_release": len(self._awaiting_release),
        }
