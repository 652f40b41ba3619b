"""Issue 36: warm restart (``persist_path``) for GDN (Qwen3.5-like) hybrids: the state pool in the
checkpoint beside the KV pool.

A GDN hybrid's host RAM is two stores (worker/pooled_engine.py): KV chunks and state chunks (one
row of every GDN layer's conv and ssm arrays), each with its own slot table. A checkpoint holds
both (the Persister's further pool, ``PoolSlots``: its own tags, checksums and stores), each host
reports its restored rows with their pool (``RESTORED_ROW.pool``, the slot in that pool's own
numbering), and the scheduler adopts a row into its own pool only (``WarmRestart._adopt``), under
that pool's restored save id (``restored_save_id``). Proven here:

* the Persister: two pools of different slot counts round-trip; a flipped byte in the state pool,
  or a checkpoint with another number of pools, is refused; a fingerprint with a state pool never
  matches one without (old, KV-only checkpoints are refused cleanly, naming ``state_layout``);
* the scheduler: rows adopted into their own pool at the pool's slot, under its save id; rows that
  differ in pool between hosts, fall outside their pool, or name one slot twice, are dropped;
* vLLM's real Scheduler with tpu-inference's hybrid coordinator, one host in process: a clean
  shutdown, a restart, and every prefix loads its attention blocks and its state row from restored
  host RAM, every state row and attention position read exact; negative control: the pool dropped
  from the restored rows (every row taken for a KV chunk) and the check fails;
* under DPScheduler (tpu-inference's qwen3.5-like-dp2 arrays, one host holding both batch shards):
  each rank restores its own rows of both pools in its own numbering and loads its KV and state
  chunks back byte-exact; negative control: state chunks restored under the KV pool's ids;
* a pod slice of 2 JAX processes x 2 CPU devices (tpu-inference's own qwen3.5-like arrays over
  the slice's mesh): serve, clean shutdown (each host's checkpoint), restart on the same
  ``persist_path``: every host restores both pools alike, the repeated prompts load KV and state
  chunks from restored host RAM, every state row and attention position exact, identical digests.

The synthetic GdnRunner checks a read against the deterministic function of the token prefix that
every run writes, so a state row or position exact there is byte for byte the one the first run saved.
"""

from __future__ import annotations

import collections
import dataclasses
import random

import numpy as np
import pytest

from tpuoffload import counters as C
from tpuoffload.manager.index import READY, ChunkIndex
from tpuoffload.manager.restart import WarmRestart
from tpuoffload.messages import RESTORED_BASE, RESTORED_ROW, PersistReport, restored_save_id
from tpuoffload.persist import Fingerprint, Persister, PoolSlots
from tpuoffload.sim import gdn_layout as gl
from tpuoffload.sim.engine import EngineSpec, InProcessEngine

from test_gdn_offload import _check_clean, _loads, _tokens
from test_persist import INDEX, SLOTS, fingerprint, host_slots, make_stores, store_specs, stores_match

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


# ---------------------------------------------------------------- the Persister: two pools
def _pool_tags(num_slots: int) -> np.ndarray:
    tags = np.stack([np.arange(500, 500 + num_slots), 2000 + np.arange(num_slots)], axis=1)
    tags[[1, 4], 0] = -1  # empty slots
    return tags


