"""Worker half of the connector: executes each step's plan on this host.

Per step (the order vLLM's KVConnectorModelRunnerMixin calls it)::

    bind(meta)        flush saves (blocks of preempted/finished requests) before the forward
    start_load()      this step's loads: one host-to-device transfer and one scatter
    <forward>
    wait_for_save()   saves of blocks this step's forward filled: one gather, one device-to-host
    get_finished / take_load_errors / build_report / take_stats
    clear()           close the step's dispatch digest

Every dispatch happens on the calling (engine main) thread in an order fixed by the metadata, so
every host issues the same programs (invariant 1); local trouble only changes what is reported.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, deque
from collections.abc import Iterable
from typing import Protocol

import jax

from tpuoffload.config import OffloadConfig, check_fits_in_ram
from tpuoffload.messages import LoadRequest, OffloadMetadata, OffloadWorkerReport, SaveBatch
from tpuoffload.snapshot import SnapshotWriter
from tpuoffload.stats import OffloadStats, make_report
from tpuoffload.worker.dispatch_log import StepDigest
from tpuoffload.worker.transfer_engine import Faults, TransferEngine, host_slot_shape

logger = logging.getLogger(__name__)


class CacheOwner(Protocol):
    """What tpu-inference's runner offers: the per-layer caches, replaced by functions that donate them."""

    kv_caches: list[jax.Array]


class OffloadWorker:
    def __init__(self, config: OffloadConfig, host_id: int | None = None, faults: Faults | None = None,
                 digest_history: int = 64) -> None:
        self.config = config
        self.host_id = jax.process_index() if host_id is None else host_id
        self._faults = faults
        self._runner: CacheOwner | None = None
        self.engine: TransferEngine | None = None
        self._meta: OffloadMetadata | None = None
        self._loaded = False
        self._saved = False
        self._finished_recving: set[str] = set()
        self._load_errors: set[int] = set()
        self._report_failures: list[int] = []
        self._stats_seq = 0
        self.totals: Counter[str] = Counter()  # since start, for snapshots
        self._unreported: Counter[str] = Counter()  # since the last take_stats
        self._snapshot: SnapshotWriter | None = None
        self.digests: deque[StepDigest] = deque(maxlen=digest_history)

    # ------------------------------------------------------------------ setup
    def register_runner(self, runner: CacheOwner) -> None:
        caches = list(runner.kv_caches)
        if not caches:
            raise ValueError("runner.kv_caches is empty: register the runner after the KV cache is allocated")
        TransferEngine.validate_caches(caches)
        per_host_chunk = math.prod(host_slot_shape(caches)) * caches[0].dtype.itemsize
        host_bytes = self.config.host_bytes(per_host_chunk)
        check_fits_in_ram(host_bytes)
        self._runner = runner
        self.engine = TransferEngine(
            caches,
            host_bytes,
            host_memory_kind=self.config.host_memory_kind,
            save_threads=self.config.save_threads,
            load_wait_timeout_s=self.config.load_wait_timeout_s,
            faults=self._faults,
        )
        if self.config.stats_dir:
            self._snapshot = SnapshotWriter(self.config.stats_dir, f"host-{self.host_id}.json",
                                            self.config.stats_interval_s, self.snapshot)
        logger.info("tpuoffload worker %d: %d host slots of %d bytes (%d bytes)", self.host_id,
                    self.engine.backend.num_slots, self.engine.backend.slot_bytes, self.engine.backend.nbytes)

    # ------------------------------------------------------------------ per step
    def bind(self, meta: OffloadMetadata) -> None:
        if self.engine is None:
            raise RuntimeError("tpuoffload: register_runner() must be called before the first step")
        if meta.num_slots > self.engine.backend.num_slots:
            raise ValueError(
                f"the scheduler plans {meta.num_slots} host slots but this host (host {self.host_id}) has "
                f"{self.engine.backend.num_slots}: the scheduler and workers disagree on the chunk size"
            )
        if meta.step == 0 and meta.num_slots < self.engine.backend.num_slots:
            logger.warning("tpuoffload host %d: the scheduler plans %d of this host's %d slots; the chunk sizes "
                           "the two halves computed differ", self.host_id, meta.num_slots, self.engine.backend.num_slots)
        self._meta = meta
        self._loaded = self._saved = False
        self.engine.log.record("step", n=meta.step)
        self._save(meta.flush)

    def start_load(self) -> None:
        meta = self._meta
        if meta is None or self._loaded:
            return
        self._loaded = True
        if not meta.loads:
            return
        blocks, slots, save_ids = _concat_loads(meta.loads)
        try:
            caches, failed = self.engine.load(self._runner.kv_caches, blocks, slots, save_ids)
            self._runner.kv_caches = caches
        except Exception:
            logger.exception("tpuoffload: load dispatch failed on host %d", self.host_id)
            failed = blocks
        self._load_errors.update(failed)
        for load in meta.loads:
            self._load_errors.update(load.unavailable_block_ids)
            self._finished_recving.add(load.req_id)

    def wait_for_save(self) -> None:
        if self._meta is None or self._saved:
            return
        self._saved = True
        self._save(self._meta.save)

    def _save(self, batch: SaveBatch) -> None:
        if not batch:
            return
        try:
            self.engine.save(self._runner.kv_caches, batch.block_ids, batch.slots, batch.save_ids)
        except Exception:
            logger.exception("tpuoffload: save dispatch failed on host %d", self.host_id)
            self._report_failures.extend(batch.save_ids)

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        sending = set(self._meta.release_req_ids) if self._meta is not None else set()
        recving, self._finished_recving = self._finished_recving, set()
        return sending or None, recving or None

    def take_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def build_report(self) -> OffloadWorkerReport | None:
        results = Counter()
        for r in self.engine.drain_results() if self.engine is not None else ():
            results[(self.host_id, r.save_id, r.ok)] = 1
        for save_id in self._report_failures:
            results[(self.host_id, save_id, False)] = 1
        self._report_failures = []
        return OffloadWorkerReport(results) if results else None

    def _collect_counters(self) -> None:
        delta = self.engine.take_counters()
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
        digest = self.engine.finish_step()
        self.digests.append(digest)
        if self._snapshot is not None:
            self._snapshot.maybe_write()
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
            "slots_total": self.engine.backend.num_slots,
            "slots_used": self.engine.backend.num_used(),
            "backend_bytes": self.engine.backend.nbytes,
            "staging_bytes": staging,
            "inflight_chunks": chunks,
            "oldest_inflight_age_s": (time.monotonic() - oldest) if oldest is not None else 0.0,
        }

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            if self._snapshot is not None:
                self._snapshot.maybe_write(force=True)


def _concat_loads(loads: Iterable[LoadRequest]) -> tuple[list[int], list[int], list[int]]:
    blocks, slots, save_ids = [], [], []
    for load in loads:
        blocks.extend(load.block_ids)
        slots.extend(load.slots)
        save_ids.extend(load.save_ids)
    return blocks, slots, save_ids
