"""Issue 36: the shared tier for a hybrid model on pod slices: two slices of the gpt-oss-like layout
(sliding window + full attention, vLLM's hybrid KV cache manager on; 2 JAX processes x 2 CPU
devices each, every host holding its heads of tpu-inference's shared arrays) share one
redis-server. Slice A computes a prefix workload and publishes every group's chunks; slice B,
started after A shut down, serves the same workload from the store: every output equals what the
context-dependent synthetic model computes from scratch (``wrong_outputs``), every context
position every host read is right (sliding-window reads included), and every host dispatched the
same at every step. The byte audit per group and its negative control are tests/test_hybrid_shared.py."""

from __future__ import annotations

from collections import Counter

import pytest

from tpuoffload import counters as C


def _spec(url: str):
    from tpuoffload.sim.podslice import SliceSpec

    config = {"num_cpu_chunks": 256, "shared_url": url, "save_timeout_s": 30.0, "load_wait_timeout_s": 10.0}
    return SliceSpec(num_hosts=2, devices_per_host=2, hybrid="gpt-oss-like", kv_budget_bytes=96 * 2 * 32768,
                     max_model_len=256, max_num_seqs=16, max_num_batched_tokens=256, extra_config=config,
                     step_timeout_s=120.0)


def _serve(pod) -> Counter:
    from tpuoffload.sim.workload import PrefixRepetition, run_prefix_repetition

    workload = PrefixRepetition(num_prefixes=4, prefix_blocks=10, suffix_len=(8, 16), output_len=(4, 8),
                                num_requests=8, waves=1, arrivals_per_step=4, seed=5)
    res = run_prefix_repetition(pod, workload)
    assert res.wrong_outputs == [] and res.finished == res.requests, res
    states = pod.worker_state()
    assert all(s["mismatches"] == 0 and s["positions_verified"] > 0 for s in states), states
    assert all(len(set(step)) == 1 for step in pod.digests)  # (the slice raises at the first divergence)
    return Counter(pod.stats.totals())


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_hybrid_slices_share_every_groups_chunks_through_redis(make_slice):
    from tpuoffload.sim.redis_server import RedisServer

    with RedisServer(lifetime_s=900) as server:  # killed (process group) when the test ends, or by timeout
        url = f"{server.url}?timeout_s=30"
        first = make_slice(_spec(url))
        assert len(first.scheduler.kv_cache_config.kv_cache_groups) == 2
        a = _serve(first)
        assert a[C.SHARED_WRITTEN_CHUNKS] > 0 and a[C.SHARED_FETCHES_READY] == 0, a
        first.shutdown()  # the hosts finish their background writes
        second = make_slice(_spec(url))
        b = _serve(second)
        print(f"hybrid shared tier, redis: slice B hit {b[C.HIT_TOKENS]} of {b[C.LOOKUP_TOKENS]} prompt tokens, "
              f"{b[C.SHARED_FETCHES_READY]} chunks fetched (both groups), {b[C.SHARED_READ_BYTES]} bytes read; "
              f"A wrote {a[C.SHARED_WRITTEN_BYTES]}")
        assert b[C.SHARED_FETCHES_READY] > 0 and b[C.SHARED_FETCHES_FAILED] == 0, b
        assert b[C.HIT_TOKENS] > 0 and b[C.LOAD_ERRORS] == 0 and b[C.CHUNKS_LOADED] > 0, b
        assert b[C.SHARED_READ_CHUNKS] == 2 * b[C.SHARED_FETCHES_READY], b  # each host read and verified its part
        second.close()
