"""``TPUOffloadConnector``: the class vLLM loads. Thin: every hook delegates to the scheduler half
(``OffloadScheduler``) or the worker half (``OffloadWorker``).

Load it with::

    --kv-transfer-config '{"kv_connector": "TPUOffloadConnector",
                           "kv_connector_module_path": "tpuoffload.connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"cpu_bytes_to_use": 107374182400}}'
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from typing_extensions import override
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from tpuoffload.config import parse_config, per_engine
from tpuoffload.messages import OffloadMetadata
from tpuoffload.manager import OffloadScheduler
from tpuoffload.manager.admission import load_admission
from tpuoffload.manager.events import event_format
from tpuoffload.manager.kv_groups import KVCacheGroups
from tpuoffload.manager.topology import (DPRank, host_chunk_bytes, host_state_bytes, publish_as_dp_rank,
                                         reporting_workers, storage_factor)
from tpuoffload.stats import OffloadStats
from tpuoffload.worker.offload_worker import OffloadWorker
from tpuoffload.worker.persistence import Deployment

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


class TPUOffloadConnector(KVConnectorBase_V1, SupportsHMA):
    """``SupportsHMA``: vLLM keeps its hybrid KV cache manager on with this connector. With several
    KV cache groups a chunk is keyed by content hash and group (manager/kv_groups.py), and load
    failures reach vLLM by request (``failed_recving``), never by block id."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self.config = per_engine(parse_config(extra), vllm_config.parallel_config)
        self.scheduler: OffloadScheduler | None = None
        self.worker: OffloadWorker | None = None
        # Worker processes that report each step: the confirmations a chunk needs, and what
        # get_finished_count() tells vLLM's KVOutputAggregator to wait for.
        self.num_workers, workers_source = reporting_workers(vllm_config, self.config.num_hosts)
        if role == KVConnectorRole.SCHEDULER:
            if kv_cache_config is None:
                raise ValueError("TPUOffloadConnector needs the KV cache config on the scheduler side")
            dp = DPRank.of(vllm_config, kv_cache_config)
            if dp.ranks > 1:
                published = publish_as_dp_rank(vllm_config, dp)
                if published is not None:
                    logger.info("tpuoffload: this DPScheduler rank publishes KV events as data parallel rank %d "
                                "(endpoint port offset by it)", published)
            kv_groups = KVCacheGroups.of(kv_cache_config, vllm_config.cache_config.block_size)
            self.scheduler = OffloadScheduler(
                self.config,
                block_size=vllm_config.cache_config.block_size,
                chunk_bytes=host_chunk_bytes(kv_cache_config, self.num_workers,
                                             storage_factor(vllm_config, kv_cache_config)),
                num_hosts=self.num_workers,
                hosts_source=workers_source,
                dp=dp,
                kv_groups=kv_groups,
                events=event_format(vllm_config, kv_cache_config),
                state_chunk_bytes=host_state_bytes(kv_cache_config, self.num_workers, dp.ranks),
                admission=load_admission(vllm_config, kv_cache_config, kv_groups),
            )
            logger.info("tpuoffload scheduler%s: host slots per pool %s (KV chunks of %d bytes per host, then state "
                        "chunks); %d worker processes confirm each chunk (%s); KV cache groups: %s; loads: %s; %s",
                        f" (DPScheduler rank of {dp.ranks}, {dp.num_blocks} blocks, source {dp.source})"
                        if dp.ranks > 1 else "", self.scheduler.index.pool_sizes, self.scheduler.chunk_bytes,
                        self.num_workers, workers_source, self.scheduler.kv_groups.describe(),
                        self.scheduler.admission.describe(), self.config.summary())
            self._bind_scheduler_hooks()
        else:
            self.worker = OffloadWorker(self.config, deployment=Deployment(
                vllm_config.model_config.model, vllm_config.cache_config.block_size),
                kv_cache_config=kv_cache_config)
            logger.info("tpuoffload worker (host %d): %s", self.worker.host_id, self.config.summary())

    @property
    @override
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a save lost to preemption is a future miss, never a correctness issue.
        return False

    # ============================== worker side ==============================
    def register_runner(self, runner: Any) -> None:
        """Called by tpu-inference's runner once ``runner.kv_caches`` exists."""
        self.worker.register_runner(runner)

    @override
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        # The JAX cache is replaced by every donating update, so the connector needs the runner
        # that owns it (register_runner), not a snapshot of the arrays.
        logger.debug("tpuoffload: register_kv_caches ignored; waiting for register_runner")

    @override
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, OffloadMetadata)
        self.worker.bind(connector_metadata)

    @override
    def clear_connector_metadata(self) -> None:
        self.worker.clear()
        super().clear_connector_metadata()

    @override
    def start_load_kv(self, forward_context: Any = None, **kwargs: Any) -> None:
        self.worker.start_load()

    @override
    def wait_for_layer_load(self, layer_name: str) -> None:
        pass  # loads land whole before the requests that need them are scheduled

    @override
    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        pass  # saves are one batched gather per step, in wait_for_save

    @override
    def wait_for_save(self) -> None:
        self.worker.wait_for_save()

    @override
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker.get_finished()

    @override
    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """vLLM's mixin asks this (not ``get_finished``): loads done, and, with several KV cache
        groups, the loads that failed (also listed as done, as vLLM requires)."""
        sending, recving = self.worker.get_finished()
        return KVConnectorTransferResults(set(sending or ()), set(recving or ()), self.worker.take_failed_recving())

    @override
    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors()

    @override
    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker.build_report()

    @override
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.worker is not None:
            return self.worker.take_stats()
        return self.scheduler.take_stats()

    @override
    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
        else:
            self.scheduler.close()

    # ============================== scheduler side ==============================
    def _bind_scheduler_hooks(self) -> None:
        """vLLM calls these on its scheduler thread, several per request per step, on caches its
        own step has just evicted, where every Python call costs about a microsecond: the instance
        takes the scheduler half's bound methods (same signatures), and the class methods below,
        which say the same, are never reached on the scheduler side."""
        for name in ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                     "update_connector_output", "request_finished", "request_finished_all_groups",
                     "take_events"):
            setattr(self, name, getattr(self.scheduler, name))
        self.get_kv_connector_stats = self.scheduler.take_stats  # once per step

    @override
    def bind_kv_cache_manager(self, kv_cache_manager: "KVCacheManager") -> None:
        self.scheduler.bind_kv_cache_manager(kv_cache_manager)

    @override
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    @override
    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    @override
    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    @override
    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        self.scheduler.update_connector_output(connector_output)

    @override
    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    @override
    def request_finished_all_groups(self, request: "Request",
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished_all_groups(request, block_ids)

    @override
    def take_events(self) -> "Iterable[KVCacheEvent]":
        """KV events since the last call (vLLM publishes them each step): chunks that became
        loadable in host RAM ("CPU") or on every host's disk ("STORAGE"), and chunks that stopped
        being loadable (manager/events.py). Empty unless vLLM's ``kv_events_config`` enables them."""
        return self.scheduler.take_events()

    @override
    def has_pending_push_work(self) -> bool:
        """vLLM's scheduler asks before idling: True keeps it stepping while the hosts owe reports
        no request waits for (a checkpoint being written, restore reports due; manager/tier.py).
        tpu-inference's DPScheduler does not ask (0.32): there they come with the next request."""
        return self.scheduler is not None and self.scheduler.has_pending_push_work()

    @override
    def reset_cache(self) -> bool | None:
        """vLLM's ``reset_prefix_cache(reset_connector=True)`` (e.g. after a weight update): nothing
        saved before is ever loaded after, saves in flight included."""
        return self.scheduler.reset_cache() if self.scheduler is not None else None

    @override
    def get_finished_count(self) -> int | None:
        """Reports vLLM's KVOutputAggregator waits for per request: one per worker process (one per
        host with tpu-inference), not vLLM's world size."""
        return self.num_workers

    @classmethod
    def supports_sleep_mode(cls, *args: Any, **kwargs: Any) -> bool:
        """vLLM 0.33 asks: no, this connector keeps no state across sleep."""
        return False

    @classmethod
    @override
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        from tpuoffload.prom import OffloadPromMetrics

        return OffloadPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    @override
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return OffloadStats(dict(data)) if data is not None else OffloadStats()


def register_with_vllm() -> bool:
    """Register ``TPUOffloadConnector`` by name with vLLM's ``KVConnectorFactory`` (lazily, by
    module path), so that vLLM finds the class from its name alone: a ``MultiConnector`` parent
    rebuilds its children's stats by name (``get_connector_class_by_name``). Runs at import of this
    module; a second call, or a name some other package registered first, changes nothing (vLLM
    raises on a second registration). True when this call registered it."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(TPUOffloadConnector.__name__, __name__, TPUOffloadConnector.__name__)
    except ValueError:  # already registered (this module imported again, or another package's class)
        return False
    return True


register_with_vllm()
