"""Issue 21, the worker half of GDN (Qwen3.5-like) hybrids: two slot pools.

``runner.kv_caches`` of a GDN hybrid, exactly as tpu-inference allocates it
(``tpuoffload.sim.gdn_layout``): a KV array per attention layer (the attention block pool) and a
``(conv, ssm)`` tuple per GDN layer (the compact state pool, M rows). The worker half, built as the
engine builds it, keeps KV chunks in pool 0 and state chunks (one row of every conv and ssm array)
in pool 1; the plan numbers both as one slot range, pool 1 from ``num_slots - state_slots`` on
(worker/pooled_engine.py). Checked here: bit-exact round trips of every array in one plan, block
ids and pool-relative slots that coincide across the pools, per-request load failures, one pool
unchanged, and the refusals.
"""

from __future__ import annotations

import copy
import types

import jax
import numpy as np
import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from tpuoffload.config import parse_config
from tpuoffload.connector import TPUOffloadConnector
from tpuoffload.layout import CacheLayout, CachePools, UnsupportedCache
from tpuoffload.messages import LoadRequest, OffloadMetadata, OffloadWorkerReport, SaveBatch, StepPlan
from tpuoffload.sim import gdn_layout as gl
from tpuoffload.sim.tpu_layouts import LAYOUTS, create_caches
from tpuoffload.worker.faults import FaultInjector, FaultPoint
from tpuoffload.worker.offload_worker import OffloadWorker
from tpuoffload.worker.pooled_engine import PooledEngine
from tpuoffload.worker.transfer_engine import TransferEngine

SPEC = gl.QWEN35_LIKE
# 32 KV slots and 9 state slots (a state chunk is 215040 bytes, a KV chunk 65536): room for several
# state chunks (with num_cpu_chunks 16 and the default fraction the state pool has one slot).
EXTRA = {"num_cpu_chunks": 64, "state_ram_fraction": 0.5}

# The standard save (step 0), by pool-relative slot: pool-0 slot -> attention block, state slot
# -> state row. Pool-0 slot 0 and state slot 0 coincide pool-relatively; 5 and 11 are ids in both.
KV_SAVED = {0: 5, 1: 7, 2: 100, 3: 361, 4: 11}
STATE_SAVED = {0: 5, 1: 9, 2: 11, 3: 64}
KV_SAVE_IDS = {0: 102, 1: 104, 2: 106, 3: 108, 4: 100}
STATE_SAVE_IDS = {0: 103, 1: 105, 2: 101, 3: 107}
# The standard loads (step 1), destination -> pool-relative slot. Request "a": attention blocks
# 20, 21 and state row 50; "b": attention blocks 40..42 and state rows 40, 41, 12 (40 and 41 are
# destinations in both pools).
KV_LOADS = {"a": {20: 0, 21: 1}, "b": {40: 2, 41: 3, 42: 4}}
STATE_LOADS = {"a": {50: 3}, "b": {40: 0, 41: 1, 12: 2}}


@pytest.fixture(scope="module")
def layout():
    return gl.build(SPEC)


@pytest.fixture(scope="module")
def vllm_config(layout):
    return gl.make_vllm_config(SPEC, EXTRA)


# ------------------------------------------------------------------ helpers
def _bits(arr, rng: np.random.Generator) -> np.ndarray:
    """Random bits in ``arr``'s shape and dtype (NaN patterns included: compared as ints)."""
    wire = np.dtype(f"uint{8 * arr.dtype.itemsize}")
    return rng.integers(0, np.iinfo(wire).max, size=arr.shape, dtype=wire, endpoint=True).view(arr.dtype)


def _fill(kv_caches, seed: int) -> list:
    """New caches laid out as ``kv_caches`` (tuples stay tuples), every byte random."""
    rng = np.random.default_rng(seed)

    def put(a):
        return jax.device_put(_bits(a, rng), a.sharding)

    return [tuple(put(a) for a in c) if isinstance(c, tuple) else put(c) for c in kv_caches]


