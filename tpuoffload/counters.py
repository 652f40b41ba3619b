"""The one registry of counter names.

Every counter that tpuoffload reports (through vLLM's stats path, Prometheus, the snapshots and
``tpuoffload stats``) is declared here once, with the half that counts it and what it means.
Code that counts or reads a counter imports its name from this module; a name that is not
registered here is a bug (``tests/test_prom.py`` checks that every registered name becomes a
Prometheus series, and ``stats.OffloadStats.reduce`` reports only registered names).

Counters are monotonic totals (per report interval on the wire, summed across hosts and reports by
``OffloadStats.reduce``). Point-in-time values (what is held right now) are gauges: they are not
here but in each half's ``idle_report()`` and snapshot.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Side(enum.Enum):
    """Which half counts it: the scheduler half (one process) or each worker (one per host)."""

    SCHEDULER = "scheduler"
    WORKER = "worker"


@dataclass(frozen=True)
class CounterInfo:
    """One counter: its name, which half counts it (scheduler or worker) and what it means (the text of
    its Prometheus help and of ``tpuoffload stats``)."""

    name: str
    side: Side
    doc: str


# ---- worker half (each host counts its own; the slice total is the sum) ----
CHUNKS_SAVED = "chunks_saved"
BYTES_SAVED = "bytes_saved"
SAVE_FAILURES = "save_failures"
SAVE_SECONDS = "save_seconds"
CHUNKS_LOADED = "chunks_loaded"
BYTES_LOADED = "bytes_loaded"
LOAD_ERRORS = "load_errors"
LOAD_SECONDS = "load_seconds"
CROSS_RANK_CHUNKS_LOADED = "cross_rank_chunks_loaded"
CROSS_RANK_LOAD_ERRORS = "cross_rank_load_errors"

# ---- worker half: warm restart (each host its own part of a checkpoint) ----
PERSIST_SAVED_CHUNKS = "persist_saved_chunks"
PERSIST_SAVED_BYTES = "persist_saved_bytes"
PERSIST_SAVE_FAILED = "persist_save_failed"
PERSIST_RESTORED_CHUNKS = "persist_restored_chunks"
PERSIST_RESTORED_BYTES = "persist_restored_bytes"
PERSIST_RESTORE_REFUSED = "persist_restore_refused"

# ---- worker half: the disk tier (each host its own files) ----
DISK_WRITTEN_CHUNKS = "disk_written_chunks"
DISK_WRITTEN_BYTES = "disk_written_bytes"
DISK_WRITE_FAILED = "disk_write_failed"
DISK_WRITE_NO_SPACE = "disk_write_no_space"
DISK_EVICTED = "disk_evicted"
DISK_READ_CHUNKS = "disk_read_chunks"
DISK_READ_BYTES = "disk_read_bytes"
DISK_READ_FAILED = "disk_read_failed"
DISK_ADOPTED = "disk_adopted"

# ---- worker half: the shared tier (each host its own shard's objects) ----
SHARED_WRITTEN_CHUNKS = "shared_written_chunks"
SHARED_WRITTEN_BYTES = "shared_written_bytes"
SHARED_WRITE_EXISTS = "shared_write_exists"
SHARED_WRITE_DROPPED = "shared_write_dropped"
SHARED_WRITE_FAILED = "shared_write_failed"
SHARED_WRITE_SECONDS = "shared_write_seconds"
SHARED_READ_CHUNKS = "shared_read_chunks"
SHARED_READ_BYTES = "shared_read_bytes"
SHARED_READ_SECONDS = "shared_read_seconds"
SHARED_MISS_ABSENT = "shared_miss_absent"
SHARED_MISS_SHORT = "shared_miss_short"
SHARED_MISS_CORRUPT = "shared_miss_corrupt"
SHARED_MISS_FOREIGN = "shared_miss_foreign"
SHARED_MISS_UNAVAILABLE = "shared_miss_unavailable"
SHARED_PROBE_UNAVAILABLE = "shared_probe_unavailable"

# ---- scheduler half: lookups and loads ----
LOOKUP_TOKENS = "lookup_tokens"
HIT_TOKENS = "hit_tokens"
LOADS_CANCELLED = "loads_cancelled"
LOADS_DEFERRED = "loads_deferred"
REQUESTS_PREEMPTED = "requests_preempted"
DISCARDED = "discarded"
FAILED_REQUESTS = "failed_requests"
CROSS_RANK_HIT_TOKENS = "cross_rank_hit_tokens"
CROSS_RANK_DISCARDED = "cross_rank_discarded"

# ---- scheduler half: save planning (every save candidate lands in exactly one of these) ----
SAVES_ISSUED = "saves_issued"
DEDUP_BATCH = "dedup_batch"
DEDUP_INDEX = "dedup_index"
SKIPPED_STAGING = "skipped_staging"
SKIPPED_NO_SPACE = "skipped_no_space"
SKIPPED_CHECKPOINT = "skipped_checkpoint"

# ---- scheduler half: the disk tier ----
SPILLS_ISSUED = "spills_issued"
SPILLS_CONFIRMED = "spills_confirmed"
SPILLS_DROPPED = "spills_dropped"
FETCHES_ISSUED = "fetches_issued"
FETCHES_FAILED = "fetches_failed"

# ---- scheduler half: the shared tier ----
SHARED_PROBES = "shared_probes"
SHARED_PROBE_TIMEOUTS = "shared_probe_timeouts"
SHARED_PROBE_HIT_CHUNKS = "shared_probe_hit_chunks"
SHARED_FETCHES_ISSUED = "shared_fetches_issued"
SHARED_FETCHES_READY = "shared_fetches_ready"
SHARED_FETCHES_FAILED = "shared_fetches_failed"
SHARED_PUBLISH_ISSUED = "shared_publish_issued"

# ---- scheduler half: warm restart ----
RESTORED_READY = "restored_ready"
RESTORED_DROPPED = "restored_dropped"
DISK_RESTORED_READY = "disk_restored_ready"
DISK_RESTORED_DROPPED = "disk_restored_dropped"
CHECKPOINTS_PLANNED = "checkpoints_planned"
CHECKPOINTS_COMMITTED = "checkpoints_committed"
CHECKPOINTS_FAILED = "checkpoints_failed"

# ---- scheduler half: host RAM ----
EVICTED = "evicted"
RESETS = "resets"
REVOKED = "revoked"

# ---- scheduler half: the completion ledger ----
LEDGER_CONFIRMED = "ledger_confirmed"
LEDGER_FAILED = "ledger_failed"
LEDGER_EXPIRED = "ledger_expired"
LEDGER_DUPLICATE = "ledger_duplicate"
LEDGER_LATE = "ledger_late"
LEDGER_EARLY = "ledger_early"
LEDGER_UNKNOWN = "ledger_unknown"
LEDGER_UNKNOWN_HOST = "ledger_unknown_host"
REPORTERS_MISSING = "reporters_missing"
UNKNOWN_REQUEST = "unknown_request"

_W, _S = Side.WORKER, Side.SCHEDULER
REGISTRY: dict[str, CounterInfo] = {c.name: c for c in (
    CounterInfo(CHUNKS_SAVED, _W, "KV chunks written to host RAM"),
    CounterInfo(BYTES_SAVED, _W, "Bytes written to host RAM"),
    CounterInfo(SAVE_FAILURES, _W, "Chunk saves that failed on a host (never loadable)"),
    CounterInfo(SAVE_SECONDS, _W, "Seconds background threads spent completing saves"),
    CounterInfo(CHUNKS_LOADED, _W, "KV chunks loaded from host RAM into the KV cache"),
    CounterInfo(BYTES_LOADED, _W, "Bytes loaded from host RAM"),
    CounterInfo(LOAD_ERRORS, _W, "Blocks whose load failed on a host and were recomputed"),
    CounterInfo(LOAD_SECONDS, _W, "Seconds the main thread spent dispatching loads"),
    CounterInfo(CROSS_RANK_CHUNKS_LOADED, _W, "DPScheduler: chunks one DP rank saved loaded into another rank's blocks"),
    CounterInfo(CROSS_RANK_LOAD_ERRORS, _W, "DPScheduler: rows of another rank's chunk that failed to load on a host "
                "(any cause: its slot reused by its owner or lost there, its write late; recomputed)"),
    CounterInfo(PERSIST_SAVED_CHUNKS, _W, "Chunks this host wrote into committed checkpoints"),
    CounterInfo(PERSIST_SAVED_BYTES, _W, "Bytes this host wrote into committed checkpoints"),
    CounterInfo(PERSIST_SAVE_FAILED, _W, "Checkpoints that failed on this host (never restored)"),
    CounterInfo(PERSIST_RESTORED_CHUNKS, _W, "Chunks this host restored from a checkpoint at start-up"),
    CounterInfo(PERSIST_RESTORED_BYTES, _W, "Bytes this host restored from a checkpoint at start-up"),
    CounterInfo(PERSIST_RESTORE_REFUSED, _W, "Start-ups that restored nothing: no complete checkpoint, or one refused (cold start)"),
    CounterInfo(DISK_WRITTEN_CHUNKS, _W, "Chunks this host wrote to its disk tier"),
    CounterInfo(DISK_WRITTEN_BYTES, _W, "Bytes this host wrote to its disk tier"),
    CounterInfo(DISK_WRITE_FAILED, _W, "Chunk writes to the disk tier that failed on this host"),
    CounterInfo(DISK_WRITE_NO_SPACE, _W, "Chunk writes refused: every disk chunk being read or written"),
    CounterInfo(DISK_EVICTED, _W, "Chunks the disk tier itself evicted to make room"),
    CounterInfo(DISK_READ_CHUNKS, _W, "Chunks read back from the disk tier, checksums verified"),
    CounterInfo(DISK_READ_BYTES, _W, "Bytes read back from the disk tier"),
    CounterInfo(DISK_READ_FAILED, _W, "Disk reads that failed (missing, short, corrupt file; recomputed)"),
    CounterInfo(DISK_ADOPTED, _W, "Valid chunk files a starting disk tier found and kept"),
    CounterInfo(SHARED_WRITTEN_CHUNKS, _W, "Shard objects this host published to the shared tier"),
    CounterInfo(SHARED_WRITTEN_BYTES, _W, "Bytes this host published to the shared tier"),
    CounterInfo(SHARED_WRITE_EXISTS, _W, "Shared-tier writes skipped: the store held the object already"),
    CounterInfo(SHARED_WRITE_DROPPED, _W, "Shared-tier writes dropped: this host's write queue was full"),
    CounterInfo(SHARED_WRITE_FAILED, _W, "Shared-tier writes that failed (store unavailable, full or erroring)"),
    CounterInfo(SHARED_WRITE_SECONDS, _W, "Seconds this host's writer threads spent on the shared store"),
    CounterInfo(SHARED_READ_CHUNKS, _W, "Shard objects read from the shared tier and verified"),
    CounterInfo(SHARED_READ_BYTES, _W, "Payload bytes read from the shared tier and verified"),
    CounterInfo(SHARED_READ_SECONDS, _W, "Seconds this host's reader threads spent on the shared store"),
    CounterInfo(SHARED_MISS_ABSENT, _W, "Shared-tier reads that found no object (evicted meanwhile)"),
    CounterInfo(SHARED_MISS_SHORT, _W, "Shared-tier reads of a torn or truncated object (a miss)"),
    CounterInfo(SHARED_MISS_CORRUPT, _W, "Shared-tier reads whose header or payload checksum failed (a miss)"),
    CounterInfo(SHARED_MISS_FOREIGN, _W, "Shared-tier reads of an object of another namespace, key, group, shard or size (a miss)"),
    CounterInfo(SHARED_MISS_UNAVAILABLE, _W, "Shared-tier reads the store did not answer in time (a miss)"),
    CounterInfo(SHARED_PROBE_UNAVAILABLE, _W, "Shared-tier probes the store did not answer in time (all missed)"),
    CounterInfo(LOOKUP_TOKENS, _S, "Prompt tokens of admitted requests looked up in host RAM"),
    CounterInfo(HIT_TOKENS, _S, "Prompt tokens served from host RAM"),
    CounterInfo(LOADS_CANCELLED, _S, "Planned loads not sent because vLLM no longer waited for them"),
    CounterInfo(LOADS_DEFERRED, _S, "Hits answered 'ask again' because enough loaded requests already waited to run "
                "(GDN/mamba state rows in tpu-inference's compact pool: manager/admission.py)"),
    CounterInfo(REQUESTS_PREEMPTED, _S, "Preemptions vLLM reported to this scheduler half (SchedulerOutput.preempted_req_ids; "
                "under DPScheduler each rank's own, which tpu-inference's combined output leaves out)"),
    CounterInfo(DISCARDED, _S, "Chunks dropped from the index after a load of them failed on a host"),
    CounterInfo(CROSS_RANK_HIT_TOKENS, _S, "DPScheduler: prompt tokens served from chunks another DP rank saved"),
    CounterInfo(CROSS_RANK_DISCARDED, _S, "DPScheduler: other ranks' chunks dropped from this rank's view after a "
                "failed load"),
    CounterInfo(FAILED_REQUESTS, _S, "Loads failed by request (several KV cache groups): vLLM recomputed the whole request"),
    CounterInfo(SAVES_ISSUED, _S, "Unique chunks the scheduler asked the hosts to save"),
    CounterInfo(DEDUP_BATCH, _S, "Chunk saves deduplicated within one step"),
    CounterInfo(DEDUP_INDEX, _S, "Chunk saves skipped: content already in host RAM or being saved"),
    CounterInfo(SKIPPED_STAGING, _S, "Chunk saves skipped: staging budget exhausted"),
    CounterInfo(SKIPPED_NO_SPACE, _S, "Chunk saves skipped: host RAM full of saving or pinned chunks"),
    CounterInfo(SPILLS_ISSUED, _S, "Chunks evicted from host RAM and sent to the disk tier"),
    CounterInfo(SPILLS_CONFIRMED, _S, "Spills every host wrote (loadable from disk from then on)"),
    CounterInfo(SPILLS_DROPPED, _S, "Spills a host failed to write, or not confirmed in time"),
    CounterInfo(FETCHES_ISSUED, _S, "Chunks planned to come back from disk into host RAM"),
    CounterInfo(FETCHES_FAILED, _S, "Fetches from disk that failed on some host (forgotten; recomputed)"),
    CounterInfo(SHARED_PROBES, _S, "Shared-tier lookups planned (every host checks its own shard objects)"),
    CounterInfo(SHARED_PROBE_TIMEOUTS, _S, "Shared-tier lookups not answered by every host in time (a miss)"),
    CounterInfo(SHARED_PROBE_HIT_CHUNKS, _S, "Chunks every host's shared-store shard held when looked up"),
    CounterInfo(SHARED_FETCHES_ISSUED, _S, "Chunks planned to come from the shared tier into host RAM"),
    CounterInfo(SHARED_FETCHES_READY, _S, "Chunks every host fetched, verified and installed (loadable from host RAM)"),
    CounterInfo(SHARED_FETCHES_FAILED, _S, "Shared-tier fetches some host could not verify or install (a miss everywhere)"),
    CounterInfo(SHARED_PUBLISH_ISSUED, _S, "READY host-RAM chunks planned to be published to the shared tier"),
    CounterInfo(SKIPPED_CHECKPOINT, _S, "Chunk saves skipped: a checkpoint was being written or restored"),
    CounterInfo(RESTORED_READY, _S, "Restored chunks every host held identically (loadable after a restart)"),
    CounterInfo(RESTORED_DROPPED, _S, "Restored chunks dropped: not held alike by every host, or reused meanwhile"),
    CounterInfo(DISK_RESTORED_READY, _S, "Chunk files every host's disk tier kept identically (fetchable after a restart)"),
    CounterInfo(DISK_RESTORED_DROPPED, _S, "Chunk files kept by some host's disk tier but not by every host alike (deleted)"),
    CounterInfo(CHECKPOINTS_PLANNED, _S, "Checkpoints planned (operator request or interval)"),
    CounterInfo(CHECKPOINTS_COMMITTED, _S, "Planned checkpoints every host committed"),
    CounterInfo(CHECKPOINTS_FAILED, _S, "Planned checkpoints that failed on some host"),
    CounterInfo(EVICTED, _S, "Chunks evicted from host RAM (LRU)"),
    CounterInfo(RESETS, _S, "Connector cache resets (reset_cache, e.g. after a weight update)"),
    CounterInfo(REVOKED, _S, "Chunks made unloadable by a reset (held, or saves in flight)"),
    CounterInfo(LEDGER_CONFIRMED, _S, "Saves confirmed by every host (loadable from then on)"),
    CounterInfo(LEDGER_FAILED, _S, "Saves dropped because a host reported the save failed"),
    CounterInfo(LEDGER_EXPIRED, _S, "Saves not confirmed by every host in time (dropped)"),
    CounterInfo(LEDGER_DUPLICATE, _S, "Duplicate completion reports (ignored)"),
    CounterInfo(LEDGER_LATE, _S, "Completion reports after the chunk was resolved (ignored)"),
    CounterInfo(LEDGER_EARLY, _S, "Completion reports before registration (staged)"),
    CounterInfo(LEDGER_UNKNOWN, _S, "Completion reports never matched to a save (dropped)"),
    CounterInfo(LEDGER_UNKNOWN_HOST, _S, "Completion reports from a host id outside the expected hosts (dropped)"),
    CounterInfo(REPORTERS_MISSING, _S, "Times an expected host was found never to report (reporting-worker count mismatch)"),
    CounterInfo(UNKNOWN_REQUEST, _S, "Transfer completions for requests the connector did not know"),
)}

NAMES: tuple[str, ...] = tuple(REGISTRY)
WORKER_NAMES: tuple[str, ...] = tuple(n for n, c in REGISTRY.items() if c.side is Side.WORKER)
SCHEDULER_NAMES: tuple[str, ...] = tuple(n for n, c in REGISTRY.items() if c.side is Side.SCHEDULER)


def doc(name: str) -> str:
    """The one-line meaning of a registered counter (KeyError for an unregistered name)."""
    return REGISTRY[name].doc
