"""Issue 21: a repeated-prefix workload on hybrid layouts with vLLM's hybrid KV cache manager on
gets host-RAM hits, byte-exact (stage 1: gpt-oss-like; stage 3: Gemma-3-like, 5 local : 1 global).

The arrays and vLLM's KV cache config come from tpu-inference's and vLLM's own code
(``tpuoffload.sim.hybrid_layouts``); vLLM's real ``Scheduler`` and ``AsyncScheduler`` drive the
connector. Every reloaded block is compared byte for byte, for every array and the layer of the
block's KV cache group it holds, with what the synthetic model computes; every step's reads are
checked by the runner (a sliding-window layer reads its window only).
"""

from __future__ import annotations

import dataclasses

import pytest
from offload_harness import BS, Harness

from tpuoffload.manager import kv_groups
from tpuoffload.manager.kv_groups import NULL_BLOCK, KVCacheGroups
from tpuoffload.sim.hybrid_layouts import GEMMA3_LIKE, GPT_OSS_LIKE

# Small enough to run fast on CPU (vLLM gives 128 and 256 blocks for these budgets).
LAYOUTS = {
    "gpt-oss-like": (dataclasses.replace(GPT_OSS_LIKE, max_model_len=1024), 8 << 20),
    "gemma3-like": (dataclasses.replace(GEMMA3_LIKE, max_model_len=1024), 16 << 20),
}
VARIANTS = [pytest.param(False, id="Scheduler"), pytest.param(True, id="AsyncScheduler")]


def run_repeated_prefixes(name, async_scheduling, hosts=1, seed=0):
    spec, budget = LAYOUTS[name]
    assert spec.block_size == BS
    h = Harness(hosts=hosts, async_scheduling=async_scheduling, hybrid=spec, kv_budget_bytes=budget,
                extra={"num_cpu_chunks": 512})
    # Prefixes longer and shorter than the windows: a hit needs each window's tail.
    return h, h.two_waves((20, 13, 5, 2), seed)


@pytest.mark.parametrize("async_scheduling", VARIANTS)
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_repeated_prefix_hits_host_ram_byte_exact(name, async_scheduling):
    h, prefixes = run_repeated_prefixes(name, async_scheduling)
    try:
        bs = h.eng.spec.hybrid.block_size
        groups = KVCacheGroups.of(h.eng.scheduler.kv_cache_config, bs)
        assert groups.several and groups.windowed
        t = h.totals()
        lookup, hit = t["lookup_tokens"], t.get("hit_tokens", 0)
        print(f"{name}: {groups.describe()}; host-RAM hit rate {hit}/{lookup} tokens = {hit / lookup:.1%} "
              f"(second wave: every prefix block); {h.check_loaded_bytes()} bytes reloaded, all exact")
        assert hit == sum(len(p) for p in prefixes), t
        h.check_idle()  # also: no step read a wrong KV value (sliding-window reads included)
        # Per load: a full-attention group moves every hit block, a sliding-window group only the
        # window's tail ending at the hit boundary; nothing into the null block.
        h.check_group_loads(prefixes, groups.windows, bs)
        loads = [ld for plan in h.metas() for ld in plan.loads]
        assert all(NULL_BLOCK not in ld.block_ids for ld in loads)
        # Saves never gather the null block (a sliding-window block vLLM already dropped).
        assert all(NULL_BLOCK not in plan.save.block_ids for plan in h.metas())
    finally:
        h.close()


def test_negative_control_chunks_not_keyed_by_group_load_wrong_bytes(monkeypatch):
    """If a chunk's key ignored its KV cache group, one group's chunk would be loaded into the
    other group's blocks: the byte check must catch it."""
    monkeypatch.setattr(kv_groups, "_key_words", lambda words, kv_group: None)
    h, _ = run_repeated_prefixes("gpt-oss-like", False)
    try:
        with pytest.raises(AssertionError):
            h.check_loaded_bytes()
    finally:
        h.close()
