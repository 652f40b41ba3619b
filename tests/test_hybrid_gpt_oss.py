"""Issue 21, stage 1: a gpt-oss-like hybrid model (4 layers alternating sliding window 128 and full
attention, 8 KV heads, head_dim 64, TP 4, block 16) with vLLM's hybrid KV cache manager (HMA) on.

Everything that decides the cache is installed code (``tpuoffload.sim.hybrid_layouts``):
tpu-inference's ``get_kv_cache_spec`` and ``initialize_kv_cache``, vLLM's ``get_kv_cache_configs``.
The repeated-prefix workload on it runs in tests/test_hybrid_prefix.py.
"""

from __future__ import annotations

from tpuoffload.layout import KVGroupMap
from tpuoffload.manager.kv_groups import KVCacheGroups
import dataclasses

from tpuoffload.sim.hybrid_layouts import GPT_OSS_LIKE, create_hybrid_cache, num_blocks
from tpuoffload.sim.vllm_setup import make_vllm_config

BS = GPT_OSS_LIKE.block_size
WINDOW_BLOCKS = 8  # cdiv(128 - 1, 16): the blocks a hit of the sliding-window group needs
# Small enough to run fast on CPU: 128 blocks at 8 MiB (2 arrays of 32 KiB pages per block).
SPEC = dataclasses.replace(GPT_OSS_LIKE, max_model_len=1024)
BUDGET = 8 << 20


def test_vllm_keeps_hma_on_with_tpuoffload():
    """vLLM turns HMA off for a connector that is not SupportsHMA; with tpuoffload it stays on, and
    an explicit --no-disable-hybrid-kv-cache-manager starts (the factory accepts the connector)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    cfg = make_vllm_config(block_size=BS, kv_connector_extra_config={"cpu_bytes_to_use": 1 << 22},
                           connector_module_path="tpuoffload.connector")
    assert cfg.scheduler_config.disable_hybrid_kv_cache_manager is False
    assert KVConnectorFactory.supports_hma_config(cfg.kv_transfer_config)


def test_hma_doubles_the_kv_blocks_at_the_same_hbm():
    """The HBM figure, from vLLM's own block-count computation over tpu-inference's specs."""
    budget = 30 << 20
    on, off = num_blocks(GPT_OSS_LIKE, budget, hma=True), num_blocks(GPT_OSS_LIKE, budget, hma=False)
    print(f"gpt-oss-like at {budget >> 20} MiB of KV memory: {on} blocks with HMA on, {off} with HMA off")
    assert (on, off) == (480, 240)


def test_layout_describes_which_layers_of_which_group_each_array_serves():
    cache = create_hybrid_cache(SPEC, BUDGET)
    cfg = cache.kv_cache_config
    groups = KVCacheGroups.of(cfg, BS)
    assert groups.windows == (WINDOW_BLOCKS, None)  # vLLM's order: the sliding-window group first
    assert len(cache.kv_caches) == 2
    m = KVGroupMap.of(cfg, cache.layer_name_to_kvcache_index, len(cache.kv_caches))
    names = SPEC.layer_names()
    assert m.uses == (((0, names[0]), (1, names[1])), ((0, names[2]), (1, names[3])))


def test_tpu_platform_supports_the_hybrid_kv_cache_manager():
    """The sim answers vLLM's platform question as tpu-inference's platform does
    (``vllm_setup.tpu_platform_hybrid_kv_cache``): checked against the installed TpuPlatform."""
    from tpuoffload.sim.tpu_layouts import tpu_inference

    tpu_inference()
    from tpu_inference.platforms.tpu_platform import TpuPlatform

    assert TpuPlatform.support_hybrid_kv_cache() is True
