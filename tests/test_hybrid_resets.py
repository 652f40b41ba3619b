"""Issue 21: preemption, aborts, resets of every kind and flaky loads on hybrid layouts (gpt-oss-like,
and a Qwen3.5-like GDN hybrid with tpu-inference's hybrid coordinator and compact state pool; vLLM's
hybrid KV cache manager on), under vLLM's real Scheduler and AsyncScheduler: the random workload of
tests/test_resets.py (every load after every reset checked, nothing saved before a connector reset
ever loaded, nothing leaked, every step's reads exact on every host, GDN state rows included)."""

from __future__ import annotations

import dataclasses

import pytest
from offload_harness import Harness
from test_resets import FlakyReads, run_random_workload

from tpuoffload.sim import gdn_layout as gl
from tpuoffload.sim.hybrid_layouts import GPT_OSS_LIKE

# 40 blocks (2 arrays of 32 KiB pages per block): preemption pressure.
SPEC = dataclasses.replace(GPT_OSS_LIKE, max_model_len=256)
BUDGET = 40 * 2 * 32768
# 30 attention blocks (preemption pressure) and 4 sequences (a compact state pool of 33 rows).
GDN_SPEC = dataclasses.replace(gl.QWEN35_LIKE, hbm_bytes=6 << 20, max_model_len=256)

# One variant per layout (suite time), the two between them covering both schedulers and 1 and 2 hosts.
SW_VARIANT = pytest.param(2, 2, True, id="seed2-2host-AsyncScheduler")
GDN_VARIANT = pytest.param(1, 1, False, id="seed1-1host-Scheduler")


def run_with_flaky_host(h: Harness, seed: int) -> dict:
    """The random workload; with several KV cache groups no output may carry block-level load
    errors: the flaky host's failures must come by request (``failed_recving``)."""
    outs = []
    orig = h.eng._process
    h.eng._process = lambda so, out: (outs.append(out.kv_connector_output), orig(so, out))[1]
    ev = run_random_workload(h, seed, steps=300)
    assert ev["resets"] >= 5 and ev["connector_resets"] >= 2 and ev["aborts"] >= 5
    assert ev["preemptions"] > 0 and ev["loads"] > 0 and ev["arrivals"] > 50
    assert not any(o is not None and o.invalid_block_ids for o in outs)
    ev["failed_recving"] = sum(len(o.failed_recving) for o in outs if o is not None)
    assert ev["failed_recving"] > 0
    return ev


@pytest.mark.parametrize("seed,hosts,async_sched", [SW_VARIANT])
def test_random_workload_with_resets_ends_clean(seed, hosts, async_sched):
    faults = [None] * (hosts - 1) + [FlakyReads(seed, 0.1)]
    h = Harness(hosts, async_sched, max_num_batched_tokens=64, max_num_seqs=8, faults=faults,
                hybrid=SPEC, kv_budget_bytes=BUDGET, extra={"num_cpu_chunks": 96, "save_timeout_s": 2.0})
    try:
        assert h.eng.scheduler.kv_cache_config.num_blocks == 40
        print(f"hybrid random workload seed {seed}: {run_with_flaky_host(h, seed)}")
    finally:
        h.close()


@pytest.mark.parametrize("seed,hosts,async_sched", [GDN_VARIANT])
def test_gdn_random_workload_with_resets_ends_clean(seed, hosts, async_sched):
    # Flakier than above (0.3): a load here is checked once per pool, and only some loads fail.
    faults = [None] * (hosts - 1) + [FlakyReads(seed, 0.3)]
    h = Harness(hosts, async_sched, max_num_batched_tokens=64, max_num_seqs=4, faults=faults, gdn=GDN_SPEC,
                extra={"num_cpu_chunks": 96, "state_ram_fraction": 0.5, "save_timeout_s": 2.0})
    try:
        assert h.eng.scheduler.kv_cache_config.num_blocks == 30
        ev = run_with_flaky_host(h, seed)
        ev["states_verified"] = [r.stats.states_verified for r in h.eng.runners]
        assert min(ev["states_verified"]) > 0  # resumed and hit requests read their state rows back
        print(f"GDN random workload seed {seed}: {ev}")
    finally:
        h.close()