def test_a_second_pool_round_trips_and_is_checked_like_the_first(tmp_path):
    path = str(tmp_path / "p")
    kv_specs, state_specs = store_specs(), store_specs(num_slots=7, layers=3)
    _, save_ids = host_slots(0)
    kv_tags = np.stack([save_ids, 1000 + 3 * np.arange(SLOTS)], axis=1)
    state_tags = _pool_tags(7)
    p = Persister(path, fingerprint())
    assert p.restore(kv_specs, [state_specs])[0] is None
    report = p.save(make_stores(kv_specs), kv_tags, INDEX,
                    pools=[PoolSlots(make_stores(state_specs, seed=9), state_tags)]).result(timeout=120)
    p.close()
    assert report.ok and report.chunks == (SLOTS - 2) + (7 - 2), report
    p = Persister(path, fingerprint())
    restored, reason = p.restore(kv_specs, [state_specs])
    p.close()
    assert reason == "" and np.array_equal(restored.tags, kv_tags) and stores_match(restored.stores, kv_specs)
    (state,) = restored.pools
    assert np.array_equal(state.tags, state_tags) and stores_match(state.stores, state_specs, seed=9)
    assert not stores_match(state.stores, state_specs, seed=0)  # the state pool's own bytes, not the KV pool's
    assert restored.chunks == report.chunks
    # A deployment without the state pool (or with another one) is refused before any array is read.
    p = Persister(path, fingerprint())
    restored, reason = p.restore(kv_specs)
    p.close()
    assert restored is None and "slot pools: checkpoint 2, this deployment 1" in reason, reason
    p = Persister(path, fingerprint())
    restored, reason = p.restore(kv_specs, [store_specs(num_slots=8, layers=3)])
    p.close()
    assert restored is None and "pool 1 host slots: checkpoint 7, this deployment 8" in reason, reason
    # A flipped byte in the state pool's data: refused, naming the pool.
    from test_persist import _data_file_with, _flip
    from test_persist import store_values

    want = store_values(state_specs["group0"], 9)[0, 5, 0, 0, :8].tobytes()
    data_file, at = _data_file_with(path, want)
    _flip(data_file, at + 10)
    p = Persister(path, fingerprint())
    restored, reason = p.restore(kv_specs, [state_specs])
    p.close()
    assert restored is None and "pool 1: 1 slot(s) fail their checksum (first: slot 5)" in reason, reason


def test_a_state_pool_is_part_of_the_fingerprint_and_old_ones_read_without_it():
    old = fingerprint().to_json()
    assert "state_layout" not in old and Fingerprint.from_json(old) == fingerprint()
    gdn = fingerprint(state_layout="6 layers of (3, 512) bfloat16 ...; 215040 bytes per state chunk")
    assert gdn.to_json()["state_layout"].startswith("6 layers")
    assert Fingerprint.from_json(gdn.to_json()) == gdn
    (diff,) = gdn.mismatches(Fingerprint.from_json(old))  # a KV-only checkpoint: refused, saying why
    assert diff.startswith("state_layout: checkpoint ''")


# ---------------------------------------------------------------- the scheduler: adoption per pool
def _rows(*entries) -> bytes:
    """RESTORED_ROW rows of (slot, save id, k1, pool); k2 = k1 + 1."""
    out = np.zeros(len(entries), RESTORED_ROW)
    for i, (slot, save_id, k1, pool) in enumerate(entries):
        out[i] = (slot, save_id, k1, k1 + 1, pool)
    return out.tobytes()


def _restart(tmp_path, pools=(6, 3), hosts=2):
    counters = collections.Counter()
    index = ChunkIndex(sum(pools), counters=counters, pools=pools)
    return WarmRestart(str(tmp_path), 0.0, 30.0, index, hosts, counters, lambda: 0.0), index, counters


def _slot_of(index: ChunkIndex, k1: int) -> int:
    return index.ready_slot(int(k1).to_bytes(8, "little") + int(k1 + 1).to_bytes(8, "little"))


