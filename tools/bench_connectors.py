"""Benchmark-only KV connectors for tools/bench_scheduler.py (never used in serving).

Both load through vLLM's connector factory with ``kv_connector_module_path="bench_connectors"``
(bench_scheduler.py puts tools/ on ``sys.path``) and ``kv_connector`` set to the class name:

  NullConnector      every hook does nothing: what vLLM itself adds for having a KV connector.
  SameHitsConnector  finds the hits the real connectors find and moves nothing: what vLLM itself
                     spends on a connector's loads.
"""

from __future__ import annotations

from dataclasses import dataclass

import tpuoffload.sim.vllm_setup  # noqa: F401  (sets VLLM_TARGET_DEVICE before vllm is imported)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata


# --------------------------------------------------------------------------
# a connector that does nothing (measures vLLM's own cost of having one)
# --------------------------------------------------------------------------
class NullConnector(KVConnectorBase_V1):
    """Load with connector_module_path="bench_connectors",
    connector_class="NullConnector": every hook does nothing, so a scheduler
    with it costs exactly what vLLM itself adds for a KV connector
    (tools/bench_scheduler.py reports it beside the real connectors)."""

    def start_load_kv(self, forward_context, **kwargs) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens) -> None:
        pass

    def build_connector_meta(self, scheduler_output):
        return KVConnectorMetadata()


# --------------------------------------------------------------------------
# a connector that only finds hits (separates vLLM's cost of loads from a connector's)
# --------------------------------------------------------------------------
@dataclass
class SameHitsMetadata(KVConnectorMetadata):
    loads: tuple[tuple[str, int], ...] = ()  # (request id, blocks it loads)


class SameHitsConnector(NullConnector):
    """Load with connector_module_path="bench_connectors",
    connector_class="SameHitsConnector": it remembers the prompt block hashes of every finished
    request (one list per first block) and answers lookups from them, leaving one token to compute
    and loading asynchronously, like the real connectors; it saves and moves nothing. With hits,
    vLLM's own steps change (a request waits a step for its load, and each step then carries more
    requests than without a connector): this connector pays that and little else, so
    tools/bench_scheduler.py can tell vLLM's cost of loads from the connector's own."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._block_size = self._vllm_config.cache_config.block_size
        self._prompts: dict = {}  # first block hash -> the prompt block hashes of a finished request
        self._loads: list[tuple[str, int]] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        hashes = request.block_hashes
        held = self._prompts.get(hashes[0]) if hashes else None
        start = n = num_computed_tokens // self._block_size
        if held is not None:  # block hashes are chained: equal hashes, equal prefixes
            stop = min(len(hashes), len(held), (request.num_tokens - 1) // self._block_size)
            while n < stop and hashes[n] == held[n]:
                n += 1
        return (n - start) * self._block_size, n > start

    def update_state_after_alloc(self, request, blocks, num_external_tokens) -> None:
        if num_external_tokens:
            self._loads.append((request.request_id, num_external_tokens // self._block_size))

    def build_connector_meta(self, scheduler_output):
        meta, self._loads = SameHitsMetadata(tuple(self._loads)), []
        return meta

    def request_finished(self, request, block_ids):
        hashes = request.block_hashes[:request.num_prompt_tokens // self._block_size]
        if hashes:
            self._prompts[hashes[0]] = hashes
        return False, None
