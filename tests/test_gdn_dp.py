"""Issue 36: GDN (Qwen3.5-like) hybrids under tpu-inference's DPScheduler.

tpu-inference 0.32's DPScheduler gives each rank ``mamba_num_blocks // dp`` rows of the compact
state pool (``_create_per_rank_configs``), installs its hybrid coordinator hooks in every rank
process (mamba cache mode "align"), and passes every group's block ids through rank-local; the
runner shards the state pool over ``ATTN_DATA`` like the attention blocks, so rank r's state row b
is the pool's row ``r * (M // dp) + b``. The scheduler half tells the workers its rank's row count
(``StepPlan.state_rows``) and the workers place its state rows and its share of the host state
store (``offload_worker._Placed``).

The pod-slice proof runs 2 JAX processes x 2 CPU devices (DP 2 x TP 2, the qwen3.5-like-dp2
layout built by tpu-inference's and vLLM's own code on every host) under tpu-inference's own
DPScheduler: the synthetic GDN runner reads every state row and every attention position a step
needs and checks it (a wrong row is a detected wrong read that poisons the request's tokens), the
harness compares every host's dispatch digest at every step.
"""

from __future__ import annotations

import numpy as np
import pytest

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
def test_gdn_hybrid_under_dpscheduler_hits_on_both_ranks_and_across_them(make_slice):
    """Both ranks save state rows and KV at exact block boundaries and serve second-wave prefixes
    from host RAM, also another rank's (cross-rank loads of state chunks and KV chunks); every state
    row and attention position read is exact on every host, tokens are right, every host
    dispatched the same programs at every step, nothing leaks."""
    from test_podslice import _assert_clean_end

    pod = make_slice(_spec())
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