def test_restored_rows_are_adopted_into_their_own_pool_only(tmp_path):
    tier, index, counters = _restart(tmp_path)
    host0 = _rows((1, 10, 100, 0), (1, 11, 200, 1), (2, 12, 300, 1), (0, 13, 400, 1), (3, 14, 500, 1),
                  (2, 15, 600, 0), (0, 16, 700, 0))
    host1 = _rows((1, 10, 100, 0), (1, 11, 200, 1), (2, 12, 300, 0), (0, 13, 400, 1), (3, 14, 500, 1),
                  (2, 15, 600, 0), (0, 16, 700, 1))
    tier.on_report({0: PersistReport(host0), 1: PersistReport(host1)})
    # KV slot 1 and state slot 1 (index slot 6 + 1) coincide in their pools' numbering: each in its own.
    assert _slot_of(index, 100) == 1 and index.save_id_of(1) == RESTORED_BASE + 1
    assert _slot_of(index, 200) == 7 and index.save_id_of(7) == restored_save_id(1, 1) != RESTORED_BASE + 7
    assert _slot_of(index, 400) == 6 and index.save_id_of(6) == restored_save_id(1, 0)
    assert _slot_of(index, 600) == 2 and index.state_of(2) == READY
    # Dropped: 300 and 700 restored in different pools by the two hosts; 500 at state slot 3 (the
    # state pool has 3 slots).
    assert _slot_of(index, 300) < 0 and _slot_of(index, 500) < 0 and _slot_of(index, 700) < 0
    assert counters[C.RESTORED_READY] == 4 and counters[C.RESTORED_DROPPED] == 3


def test_a_slot_named_twice_is_adopted_for_neither(tmp_path):
    tier, index, counters = _restart(tmp_path, hosts=1)
    tier.on_report({0: PersistReport(_rows((4, 1, 100, 0), (4, 2, 200, 0), (0, 3, 300, 1)))})
    assert _slot_of(index, 100) < 0 and _slot_of(index, 200) < 0 and _slot_of(index, 300) == 6
    assert counters[C.RESTORED_READY] == 1 and counters[C.RESTORED_DROPPED] == 2


# ---------------------------------------------------------------- vLLM's Scheduler, one host in process
SPEC = dataclasses.replace(gl.QWEN35_LIKE, max_num_seqs=4, max_num_batched_tokens=256)
BS = SPEC.block_size
PREFIX_BLOCKS = (9, 5, 2)


def _engine(persist: str) -> InProcessEngine:
    extra = {"num_cpu_chunks": 128, "state_ram_fraction": 0.5, "persist_path": persist}
    eng = InProcessEngine(EngineSpec(num_hosts=1, gdn=SPEC, extra_config=extra))
    eng.settle()  # the host's restore report reaches the scheduler (a request before it would miss)
    return eng


def _wave(eng: InProcessEngine, tag: str, prefixes, rng) -> None:
    for i, p in enumerate(prefixes):
        eng.add_request(gl.make_request(eng.gdn_layout, f"{tag}{i}", p + _tokens(rng, 7), max_tokens=3))
    eng.run()
    eng.settle()


def _restart_in_process(tmp_path):
    """Serve the prefixes, shut down cleanly, start again on the same persist_path and serve them
    again. Returns (chunks saved by the first run, the second engine, its loads, the prefixes)."""
    persist = str(tmp_path / "ckpt")
    rng = random.Random(4)
    prefixes = [_tokens(rng, n * BS) for n in PREFIX_BLOCKS]
    first = _engine(persist)
    try:
        _wave(first, "a", prefixes, rng)
        saved = first.stats.totals()[C.CHUNKS_SAVED]
        pools = first.connectors[0].worker.engine.pool_totals
        assert pools[1][C.CHUNKS_SAVED] >= len(prefixes), pools  # the state chunks were saved
        _check_clean(first)
    finally:
        first.close()  # clean shutdown: the host's checkpoint holds both pools
    second = _engine(persist)
    loads = _loads(second)
    _wave(second, "b", prefixes, rng)
    return saved, second, loads, prefixes


