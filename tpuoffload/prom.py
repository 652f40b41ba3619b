"""Prometheus metrics through vLLM's ``build_prom_metrics`` hook.

Every counter of ``tpuoffload.stats.COUNTERS`` becomes ``vllm:tpuoffload_<name>_total`` with vLLM's
per-engine labels plus ``host`` (a worker's host id, or ``sched`` for the scheduler half), so a
host that drifts shows up in its own series.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

from tpuoffload.stats import COUNTERS

_DOCS = {
    "chunks_saved": "KV chunks written to host RAM",
    "bytes_saved": "Bytes written to host RAM",
    "save_failures": "Chunk saves that failed on a host (never loadable)",
    "save_seconds": "Seconds background threads spent completing saves",
    "chunks_loaded": "KV chunks loaded from host RAM into the KV cache",
    "bytes_loaded": "Bytes loaded from host RAM",
    "load_errors": "Blocks whose load failed on a host and were recomputed",
    "load_seconds": "Seconds the main thread spent dispatching loads",
    "lookup_tokens": "Prompt tokens of admitted requests looked up in host RAM",
    "hit_tokens": "Prompt tokens served from host RAM",
    "saves_issued": "Unique chunks the scheduler asked the hosts to save",
    "skipped_no_space": "Chunk saves skipped: host RAM full of saving or pinned chunks",
    "skipped_staging": "Chunk saves skipped: staging budget exhausted",
    "dedup_batch": "Chunk saves deduplicated within one step",
    "dedup_index": "Chunk saves skipped: content already in host RAM or being saved",
    "evicted": "Chunks evicted from host RAM (LRU)",
    "ledger_duplicate": "Duplicate completion reports (ignored)",
    "ledger_late": "Completion reports after the chunk was resolved (ignored)",
    "ledger_early": "Completion reports before registration (staged)",
    "ledger_unknown": "Completion reports never matched to a save (dropped)",
    "ledger_expired": "Saves not confirmed by every host in time (dropped)",
    "unknown_request": "Transfer completions for requests the connector did not know",
    "ledger_confirmed": "Saves confirmed by every host (loadable from then on)",
    "ledger_failed": "Saves dropped because a host reported the save failed",
    "ledger_unknown_host": "Completion reports from a host id outside the slice (dropped)",
    "discarded": "Chunks dropped from the index after a load of them failed on a host",
}


def metric_name(counter: str) -> str:
    if counter.startswith("bytes_"):
        return f"vllm:tpuoffload_{counter[6:]}_bytes_total"
    return f"vllm:tpuoffload_{counter}_total"


class OffloadPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._counter_cls(name=metric_name(name), documentation=_DOCS.get(name, name),
                                    labelnames=self._labelnames + ["host"])
            for name in COUNTERS
        }
        self._children: dict[tuple[int, str, str], Any] = {}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        # Runs in vLLM's stats logger: anything it cannot use is skipped, never raised.
        for key, value in transfer_stats_data.items():
            parts = key.split("|", 2) if isinstance(key, str) else ()
            if len(parts) != 3:
                continue
            source, _, name = parts
            counter = self._counters.get(name)
            if (counter is None or isinstance(value, bool) or not isinstance(value, (int, float))
                    or not value > 0):
                continue
            child = self._children.get((engine_idx, name, source))
            if child is None:
                child = counter.labels(*self.per_engine_labelvalues[engine_idx], source)
                self._children[(engine_idx, name, source)] = child
            child.inc(value)
