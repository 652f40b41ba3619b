"""Issue 36: GDN (Qwen3.5-like) hybrids under tpu-inference's DPScheduler.

tpu-inference 0.32's DPScheduler gives each rank ``mamba_num_blocks // dp`` rows of the compact
state pool (``_create_per_rank_configs``), installs its hybrid coordinator hooks in every rank
process (mamba cache mode "align"), and passes every group's block ids through rank-local; the
runner shards the state pool over ``ATTN_DATA`` like the attention blocks, so rank r's state row b
is the pool's row ``r * (M // dp) + b``. The scheduler half tells the workers its rank's row count
(``StepPlan.state_rows``) and the workers place its state rows and its share of the host state
store (``offload_worker._Placed``). The disk tier keeps each rank's KV and state chunks in that
rank's files, placed the same way (its section); the shared tier keeps them as the rank's objects
in a real redis-server (the last section).

The pod-slice proof runs 2 JAX processes x 2 CPU devices (DP 2 x TP 2, the qwen3.5-like-dp2
layout built by tpu-inference's and vLLM's own code on every host) under tpu-inference's own
DPScheduler: the synthetic GDN runner reads every state row and every attention position a step
needs and checks it (a wrong row is a detected wrong read that poisons the request's tokens), the
harness compares every host's dispatch digest at every step. One deployment carries every feature
(a GDN slice takes long to start): host RAM with lazy offload under faults, then eager saves, the
disk tier, a warm restart, the shared tier in a redis-server, KV events of each rank.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import os
import types

import numpy as np
import pytest

from tpuoffload import counters as C
from tpuoffload.backend.disk_tier import HEADER_BYTES
from tpuoffload.messages import DiskReport, pack_keys
from tpuoffload.sim.podslice import SliceSpec
from tpuoffload.snapshot import read_rank_snapshots
from tpuoffload.sim.workload import PrefixRepetition, run_prefix_repetition

# Per host, as both halves size them (tests/test_chunk_bytes_agree.py): a KV chunk 32 KiB, a state
# chunk 210 KiB. Host RAM: 36 KV rows and 20 state rows per device (20 KV and 4 state slots per rank,
# past the 16 spare rows a batch-split store keeps), so the workload below overflows both pools.
CONFIG = {"cpu_bytes_to_use": 5_490_000, "state_ram_fraction": 0.785, "save_timeout_s": 30.0,
          "load_wait_timeout_s": 5.0}
# 12 prefixes of 6 blocks, each asked twice in each wave (36 KV chunks per rank a wave): more than a
# rank's host RAM holds. vLLM's prefix cache is reset between waves, so a second wave finds its
# prefixes only below HBM, on either rank.
CHURN = PrefixRepetition(num_prefixes=12, prefix_blocks=6, suffix_len=(8, 16), output_len=(4, 8),
                         num_requests=24, waves=2, arrivals_per_step=4, seed=3)


def _spec(**extra) -> SliceSpec:
    return SliceSpec(num_hosts=2, devices_per_host=2, gdn="qwen3.5-like-dp2", max_num_seqs=4,
                     max_num_batched_tokens=256, extra_config={**CONFIG, **extra}, step_timeout_s=240.0,
                     start_timeout_s=400.0)


def _rank_totals(pod) -> list[dict]:
    """Each DP rank's scheduler-half totals (from its snapshot file), rank 0 first."""
    ranks = read_rank_snapshots(pod.stats_dir)
    assert sorted(ranks) == ["scheduler-dp0.json", "scheduler-dp1.json"], list(ranks)
    return [ranks[f"scheduler-dp{r}.json"]["totals"] for r in range(2)]


def _pool_totals(pod) -> list[list[dict]]:
    """Per host, its (KV pool, state pool) counters."""
    return [h["pool_totals"] for h in pod.worker_state()]


def _assert_exact_reads(pod) -> None:
    """Every state row and every attention position each host's runner read was the synthetic
    model's value (it reads and checks all a step needs)."""
    assert pod.mismatches == [0, 0], pod.mismatches
    for h in pod.worker_state():
        assert h["states_verified"] > 0 and h["state_mismatches"] == 0 and h["mismatches"] == 0, h


# ------------------------------------------------------------------ every feature, one deployment
# The disk split as host RAM is, room for every chunk a rank spills; warm restart; a redis-server.
TIERS = {"disk_bytes_to_use": 24 << 20, "persist_timeout_s": 60.0}
PINNED_TAIL = 7  # a prompt of whole blocks then a tail shorter than a block: the state row saved at its last block


