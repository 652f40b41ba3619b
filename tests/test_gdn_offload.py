"""Issue 21: a GDN (Qwen3.5-like: 3 GDN layers to 1 full-attention layer) hybrid offloaded end to end.

What runs is installed code wherever it decides something (``tpuoffload.sim.gdn_layout``):
tpu-inference 0.32's KV cache specs, its compact mamba pool and arrays (``runner.kv_caches`` with a
(conv, ssm) tuple per GDN layer), vLLM's config resolution (mamba cache mode "align") and vLLM's real
``Scheduler`` / ``AsyncScheduler`` with tpu-inference's hybrid coordinator, the connector's two
halves. The model is the synthetic ``GdnRunner``: every step writes each request's state after its
last token into the state row the GDN kernel would (mamba column ``(tokens - 1) // block_size``),
and on (re)admission reads the state row and every attention position back: a state loaded from
host RAM into the wrong row, from the wrong boundary, or with one wrong bit is counted.

A hit is the attention chunks of k blocks plus the one state chunk saved when a step ended exactly
at block k; vLLM's prefix cache is reset between waves, so the second wave's prefixes come only
from host RAM.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
from offload_harness import zeroed

from tpuoffload.manager.kv_groups import MIRROR, NULL_BLOCK, STATE_POOL
from tpuoffload.sim import gdn_layout as gl
from tpuoffload.sim.engine import EngineSpec, InProcessEngine
from tpuoffload.worker.faults import FaultInjector, FaultPoint

SPEC = dataclasses.replace(gl.QWEN35_LIKE, max_num_seqs=4, max_num_batched_tokens=256)
BS = SPEC.block_size
# Host RAM in KV chunks (the workers hold each attention block twice: 2 KV heads over TP 4), half of
# it for state chunks (210 KiB: a row of 6 GDN layers' states).
EXTRA = {"num_cpu_chunks": 128, "state_ram_fraction": 0.5}


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 30000) for _ in range(n)]


def _engine(async_scheduling=False, hosts=1, extra=EXTRA, faults=None, spec=SPEC) -> InProcessEngine:
    return InProcessEngine(EngineSpec(num_hosts=hosts, gdn=spec, async_scheduling=async_scheduling,
                                      extra_config=dict(extra)), faults)


def _wipe(eng: InProcessEngine) -> None:
    """Zero every host's arrays, states included: after a reset of vLLM's prefix cache a row that
    holds a prefix's state can only have been loaded from host RAM."""
    for r in eng.runners:
        r.kv_caches = zeroed(r.kv_caches)


def _waves(eng: InProcessEngine, prefix_blocks=(9, 5, 2), seed=0, tail=(7, 11)):
    """Two waves over the same prefixes (each ``n`` blocks, then a tail shorter than a block, so
    the prompt's state is saved at block ``n``), vLLM's prefix cache reset and every array wiped
    between them. Returns the prefixes."""
    rng = random.Random(seed)
    layout = eng.gdn_layout
    prefixes = [_tokens(rng, n * BS) for n in prefix_blocks]
    for w in range(2):
        if w:
            assert eng.scheduler.reset_prefix_cache()
            _wipe(eng)
        for i, p in enumerate(prefixes):
            eng.add_request(gl.make_request(layout, f"{w}{i}", p + _tokens(rng, tail[w]), max_tokens=3))
        eng.run()
        eng.settle()
    return prefixes


def _loads(eng: InProcessEngine) -> list:
    """Every (host, LoadRequest, slot pool of each of its slots) the workers were handed."""
    seen = []
    for host, conn in enumerate(eng.connectors):
        orig = conn.bind_connector_metadata
        index = eng.offload.index

        def bind(meta, orig=orig, host=host):
            for load in meta.plan.loads:
                seen.append((host, load, index.pool_of(np.asarray(list(load.slots), np.int64))))
            return orig(meta)

        conn.bind_connector_metadata = bind
    return seen


def _check_clean(eng: InProcessEngine) -> None:
    """No wrong read anywhere (attention positions and states), nothing held."""
    eng.settle()
    for r in eng.runners:
        assert r.stats.mismatches == 0, r.stats.mismatched_requests
        assert r.stats.state_mismatches == 0, r.stats.state_mismatched_requests
    leaks = eng.offload.leak_report()
    assert all(v == 0 for v in leaks.values()), leaks
    for conn in eng.connectors:
        idle = conn.worker.idle_report()
        assert all(v == 0 for v in idle.values()), idle


VARIANTS = [pytest.param(False, id="Scheduler"), pytest.param(True, id="AsyncScheduler")]


