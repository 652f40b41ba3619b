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
harness compares every host's dispatch digest at every step.
"""

from __future__ import annotations

import collections
import functools
import json
import os
import types

import numpy as np
import pytest

from tpuoffload.backend.disk_tier import HEADER_BYTES
from tpuoffload.messages import DiskReport, pack_keys
from tpuoffload.sim.podslice import SliceSpec
from tpuoffload.snapshot import read_rank_snapshots
from tpuoffload.sim.workload import PrefixRepetition, run_prefix_repetition

# 8 prefixes of 6 blocks, each asked twice in each of 2 waves: second-wave requests find their
# prefix only in host RAM (vLLM's prefix cache is reset between waves), on either rank.
WORKLOAD = PrefixRepetition(num_prefixes=8, prefix_blocks=6, suffix_len=(8, 16), output_len=(4, 8),
                            num_requests=16, waves=2, arrivals_per_step=4, seed=3)
# Per host, as both halves size them (tests/test_chunk_bytes_agree.py): a KV chunk 32 KiB, a state
# chunk 210 KiB; 10 MiB of host RAM, 40% KV rows (128 per device: 112 slots per rank), 60% state rows
# (29 per device: 13 state slots per rank, past the 16 spare rows a batch-split store keeps).
CONFIG = {"cpu_bytes_to_use": 10 << 20, "state_ram_fraction": 0.6, "save_timeout_s": 30.0,
          "load_wait_timeout_s": 5.0}


def _spec(**extra) -> SliceSpec:
    return SliceSpec(num_hosts=2, devices_per_host=2, gdn="qwen3.5-like-dp2", max_num_seqs=4,
                     max_num_batched_tokens=256, extra_config={**CONFIG, **extra}, step_timeout_s=240.0,
                     start_timeout_s=400.0)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("lazy", [pytest.param(False, id="eager"), pytest.param(True, id="lazy")])
def test_gdn_hybrid_under_dpscheduler_hits_on_both_ranks_and_across_them(make_slice, lazy):
    """Both ranks save state rows and KV at exact block boundaries and serve second-wave prefixes
    from host RAM, also another rank's (cross-rank loads of state chunks and KV chunks); every state
    row and attention position read is exact on every host, tokens are right, every host
    dispatched the same programs at every step, nothing leaks."""
    from test_podslice import _assert_clean_end

    pod = make_slice(_spec(lazy_offload=lazy))
    assert type(pod.scheduler).__name__ == "DPScheduler" and pod.dp_ranks == 2
    rank_cfgs = pod.scheduler.per_rank_kv_cache_configs
    assert [c.mamba_num_blocks for c in rank_cfgs] == [pod.gdn.mamba_num_blocks // 2] * 2  # DPScheduler's split
    res = run_prefix_repetition(pod, WORKLOAD)
    assert res.finished == res.requests and res.wrong_outputs == [], res
    assert pod.mismatches == [0, 0], pod.mismatches
    hosts = pod.worker_state()
    for h in hosts:
        assert h["states_verified"] > 0 and h["state_mismatches"] == 0 and h["mismatches"] == 0, h
    pools = [h["pool_totals"] for h in hosts]
    for kv, state in pools:
        # Every host loaded state rows and KV blocks; some of each came from the other rank.
        assert kv.get("chunks_loaded", 0) > 0 and state.get("chunks_loaded", 0) > 0, pools
        assert kv.get("cross_rank_chunks_loaded", 0) > 0 and state.get("cross_rank_chunks_loaded", 0) > 0, pools
        assert state.get("load_errors", 0) == 0, pools
    assert res.per_wave_loaded[1] > 0, res
    # Both ranks served hits from host RAM (each rank's half counts its own, in its snapshot).
    ranks = read_rank_snapshots(pod.stats_dir)
    assert sorted(ranks) == ["scheduler-dp0.json", "scheduler-dp1.json"], list(ranks)
    assert all(snap["totals"].get("hit_tokens", 0) > 0 for snap in ranks.values()), \
        {name: snap["totals"] for name, snap in ranks.items()}
    _assert_clean_end(pod)  # also: identical digests on every host at every step
    print(f"GDN under DPScheduler: {res}; pool counters per host {pools}")


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
