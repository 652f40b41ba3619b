"""Issue 36: the shared tier (one store every replica shares) for GDN/mamba hybrids, against a real
redis-server, vLLM's real Scheduler with tpu-inference 0.32's hybrid coordinator and its own
Qwen3.5-like layout (``tpuoffload.sim.gdn_layout``: 3 GDN layers to 1 full attention, the compact
state pool, (conv, ssm) state arrays).

Deployment A (2 hosts) serves prompts and publishes what it saves: the attention blocks (KV pool)
and the state rows saved at exact block boundaries (the state pool), each host its shard, each
object named by content hash, KV cache group and slot pool. Deployment B (2 hosts, fresh host RAM
and HBM, the same store) serves the same prompts: a hit needs the attention chunks of k blocks and
the state row at block k (host RAM's own rule, over host RAM and the store together), so the store
serves a prefix only where both are there; B fetches both pools' chunks into their own pools and
loads them like any host-RAM hit. ``GdnRunner`` checks every state row and attention position B
reads against the synthetic model (exact in each array's dtype: a row loaded into the wrong pool or
slot, from the wrong boundary or with one wrong bit is counted), and B's greedy tokens, which
depend on every value read, equal A's.

Negative control, the one mechanism removed: the state chunks left out of the store's probes and
fetches (the planner treats the state group as a mirror): no prefix is served, though every KV
chunk is in the store. The pool in an object's name and header is checked on its own (a state
object read as a KV object, or the reverse, is foreign: a miss).
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import numpy as np
import pytest

from tpuoffload import counters as C
from tpuoffload.manager.kv_groups import MIRROR, STATE_POOL
from tpuoffload.sim import gdn_layout as gl
from tpuoffload.sim.engine import EngineSpec, InProcessEngine
from test_gdn_offload import _check_clean

SPEC = dataclasses.replace(gl.QWEN35_LIKE, max_num_seqs=4, max_num_batched_tokens=256)
BS = SPEC.block_size
EXTRA = {"num_cpu_chunks": 128, "state_ram_fraction": 0.5, "save_timeout_s": 600.0, "load_wait_timeout_s": 60.0}
PREFIX_BLOCKS = (9, 5, 2)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 30000) for _ in range(n)]


def _prompts() -> list[list[int]]:
    """Each a prefix of ``n`` blocks then a tail shorter than a block: align mode ends a prefill
    step exactly at block ``n``, so A saves the state row there."""
    rng = random.Random(0)
    return [_tokens(rng, n * BS) + _tokens(rng, 7) for n in PREFIX_BLOCKS]


def _serve(url: str, tag: str) -> tuple[InProcessEngine, dict[str, list[int]], list]:
    """A fresh 2-host deployment on ``url`` serves the prompts; returns it (open), its tokens and
    the loads its workers were handed: (host, LoadRequest, slot pool of each slot)."""
    eng = InProcessEngine(EngineSpec(num_hosts=2, gdn=SPEC, extra_config={**EXTRA, "shared_url": url}))
    loads = []
    index = eng.offload.index
    for host, conn in enumerate(eng.connectors):
        orig = conn.bind_connector_metadata

        def bind(meta, orig=orig, host=host):
            for load in meta.plan.loads:
                loads.append((host, load, index.pool_of(np.asarray(list(load.slots), np.int64))))
            return orig(meta)

        conn.bind_connector_metadata = bind
    for i, p in enumerate(_prompts()):
        eng.add_request(gl.make_request(eng.gdn_layout, f"{tag}{i}", p, max_tokens=3))
    eng.run()
    eng.settle()
    for conn in eng.connectors:  # publishes are background writes: wait for them
        assert conn.worker.wait_idle(30)
    eng.settle()
    return eng, {rid[len(tag):]: t for rid, t in eng.outputs.items() if rid.startswith(tag)}, loads


@pytest.fixture(scope="module")
def published():
    """A redis-server that deployment A filled: A served the prompts, published what it saved and
    was closed. Yields (url, A's totals, A's tokens)."""
    from tpuoffload.sim.redis_server import RedisServer

    with RedisServer(lifetime_s=600) as server:
        url = f"{server.url}?timeout_s=30"
        a, out_a, _ = _serve(url, "a")
        try:
            ta = Counter(a.stats.reduce())
            _check_clean(a)
        finally:
            a.close()
        yield url, ta, out_a


@pytest.mark.timeout(300)
def test_deployment_b_serves_kv_and_state_rows_from_the_store_byte_exact(published):
    url, ta, out_a = published
    b, out_b, loads = _serve(url, "b")
    try:
        groups = b.offload.kv_groups
        assert groups.windows == (1, MIRROR, MIRROR, None) and groups.pools == (STATE_POOL,) * 3 + (0,)
        # A published its KV and state chunks, each host its shard (2 objects per chunk).
        assert ta[C.SHARED_WRITTEN_CHUNKS] == 2 * ta[C.SHARED_PUBLISH_ISSUED] > 0, ta
        tb = Counter(b.stats.reduce())
        # Every prefix whole, from the store (B's host RAM started empty): its attention blocks and
        # the one state row at its boundary, each fetched into its own pool, read by both hosts.
        assert tb[C.HIT_TOKENS] == sum(PREFIX_BLOCKS) * BS, tb
        want = sum(PREFIX_BLOCKS) + len(PREFIX_BLOCKS)  # KV chunks + one state chunk per prefix
        assert tb[C.SHARED_FETCHES_READY] == want and tb[C.SHARED_FETCHES_FAILED] == 0, tb
        assert tb[C.SHARED_READ_CHUNKS] == 2 * want, tb
        assert tb[C.SHARED_PUBLISH_ISSUED] == 0 and tb[C.LOAD_ERRORS] == 0, tb
        assert sorted({ld.req_id for _, ld, _ in loads}) == ["b0", "b1", "b2"]
        for _, load, pools in loads:
            n = PREFIX_BLOCKS[int(load.req_id[1])]
            assert sorted(pools.tolist()) == [0] * n + [1], (load, pools)  # n KV blocks and one state row
        # Byte-exact: every state row and attention position B read is the synthetic model's
        # value for that prefix (B's HBM started at zeros: a row not loaded reads zeros).
        for r in b.runners:
            assert r.stats.states_verified > 0 and r.stats.positions_verified > 0
        _check_clean(b)
        print(f"GDN shared tier: B fetched {tb[C.SHARED_FETCHES_READY]} chunks ({len(PREFIX_BLOCKS)} state rows) "
              f"from redis, hit {tb[C.HIT_TOKENS]}/{tb[C.LOOKUP_TOKENS]} tokens; "
              f"{b.runners[0].stats.states_verified} state rows and {b.runners[0].stats.positions_verified} "
              "attention positions verified per host, all exact")
    finally:
        b.close()
    assert out_b == out_a and len(out_a) == len(PREFIX_BLOCKS)  # greedy tokens: every value read right
    assert all(len(t) == 3 for t in out_a.values())


@pytest.mark.timeout(300)
def test_negative_control_state_rows_not_fetched_serve_no_prefix(published, monkeypatch):
    """The one mechanism removed: the state chunks in the store's probes and fetches (the planner
    probes the state group as it does a mirror group: nothing of its own). The store holds every
    chunk A computed, yet no prefix is served: a GDN hit needs the state row at its boundary."""
    from tpuoffload.manager import shared_tier

    url, ta, out_a = published
    orig = shared_tier.SharedTierPlanner.__init__

    def kv_only(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        self._probed = self._probed[self._pools[self._probed] != STATE_POOL]

    monkeypatch.setattr(shared_tier.SharedTierPlanner, "__init__", kv_only)
    c, out_c, _ = _serve(url, "c")
    try:
        tc = Counter(c.stats.reduce())
        assert ta[C.SHARED_WRITTEN_CHUNKS] > 0 and tc[C.SHARED_PROBES] > 0, (ta, tc)
        assert tc[C.SHARED_FETCHES_ISSUED] == 0 and tc.get(C.HIT_TOKENS, 0) == 0, tc
        _check_clean(c)
    finally:
        c.close()
    assert out_c == out_a  # recomputed


def test_an_object_of_one_pool_is_foreign_to_the_other():
    """The name and the header carry the pool: a state chunk's object is never a KV chunk's, even
    with the same content key, group, shard and size; a KV-pool object keeps its old name."""
    from tpuoffload.backend import shared_store
    from tpuoffload.backend.shared_store import ObjectError, ObjectId, decode_object, encode_header

    ns, key = bytes(range(16)), bytes(range(16, 32))
    kv, state = ObjectId(ns, key, 0, 0, 2), ObjectId(ns, key, 0, 0, 2, 1)
    assert kv.name.endswith(".g0") and state.name == kv.name + ".p1"
    payload = np.arange(64, dtype=np.uint8)
    data = encode_header(state, payload) + payload.tobytes()
    assert decode_object(state, data, 64)[1] is None
    assert decode_object(kv, data, 64)[1] is ObjectError.FOREIGN
    assert decode_object(state, encode_header(kv, payload) + payload.tobytes(), 64)[1] is ObjectError.FOREIGN
    # A KV object written before objects had a pool (that header byte was a reserved zero) is the
    # KV pool's still, and never a state chunk.
    old = bytearray(encode_header(kv, payload))
    assert old[shared_store._POOL_AT] == 0 and bytes(old[shared_store._POOL_AT:shared_store._HEADER_CRC_AT]) == bytes(
        shared_store._HEADER_CRC_AT - shared_store._POOL_AT)
    assert decode_object(kv, bytes(old) + payload.tobytes(), 64)[1] is None