def test_restart_loads_attention_blocks_and_state_rows_from_restored_host_ram_byte_exact(tmp_path):
    saved, eng, loads, prefixes = _restart_in_process(tmp_path)
    try:
        t = eng.stats.totals()
        assert t[C.PERSIST_RESTORED_CHUNKS] == saved and t[C.RESTORED_READY] == saved, t
        assert t[C.HIT_TOKENS] == sum(len(p) for p in prefixes), t  # every prefix whole, with its state
        assert sorted(ld.req_id for _, ld, _ in loads) == ["b0", "b1", "b2"]
        for _, load, pools in loads:  # its attention blocks from the KV pool, ONE state row from the state pool
            assert sorted(pools.tolist()) == [0] * PREFIX_BLOCKS[int(load.req_id[1])] + [1], (load, pools)
            state = np.asarray(load.save_ids)[pools == 1]
            assert (state >= restored_save_id(1, 0)).all(), load  # restored state chunks, not new saves
        state_pool = eng.connectors[0].worker.engine.pool_totals[1]
        assert state_pool[C.CHUNKS_LOADED] == len(prefixes) and state_pool.get(C.LOAD_ERRORS, 0) == 0, state_pool
        runner = eng.runners[0]
        assert runner.stats.states_verified >= len(prefixes) and runner.stats.positions_verified > 0
        _check_clean(eng)  # no wrong state row or position read, nothing held
    finally:
        eng.close()


def test_negative_control_rows_without_their_pool_do_not_restore_the_state(tmp_path, monkeypatch):
    """The check above can fail: with the pool dropped from the restored rows (every row taken for
    a KV chunk, the mechanism that keeps state rows in the state pool), the prefixes are not
    served whole from the restored host RAM, or a state row or position is read wrong."""
    on_report = WarmRestart.on_report

    def without_pools(self, parts):
        stripped = {}
        for host, part in parts.items():
            if part.restored:
                rows = np.frombuffer(part.restored, RESTORED_ROW).copy()
                rows["pool"] = 0
                part = dataclasses.replace(part, restored=rows.tobytes())
            stripped[host] = part
        on_report(self, stripped)

    monkeypatch.setattr(WarmRestart, "on_report", without_pools)
    _, eng, _, prefixes = _restart_in_process(tmp_path)
    try:
        t = eng.stats.totals()
        st = eng.runners[0].stats
        print("negative control:", {k: t.get(k, 0) for k in (C.RESTORED_READY, C.RESTORED_DROPPED, C.HIT_TOKENS,
                                                              C.LOAD_ERRORS)},
              "state mismatches", st.state_mismatches, "mismatches", st.mismatches)
        assert (t.get(C.HIT_TOKENS, 0) < sum(len(p) for p in prefixes) or st.state_mismatches > 0
                or st.mismatches > 0), (t, st)
    finally:
        eng.close()


