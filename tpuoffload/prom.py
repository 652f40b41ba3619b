"""Prometheus metrics through vLLM's ``build_prom_metrics`` hook.

Every counter of the registry (``tpuoffload.counters``) becomes ``vllm:tpuoffload_<name>_total`` with vLLM's
per-engine labels plus ``host`` (a worker's host id, or ``sched`` for the scheduler half), so a
host that drifts shows up in its own series.
"""

from __future__ import annotations

from typing import Any

from typing_extensions import override
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

from tpuoffload import counters as C


def metric_name(counter: str) -> str:
    if counter.startswith("bytes_"):
        return f"vllm:tpuoffload_{counter[6:]}_bytes_total"
    return f"vllm:tpuoffload_{counter}_total"


class OffloadPromMetrics(KVConnectorPromMetrics):
    """tpuoffload's counters as Prometheus series through vLLM's ``build_prom_metrics``:
    ``vllm:tpuoffload_<counter>_total`` (bytes as ``_bytes_total``), labelled with vLLM's engine
    labels plus ``host``."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._counter_cls(name=metric_name(name), documentation=C.doc(name),
                                    labelnames=self._labelnames + ["host"])
            for name in C.NAMES
        }
        self._children: dict[tuple[int, str, str], Any] = {}

    @override
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