@pytest.mark.parametrize("async_scheduling", VARIANTS)
def test_repeated_prefixes_hit_host_ram_with_their_state_byte_exact(async_scheduling):
    eng = _engine(async_scheduling)
    try:
        groups = eng.offload.kv_groups
        assert groups.windows == (1, MIRROR, MIRROR, None) and groups.pools == (STATE_POOL,) * 3 + (0,)
        loads = _loads(eng)
        prefixes = _waves(eng)
        t = eng.stats.reduce()
        runner = eng.runners[0]
        lookup, hit = t["lookup_tokens"], t.get("hit_tokens", 0)
        print(f"qwen3.5-like: {groups.describe()}; host slots KV/state {eng.offload.index.pool_sizes}; "
              f"host-RAM hit rate {hit}/{lookup} tokens = {hit / lookup:.1%} (second wave: every prefix); "
              f"{runner.stats.states_verified} state rows and {runner.stats.positions_verified} attention "
              "positions verified, all exact")
        assert hit == sum(len(p) for p in prefixes), t
        # Each second-wave request loaded its prefix's attention blocks and ONE state row, the
        # row at the hit's last block, from the state pool; the mirror groups nothing.
        assert sorted(ld.req_id for _, ld, _ in loads) == ["10", "11", "12"]
        for _, load, pools in loads:
            n = len(prefixes[int(load.req_id[1])]) // BS
            assert len(load.block_ids) == n + 1 and not load.unavailable_block_ids
            assert sorted(pools.tolist()) == [0] * n + [1]
            assert NULL_BLOCK not in load.block_ids
        assert runner.stats.states_verified >= len(prefixes)
        _check_clean(eng)
    finally:
        eng.close()


def test_a_state_load_that_is_skipped_is_caught():
    """The check behind the test above can fail: with the state rows' loads dropped (the attention
    blocks still load), every second-wave request reads a state that is not its prefix's."""
    from tpuoffload.worker import pooled_engine

    eng = _engine()
    try:
        orig = pooled_engine.PooledEngine.load

        def attention_only(self, kv_caches, block_ids, slots, save_ids, sources, boundary):
            keep = [i for i, s in enumerate(slots) if s < boundary]
            caches, failed = orig(self, kv_caches, [block_ids[i] for i in keep], [slots[i] for i in keep],
                                  [save_ids[i] for i in keep], None, boundary)
            return caches, {keep[i] for i in failed}

        pooled_engine.PooledEngine.load = attention_only
        try:
            _waves(eng)
        finally:
            pooled_engine.PooledEngine.load = orig
        eng.settle()
        st = eng.runners[0].stats
        assert st.state_mismatches >= 3
        # The attention blocks did load: the only wrong attention reads are of KV that requests
        # computed after their wrong state read (the model's outputs depend on what it read).
        assert st.mismatched_requests <= st.state_mismatched_requests, st
    finally:
        eng.close()


class LoseStateRows(FaultInjector):
    """A host loses the first state row of a step's loads (the first listed request's), ``times``
    times: a step's state rows are checked in the second slot check of its load call (the state
    pool's engine runs after the attention pool's: worker/pooled_engine.py)."""

    def __init__(self, times: int):
        self.times = times
        self.calls = 0
        self.lost = 0

    def hit(self, point: FaultPoint, n: int) -> set[int]:
        if point is not FaultPoint.LOAD_SLOT_CHECK:
            return set()
        self.calls += 1
        if self.calls % 2 or self.times <= 0:
            return set()
        self.times -= 1
        self.lost += 1
        return {0}


@pytest.mark.parametrize("async_scheduling", VARIANTS)
def test_a_lost_state_row_on_one_host_is_recomputed_on_every_host(async_scheduling):
    """Two hosts; host 1 loses the state rows of the second wave's first load. vLLM takes the
    failure by request (several KV cache groups): the request is recomputed on both hosts, every
    read stays exact, nothing crashes or leaks, and the other requests still hit."""
    fault = LoseStateRows(times=1)
    extra = dict(EXTRA, num_cpu_chunks=64)
    eng = _engine(async_scheduling, hosts=2, extra=extra, faults=[None, fault])
    try:
        loads = _loads(eng)
        prefixes = _waves(eng)
        t = eng.stats.reduce()
        assert fault.lost == 1 and t["load_errors"] == 1 and t["failed_requests"] == 1, t
        # Recomputed, not failed: every request of both waves ran to its 3 tokens (vLLM's default
        # policy, ``fail``, would have finished the failed one with an error and no token).
        assert {rid: len(out) for rid, out in eng.outputs.items()} == {f"{w}{i}": 3 for w in (0, 1) for i in range(3)}
        # Both hosts were handed the same three loads; the first request's failed (host 1) and was
        # recomputed everywhere, the other two were served whole with their states.
        assert [(h, ld.req_id) for h, ld, _ in loads] == [(h, f"1{i}") for h in (0, 1) for i in range(3)]
        assert t["hit_tokens"] == sum(len(p) for p in prefixes), t  # admitted hits, the lost one included
        a, b = (r.stats for r in eng.runners)
        # Every state row read was checked, alike on both hosts (every step of every request that has
        # computed tokens reads one), and none was wrong.
        assert a.states_verified == b.states_verified > 0 and a.state_mismatches == b.state_mismatches == 0
        assert (a.steps, a.tokens_written, a.states_written) == (b.steps, b.tokens_written, b.states_written)
        _check_clean(eng)
    finally:
        eng.close()