def _host(kv_caches) -> dict[tuple[int, int], np.ndarray]:
    """Every array's bytes as unsigned ints, by (runner entry, element of its tuple)."""
    out = {}
    for i, c in enumerate(kv_caches):
        for j, a in enumerate(c if isinstance(c, tuple) else (c,)):
            h = np.asarray(a)
            out[i, j] = h.view(f"uint{8 * h.dtype.itemsize}")
    return out


def _expect(before: dict, source: dict, state_keys: set, kv_moves: dict[int, int],
            state_moves: dict[int, int]) -> dict:
    """``before`` with each destination block (attention arrays) or row (state arrays) replaced
    by ``source``'s bytes of its source block or row."""
    out = {}
    for key, arr in before.items():
        arr = arr.copy()
        for dst, src in (state_moves if key in state_keys else kv_moves).items():
            arr[dst] = source[key][src]
        out[key] = arr
    return out


def _assert_bytes(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        bad = np.flatnonzero([not np.array_equal(a, e) for a, e in zip(actual[key], expected[key])])
        assert not len(bad), f"kv_caches{list(key)}: rows {bad[:8].tolist()} differ"


def _ids(report: OffloadWorkerReport | None, which: str) -> set[int]:
    if report is None:
        return set()
    return {i for ranges in getattr(report, which).values() for a, b in ranges for i in range(a, b)}


def _worker(layout, vllm_config, seed: int = 0) -> TPUOffloadConnector:
    """The worker half as the engine builds it, over freshly filled caches."""
    layout.runner.kv_caches = _fill(layout.kv_caches, seed)
    conn = TPUOffloadConnector(vllm_config, KVConnectorRole.WORKER, copy.deepcopy(layout.worker_kv_cache_config))
    conn.register_runner(layout.runner)
    return conn


def _plan(conn: TPUOffloadConnector, step: int, **fields) -> OffloadMetadata:
    """A one-scheduler plan over both pools, every state slot planned (as the scheduler half does)."""
    engine = conn.worker.engine
    state = engine.num_slots(1)
    return OffloadMetadata([StepPlan(step=step, num_slots=engine.num_slots(0) + state, state_slots=state,
                                     failures_by_request=True, **fields)])


def _step(conn: TPUOffloadConnector, meta: OffloadMetadata):
    """One step through the hooks vLLM calls; returns (transfer results, report, digest)."""
    conn.bind_connector_metadata(meta)
    conn.start_load_kv()
    conn.wait_for_save()
    results = conn.get_transfer_results(set())
    report = conn.build_connector_worker_meta()
    conn.clear_connector_metadata()
    return results, report, conn.worker.digests[-1]


def _save_standard(conn: TPUOffloadConnector) -> None:
    """Step 0: KV_SAVED and STATE_SAVED in one plan (one chunk of each pool flushed before the
    forward, the rest interleaved after it); returns once every save is confirmed."""
    b = conn.worker.engine.num_slots(0)
    flush = SaveBatch((KV_SAVED[4], STATE_SAVED[2]), (4, b + 2), (KV_SAVE_IDS[4], STATE_SAVE_IDS[2]))
    rows = [(KV_SAVED[0], 0), (STATE_SAVED[0], b), (KV_SAVED[1], 1), (STATE_SAVED[1], b + 1), (KV_SAVED[2], 2),
            (STATE_SAVED[3], b + 3), (KV_SAVED[3], 3)]
    ids = [KV_SAVE_IDS[s] if s < b else STATE_SAVE_IDS[s - b] for _, s in rows]
    save = SaveBatch(tuple(r for r, _ in rows), tuple(s for _, s in rows), tuple(ids))
    _, report, digest = _step(conn, _plan(conn, 0, flush=flush, save=save))
    assert conn.worker.wait_idle(30)
    saved = _ids(report, "saved") | _ids(conn.build_connector_worker_meta(), "saved")
    assert saved == set(KV_SAVE_IDS.values()) | set(STATE_SAVE_IDS.values())
    assert sum(op.startswith("pool n=1") for op in digest.ops) == 2  # the flush's and the save's state programs


def _loads(b: int, wrong_state_id: str | None = None) -> tuple[LoadRequest, ...]:
    """The standard loads (``wrong_state_id``: that request's first state row names a save id its
    slot never held)."""
    out = []
    for req in ("a", "b"):
        kv, state = KV_LOADS[req], STATE_LOADS[req]
        ids = [KV_SAVE_IDS[s] for s in kv.values()] + [STATE_SAVE_IDS[s] for s in state.values()]
        if req == wrong_state_id:
            ids[len(kv)] = 999
        out.append(LoadRequest(req, (*kv, *state), (*kv.values(), *(b + s for s in state.values())), tuple(ids)))
    return tuple(out)


def _expected_after_load(before: dict, saved_from: dict, keys: set,
                         failed_rows: frozenset[int] = frozenset()) -> dict:
    """What the standard loads leave: every destination holds its source's bytes, except the
    state rows ``failed_rows``, which hold zeros (placeholders)."""
    kv_moves = {dst: KV_SAVED[s] for moves in KV_LOADS.values() for dst, s in moves.items()}
    state_moves = {dst: STATE_SAVED[s] for moves in STATE_LOADS.values() for dst, s in moves.items()
                   if dst not in failed_rows}
    expected = _expect(before, saved_from, keys, kv_moves, state_moves)
    for key in keys:
        expected[key][sorted(failed_rows)] = 0
    return expected


def _state_keys(kv_caches) -> set[tuple[int, int]]:
    return {(i, j) for i, c in enumerate(kv_caches) if isinstance(c, tuple) for j in range(len(c))}


# ------------------------------------------------------------------ CachePools
def test_cache_pools_split_and_rebuild(layout):
    pools = CachePools.of(layout.kv_caches)
    state = layout.state_layers()
    assert pools.num == 2 and state == [0, 1, 2, 3, 4, 5]
    kv, st = pools.arrays(layout.kv_caches, 0), pools.arrays(layout.kv_caches, 1)
    assert [a.shape for a in kv] == [(layout.attention_num_blocks, SPEC.block_size, 4, 2, 128)] * 2
    assert [a.shape for a in st] == [(layout.mamba_num_blocks, 3, 512), (layout.mamba_num_blocks, 8, 32, 32)] * 6
    assert st[1] is layout.kv_caches[0][1] and kv[0] is layout.kv_caches[6]
    # Each pool's flat list is an ordinary layout, of one number of blocks.
    assert [CacheLayout.from_caches(pools.arrays(layout.kv_caches, p)).num_blocks for p in (0, 1)] == \
        [layout.attention_num_blocks, layout.mamba_num_blocks]
    rebuilt = pools.put(layout.kv_caches, 1, st[::-1])
    assert all(type(rebuilt[i]) is tuple for i in state) and rebuilt[6] is layout.kv_caches[6]
    assert rebuilt[0] == (st[-1], st[-2]) and rebuilt[5] == (st[1], st[0])
    assert pools.put(layout.kv_caches, 0, kv[::-1])[6:] == kv[::-1]
    with pytest.raises(ValueError, match="3 arrays for pool 0, which holds 2"):
        pools.put(layout.kv_caches, 0, kv + kv[:1])
    with pytest.raises(ValueError, match="no pool 2"):
        pools.arrays(layout.kv_caches, 2)
    attn_only = CachePools.of(layout.kv_caches[6:])
    assert attn_only.num == 1 and attn_only.put(layout.kv_caches[6:], 0, kv) == kv


def test_cache_pools_refuse_malformed_entries(layout):
    conv, ssm = layout.kv_caches[0]
    attn = layout.kv_caches[6]
    not_arrays = r"kv_caches\[1\] is a tuple of {} entries \(not arrays: \[{}\]\)"
    for caches, msg in (([attn, (conv, np.zeros(3))], not_arrays.format(2, "'ndarray'")),
                        ([attn, ()], not_arrays.format(0, "")),
                        ([(conv, ssm)], "state tuples only"),
                        ([attn, [conv, ssm]], r"kv_caches\[1\] is list, not a jax.Array or a tuple")):
        with pytest.raises(UnsupportedCache, match=msg):
            CachePools.of(caches)
    with pytest.raises(ValueError, match="empty"):
        CachePools.of([])


# ------------------------------------------------------------------ round trips
def test_both_pools_round_trip_bit_exact_in_one_plan(layout, vllm_config, monkeypatch):
    conn = _worker(layout, vllm_config)
    try:
        engine = conn.worker.engine
        b = engine.num_slots(0)
        assert (b, engine.num_slots(1)) == (32, 9) and len(engine.engines) == 2
        saved_from = _host(layout.runner.kv_caches)
        _save_standard(conn)

        layout.runner.kv_caches = _fill(layout.kv_caches, 1)  # what the blocks hold meanwhile
        before = _host(layout.runner.kv_caches)
        results, _, digest = _step(conn, _plan(conn, 1, loads=_loads(b)))
        assert (results.finished_recving, results.failed_recving) == ({"a", "b"}, set())
        assert conn.get_block_ids_with_load_errors() == set()
        assert sum(op.startswith("pool n=1") for op in digest.ops) == 1  # one load program per pool

        keys = _state_keys(layout.runner.kv_caches)
        assert len(keys) == 12 and all(type(layout.runner.kv_caches[i]) is tuple for i, _ in keys)
        expected = _expected_after_load(before, saved_from, keys)
        _assert_bytes(_host(layout.runner.kv_caches), expected)  # every byte of every array
        stats = conn.get_kv_connector_stats().totals()
        assert (stats["chunks_saved"], stats["chunks_loaded"], stats["load_errors"]) == (9, 9, 0)
        assert stats["bytes_loaded"] == 5 * engine.tables[0].slot_bytes + 4 * engine.tables[1].slot_bytes

        # Negative controls: the loads changed every destination, and a load whose state slots are
        # routed one slot off (the slot checks switched off, so the wrong bytes do land) fails the
        # byte check.
        for key, arr in before.items():
            rows = {d for m in (STATE_LOADS if key in keys else KV_LOADS).values() for d in m}
            assert all(not np.array_equal(arr[r], expected[key][r]) for r in rows)
        monkeypatch.setattr(engine.engines[1], "_unusable", lambda *a: set())
        loads = _loads(b)
        blocks = [x for ld in loads for x in ld.block_ids]
        slots = [x for ld in loads for x in ld.slots]
        save_ids = [x for ld in loads for x in ld.save_ids]
        layout.runner.kv_caches = _fill(layout.kv_caches, 1)
        caches, failed = engine.load(layout.runner.kv_caches, blocks, slots, save_ids, None, b - 1)
        layout.runner.kv_caches = caches
        assert failed == set()
        with pytest.raises(AssertionError, match=r"kv_caches\[\d, [01]\]: rows \[12, 40, 41, 50\] differ"):
            _assert_bytes(_host(caches), expected)
    finally:
        conn.shutdown()


def test_the_scheduler_halfs_numbering_binds_on_the_workers_pools(layout, vllm_config):
    """Both halves built from one vLLM config: the scheduler half's pools are the worker's, and a
    plan in its numbering (the last state slot included) saves into the right pools. (Both count a
    KV chunk as the TPU arrays' block, head_dim padded to 128: 65536 bytes, not vLLM's 32768-byte
    count; tests/test_chunk_bytes_agree.py.)"""
    sched_half = TPUOffloadConnector(vllm_config, KVConnectorRole.SCHEDULER, copy.deepcopy(layout.kv_cache_config))
    conn = _worker(layout, vllm_config)
    try:
        kv, state = sched_half.scheduler.index.pool_sizes
        engine = conn.worker.engine
        assert (kv, state) == (engine.num_slots(0), engine.num_slots(1))
        meta = OffloadMetadata([StepPlan(step=0, num_slots=kv + state, state_slots=state, failures_by_request=True,
                                         save=SaveBatch((5, 5), (kv - 1, kv + state - 1), (1, 2)))])
        _, report, _ = _step(conn, meta)
        assert conn.worker.wait_idle(30)
        assert _ids(report, "saved") | _ids(conn.build_connector_worker_meta(), "saved") == {1, 2}
        assert [t.tag(s) for t, s in zip(engine.tables, (kv - 1, state - 1))] == [1, 2]
    finally:
        conn.shutdown()
        sched_half.shutdown()


# ------------------------------------------------------------------ failures
class StateRowFault(FaultInjector):
    """While armed, position ``position`` of pool 1's slot check fails (the second
    LOAD_SLOT_CHECK of a load: pool 0's check comes first)."""

    def __init__(self, position: int) -> None:
        self.position, self.armed, self.checks = position, False, 0

    def hit(self, point: FaultPoint, n: int) -> set[int]:
        if not self.armed or point is not FaultPoint.LOAD_SLOT_CHECK:
            return set()
        self.checks += 1
        return {self.position} if self.checks == 2 else set()


def test_wrong_state_save_id_fails_only_its_request(layout, vllm_config):
    conn = _worker(layout, vllm_config)
    try:
        b = conn.worker.engine.num_slots(0)
        saved_from = _host(layout.runner.kv_caches)
        _save_standard(conn)
        layout.runner.kv_caches = _fill(layout.kv_caches, 1)
        before = _host(layout.runner.kv_caches)
        results, _, _ = _step(conn, _plan(conn, 1, loads=_loads(b, wrong_state_id="a")))
        assert (results.finished_recving, results.failed_recving) == ({"a", "b"}, {"a"})
        assert conn.get_block_ids_with_load_errors() == set()  # several KV cache groups: by request only
        keys = _state_keys(layout.runner.kv_caches)
        # "a"'s state row loads zeros (its attention blocks still land); "b" lands whole.
        _assert_bytes(_host(layout.runner.kv_caches), _expected_after_load(before, saved_from, keys, frozenset({50})))
        stats = conn.get_kv_connector_stats().totals()
        assert (stats["chunks_loaded"], stats["load_errors"]) == (8, 1)
    finally:
        conn.shutdown()


def test_state_row_fault_fails_only_its_request_and_dispatches_as_a_clean_host(layout, vllm_config):
    """Invariant 2 across the pools: the faulty host issues the clean host's programs."""
    fault = StateRowFault(position=1)  # pool 1's rows: a's 50, b's 40, 41, 12
    clean = _worker(layout, vllm_config)
    faulty = TPUOffloadConnector(vllm_config, KVConnectorRole.WORKER, copy.deepcopy(layout.worker_kv_cache_config))
    faulty.worker = OffloadWorker(faulty.config, host_id=0, faults=fault,
                                  kv_cache_config=copy.deepcopy(layout.worker_kv_cache_config))
    runner = types.SimpleNamespace(kv_caches=_fill(layout.kv_caches, 0),
                                   layer_name_to_kvcache_index=dict(layout.layer_name_to_kvcache_index))
    faulty.register_runner(runner)
    try:
        b = clean.worker.engine.num_slots(0)
        saved_from = _host(runner.kv_caches)
        assert all(np.array_equal(v, saved_from[k]) for k, v in _host(layout.runner.kv_caches).items())
        for conn in (clean, faulty):
            _save_standard(conn)
        layout.runner.kv_caches, runner.kv_caches = _fill(layout.kv_caches, 1), _fill(layout.kv_caches, 1)
        before = _host(runner.kv_caches)
        fault.armed = True
        out = {name: _step(conn, _plan(conn, 1, loads=_loads(b))) for name, conn in (("clean", clean),
                                                                                      ("faulty", faulty))}
        assert fault.checks == 2
        assert out["faulty"][0].failed_recving == {"b"} and out["clean"][0].failed_recving == set()
        assert out["faulty"][0].finished_recving == out["clean"][0].finished_recving == {"a", "b"}
        assert out["faulty"][2].ops == out["clean"][2].ops and out["faulty"][2].digest == out["clean"][2].digest
        keys = _state_keys(runner.kv_caches)
        _assert_bytes(_host(runner.kv_caches), _expected_after_load(before, saved_from, keys, frozenset({40})))
        _assert_bytes(_host(layout.runner.kv_caches), _expected_after_load(before, saved_from, keys))
    finally:
        fault.armed = False
        clean.shutdown()
        faulty.shutdown()


# ------------------------------------------------------------------ refusals
def test_plans_whose_pools_disagree_are_refused(layout, vllm_config):
    conn = _worker(layout, vllm_config)
    try:
        engine = conn.worker.engine
        b, s = engine.num_slots(0), engine.num_slots(1)
        save = SaveBatch((5,), (0,), (1,))
        for plan, msg in ((StepPlan(step=0, num_slots=b, save=save), "scheduler plans no state slots"),
                          (StepPlan(step=0, num_slots=b + s + 1, state_slots=s + 1, save=save),
                           f"plans {s + 1} state slots but this host \\(host 0\\) has {s}"),
                          (StepPlan(step=0, num_slots=b + 1 + s, state_slots=s, save=save),
                           f"plans host slots up to {b + 1} but this host \\(host 0\\) has {b}")):
            with pytest.raises(ValueError, match=msg):
                conn.bind_connector_metadata(OffloadMetadata([plan]))
        # A plan without state slots is refused even with nothing to do: the plans' shape is checked
        # once, not at every step, so a later plan of the same shape would not be looked at again.
        with pytest.raises(ValueError, match="scheduler plans no state slots"):
            conn.bind_connector_metadata(OffloadMetadata([StepPlan(step=0, num_slots=b)]))
        conn.bind_connector_metadata(OffloadMetadata([StepPlan(step=0, num_slots=b + s, state_slots=s)]))
        conn.clear_connector_metadata()
        # A row outside its pool is refused whole, before anything is dispatched.
        for boundary_row, msg in (((65, b), "pool 1's block ids out of range 0..64"),
                                  ((5, b + s), f"pool 1's slots out of range 0..{s - 1}")):
            with pytest.raises(ValueError, match=msg):
                engine.save(layout.runner.kv_caches, (5, boundary_row[0]), (0, boundary_row[1]), (1, 2), b)
        with pytest.raises(ValueError, match="pool 1's block ids repeat within one load"):
            engine.load(layout.runner.kv_caches, (5, 5), (b, b + 1), (1, 2), None, b)
        assert not [op for op in engine.finish_step().ops if not op.startswith("step")]
    finally:
        conn.shutdown()


def test_state_slots_are_refused_without_state_layers():
    caches, mesh = create_caches(LAYOUTS["bf16-8kv-tp4"])
    worker = OffloadWorker(parse_config({"num_cpu_chunks": 16}), host_id=0)
    worker.register_runner(types.SimpleNamespace(kv_caches=_fill(caches, 0), mesh=mesh))
    try:
        with pytest.raises(ValueError, match="plans state slots .* but the runner's caches hold none"):
            worker.bind(OffloadMetadata([StepPlan(step=0, num_slots=20, state_slots=4)]))
    finally:
        worker.close()


# ------------------------------------------------------------------ one pool
def test_one_pool_dispatches_as_the_transfer_engine_alone():
    """One pool: the same programs, digest and bytes as a TransferEngine alone; failures come
    back as positions instead of block ids."""
    caches, _ = create_caches(LAYOUTS["bf16-8kv-tp4"])
    nbytes = 16 * CacheLayout.from_caches(caches).device_bytes_per_chunk
    blocks, dst, slots = [3, 9, 4], [30, 31, 32], [2, 0, 5]
    out = {}
    for kind in ("transfer", "pooled"):
        kv = _fill(caches, 0)
        if kind == "transfer":
            engine = TransferEngine(kv, nbytes)
            engine.save(kv, blocks, slots, [10, 11, 12])
            assert engine.wait_idle(30)
            kv, failed = engine.load(kv, dst, slots, [10, 99, 12])
        else:
            engine = PooledEngine(CachePools.of(kv), kv, (nbytes,))
            engine.save(kv, blocks, slots, [10, 11, 12], 16)
            assert engine.wait_idle(30)
            kv, failed = engine.load(kv, dst, slots, [10, 99, 12], None, 16)
        counts = {k: v for k, v in engine.take_counters().items() if not k.endswith("seconds")}
        out[kind] = (failed, engine.finish_step().ops, _host(kv), counts)
        engine.close()
    assert out["transfer"][0] == [31] and out["pooled"][0] == {1}
    assert out["transfer"][1] == out["pooled"][1]
    _assert_bytes(out["pooled"][2], out["transfer"][2])
    assert out["pooled"][3] == out["transfer"][3] and out["pooled"][3]["load_errors"] == 1
