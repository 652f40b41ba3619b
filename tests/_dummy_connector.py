"""A tiny, configurable vLLM 0.32 KV connector used to exercise tests/vllm_harness.py.

Load it with kv_connector="DummyRecordingConnector",
kv_connector_module_path="tests._dummy_connector" (or "_dummy_connector" when
tests/ is on sys.path).

kv_connector_extra_config keys (all optional):
  matched_tokens (int, default 0): what get_num_new_matched_tokens reports
      (clipped so that at least one prompt token is left to compute).
  is_async (bool, default False): second element of get_num_new_matched_tokens.
  delay_free (bool, default False): first element of request_finished().

Every call is appended to ``self.calls`` as (method_name, details) so tests can
assert on the exact call order vLLM uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)


@dataclass
class DummyMeta(KVConnectorMetadata):
    step: int
    new_req_ids: list[str] = field(default_factory=list)
    cached_req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    finished_req_ids: set[str] = field(default_factory=set)
    # req_id -> number of external tokens to load (async or sync), from
    # update_state_after_alloc.
    loads: dict[str, int] = field(default_factory=dict)
    # req ids whose blocks the scheduler-side connector is holding after
    # request_finished returned True; the worker reports them as finished_sending.
    delayed_free: set[str] = field(default_factory=set)


@dataclass
class DummyWorkerMeta(KVConnectorWorkerMetadata):
    counts: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, DummyWorkerMeta)
        merged = dict(self.counts)
        for k, v in other.counts.items():
            merged[k] = merged.get(k, 0) + v
        return DummyWorkerMeta(merged)


class DummyRecordingConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        extra: dict[str, Any] = self._kv_transfer_config.kv_connector_extra_config
        self.matched_tokens = int(extra.get("matched_tokens", 0))
        self.is_async = bool(extra.get("is_async", False))
        self.delay_free = bool(extra.get("delay_free", False))
        self.calls: list[tuple[str, Any]] = []
        self._step = 0
        self._pending_loads: dict[str, int] = {}
        self._pending_delayed: set[str] = set()
        # worker-side state
        self._worker_recving: set[str] = set()
        self._worker_sending: set[str] = set()

    @property
    def requires_kv_delivery(self) -> bool:
        # Best-effort cache semantics (like OffloadingConnector).
        return False

    # ---------------- scheduler side ----------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        n = 0
        if self.matched_tokens > num_computed_tokens:
            # never report the whole prompt: keep >= 1 token to compute
            n = min(self.matched_tokens, request.num_tokens - 1) - num_computed_tokens
            n = max(n, 0)
        self.calls.append(
            ("get_num_new_matched_tokens", (request.request_id, num_computed_tokens, n))
        )
        return n, (self.is_async and n > 0)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self.calls.append(
            (
                "update_state_after_alloc",
                (request.request_id, blocks.get_block_ids(), num_external_tokens),
            )
        )
        if num_external_tokens > 0:
            self._pending_loads[request.request_id] = num_external_tokens

    def build_connector_meta(self, scheduler_output):
        self._step += 1
        cached = scheduler_output.scheduled_cached_reqs
        meta = DummyMeta(
            step=self._step,
            new_req_ids=[r.req_id for r in scheduler_output.scheduled_new_reqs],
            cached_req_ids=list(cached.req_ids),
            resumed_req_ids=set(cached.resumed_req_ids),
            preempted_req_ids=set(scheduler_output.preempted_req_ids or ()),
            finished_req_ids=set(scheduler_output.finished_req_ids),
            loads=self._pending_loads,
            delayed_free=self._pending_delayed,
        )
        self._pending_loads = {}
        self._pending_delayed = set()
        self.calls.append(("build_connector_meta", meta))
        return meta

    def update_connector_output(self, connector_output):
        self.calls.append(("update_connector_output", connector_output))

    def request_finished(self, request, block_ids):
        self.calls.append(("request_finished", (request.request_id, list(block_ids))))
        if self.delay_free:
            self._pending_delayed.add(request.request_id)
        return self.delay_free, None

    # ---------------- worker side ----------------
    def start_load_kv(self, forward_context, **kwargs):
        meta = self._get_connector_metadata()
        assert isinstance(meta, DummyMeta)
        self.calls.append(("start_load_kv", meta.step))
        if self.is_async:
            self._worker_recving |= set(meta.loads)

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass

    def wait_for_save(self):
        meta = self._get_connector_metadata()
        assert isinstance(meta, DummyMeta)
        self.calls.append(("wait_for_save", meta.step))
        self._worker_sending |= meta.delayed_free

    def get_finished(self, finished_req_ids):
        recv, self._worker_recving = self._worker_recving, set()
        send, self._worker_sending = self._worker_sending, set()
        self.calls.append(("get_finished", (set(finished_req_ids), send, recv)))
        return (send or None), (recv or None)

    def build_connector_worker_meta(self):
        meta = self._get_connector_metadata()
        assert isinstance(meta, DummyMeta)
        return DummyWorkerMeta({"steps": 1})