# ---------------------------------------------------------------- under DPScheduler: each rank's rows
def _dp_restart(tmp_path, layout):
    """tpu-inference's qwen3.5-like-dp2 arrays (DP 2 x TP 2, one host holding both batch shards):
    each rank saves its local block 9 into its KV slot 1 and its local state row 5 + r into its
    state slot 1 (slot 1 of both pools, on both ranks, under the same local save ids), the host
    shuts down (its checkpoint), a new host (other contents) restores and each rank loads its
    restored KV chunk into its block 30 and its state chunk into its state row 12. Returns (each
    rank's restored rows, the failed loads, whether every destination holds exactly its source's
    bytes and nothing else changed)."""
    import copy

    from test_gdn_dp import UNIT_EXTRA, _dp_plan
    from test_state_pool_worker import _fill, _host, _state_keys, _step
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from tpuoffload.connector import TPUOffloadConnector
    from tpuoffload.messages import LoadRequest, OffloadMetadata, SaveBatch, pack_keys

    config = gl.make_vllm_config(layout.spec, {**UNIT_EXTRA, "persist_path": str(tmp_path / "ckpt"),
                                               "persist_timeout_s": 30.0})

    def worker(seed):
        layout.runner.kv_caches = _fill(layout.kv_caches, seed)
        conn = TPUOffloadConnector(config, KVConnectorRole.WORKER, copy.deepcopy(layout.worker_kv_cache_config))
        conn.register_runner(layout.runner)
        return conn

    def keys(r):  # KV chunk, state chunk of rank r
        return pack_keys(np.array([0x100 + r, 0x200 + r], np.uint64), np.array([0x300 + r, 0x400 + r], np.uint64))

    conn = worker(7)
    saved_from = _host(layout.runner.kv_caches)
    kv = conn.worker.engine.tables[0].shard_slots
    saves = [SaveBatch((9, 5 + r), (1, kv + 1), (10, 11), keys(r)) for r in range(2)]
    _step(conn, OffloadMetadata([_dp_plan(conn, r, 0, layout, save=saves[r]) for r in range(2)]))
    assert conn.worker.wait_idle(30)
    conn.build_connector_worker_meta()
    conn.shutdown()  # the host's checkpoint: both ranks' rows of both pools

    conn = worker(8)
    try:
        _, report, _ = _step(conn, OffloadMetadata([_dp_plan(conn, r, 0, layout) for r in range(2)]))
        rows = {r: np.frombuffer(report.tier_parts("persist", 100 + r)[0].restored, RESTORED_ROW) for r in range(2)}
        before = _host(layout.runner.kv_caches)
        loads = [LoadRequest(f"r{r}", (30, 12), (1, kv + 1), (restored_save_id(0, 1), restored_save_id(1, 1)))
                 for r in range(2)]
        results, _, _ = _step(conn, OffloadMetadata([_dp_plan(conn, r, 1, layout, loads=(loads[r],))
                                                     for r in range(2)]))
        after, state_keys = _host(layout.runner.kv_caches), _state_keys(layout.runner.kv_caches)
    finally:
        conn.shutdown()
    blocks, state_rows = layout.attention_num_blocks // 2, layout.mamba_num_blocks // 2
    kv_moves = {r * blocks + 30: r * blocks + 9 for r in range(2)}  # the engine's numbering of rank r's blocks
    state_moves = {r * state_rows + 12: r * state_rows + 5 + r for r in range(2)}
    exact = True
    for key, arr in before.items():
        want = arr.copy()
        for dst, src in (state_moves if key in state_keys else kv_moves).items():
            want[dst] = saved_from[key][src]
        exact &= all(np.array_equal(a, w) for a, w in zip(after[key], want))
    return rows, set(results.failed_recving or ()), exact


@pytest.fixture(scope="module")
def dp_layout():
    return gl.build(gl.QWEN35_LIKE_DP2)


def test_under_dpscheduler_each_rank_restores_its_own_kv_and_state_rows_byte_exact(tmp_path, dp_layout):
    rows, failed, exact = _dp_restart(tmp_path, dp_layout)
    for r in range(2):  # its own slot 1 of each pool, its own save ids and hash keys
        assert sorted(zip(rows[r]["pool"].tolist(), rows[r]["slot"].tolist(), rows[r]["save_id"].tolist(),
                          rows[r]["k1"].tolist())) == [(0, 1, 10, 0x100 + r), (1, 1, 11, 0x200 + r)], (r, rows[r])
    assert failed == set() and exact


def test_negative_control_state_chunks_restored_under_the_kv_pools_ids_fail_to_load(tmp_path, dp_layout,
                                                                                    monkeypatch):
    """The one mechanism removed: the state pool's restored chunks tagged as the KV pool's
    (``restored_save_id`` without its pool). The plans name the state chunks by the state pool's
    ids, the tags do not match, and every rank's load fails (KV chunks alone would still load)."""
    from tpuoffload.worker import persistence

    monkeypatch.setattr(persistence, "restored_save_id", lambda pool, slot: restored_save_id(0, slot))
    _, failed, exact = _dp_restart(tmp_path, dp_layout)
    assert failed == {"r0", "r1"} and not exact


