"""Issue 21, stage 5 (part): a 2-host pod slice (2 JAX processes x 2 CPU devices, gloo) on the
gpt-oss-like hybrid layout with vLLM's hybrid KV cache manager on, under chaos: per-host delays,
failed device-to-host copies, lost slots (with several KV cache groups vLLM recomputes the whole
request, by ``failed_recving``), dropped and doubled reports, aborts, preemption storms. Every host
holds its heads of tpu-inference's shared arrays; the harness compares every host's dispatch digest
at every step, and every host's runner checks every position it reads."""

from __future__ import annotations

import pytest
from test_podslice import WORKLOAD, _assert_clean_end

from tpuoffload.sim.chaos import Chaos
from tpuoffload.sim.podslice import SliceSpec
from tpuoffload.sim.workload import run_prefix_repetition

# 48 blocks of 2 arrays x 32 KiB pages (whole mesh): a small pool, for preemption storms (vLLM needs
# 41 for one request of 256 tokens: 16 full-attention blocks, 25 for the window and a prefill chunk).
BUDGET = 48 * 2 * 32768


def _spec(**extra) -> SliceSpec:
    config = {"cpu_bytes_to_use": 1 << 22, "save_timeout_s": 3.0, "load_wait_timeout_s": 2.0, **extra}
    return SliceSpec(num_hosts=2, devices_per_host=2, hybrid="gpt-oss-like", kv_budget_bytes=BUDGET,
                     max_model_len=256, max_num_seqs=16, max_num_batched_tokens=256, extra_config=config,
                     step_timeout_s=60.0)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_hybrid_prefix_repetition_chaos(make_slice):
    pod = make_slice(_spec(), Chaos.storm(2, seed=7))
    assert len(pod.scheduler.kv_cache_config.kv_cache_groups) == 2
    assert pod.scheduler.kv_cache_config.num_blocks == 48
    res = run_prefix_repetition(pod, WORKLOAD)
    assert res.finished + res.aborted == res.requests, res
    assert res.aborted > 0 and pod.preemptions > 0, (res.aborted, pod.preemptions)
    assert res.wrong_outputs == []
    totals = pod.stats.totals()
    assert totals["chunks_loaded"] > 0, res.stats
    assert totals["load_errors"] > 0 and totals["save_failures"] > 0, res.stats
    _assert_clean_end(pod)
    print(f"hybrid pod slice: {res}")
