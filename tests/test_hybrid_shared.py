"""Issue 36: the shared tier (one store every replica shares) for hybrid models, several KV cache
groups (gpt-oss-like: sliding window 128 and full attention, tpu-inference's shared arrays, vLLM's
hybrid KV cache manager on), against vLLM's real Scheduler and a real redis-server.

Engine A (2 hosts) computes prefixes and publishes every group's chunks; engine B (2 hosts, empty
host RAM, the same store) serves the same prefixes from the store: each object is named by its
content hash and KV cache group (as vLLM's offload key), a probe asks for every group's chunk, and
the hit the store extends is the one host RAM's own rule gives (a full-attention group every block,
a sliding-window group only the window ending at the hit). Every block B loads is compared byte for
byte, per group and array, with what the synthetic model computes, and B's tokens (the model's
outputs depend on every KV value read) equal a run that recomputes. Negative control: objects named
by content hash alone (every group as group 0): the groups' objects collide in the store, and the
byte audit catches the wrong group's bytes. The shared tier's path through separate host
processes is tests/test_shared_podslice.py's (one group; a hybrid pod-slice run of this, 344 s
on this 2-core box, was left out of the suite for time).

Under tpu-inference's DPScheduler (below, a pod slice of 2 processes, DP 2 x TP 2): both groups'
chunks each rank computed are published and fetched back by the other rank, on the other host."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import numpy as np
import pytest
from offload_harness import BS, Harness, rand_tokens

from tpuoffload import counters as C
from tpuoffload.manager.hash_table import PackedHashes
from tpuoffload.manager.kv_groups import KVCacheGroups
from tpuoffload.sim.hybrid_layouts import GPT_OSS_LIKE

SPEC = dataclasses.replace(GPT_OSS_LIKE, max_model_len=1024)
BUDGET = 8 << 20
# Prefixes longer and shorter than the 8-block window: a hit needs the window's tail only.
PREFIX_BLOCKS = (20, 13, 5)


def _harness(url: str | None) -> Harness:
    extra = {"num_cpu_chunks": 512, "save_timeout_s": 30.0, "load_wait_timeout_s": 10.0}
    if url is not None:
        extra["shared_url"] = url
    return Harness(hosts=2, hybrid=SPEC, kv_budget_bytes=BUDGET, extra=extra)


def _serve(h: Harness, tag: str, prefixes: list[list[int]], seed: int) -> dict[str, list[int]]:
    rng = random.Random(seed)
    for i, p in enumerate(prefixes):
        h.add(f"{tag}{i}", p + rand_tokens(rng, 11))
    h.run()
    h.eng.settle()
    for conn in h.eng.connectors:  # publishes are background writes: wait for them
        assert conn.worker.wait_idle(30)
    h.eng.settle()
    return {rid[len(tag):]: toks for rid, toks in h.eng.outputs.items() if rid.startswith(tag)}


def _prefixes() -> list[list[int]]:
    rng = random.Random(0)
    return [rand_tokens(rng, n * BS) for n in PREFIX_BLOCKS]


def _a_then_b(url: str):
    """Engine A serves the prefixes (the store fills), then engine B serves them again."""
    prefixes = _prefixes()
    a = _harness(url)
    try:
        out_a = _serve(a, "a", prefixes, seed=1)
        ta = Counter(a.totals())
        a.check_idle()
    finally:
        a.close()
    b = _harness(url)
    out_b = _serve(b, "b", prefixes, seed=1)
    return prefixes, out_a, ta, b, out_b


def test_engine_b_loads_every_groups_blocks_from_the_store_byte_exact():
    from tpuoffload.sim.redis_server import RedisServer

    with RedisServer(lifetime_s=600) as server:
        prefixes, out_a, ta, b, out_b = _a_then_b(f"{server.url}?timeout_s=30")
        try:
            groups = KVCacheGroups.of(b.eng.scheduler.kv_cache_config, BS)
            assert sorted(groups.windows, key=str) == [8, None], groups.describe()
            # A published both groups' chunks, as separate objects (2 hosts: 2 objects each).
            assert ta[C.SHARED_WRITTEN_CHUNKS] == 2 * ta[C.SHARED_PUBLISH_ISSUED] > 0, ta
            tb = Counter(b.totals())
            assert tb[C.SHARED_FETCHES_READY] > 0 and tb[C.SHARED_FETCHES_FAILED] == 0, tb
            assert tb[C.SHARED_READ_CHUNKS] == 2 * tb[C.SHARED_FETCHES_READY], tb  # both hosts read their part
            assert tb[C.HIT_TOKENS] == sum(len(p) for p in prefixes), tb  # every prefix block, from the store
            assert tb[C.SHARED_PUBLISH_ISSUED] == 0 and tb[C.LOAD_ERRORS] == 0, tb
            checked = b.check_loaded_bytes()  # every loaded block, per group and array, byte for byte
            # Per load: the full-attention group moved every hit block, the sliding-window group only
            # the window's tail ending at the hit; each fetched from the store (B computed no prefix).
            b.check_group_loads(prefixes, groups.windows)
            fetched = sum(len(p) // BS + min(len(p) // BS, 8) for p in prefixes)  # both groups' chunks of each hit
            assert tb[C.SHARED_FETCHES_READY] == fetched, (tb, fetched)
            print(f"hybrid shared tier: B fetched {tb[C.SHARED_FETCHES_READY]} chunks of both groups from redis, "
                  f"hit {tb[C.HIT_TOKENS]}/{tb[C.LOOKUP_TOKENS]} tokens, {checked} bytes reloaded, all exact")
            b.check_idle()  # no position read wrong (sliding-window reads included), nothing leaked
        finally:
            b.close()
    control = _harness(None)  # the same prompts recomputed, no shared tier
    try:
        out_c = _serve(control, "c", prefixes, seed=1)
        assert control.totals().get(C.HIT_TOKENS, 0) == 0
    finally:
        control.close()
    assert out_b == out_c == out_a


def test_negative_control_objects_named_without_their_group_load_the_other_groups_bytes(monkeypatch, tmp_path):
    """The one mechanism removed: the KV cache group in the object's name (every group's chunk of a
    block named as group 0's, by content hash alone). A's two chunks of a block collide (the first
    publish wins), B installs that one object for both groups, and the byte audit catches it."""
    from tpuoffload.backend.shared_store import ObjectId
    from tpuoffload.worker import shared_stage

    monkeypatch.setattr(shared_stage, "ObjectId",
                        lambda ns, key, group, part, parts, pool=0: ObjectId(ns, key, 0, part, parts, pool))
    _, _, ta, b, _ = _a_then_b(f"file://{tmp_path}/shared?timeout_s=30")
    try:
        assert ta[C.SHARED_WRITE_EXISTS] > 0, ta  # the collision: one group's chunk found the other's object
        assert Counter(b.totals())[C.SHARED_FETCHES_READY] > 0
        with pytest.raises(AssertionError, match="group"):
            b.check_loaded_bytes()
    finally:
        b.close()


def test_the_hit_follows_host_rams_rule_over_ram_and_store_together():
    """The scheduler's side alone (a real ChunkIndex, the probe answers given): the hit the store
    extends is the longest every group serves from host RAM and the store together, and what is
    fetched is each group's chunks of it that host RAM lacks (a sliding-window group its window
    only), block by block; a store lacking a full-attention block cuts the hit there."""
    from tpuoffload.manager.index import ChunkIndex
    from tpuoffload.manager.kv_groups import chunk_keys
    from tpuoffload.manager.ledger import CompletionLedger
    from tpuoffload.manager.save_planner import SavePlanner
    from tpuoffload.manager.shared_tier import SharedTierPlanner
    from tpuoffload.manager.staging import StagingBudget
    from tpuoffload.messages import SharedReport, unpack_keys

    groups = KVCacheGroups((None, 3))  # full attention, a 3-block window
    index = ChunkIndex(64)
    ledger = CompletionLedger(2)
    saves = SavePlanner(index, ledger, StagingBudget(1 << 30), chunk_bytes=1, save_timeout_s=30, clock=lambda: 0.0,
                        counters=Counter())
    tier = SharedTierPlanner(saves, ledger, 2, BS, Counter(), lambda: 0.0, 30.0, lambda rid: None, groups)
    from tpuoffload.sim.vllm_setup import make_request

    request = make_request("r", rand_tokens(random.Random(2), 10 * BS + 1), block_size=BS)
    hashes = list(request.block_hashes)
    assert len(hashes) == 10
    # Host RAM holds blocks 0-1 of both groups (a 2-block host-RAM hit).
    for g in range(2):
        c = saves.claim(chunk_keys(PackedHashes.of(hashes[:2]), g), 0)
        index.mark_ready(c.slots, np.arange(c.first_save_id, c.first_save_id + len(c.slots)))
    assert tier.wants(request, 0, 2)
    plan = tier.finish_step(0)
    (pid, keys, kv_groups, pools), = plan.probe
    assert pools == b""  # one host slot pool: every chunk the KV pool's
    assert len(unpack_keys(keys)) == 8 * 2 and np.frombuffer(kv_groups, np.uint8).tolist() == [0, 1] * 8
    # Every host's store: both groups of blocks 2-8 except the full group's block 7 (hit: 7 blocks),
    # and the window group's block 3 (outside the hit's window: not needed).
    present = np.ones((8, 2), bool)
    present[5, 0] = False  # block 7, full attention
    present[1, 1] = False  # block 3, sliding window
    answer = bytes(present.reshape(-1).astype(np.uint8))
    tier.on_report({h: SharedReport(probed=((pid, answer),)) for h in range(2)})
    tier.plan_into_ram(1)
    fetch = tier.finish_step(1)
    got = list(zip(np.frombuffer(fetch.fetch_groups, np.uint8).tolist(),
                   [bytes(r.tobytes()) for r in unpack_keys(fetch.fetch.keys)]))
    first = [h[:16] for h in hashes]
    # Blocks 2..6 of the full group, the window's blocks 4..6 of the sliding one, block by block.
    want = [(0, first[2]), (0, first[3]), (0, first[4]), (1, first[4]), (0, first[5]), (1, first[5]),
            (0, first[6]), (1, first[6])]
    assert got == want, got
    assert fetch.publish_groups == b"" and len(fetch.publish) == 0


# ---------------------------------------------------------------------------- under DPScheduler
DP_RANKS = 2
DP_PREFIX_BLOCKS = 6  # within the 8-block window: a hit loads every block of both groups


def _dp_spec(url: str):
    """gpt-oss-like under tpu-inference's DPScheduler: DP 2 x TP 2 over a 2-process pod slice (each
    rank's batch shard on one host's 2 devices), the shared tier on ``url``."""
    from tpuoffload.sim.podslice import SliceSpec

    config = {"num_cpu_chunks": 64, "shared_url": url, "save_timeout_s": 30.0, "load_wait_timeout_s": 10.0}
    return SliceSpec(num_hosts=2, devices_per_host=2, hybrid="gpt-oss-like-dp2", kv_budget_bytes=2 * 48 * 2 * 32768,
                     max_model_len=256, max_num_seqs=16, max_num_batched_tokens=256, extra_config=config,
                     step_timeout_s=60.0)


def _dp_rank_totals(pod) -> list[dict]:
    from tpuoffload.snapshot import read_rank_snapshots

    snaps = read_rank_snapshots(pod.stats_dir)
    assert len(snaps) == DP_RANKS, list(snaps)
    return [snap["totals"] for _, snap in sorted(snaps.items())]


def _per_host(pod, name: str) -> list[int]:
    """Counter ``name`` as each host reported it (stats keys ``<host>|<seq>|<name>``)."""
    out = [0] * pod.spec.num_hosts
    for key, value in pod.stats.data.items():
        source, _, counter = key.split("|")
        if counter == name and source.isdigit():
            out[int(source)] += value
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_dpscheduler_slices_share_both_groups_chunks_across_ranks_and_hosts(make_slice):
    """The gpt-oss-like hybrid through tpu-inference's own DPScheduler with a real redis-server as
    the shared tier. Slice A serves groups of one 6-block prompt per rank and publishes every
    group's chunks: one object per chunk and group, each a whole rank's chunk written by the host
    holding its batch shard, all in one namespace (both ranks have the same layout). Slice C, a
    fresh deployment on the same store, gets each group rotated, so that each rank is asked for
    what A's other rank computed: each rank fetches both groups' chunks of every prompt block from
    objects the other rank's host wrote (each host wrote one rank's), loads them, and reads
    every position exact on every host; every output right, identical dispatch digests, nothing
    leaked, nothing sent back to the store."""
    import redis

    from dp_helpers import serve_groups
    from test_dp_shared import _clean_end

    from tpuoffload.backend.shared_store_redis import KEY_PREFIX
    from tpuoffload.sim.redis_server import RedisServer

    rng = np.random.default_rng(41)
    prompts = [[rng.integers(3, 30000, DP_PREFIX_BLOCKS * BS + 5).tolist() for _ in range(DP_RANKS)] for _ in range(2)]
    per_rank = 2 * DP_PREFIX_BLOCKS * len(prompts)  # both groups' chunks of every prompt block
    with RedisServer(lifetime_s=600) as server:
        url = f"{server.url}?timeout_s=30"
        a = make_slice(_dp_spec(url))
        assert a.dp_ranks == DP_RANKS and type(a.scheduler).__name__ == "DPScheduler"
        assert serve_groups(a, prompts, "a") == [list(range(DP_RANKS))] * len(prompts)
        published = [t.get(C.SHARED_PUBLISH_ISSUED, 0) for t in _dp_rank_totals(a)]
        assert published == [per_rank] * DP_RANKS, published  # every rank its own prompts', both groups
        _clean_end(a)
        # Each host wrote one rank's objects: the ranks' shards are on different hosts.
        assert _per_host(a, C.SHARED_WRITTEN_CHUNKS) == [per_rank] * 2, a.stats.totals()
        a.shutdown()  # the hosts finish their background writes
        client = redis.Redis(port=server.port)
        names = [k.decode()[len(KEY_PREFIX):] for k in client.scan_iter(KEY_PREFIX + "*")]
        client.close()
        # One object per chunk and group: a whole rank's chunk from the one host holding its shard
        # ("h0of1"), in one namespace, group 0's and group 1's alike.
        assert len(names) == sum(published), (len(names), published)
        assert {n.split("/")[1] for n in names} == {"h0of1"} and len({n.split("/")[0] for n in names}) == 1, names[:4]
        assert Counter(n.rsplit(".g", 1)[1] for n in names) == {"0": sum(published) // 2, "1": sum(published) // 2}

        c = make_slice(_dp_spec(url))
        rotated = [group[-1:] + group[:-1] for group in prompts]  # rank r gets A's rank r-1's prompt
        assert serve_groups(c, rotated, "c") == [list(range(DP_RANKS))] * len(prompts)
        assert c.finished == {f"c{g}-{i}" for g in range(len(prompts)) for i in range(DP_RANKS)}
        assert c.mismatches == [0, 0], c.mismatches
        totals = _dp_rank_totals(c)
        for r, t in enumerate(totals):  # each rank fetched every chunk of both groups and loaded them
            assert t.get(C.SHARED_FETCHES_READY, 0) == per_rank and not t.get(C.SHARED_FETCHES_FAILED), (r, t)
            assert t[C.HIT_TOKENS] == DP_PREFIX_BLOCKS * BS * len(prompts), (r, t)
            assert not t.get(C.SHARED_PUBLISH_ISSUED), (r, t)  # what came from the store is not sent back
        hc = c.stats.totals()
        assert hc[C.LOAD_ERRORS] == 0 and hc[C.SHARED_MISS_CORRUPT] == 0, hc
        # Every chunk of both ranks loaded, as each host counts it (every host runs every rank's loads).
        assert _per_host(c, C.CHUNKS_LOADED) == [DP_RANKS * per_rank] * 2, hc
        # Each chunk read once, by the host holding the rank that fetched it (the other rank's host wrote it).
        assert _per_host(c, C.SHARED_READ_CHUNKS) == [per_rank] * 2, hc
        _clean_end(c)  # every position every host read exact, digests equal at every step, nothing leaked
        print(f"hybrid shared tier under DPScheduler: A published {published} chunks per rank ({len(names)} "
              f"objects), C fetched {[t[C.SHARED_FETCHES_READY] for t in totals]} per rank, loaded "
              f"{_per_host(c, C.CHUNKS_LOADED)} per host, {hc[C.HIT_TOKENS]} hit tokens")
        c.close()