# ---------------------------------------------------------------- the pod slice
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_podslice_gdn_restart_loads_kv_and_state_chunks_from_restored_host_ram(make_slice, tmp_path):
    from test_podslice import _assert_clean_end

    from tpuoffload.sim.podslice import SliceSpec
    from tpuoffload.sim.workload import PrefixRepetition, run_prefix_repetition

    # Host RAM for every chunk the run saves (no eviction: the restart must find every prefix whole):
    # a quarter KV chunks, three quarters state chunks (a state chunk is about 6.5 KV chunks).
    config = {"num_cpu_chunks": 256, "state_ram_fraction": 0.75, "save_timeout_s": 60.0, "load_wait_timeout_s": 5.0,
              "persist_path": str(tmp_path / "ckpt"), "persist_timeout_s": 120.0}
    spec = SliceSpec(num_hosts=2, devices_per_host=2, gdn="qwen3.5-like", max_num_seqs=4, max_num_batched_tokens=256,
                     extra_config=config, step_timeout_s=240.0, start_timeout_s=400.0)
    # 4 prefixes of 6 blocks, each asked twice: after the restart the first of each loads from host RAM.
    workload = PrefixRepetition(num_prefixes=4, prefix_blocks=6, suffix_len=(8, 16), output_len=(2, 4),
                                num_requests=8, waves=1, arrivals_per_step=4, seed=3)

    def serve(pod):
        res = run_prefix_repetition(pod, workload)
        assert res.finished == res.requests and res.wrong_outputs == [], res
        hosts = pod.worker_state()
        for h in hosts:  # every state row and attention position read exact, on every host
            assert h["mismatches"] == 0 and h["state_mismatches"] == 0, h
        assert all(len(set(step)) == 1 for step in pod.digests)  # the same programs on every host, every step
        return hosts

    first = make_slice(spec)
    first.settle()  # the hosts' (cold) restore reports first: until then no save is planned
    serve(first)
    t = first.stats.totals()
    saved = t[C.CHUNKS_SAVED]
    print(f"first run: host slots KV/state {first.offload.index.pool_sizes}, {dict(t)}")
    # Every prefix saved whole, with its state: nothing skipped, nothing evicted.
    assert t.get(C.EVICTED, 0) == 0 and t.get(C.SKIPPED_CHECKPOINT, 0) == 0, t
    per_host = first.shutdown()  # every host writes both pools; orbax commits once all have
    assert all(t[C.PERSIST_SAVED_CHUNKS] == saved // 2 for t in per_host), (saved, per_host)

    second = make_slice(spec)
    second.settle()  # every host's restore report reaches the scheduler (a request before it would miss)
    hosts = serve(second)
    totals = second.stats.totals()
    # Every host restored every chunk (both pools) and the scheduler adopted each, in its own pool.
    assert totals[C.PERSIST_RESTORED_CHUNKS] == saved and totals[C.RESTORED_READY] == saved // 2, totals
    # The repeated prompts hit host RAM, which only the restart filled before them: every prefix
    # whole, each hit its 6 attention blocks and ONE state row, loaded on every host.
    hit = workload.prefix_blocks * BS
    assert totals[C.HIT_TOKENS] >= workload.num_prefixes * hit and totals[C.HIT_TOKENS] % hit == 0, totals
    for h in hosts:
        kv, state = h["pool_totals"]
        assert state.get(C.CHUNKS_LOADED, 0) == totals[C.HIT_TOKENS] // hit, h
        assert kv.get(C.CHUNKS_LOADED, 0) == workload.prefix_blocks * state[C.CHUNKS_LOADED], h
        assert kv.get(C.LOAD_ERRORS, 0) == 0 and state.get(C.LOAD_ERRORS, 0) == 0, h
        assert h["states_verified"] > 0 and h["positions_verified"] > 0, h
    _assert_clean_end(second)
    print(f"GDN pod-slice restart: {saved // 2} chunks restored per host; "
          f"pool counters {[h['pool_totals'] for h in hosts]}")
