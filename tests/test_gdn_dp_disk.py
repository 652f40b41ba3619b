"""Issue 36: the disk tier for a GDN (Qwen3.5-like) hybrid under tpu-inference's DPScheduler.

Each DP rank's disk stage keeps both slot pools' chunks of its rank: its KV chunks and its state
chunks (one row of every GDN state array) in its own files (``rank-<r>`` and ``rank-<r>/state``),
each file holding the pieces of the rank's batch shard. The state store splits over the batch
shards as the KV store does (tpu-inference shards the compact state pool along axis 0 like the
attention blocks, and DPScheduler gives each rank ``mamba_num_blocks // dp`` rows), so a rank's
state slot is placed by the rank's share of the state store (``Placement.state_offset``, from
``offload_worker._Placed``) exactly as saves and loads place it.

The worker here is one host holding both batch shards of tpu-inference's DP 2 x TP 2 qwen3.5-like
cache (sim/gdn_layout.py: tpu-inference's and vLLM's own code), driven by the two ranks' plans as
DPScheduler's merge hands them over (``test_gdn_dp._dp_plan``): both ranks use the same local
slots, blocks, state rows, save ids, disk ids and hashes, so any chunk placed in the wrong rank's
share or file is caught. Host RAM is overwritten before the fetch (what an eviction does), so the
disk is what serves; the loads include a cross-rank hit on the other rank's fetched chunks (through
host RAM: only the owning rank fetches, docs/design.md "The disk tier per rank"). The scheduler
half's per-rank file counts agree with the stages' (tests/test_chunk_bytes_agree.py).
"""

from __future__ import annotations

import collections
import copy
import functools
import os
import types

import numpy as np
import pytest

from test_gdn_dp import UNIT_EXTRA, _dp_plan
from test_state_pool_worker import _fill, _host, _state_keys, _step
from tpuoffload.backend.disk_tier import HEADER_BYTES
from tpuoffload.messages import (RANK_SAVE_ID_SHIFT, DiskBatch, DiskPlan, DiskReport, LoadRequest, OffloadMetadata,
                                 SaveBatch, pack_keys)

# Two hashes (a KV chunk's and a state chunk's), the same for both ranks.
KEYS = pack_keys(np.array([0x1111, 0x2222], np.uint64), np.array([0x3333, 0x4444], np.uint64))
DISK_BYTES = 8 << 20


@pytest.fixture(scope="module")
def dp_layout():
    from tpuoffload.sim import gdn_layout as gl

    return gl.build(gl.QWEN35_LIKE_DP2)


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
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from tpuoffload.connector import TPUOffloadConnector
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
        for r in both:  # the spilled chunks are gone from host RAM
            held = [tables[p].lookup(np.array([r * tables[p].shard_slots + s]), [i + (r << RANK_SAVE_ID_SHIFT)])[0]
                    for p, s, i in ((0, 2, 10), (1, 1, 11))]
            assert not any(bool(h[0]) for h in held), (r, held)
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
        # Engine numbering (tpu-inference's runner): rank r's block b is r * blocks + b, its state
        # row b is r * rows + b.
        kv_moves = {r * blocks + 30: r * blocks + 9 for r in both} | {31: blocks + 9}
        state_moves = {r * rows + 7: r * rows + 5 for r in both} | {12: rows + 5}
        wrong = {}
        for key, arr in before.items():
            want = arr.copy()
            for dst, src in (state_moves if key in state_keys else kv_moves).items():
                want[dst] = original[key][src]
            bad = np.flatnonzero([not np.array_equal(a, e) for a, e in zip(after[key], want)])
            if len(bad):
                wrong[key] = bad.tolist()
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


def test_negative_control_state_slots_not_placed_by_rank(dp_layout, tmp_path, monkeypatch):
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