def _serve_pair(pod, prompts: list[list[int]], tag: str) -> list[int]:
    """Both prompts added together (DPScheduler gives the i-th to rank i when the ranks are idle),
    run until idle and settled, every output what the synthetic model computes from scratch.
    Returns the rank each went to."""
    from tpuoffload.sim.workload import expected_output

    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        pod.add_request(pod.make_request(rid, prompt, max_tokens=3))
    placed = [pod.scheduler.assigned_dp_rank[rid] for rid in ids]
    pod.run()
    for rid, prompt in zip(ids, prompts):
        assert pod.outputs[rid] == expected_output(prompt, 3, 32000), rid
    assert pod.settle(60.0)
    return placed


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_gdn_hybrid_under_dpscheduler_every_feature_at_once(make_slice, tmp_path, monkeypatch):
    """The Qwen3.5-like hybrid under tpu-inference's DPScheduler (DP 2 x TP 2 over 2 hosts x 2
    devices) with every tier at once, KV events on, a redis-server shared by both lifetimes of the
    deployment:

    1. Lazy offload (a request's blocks saved in one flush when it finishes or is preempted). Two
       prompts, one per rank, publish their KV and state chunks to the store. Then waves of twelve
       prefixes under faults (slots lost on host 1 before loads: those loads fail by request and
       vLLM recomputes the requests on every host) overflow both pools of host RAM: each rank
       serves hits from host RAM, also chunks another rank saved (state and KV), spills to its own
       files and fetches back, and what the two prompts left is gone from every rank's host RAM
       (on disk, it is in the files of the rank that computed it, which only that rank reads).
    2. Warm restart with eager saves: the deployment shuts down (every host checkpoints every
       rank's slots) and starts again on its ``persist_path`` and disk directories, no fault now.
       Each rank adopts its checkpointed slots and the chunk files its host kept; the wave of the
       same prefixes loads them, KV and state chunks, every load exact.
    3. The two prompts again, each on the other rank: for it only the store holds them, so each
       rank fetches what the other rank published, its KV chunks and its state chunk, and serves
       the whole prefix.

    Throughout: every request's tokens right, every state row and attention position each host
    read exact, identical dispatch digests, nothing leaked; each rank's KV events (its own port,
    its own rank) say after every batch exactly what that rank's host RAM and disk can serve
    (test_events.py:RankEvents), restored and fetched chunks included, state and attention chunks
    each under its group, the mirror groups silent."""
    from test_events import RankEvents
    from test_podslice import _assert_clean_end

    from tpuoffload.sim.chaos import Chaos
    from tpuoffload.sim.redis_server import RedisServer

    server = RedisServer(lifetime_s=900)
    events = RankEvents(monkeypatch, tmp_path / "events", ranks=2)
    try:
        spec = dataclasses.replace(
            _spec(**TIERS, disk_path=str(tmp_path / "disk-{host}"), persist_path=str(tmp_path / "ckpt"),
                  shared_url=f"{server.url}?timeout_s=30", lazy_offload=True), **events.spec_fields)
        rng = np.random.default_rng(5)
        pair = [rng.integers(3, 30000, 6 * 16 + PINNED_TAIL).tolist() for _ in range(2)]

        # 1. The first lifetime, under faults.
        pod = _watch(make_slice(spec, Chaos(seed=11, lose_slot_host=1, lose_slot_rate=0.3)), events)
        assert type(pod.scheduler).__name__ == "DPScheduler" and pod.dp_ranks == 2
        rank_cfgs = pod.scheduler.per_rank_kv_cache_configs
        assert [c.mamba_num_blocks for c in rank_cfgs] == [pod.gdn.mamba_num_blocks // 2] * 2  # DPScheduler's split
        assert _serve_pair(pod, pair, "pair") == [0, 1]
        res = run_prefix_repetition(pod, CHURN)
        assert res.finished == res.requests and res.wrong_outputs == [], res
        _assert_exact_reads(pod)
        totals = pod.stats.totals()
        assert totals[C.LOAD_ERRORS] > 0 and totals[C.FAILED_REQUESTS] > 0, totals  # the faults hit, recomputed
        assert res.per_wave_loaded[1] > 0 and totals[C.CROSS_RANK_CHUNKS_LOADED] > 0, res.stats
        first_ranks = ranks = _rank_totals(pod)
        for t in ranks:  # each rank served hits, spilled to its own files, read some back, published
            assert t.get(C.HIT_TOKENS, 0) > 0 and t.get(C.SPILLS_CONFIRMED, 0) > 0, ranks
            assert t.get(C.FETCHES_ISSUED, 0) > t.get(C.FETCHES_FAILED, 0), ranks
            assert t.get(C.SHARED_PUBLISH_ISSUED, 0) > 0, ranks
        assert totals[C.DISK_READ_CHUNKS] > 0 and totals[C.DISK_READ_FAILED] == 0, totals
        for kv, state in _pool_totals(pod):  # every host loaded both pools' chunks, some another rank saved
            assert kv[C.CHUNKS_LOADED] > 0 and state[C.CHUNKS_LOADED] > 0, (kv, state)
            assert kv[C.CROSS_RANK_CHUNKS_LOADED] > 0 and state[C.CROSS_RANK_CHUNKS_LOADED] > 0, (kv, state)
        _assert_clean_end(pod)
        first = _assert_events_exact(events, pod)
        held = [t.get(C.PERSIST_SAVED_CHUNKS, 0) for t in pod.shutdown()]  # each host: every rank's slots
        assert held[0] == held[1] > 0, held
        events.close()

        # 2. Warm restart, eager saves, no fault.
        events = RankEvents(monkeypatch, tmp_path / "events-again", ranks=2, after=events)
        spec = dataclasses.replace(spec, extra_config={**spec.extra_config, "lazy_offload": False},
                                   **events.spec_fields)
        again = _watch(make_slice(spec), events)
        for _ in range(4):  # empty steps: the restore reports reach every rank (DPScheduler does not
            again.step()    # ask has_pending_push_work, so vLLM would wait for a request)
        events.note_restored()
        ranks = _rank_totals(again)
        restored = [(t.get(C.RESTORED_READY, 0), t.get(C.DISK_RESTORED_READY, 0)) for t in ranks]
        assert all(ram > 0 and disk > 0 for ram, disk in restored), restored
        assert sum(ram for ram, _ in restored) == held[0], (restored, held)
        assert not any(t.get(C.RESTORED_DROPPED) or t.get(C.DISK_RESTORED_DROPPED) for t in ranks), ranks
        # Announced before any request, rank by rank: what the rank restored, on each medium.
        announced = [(sum(k[1] == "CPU" for k in got), sum(k[1] == "STORAGE" for k in got)) for got in events.restored]
        assert announced == restored, (announced, restored)
        res2 = run_prefix_repetition(again, dataclasses.replace(CHURN, waves=1))
        assert res2.finished == res2.requests and res2.wrong_outputs == [], res2
        after = again.stats.totals()
        assert res2.per_wave_loaded[0] > 0 and after[C.DISK_READ_CHUNKS] > 0, (res2, after)
        assert after[C.LOAD_ERRORS] == 0 and after[C.DISK_READ_FAILED] == 0, after
        for kv, state in _pool_totals(again):
            assert kv[C.CHUNKS_LOADED] > 0 and state[C.CHUNKS_LOADED] > 0, (kv, state)

        # 3. The pair on the other ranks: from the store only.
        before = _rank_totals(again)
        assert _serve_pair(again, pair[::-1], "swapped") == [0, 1]
        ranks = _rank_totals(again)
        for r, t in enumerate(ranks):  # the whole 6-block prefix: 6 KV chunks and a state chunk
            fetched = t.get(C.SHARED_FETCHES_READY, 0) - before[r].get(C.SHARED_FETCHES_READY, 0)
            assert fetched >= 7 and not t.get(C.SHARED_FETCHES_FAILED), (r, t)
            assert t[C.HIT_TOKENS] - before[r][C.HIT_TOKENS] >= 6 * 16, (r, t)
        _assert_exact_reads(again)
        assert again.stats.totals()[C.LOAD_ERRORS] == 0
        _assert_clean_end(again)
        second = _assert_events_exact(events, again)
    finally:
        events.close()
        server.stop()
    shown = (C.HIT_TOKENS, C.FAILED_REQUESTS, C.SPILLS_CONFIRMED, C.FETCHES_ISSUED, C.SHARED_PUBLISH_ISSUED,
             C.SHARED_FETCHES_READY)
    per_rank = [[{k: t.get(k, 0) for k in shown} for t in life] for life in (first_ranks, ranks)]
    print(f"GDN under DPScheduler, every feature: {res}; per rank {per_rank[0]}; restarted: {restored} "
          f"(host RAM, disk) chunks per rank, {res2}; per rank {per_rank[1]}; KV events: {first}, then {second}")


def _watch(pod, events):
    """Check each rank's KV events after every step of ``pod``, each announced block joined to the
    HBM event of it from any rank of the deployment: a rank announces chunks another rank computed
    and it fetched from the store (its own HBM never held them), so they are joined to the other
    rank's HBM events, which arrive steps earlier (the chunk was saved, published, probed and
    fetched in between)."""
    hbm: dict = {}
    for view in events.views:
        hbm.update(view.gpu_blocks)
        view.gpu_blocks = hbm
    step = pod.step

    def step_and_check() -> None:
        step()
        events.check()

    pod.step = step_and_check
    return pod


def _assert_events_exact(events, pod) -> str:
    """Every batch each rank published arrived on its own port, labelled with its rank, and left
    the router's view of the rank equal to what the rank's indexes could serve then; state and
    attention chunks were announced under their group and kind (the groups that mirror the
    state group: nothing), in host RAM and on disk. Returns a summary."""
    from tpuoffload.manager.kv_groups import KVCacheGroups

    groups = KVCacheGroups.of(pod.gdn.kv_cache_config, pod.scheduler.vllm_config.cache_config.block_size)
    state, attention = groups.state_group, groups.windows.index(None)
    events.check()
    for r, (view, sub) in enumerate(zip(events.views, events.subs)):
        assert events.checks[r] > 0 and events.diffs[r] == 0, (r, events.checks, events.diffs)
        assert view.ranks == {r} and sub.gaps == 0 and not view.errors, (r, view.ranks, sub.gaps, view.errors[:5])
        assert view.kinds == {state: {"mamba"}, attention: {"full_attention"}}, (r, view.kinds)
        for medium in ("CPU", "STORAGE"):
            assert {k[2] for k in view.ever if k[1] == medium} == {state, attention}, (r, medium, view.stored)
    return (f"{events.checks} batches checked per rank, {events.diffs} differences; announced "
            f"{[v.stored for v in events.views]}, withdrawn {[v.removed for v in events.views]}")


def _fetched_records(tmp_path) -> tuple[list, list]:
    """The scheduler half of a Qwen3.5-like hybrid (a state group, two groups that mirror it, a
    full-attention group; a KV and a state slot pool) with KV events and the shared tier: a request
    of 6 blocks and a tail probes the store, every host has every chunk, so the half fetches the
    6 attention chunks and the state chunk at block 5 (one claim over both pools: the KV pool's
    chunks first) and the index records each one's event record. Once they are installed
    (READY) the half announces them. Returns (the BlockStored events, what each should be:
    (group, hash, parent, tokens))."""
    import random

    from vllm.distributed.kv_events import BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as ext

    from tpuoffload.config import parse_config
    from tpuoffload.manager import OffloadScheduler
    from tpuoffload.manager.events import EventFormat
    from tpuoffload.manager.kv_groups import MIRROR, STATE_POOL, KVCacheGroups
    from tpuoffload.messages import SharedReport
    from tpuoffload.sim.vllm_setup import make_request

    groups = KVCacheGroups((1, MIRROR, MIRROR, None), (STATE_POOL,) * 3 + (0,))
    fmt = EventFormat(width=32, block_size=16, group_specs=(("mamba", None),) * 3 + (("full_attention", None),))
    half = OffloadScheduler(parse_config({"num_cpu_chunks": 64, "shared_url": f"file://{tmp_path}/store"}),
                            block_size=16, chunk_bytes=1024, state_chunk_bytes=4096, num_hosts=2, kv_groups=groups,
                            events=fmt)
    tier = half.tier("shared")
    rng = random.Random(4)
    request = make_request("r", [rng.randrange(3, 30000) for _ in range(6 * 16 + 7)], block_size=16)
    assert tier.wants(request, 0, 0)
    (pid, _, probed, _), = tier.finish_step(0).probe
    tier.on_report({h: SharedReport(probed=((pid, b"\x01" * len(probed)),)) for h in range(2)})
    tier.plan_into_ram(1)  # the fetch's claim: its chunks' records written here
    fetch = tier.finish_step(1).fetch
    slots, save_ids = np.array(fetch.slots), np.array(fetch.save_ids)
    assert len(slots) == 7 and sorted(half.index.pool_of(slots).tolist()) == [0] * 6 + [1], fetch
    half.take_events()
    half.index.mark_ready(slots, save_ids)  # what a confirmed install does
    stored = [e for e in half.take_events() if isinstance(e, BlockStored)]
    hashes, tokens = request.block_hashes, request.all_token_ids
    want = [(3, ext(hashes[b]), ext(hashes[b - 1]) if b else None, list(tokens[16 * b:16 * b + 16]))
            for b in range(6)] + [(0, ext(hashes[5]), ext(hashes[4]), list(tokens[80:96]))]
    got = [(e.group_idx, h, e.block_hashes[i - 1] if i else e.parent_block_hash, e.token_ids[16 * i:16 * i + 16])
           for e in stored for i, h in enumerate(e.block_hashes)]
    return got, want


def test_a_gdn_hybrids_chunks_fetched_from_the_store_are_announced_with_their_own_records(tmp_path):
    """Found by the pod slice above (its first fetch from the store stopped rank 1's scheduler:
    "index 7 out-of-bounds in minimum.reduceat"). A fetch of attention and state chunks claims the
    KV pool's slots first, so the claim lists its chunks out of the batch's order; the event
    sink reads them in the batch's order (``SavePlanner.record``)."""
    got, want = _fetched_records(tmp_path)
    assert sorted(got, key=repr) == sorted(want, key=repr), (got, want)


def test_negative_control_a_fetch_recorded_in_claim_order_stops_the_scheduler(tmp_path, monkeypatch):
    """The one mechanism removed: the claim's chunks handed to the event sink as the claim lists
    them (the KV pool's, then the state pool's). The sink then fails on the fetch, as rank 1's
    scheduler did in the slice."""
    from tpuoffload.manager.save_planner import SavePlanner

    monkeypatch.setattr(SavePlanner, "record",
                        lambda self, claim, origins: self.index.events.record(claim.slots, claim.keep, origins))
    with pytest.raises(IndexError, match="out-of-bounds"):
        _fetched_records(tmp_path)


# ------------------------------------------------------------------ the worker half, one process
# Two ranks' plans in one step, on the qwen3.5-like-dp2 layout's own arrays (4 CPU devices in this
# process, DP 2 x TP 2): rank 1 saves a state row and an attention block, rank 0 loads them into
# its own blocks (a cross-rank hit: slots and save ids named by their offset from rank 0's range)
# and rank 1 loads its own state chunk into another of its rows.
UNIT_EXTRA = {"cpu_bytes_to_use": 16 << 20, "state_ram_fraction": 0.75}


@pytest.fixture(scope="module")
def dp_layout():
    from tpuoffload.sim import gdn_layout as gl

    return gl.build(gl.QWEN35_LIKE_DP2)


def _dp_plan(conn, rank: int, step: int, layout, **fields):
    """Rank ``rank``'s plan as its scheduler half makes it and DPScheduler's merge leaves it: its
    own slots of each pool, its own block ids, ``local_block_ids`` translated by the merge."""
    from tpuoffload.messages import StepPlan

    tables = conn.worker.engine.tables
    kv, state = tables[0].shard_slots, tables[1].shard_slots
    blocks = layout.attention_num_blocks // 2
    return StepPlan(step=step, num_slots=kv + state, state_slots=state, num_blocks=blocks,
                    state_rows=layout.mamba_num_blocks // 2, failures_by_request=True,
                    local_block_ids=[rank * blocks], source=100 + rank, **fields)


def _cross_rank_state_round_trip(layout) -> tuple[bool, set[str], list[str]]:
    """Run the scenario (module comment above); returns (every destination holds its source's bytes
    and nothing else changed, the requests whose load failed, what differs)."""
    import copy

    from test_state_pool_worker import _fill, _host, _state_keys, _step
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from tpuoffload.connector import TPUOffloadConnector
    from tpuoffload.messages import RANK_SAVE_ID_SHIFT, LoadRequest, OffloadMetadata, SaveBatch
    from tpuoffload.sim import gdn_layout as gl

    vllm_config = gl.make_vllm_config(layout.spec, UNIT_EXTRA)
    layout.runner.kv_caches = _fill(layout.kv_caches, 7)
    conn = TPUOffloadConnector(vllm_config, KVConnectorRole.WORKER, copy.deepcopy(layout.worker_kv_cache_config))
    conn.register_runner(layout.runner)
    tables = conn.worker.engine.tables
    assert [t.shards for t in tables] == [2, 2]
    kv, num_slots = tables[0].shard_slots, tables[0].shard_slots + tables[1].shard_slots
    blocks, rows = layout.attention_num_blocks // 2, layout.mamba_num_blocks // 2
    # Rank 1 saves its block 9 into its KV slot 2 and its state row 5 into its state slot 1; rank 0
    # saves its state row 5 (the same local row) into its state slot 1 (the same local slot).
    save1 = SaveBatch((9, 5), (2, kv + 1), (10, 11))
    save0 = SaveBatch((5,), (kv + 1,), (20,))
    _step(conn, OffloadMetadata([_dp_plan(conn, 0, 0, layout, save=save0), _dp_plan(conn, 1, 0, layout, save=save1)]))
    assert conn.worker.wait_idle(30)
    conn.build_connector_worker_meta()
    before = _host(layout.runner.kv_caches)
    # Rank 0 loads rank 1's chunks into its block 30 and state row 7 (named from its own range);
    # rank 1 loads its own state chunk into its state row 12.
    other = 1 << RANK_SAVE_ID_SHIFT
    load0 = LoadRequest("r0", (30, 7), (2 + num_slots, kv + 1 + num_slots), (10 + other, 11 + other))
    load1 = LoadRequest("r1", (12,), (kv + 1,), (11,))
    results, _, _ = _step(conn, OffloadMetadata([_dp_plan(conn, 0, 1, layout, loads=(load0,)),
                                                 _dp_plan(conn, 1, 1, layout, loads=(load1,))]))
    after = _host(layout.runner.kv_caches)
    state_keys = _state_keys(layout.runner.kv_caches)
    # Engine numbering (tpu-inference's runner): rank r's block b is r * blocks + b, its state row
    # b is r * rows + b.
    kv_moves = {30: blocks + 9}
    state_moves = {7: rows + 5, rows + 12: rows + 5}
    wrong = []
    for key, arr in before.items():
        want = arr.copy()
        for dst, src in (state_moves if key in state_keys else kv_moves).items():
            want[dst] = arr[src]
        bad = np.flatnonzero([not np.array_equal(a, e) for a, e in zip(after[key], want)])
        if len(bad):
            wrong.append(f"kv_caches{list(key)}: rows {bad[:8].tolist()} differ")
    conn.shutdown()
    return not wrong, set(results.failed_recving or ()), wrong


def test_a_rank_loads_another_ranks_state_row_and_its_own_byte_exact(dp_layout):
    ok, failed, wrong = _cross_rank_state_round_trip(dp_layout)
    assert ok and not failed, (wrong, failed)


def test_negative_control_state_rows_not_placed_by_rank_load_the_wrong_rows(dp_layout, monkeypatch):
    """The one mechanism removed: a rank's state rows taken as the engine's rows (no offset by
    ``rank * state_rows``). Rank 1's state row 5 is then read from rank 0's row 5 (another shard:
    the save is refused or saves the wrong state) and its load lands in rank 0's rows."""
    from tpuoffload.worker import offload_worker

    def unplaced(self, block_ids, state):
        return np.asarray(block_ids, np.int64) + np.where(state, 0, self.block_offset)

    monkeypatch.setattr(offload_worker._Placed, "_blocks", unplaced)
    ok, failed, wrong = _cross_rank_state_round_trip(dp_layout)
    assert not ok or failed, "the state rows moved right without their placement by rank"


def test_a_ranks_plan_whose_state_rows_are_not_its_share_is_refused(dp_layout):
    """The workers place a rank's state rows by the rank's row count, so a count that does not
    split the pool into the ranks' shares (``mamba_num_blocks // ranks``) is refused before any
    dispatch."""
    import copy

    from test_state_pool_worker import _fill
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from tpuoffload.connector import TPUOffloadConnector
    from tpuoffload.messages import OffloadMetadata
    from tpuoffload.sim import gdn_layout as gl

    dp_layout.runner.kv_caches = _fill(dp_layout.kv_caches, 3)
    conn = TPUOffloadConnector(gl.make_vllm_config(dp_layout.spec, UNIT_EXTRA), KVConnectorRole.WORKER,
                               copy.deepcopy(dp_layout.worker_kv_cache_config))
    conn.register_runner(dp_layout.runner)
    try:
        plan = _dp_plan(conn, 1, 0, dp_layout)
        plan.state_rows -= 1
        with pytest.raises(ValueError, match="split over 2 batch shards"):
            conn.bind_connector_metadata(OffloadMetadata([plan]))
        assert not [op for op in conn.worker.engine.finish_step().ops if not op.startswith("step")]
    finally:
        conn.shutdown()


# ------------------------------------------------------------------ the disk tier per rank
# Each DP rank's disk stage keeps both slot pools' chunks of its rank: its KV chunks and its state
# chunks in its own files (``rank-<r>`` and ``rank-<r>/state``), each file holding the pieces of
# the rank's batch shard, and a rank's state slot is placed by its share of the state store
# (``Placement.state_offset``, from ``_Placed``) as saves and loads place it. The worker holds
# both batch shards of the qwen3.5-like-dp2 cache and gets both ranks' plans with the same local
# slots, blocks, state rows, save ids, disk ids and hashes, so a chunk placed in the wrong rank's
# share or file is caught. Host RAM is overwritten before the fetch (what an eviction does), so
# the disk is what serves; the loads include a cross-rank hit on the other rank's fetched chunks
# (through host RAM: only the owning rank fetches, docs/design.md "The disk tier per rank"). The
# scheduler half's per-rank file counts agree with the stages' (tests/test_chunk_bytes_agree.py).

# Two hashes (a KV chunk's and a state chunk's), the same for both ranks.
KEYS = pack_keys(np.array([0x1111, 0x2222], np.uint64), np.array([0x3333, 0x4444], np.uint64))
DISK_BYTES = 8 << 20


def _wrong_after_loads(original, before, after, state_keys, blocks: int, rows: int) -> dict[str, list[int]]:
    """The rows of each array that differ from what the tier tests' loads write: each rank's own
    load puts its block 9 into block 30 and its state row 5 into row 7, rank 0's cross-rank load
    puts rank 1's block 9 and state row 5 into its block 31 and row 12. Engine numbering
    (tpu-inference's runner): rank r's block b is r * blocks + b, its state row b is r * rows + b."""
    kv_moves = {r * blocks + 30: r * blocks + 9 for r in range(2)} | {31: blocks + 9}
    state_moves = {r * rows + 7: r * rows + 5 for r in range(2)} | {12: rows + 5}
    wrong = {}
    for key, arr in before.items():
        want = arr.copy()
        for dst, src in (state_moves if key in state_keys else kv_moves).items():
            want[dst] = original[key][src]
        bad = np.flatnonzero([not np.array_equal(a, e) for a, e in zip(after[key], want)])
        if len(bad):
            wrong[key] = bad.tolist()
    return wrong


def _spill_evict_fetch_load(layout, tmp_path) -> types.SimpleNamespace:
    """Both ranks in the same steps, with the same local numbers:

    0. save attention block 9 into KV slot 2 (save id 10) and state row 5 into state slot 1 (11);
    1. spill both to disk (disk ids 0 and 1, pools 0 and 1);
    2. overwrite both slots with other chunks (block 20, state row 8: save ids 12, 13): host RAM
       no longer holds the spilled chunks;
    3. fetch both back into KV slot 4 and state slot 3 (save ids 14, 15), installed in step 4;
    5. rank r loads its own fetched chunks into block 30 and state row 7; rank 0 also loads rank
       1's fetched chunks (a cross-rank hit, named from rank 0's range) into block 31 and state
       row 12.

    Returns ``disk``: each rank's disk reports by step; ``failed``: the requests whose load failed;
    ``wrong``: the rows of each array that differ from the expected caches; ``files``: each rank's
    chunk files (name, size) by pool; ``original``, ``after``: the caches' bytes before and after;
    ``rows``: state rows per rank."""
    import copy

    from test_state_pool_worker import _fill, _host, _state_keys, _step
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from tpuoffload.connector import TPUOffloadConnector
    from tpuoffload.messages import RANK_SAVE_ID_SHIFT, DiskBatch, DiskPlan, LoadRequest, OffloadMetadata, SaveBatch
    from tpuoffload.sim import gdn_layout as gl

    extra = dict(UNIT_EXTRA, disk_path=str(tmp_path / "disk-{host}"), disk_bytes_to_use=DISK_BYTES)
    layout.runner.kv_caches = _fill(layout.kv_caches, 11)
    conn = TPUOffloadConnector(gl.make_vllm_config(layout.spec, extra), KVConnectorRole.WORKER,
                               copy.deepcopy(layout.worker_kv_cache_config))
    conn.register_runner(layout.runner)
    try:
        worker = conn.worker
        tables = worker.engine.tables
        assert [t.shards for t in tables] == [2, 2]
        kv, num_slots = tables[0].shard_slots, tables[0].shard_slots + tables[1].shard_slots
        blocks, rows = layout.attention_num_blocks // 2, layout.mamba_num_blocks // 2
        original = _host(layout.runner.kv_caches)
        both = range(2)

        def step(n: int, by_rank: dict | None = None, **fields) -> tuple:
            """Step ``n``: each rank's plan with ``fields``, or with ``by_rank[rank]``'s."""
            plans = [_dp_plan(conn, r, n, layout, **(by_rank[r] if by_rank else fields)) for r in both]
            out = _step(conn, OffloadMetadata(plans))
            assert worker.wait_idle(30)
            for report in (out[1], conn.build_connector_worker_meta()):  # the step's, then what came after
                for r in both:
                    part = report.tier_parts("disk", 100 + r) if report else {}
                    if part:
                        disk[r][n].append(part[0])
            return out

        disk: dict[int, dict[int, list]] = {r: collections.defaultdict(list) for r in both}

        step(0, save=SaveBatch((9, 5), (2, kv + 1), (10, 11)))
        spill = DiskBatch((2, kv + 1), (10, 11), (0, 1), KEYS, np.array([0, 1], np.int8).tobytes())
        step(1, tiers={"disk": DiskPlan(spill=spill)})
        step(2, save=SaveBatch((20, 8), (2, kv + 1), (12, 13)))
        for r in both:  # host RAM holds the new chunks, the spilled ones are gone from it
            def held(pool: int, slot: int, save_id: int) -> bool:
                table = tables[pool]
                return bool(table.lookup(np.array([r * table.shard_slots + slot]),
                                         [save_id + (r << RANK_SAVE_ID_SHIFT)])[0][0])

            assert held(0, 2, 12) and held(1, 1, 13) and not held(0, 2, 10) and not held(1, 1, 11), r
        fetch = DiskBatch((4, kv + 3), (14, 15), (0, 1), KEYS, np.array([0, 1], np.int8).tobytes())
        step(3, tiers={"disk": DiskPlan(fetch=fetch)})
        step(4)  # the fetches are installed
        before = _host(layout.runner.kv_caches)
        other = 1 << RANK_SAVE_ID_SHIFT
        own = [LoadRequest(f"r{r}", (30, 7), (4, kv + 3), (14, 15)) for r in both]
        cross = LoadRequest("x0", (31, 12), (4 + num_slots, kv + 3 + num_slots), (14 + other, 15 + other))
        results, _, _ = step(5, {0: {"loads": (own[0], cross)}, 1: {"loads": (own[1],)}})
        after = _host(layout.runner.kv_caches)
        state_keys = _state_keys(layout.runner.kv_caches)
        wrong = _wrong_after_loads(original, before, after, state_keys, blocks, rows)
        files = {}
        for stage in (t for t in worker.tiers if t.name == "disk"):
            files[stage.rank] = [sorted((e.name, e.stat().st_size) for e in os.scandir(t.path) if e.name.endswith(".kv"))
                                 for t in stage.tiers]
        return types.SimpleNamespace(disk=disk, failed=set(results.failed_recving or ()), wrong=wrong, files=files,
                                     original=original, after=after, rows=rows, state_keys=state_keys)
    finally:
        conn.shutdown()


def test_each_rank_spills_kv_and_state_chunks_to_its_own_files_and_fetches_them_back_byte_exact(dp_layout, tmp_path):
    run = _spill_evict_fetch_load(dp_layout, tmp_path)
    assert not run.wrong and not run.failed, (run.wrong, run.failed)
    for r in range(2):  # each rank's spill of both chunks written, reported to its own half
        spilled = functools.reduce(DiskReport.merge, run.disk[r][1], DiskReport())
        assert spilled == DiskReport(saved=((0, 2),)), (r, run.disk[r])
    # One host holds both shards: each rank's files in its own directory, its KV chunk's and its
    # state chunk's pieces of its batch shard (half the host's bytes of each, read off the arrays).
    host_kv, host_state = (sum(s.data.nbytes // s.data.shape[0] for a in arrays for s in a.addressable_shards)
                           for arrays in ([c for c in dp_layout.kv_caches if not isinstance(c, tuple)],
                                          [a for c in dp_layout.kv_caches if isinstance(c, tuple) for a in c]))
    files = run.files
    names = {r: [[n for n, _ in pool] for pool in files[r]] for r in range(2)}
    assert names[0] == names[1] and all(len(pool) == 1 for pool in names[0]), files
    for r in range(2):
        (kv_file,), (state_file,) = files[r]
        assert kv_file[1] == HEADER_BYTES + host_kv // 2 and state_file[1] == HEADER_BYTES + host_state // 2, files


def test_negative_control_disk_state_slots_not_placed_by_rank(dp_layout, tmp_path, monkeypatch):
    """The one mechanism removed: the disk stage's state slots numbered as with one scheduler (the
    plan's state slot less its KV slots, ``Placement.state_offset`` without the rank's share of the
    state store), saves and loads unchanged. Rank 1's state spill then reads rank 0's slot (refused:
    another chunk is there) and its fetch is installed into rank 0's share: rank 1's state never
    comes back, and the loads of it (its own and rank 0's cross-rank hit) fail or read wrong rows."""
    from tpuoffload.worker import offload_worker

    init = offload_worker._Placed.__init__

    def unplaced(self, *args, **kw):
        init(self, *args, **kw)
        self.state_offset = -self.kv_slots

    monkeypatch.setattr(offload_worker._Placed, "__init__", unplaced)
    run = _spill_evict_fetch_load(dp_layout, tmp_path)
    print("negative control (state slots not placed by rank):",
          {"failed loads": sorted(run.failed), "disk reports": run.disk, "wrong rows": run.wrong})
    assert run.wrong or run.failed, "the state chunks came back right without their placement by rank"
    assert run.failed == {"r1", "x0"}, run.failed  # rank 1's own load of its state and rank 0's cross-rank one


def test_negative_control_state_files_of_another_batch_shard_serve_the_wrong_state(dp_layout, tmp_path,
                                                                                     monkeypatch):
    """The other mechanism removed: the state pool's files hold batch shard 0's pieces whatever the
    rank (as the stage's state pool did with one scheduler). Rank 1's state file then holds rank
    0's state row (the same local slot on shard 0's devices), is fetched and installed as rank 1's
    without complaint, and rank 1's state row (and rank 0's cross-rank hit on it) comes back with
    rank 0's bytes: silently, no load fails."""
    from tpuoffload.worker import pooled_engine

    make = pooled_engine.PooledEngine.__init__

    def state_files_of_shard_zero(self, *args, **kw):
        make(self, *args, **kw)
        if len(self.engines) > 1:
            state, own = self.engines[1], self.engines[1].rows_to_payloads
            state.rows_to_payloads = lambda rows, shard=0: own(rows, 0)

    monkeypatch.setattr(pooled_engine.PooledEngine, "__init__", state_files_of_shard_zero)
    run = _spill_evict_fetch_load(dp_layout, tmp_path)
    print("negative control (state files of shard 0):", {"failed loads": sorted(run.failed), "wrong rows": run.wrong})
    assert not run.failed  # nothing noticed ...
    rows = run.rows
    assert run.wrong and set(run.wrong) == run.state_keys, run.wrong  # ... every state array wrong, KV right
    for key in run.state_keys:  # rank 1's state row 7 and rank 0's cross-rank row 12: rank 0's row 5
        assert sorted(run.wrong[key]) == [12, rows + 7], (key, run.wrong[key])
        assert all(np.array_equal(run.after[key][dst], run.original[key][5]) for dst in (12, rows + 7))


# ------------------------------------------------------------------ the shared tier per rank
# Each DP rank's shared stage publishes and fetches both slot pools' chunks of its rank: its
# batch shard's pieces of a KV chunk and of a state row, named by the rank's namespace (the model,
# the block size, the KV pool's and the state pool's layout of the rank: not the rank), a state
# slot placed by the rank's share of the state store (``Placement.state_offset``). The worker
# holds both batch shards of the qwen3.5-like-dp2 cache and gets both ranks' plans with the same
# local slots, blocks, state rows and save ids; the ranks' rows hold other bytes, so a chunk read
# from or installed into the wrong rank's share shows as wrong bytes. The content keys differ by
# rank: the namespace is the rank's layout, equal for both ranks, and one key names one content
# for every rank (what lets a rank load what another wrote). Host RAM is overwritten before the
# fetch, so only the store (a real redis-server) can serve; rank 0 also fetches rank 1's objects,
# a cross-rank hit through the store.

# Per rank, a KV chunk's and a state chunk's content keys.
SHARED_KEYS = [pack_keys(np.array([0x1111 + r, 0x2222 + r], np.uint64), np.array([0x3333, 0x4444], np.uint64))
               for r in range(2)]
POOLS = np.array([0, 1], np.int8).tobytes()
GROUPS = bytes([3, 0])  # qwen3.5-like: the attention group is the last, a state group the first


def _publish_evict_fetch_load(layout) -> types.SimpleNamespace:
    """Both ranks in the same steps, with the same local numbers:

    0. save attention block 9 into KV slot 2 (save id 10) and state row 5 into state slot 1 (11);
    1. publish both under the rank's keys (the writes finish before the next step);
    2. overwrite both slots with other chunks (block 20, state row 8: save ids 12, 13);
    3. fetch the rank's two objects into KV slot 4 and state slot 3 (save ids 14, 15); rank 0 also
       fetches rank 1's into KV slot 6 and state slot 4 (16, 17);
    4. install what this host verified (what the scheduler half plans once every host has);
    5. rank r loads its fetched chunks into block 30 and state row 7; rank 0 loads rank 1's
       into block 31 and state row 12.

    Returns ``shared``: each rank's shared reports by step; ``failed``: the requests whose load
    failed; ``wrong``: each array's rows that differ from the expected caches; ``objects``: the
    store's keys and value sizes; ``stages``: the ranks' shared stages; ``original``, ``after``:
    the caches' bytes before and after; ``rows``: state rows per rank."""
    import copy

    import redis
    from test_state_pool_worker import _fill, _host, _state_keys, _step
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from tpuoffload.connector import TPUOffloadConnector
    from tpuoffload.messages import RANK_SAVE_ID_SHIFT, DiskBatch, LoadRequest, OffloadMetadata, SaveBatch, SharedPlan
    from tpuoffload.sim import gdn_layout as gl
    from tpuoffload.sim.redis_server import RedisServer

    server = RedisServer(lifetime_s=120)
    extra = dict(UNIT_EXTRA, shared_url=f"{server.url}?timeout_s=10")
    layout.runner.kv_caches = _fill(layout.kv_caches, 13)
    conn = None
    try:
        conn = TPUOffloadConnector(gl.make_vllm_config(layout.spec, extra), KVConnectorRole.WORKER,
                                   copy.deepcopy(layout.worker_kv_cache_config))
        conn.register_runner(layout.runner)
        worker = conn.worker
        tables = worker.engine.tables
        assert [t.shards for t in tables] == [2, 2]
        kv = tables[0].shard_slots
        blocks, rows = layout.attention_num_blocks // 2, layout.mamba_num_blocks // 2
        original = _host(layout.runner.kv_caches)
        both = range(2)
        shared: dict[int, dict[int, list]] = {r: collections.defaultdict(list) for r in both}

        def step(n: int, by_rank: dict) -> tuple:
            """Step ``n``: each rank's plan with ``by_rank[rank]``'s fields."""
            plans = [_dp_plan(conn, r, n, layout, **by_rank.get(r, {})) for r in both]
            out = _step(conn, OffloadMetadata(plans))
            assert worker.wait_idle(30)  # the stages' background writes and reads
            for report in (out[1], conn.build_connector_worker_meta()):
                for r in both:
                    part = report.tier_parts("shared", 100 + r) if report else {}
                    if part:
                        shared[r][n].append(part[0])
            return out

        def plan(**fields) -> dict:
            return {"tiers": {"shared": SharedPlan("scope", 1, **fields)}}

        step(0, {r: {"save": SaveBatch((9, 5), (2, kv + 1), (10, 11))} for r in both})
        step(1, {r: plan(publish=DiskBatch((2, kv + 1), (10, 11), keys=SHARED_KEYS[r], pools=POOLS),
                         publish_groups=GROUPS) for r in both})
        step(2, {r: {"save": SaveBatch((20, 8), (2, kv + 1), (12, 13))} for r in both})
        for r in both:  # host RAM holds the new chunks, the published ones are gone from it
            def held(pool: int, slot: int, save_id: int) -> bool:
                table = tables[pool]
                return bool(table.lookup(np.array([r * table.shard_slots + slot]),
                                         [save_id + (r << RANK_SAVE_ID_SHIFT)])[0][0])

            assert held(0, 2, 12) and held(1, 1, 13) and not held(0, 2, 10) and not held(1, 1, 11), r
        fetch = {r: DiskBatch((4, kv + 3), (14, 15), keys=SHARED_KEYS[r], pools=POOLS) for r in both}
        fetch[0] = DiskBatch((4, kv + 3, 6, kv + 4), (14, 15, 16, 17), keys=SHARED_KEYS[0] + SHARED_KEYS[1],
                             pools=POOLS * 2)
        step(3, {r: plan(fetch=fetch[r], fetch_groups=GROUPS * (len(fetch[r]) // 2)) for r in both})
        verified = {r: tuple(sorted(i for rep in shared[r][3] for a, b in rep.fetched for i in range(a, b)))
                    for r in both}  # (the reads finish in any order)
        step(4, {r: plan(install=verified[r]) for r in both})
        before = _host(layout.runner.kv_caches)
        own = [LoadRequest(f"r{r}", (30, 7), (4, kv + 3), (14, 15)) for r in both]
        cross = LoadRequest("x0", (31, 12), (6, kv + 4), (16, 17))  # rank 1's objects, in rank 0's slots
        results, _, _ = step(5, {0: {"loads": (own[0], cross)}, 1: {"loads": (own[1],)}})
        after = _host(layout.runner.kv_caches)
        state_keys = _state_keys(layout.runner.kv_caches)
        wrong = _wrong_after_loads(original, before, after, state_keys, blocks, rows)
        client = redis.Redis.from_url(server.url)
        objects = {k.decode(): client.strlen(k) for k in client.keys("*")}
        client.close()
        stages = [t for t in worker.tiers if t.name == "shared"]
        return types.SimpleNamespace(shared=shared, failed=set(results.failed_recving or ()), wrong=wrong,
                                     objects=objects, stages=stages, original=original, after=after, rows=rows,
                                     state_keys=state_keys, verified=verified)
    finally:
        if conn is not None:
            conn.shutdown()
        server.stop()


@pytest.mark.timeout(120)
def test_each_rank_publishes_kv_and_state_chunks_and_fetches_them_back_from_redis_byte_exact(dp_layout, monkeypatch):
    from tpuoffload.backend.shared_store import HEADER_BYTES as OBJECT_HEADER
    from tpuoffload.messages import SharedPlan
    from tpuoffload.worker.shared_stage import SharedStage

    run = _publish_evict_fetch_load(dp_layout)
    assert not run.wrong and not run.failed, (run.wrong, run.failed)
    assert run.verified == {0: (14, 15, 16, 17), 1: (14, 15)}, run.shared
    # One namespace for both ranks (their layouts are equal), naming both pools' layouts.
    s0, s1 = run.stages
    assert (s0.rank, s1.rank) == (0, 1) and s0.deployment == s1.deployment
    assert all(json.loads(s.deployment)["state_layout"] == s.engines[1].shard_part(s.rank)[2] for s in run.stages)
    assert (s0.part, s0.parts) == (0, 1)  # this host holds every device of each rank
    # Four objects: each rank's KV chunk and state row (".p1"), its batch shard's pieces (half the
    # host's bytes of each, read off the arrays).
    host_kv, host_state = (sum(s.data.nbytes // s.data.shape[0] for a in arrays for s in a.addressable_shards)
                           for arrays in ([c for c in dp_layout.kv_caches if not isinstance(c, tuple)],
                                          [a for c in dp_layout.kv_caches if isinstance(c, tuple) for a in c]))
    sizes = sorted((name.endswith(".p1"), size - OBJECT_HEADER) for name, size in run.objects.items())
    assert sizes == [(False, host_kv // 2)] * 2 + [(True, host_state // 2)] * 2, run.objects
    # The state layout names the objects: rank 1 with its state pool laid out otherwise (the first
    # state array's row transposed: the same bytes in another order) and the same KV layout is
    # another namespace, so it never reads these state objects (nor these KV objects).
    state = s1.engines[1]
    part, parts, layout = state.shard_part(1)
    groups = json.loads(layout)
    groups[0]["row"] = groups[0]["row"][:1] + groups[0]["row"][1:][::-1]
    other_layout = json.dumps(groups, sort_keys=True)
    assert other_layout != layout
    monkeypatch.setattr(state, "shard_part", lambda shard: (part, parts, other_layout))
    other = SharedStage(s1.engines, s1.spec, 0, s1.deployment, store=s1.store, rank=1)
    assert json.loads(other.deployment)["rank_layout"] == json.loads(s1.deployment)["rank_layout"]
    plan = SharedPlan("scope", 1)
    assert other._namespace(plan) != s1._namespace(plan) and s0._namespace(plan) == s1._namespace(plan)


@pytest.mark.timeout(120)
def test_negative_control_state_objects_of_another_batch_shard_serve_the_wrong_state(dp_layout, monkeypatch):
    """The one mechanism removed: a rank's state objects cut from its batch shard's pieces (the
    state pool's rows become batch shard 0's bytes whatever the rank). Rank 1's state object then
    holds rank 0's state row 5 (the same local slot on shard 0's devices), verifies, and is
    installed as rank 1's: rank 1's state row 7 and rank 0's cross-rank row 12 get rank 0's bytes,
    silently (no load fails); the KV chunks are right."""
    from tpuoffload.worker import pooled_engine

    make = pooled_engine.PooledEngine.__init__

    def state_objects_of_shard_zero(self, *args, **kw):
        make(self, *args, **kw)
        if len(self.engines) > 1:
            state, own = self.engines[1], self.engines[1].rows_to_payloads
            state.rows_to_payloads = lambda rows, shard=0: own(rows, 0)

    monkeypatch.setattr(pooled_engine.PooledEngine, "__init__", state_objects_of_shard_zero)
    run = _publish_evict_fetch_load(dp_layout)
    print("negative control (state objects of shard 0):", {"failed loads": sorted(run.failed), "wrong rows": run.wrong})
    assert not run.failed and run.verified == {0: (14, 15, 16, 17), 1: (14, 15)}  # nothing noticed ...
    rows = run.rows
    assert run.wrong and set(run.wrong) == run.state_keys, run.wrong  # ... every state array wrong, KV right
    for key in run.state_keys:
        assert sorted(run.wrong[key]) == [12, rows + 7], (key, run.wrong[key])
        assert all(np.array_equal(run.after[key][dst], run.original[key][5]) for dst in (12, rows + 7))


@pytest.mark.timeout(120)
def test_negative_control_shared_state_slots_not_placed_by_rank(dp_layout, monkeypatch):
    """The other mechanism removed: the stage's state slots numbered as with one scheduler
    (``Placement.state_offset`` without the rank's share of the state store), saves and loads
    unchanged. Rank 1's state publish then reads rank 0's state slot (refused: another chunk is
    there) and nothing is written; its state object is absent from the store, so rank 1's load of
    its state and rank 0's cross-rank load of it fail."""
    from tpuoffload.worker import offload_worker

    init = offload_worker._Placed.__init__

    def unplaced(self, *args, **kw):
        init(self, *args, **kw)
        self.state_offset = -self.kv_slots

    monkeypatch.setattr(offload_worker._Placed, "__init__", unplaced)
    run = _publish_evict_fetch_load(dp_layout)
    print("negative control (shared state slots not placed by rank):",
          {"failed loads": sorted(run.failed), "verified": run.verified, "wrong rows": run.wrong})
    assert run.failed == {"r1", "x0"}, run.failed  # rank 1's own load of its state and rank 0's cross-rank one
    assert run.verified == {0: (14, 15, 16), 1: (14,)}, run.verified  # rank 1's state object never written
    assert sorted(name.endswith(".p1") for name in run.objects) == [False, False, True], run.objects
