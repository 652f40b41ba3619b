"""Issue 21, stage 3: a Gemma-3-like layout (5 local sliding-window layers to 1 global, twice),
built by tpu-inference's and vLLM's own code (``tpuoffload.sim.hybrid_layouts``). The
repeated-prefix workload on it runs in tests/test_hybrid_prefix.py."""

from __future__ import annotations

import dataclasses

import pytest

from tpuoffload.layout import KVGroupMap, UnsupportedCache
from tpuoffload.manager.kv_groups import KVCacheGroups
from tpuoffload.sim.hybrid_layouts import GEMMA3_LIKE, create_hybrid_cache, num_blocks

SPEC = dataclasses.replace(GEMMA3_LIKE, max_model_len=1024)


def test_six_groups_share_two_arrays():
    cache = create_hybrid_cache(SPEC, 16 << 20)
    groups = KVCacheGroups.of(cache.kv_cache_config, SPEC.block_size)
    assert groups.windows == (4, 4, 4, 4, 4, None)  # cdiv(64 - 1, 16) blocks per window
    m = KVGroupMap.of(cache.kv_cache_config, cache.layer_name_to_kvcache_index, len(cache.kv_caches))
    names = SPEC.layer_names()
    assert m.uses == (tuple((g, names[g]) for g in range(6)), tuple((g, names[6 + g]) for g in range(6)))


def test_hma_block_count_figure():
    on, off = num_blocks(GEMMA3_LIKE, 60 << 20, hma=True), num_blocks(GEMMA3_LIKE, 60 << 20, hma=False)
    print(f"gemma3-like at 60 MiB of KV memory: {on} blocks with HMA on, {off} with HMA off")
    assert on == 6 * off


def test_arrays_not_shared_between_groups_are_refused_at_registration():
    """With one layer per group tpu-inference takes its one-array-per-tensor path: six arrays, one
    per group, where vLLM sized one shared pool. A chunk would not be what the scheduler half
    sizes, so the worker refuses it before anything runs (an error that says why)."""
    single = dataclasses.replace(SPEC, name="gemma3-6-layers", windows=(64,) * 5 + (None,))
    cache = create_hybrid_cache(single, 16 << 20)
    assert len(cache.kv_caches) == 6
    with pytest.raises(UnsupportedCache, match="did not share its arrays"):
        KVGroupMap.of(cache.kv_cache_config, cache.layer_name_to_kvcache_index, len(cache.kv_caches))
