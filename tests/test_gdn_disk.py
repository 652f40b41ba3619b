"""Issue 36: the disk tier for a GDN (Qwen3.5-like) hybrid: KV chunks and state chunks spill to disk
and come back, each into its own slot pool.

Host RAM holds 6 KV chunks and 1 state chunk; two prefixes (5 and 3 blocks, each with the state
saved at its last block) run one request at a time, twice, vLLM's prefix cache reset and every
array wiped between the waves. So the first wave's chunks (KV and state) are evicted to disk, and
the second wave's prefixes can only be served whole by fetching them back: the state chunk into
the state pool, with the state chunk's size. What runs is installed code wherever it decides
something (tpu-inference 0.32's arrays and compact state pool, vLLM's real Scheduler with
tpu-inference's hybrid coordinator); the model is the synthetic ``GdnRunner``, which checks every
state row and attention position a request reads.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import random


from tpuoffload import counters as C
from tpuoffload.backend.disk_tier import HEADER_BYTES
from tpuoffload.manager.disk_index import DiskIndex
from tpuoffload.sim import gdn_layout as gl
from tpuoffload.sim.engine import EngineSpec, InProcessEngine

from test_gdn_offload import _check_clean, _loads, _tokens, _wipe

SPEC = dataclasses.replace(gl.QWEN35_LIKE, max_num_seqs=2, max_num_batched_tokens=256)
BS = SPEC.block_size
PREFIX_BLOCKS = (5, 3)
# 13 KV chunks of host RAM, 48% of it for state chunks: 6 KV slots and 1 state slot. In chunks, not
# bytes: each simulated host of the in-process engine holds a copy of the whole mesh (sim/engine.py),
# so it stores num_hosts times the per-host chunk of the slice the scheduler plans for (64 and 32
# KiB per KV chunk with two hosts); on a real slice both halves count alike
# (tests/test_chunk_bytes_agree.py, tests/test_gdn_dp.py). The disk: ample for both pools.
EXTRA = {"num_cpu_chunks": 13, "state_ram_fraction": 0.48, "disk_bytes_to_use": 8 << 20}


def _run(tmp_path, hosts: int):
    """Two waves over the prefixes, one request at a time. Returns (engine, prefixes, each host's
    dispatch digests, the pools of every chunk spilled and fetched)."""
    extra = dict(EXTRA, disk_path=str(tmp_path / "disk-{host}"))
    eng = InProcessEngine(EngineSpec(num_hosts=hosts, gdn=SPEC, extra_config=extra))
    for conn in eng.connectors:
        conn.worker.digests = collections.deque()  # every step's, not only the last 64
    moved = collections.Counter()
    tier = eng.offload.tier("disk")
    finish = tier.finish_step

    def count(step):
        part = finish(step)
        if part is not None:
            for kind in ("spill", "fetch"):
                moved.update((kind, p) for p in getattr(part, kind).pool_of().tolist())
        return part

    tier.finish_step = count
    loads = _loads(eng)
    rng = random.Random(3)
    prefixes = [_tokens(rng, n * BS) for n in PREFIX_BLOCKS]
    for w in range(2):
        if w:
            assert eng.scheduler.reset_prefix_cache()
            _wipe(eng)
        for i, p in enumerate(prefixes):
            eng.add_request(gl.make_request(eng.gdn_layout, f"{w}{i}", p + _tokens(rng, (7, 11)[w]), max_tokens=1))
            eng.run()
            eng.settle()
    digests = [[d.digest for d in conn.worker.digests] for conn in eng.connectors]
    return eng, prefixes, digests, moved, loads


def test_kv_and_state_chunks_come_back_from_disk_into_their_own_pools_byte_exact(tmp_path):
    eng, prefixes, digests, moved, loads = _run(tmp_path, hosts=2)
    try:
        off = eng.offload
        assert off.index.pool_sizes == (6, 1), off.index.pool_sizes
        disk = off.tier("disk").disk
        # Each pool its share of the disk, both halves alike (OffloadConfig.disk_pool_bytes).
        budgets = off.config.disk_pool_bytes(2)
        want = tuple(DiskIndex.capacity(b, c) for b, c in zip(budgets, off.saves.pool_chunk_bytes))
        assert disk.index.pool_sizes == want, (disk.index.pool_sizes, want)
        t = eng.stats.reduce()
        # Both pools went to disk and came back.
        assert moved[("spill", 0)] and moved[("spill", 1)] and moved[("fetch", 0)] and moved[("fetch", 1)], moved
        assert t.get(C.FETCHES_FAILED, 0) == 0 and t.get(C.SKIPPED_NO_SPACE, 0) == 0, t
        # Every second-wave prefix was served whole, attention blocks and the state at its end.
        assert t[C.HIT_TOKENS] == sum(len(p) for p in prefixes), t
        second = [(h, ld, pools) for h, ld, pools in loads if ld.req_id.startswith("1")]
        assert len(second) == 2 * len(prefixes)
        for _, load, pools in second:
            n = PREFIX_BLOCKS[int(load.req_id[1])]
            assert sorted(pools.tolist()) == [0] * n + [1], (load.req_id, pools)
        # The runner read every state row and attention position back exact, on every host.
        for r in eng.runners:
            assert r.stats.states_verified > 0 and r.stats.positions_verified > 0
        _check_clean(eng)
        # Every host dispatched the same programs at every step.
        assert len(digests[0]) >= eng.steps and all(d == digests[0] for d in digests[1:])
        # The files: each pool's in its own directory, with its own chunk's size; nothing over budget.
        for host, conn in enumerate(eng.connectors):
            stage = conn.worker.tier("disk")
            kv_dir, state_dir = (t.path for t in stage.tiers)
            assert state_dir == os.path.join(str(tmp_path / f"disk-{host}"), "state") and kv_dir != state_dir
            for tier, engine in zip(stage.tiers, conn.worker.engine.engines):
                files = [e for e in os.scandir(tier.path) if e.name.endswith(".kv")]
                assert files and {f.stat().st_size for f in files} == {HEADER_BYTES + engine.disk_chunk_bytes()}
                assert len(files) <= tier.capacity_chunks
                assert tier.counters_snapshot().get("disk_read_chunks", 0) > 0
    finally:
        eng.close()


def test_negative_control_chunk_files_without_their_pool_do_not_serve_the_state(tmp_path, monkeypatch):
    """The check above can fail: with the pool left out of the disk plan (every chunk file taken
    for a KV chunk: ``DiskBatch.pools`` empty), the state chunks never reach their own files, and
    the second wave's prefixes are not served whole (or are read wrong)."""
    monkeypatch.setattr(DiskIndex, "_pools_bytes", lambda self, pools: b"")
    eng, prefixes, _, _, _ = _run(tmp_path, hosts=1)
    try:
        t = eng.stats.reduce()
        st = eng.runners[0].stats
        print("negative control:", {k: t.get(k, 0) for k in (C.HIT_TOKENS, C.SPILLS_CONFIRMED, C.SPILLS_DROPPED,
                                                              C.FETCHES_ISSUED, C.FETCHES_FAILED)},
              "state mismatches", st.state_mismatches)
        assert t.get(C.HIT_TOKENS, 0) < sum(len(p) for p in prefixes) or st.state_mismatches > 0, (t, st)
    finally:
        eng.close()


# ---------------------------------------------------------------- a restart's kept files, per pool
def _rows(entries):
    """DISK_ROW rows of (disk id, k1, pool); k2 = k1 + 1."""
    import numpy as np

    from tpuoffload.messages import DISK_ROW

    out = np.zeros(len(entries), DISK_ROW)
    for i, (d, k1, pool) in enumerate(entries):
        out[i] = (d, k1, k1 + 1, pool)
    return out


def test_kept_files_are_adopted_into_their_own_pool_and_the_rest_dropped_with_their_pool():
    """``DiskIndex.adopt`` with two pools: a file every host kept in the same pool becomes READY in
    that pool's entries (the most recently used that fit); one kept in different pools, or by one
    host only, is deleted everywhere, from the directory of the pool it was found in."""
    import numpy as np

    from tpuoffload.manager.hash_table import HashKeys

    disk = DiskIndex((3, 1), 2, collections.Counter(), lambda: 0.0, 30.0)
    host0 = _rows([(0, 10, 0), (1, 12, 0), (2, 14, 1), (3, 16, 1), (4, 18, 0), (5, 20, 1)])
    host1 = _rows([(0, 10, 0), (1, 12, 1), (2, 14, 1), (3, 16, 1), (4, 18, 0), (5, 20, 1)])
    adopted, dropped = disk.adopt([host0, host1])
    # Common: 10 (pool 0), 14, 16, 20 (pool 1), 18 (pool 0); 12 differs in pool: deleted on both
    # hosts, each copy from its own directory. Pool 1 has one entry: the most recent (20) fits,
    # 14 and 16 are deleted from the state directories.
    slots = disk.index.ready_slots(HashKeys(np.array([10, 18, 14, 16, 20], np.uint64),
                                            np.array([11, 19, 15, 17, 21], np.uint64)))
    assert (slots[:2] >= 0).all() and (disk.index.pool_of(slots[:2]) == 0).all()
    assert slots[2] < 0 and slots[3] < 0 and slots[4] >= 0 and disk.index.pool_of(slots[4:]).tolist() == [1]
    assert adopted == 3
    drops = disk.take_drops()
    named = sorted(zip(drops.pool_of().tolist(), np.frombuffer(drops.keys, "<u8")[::2].tolist()))
    assert named == [(0, 12), (1, 12), (1, 14), (1, 16)], named
    assert dropped == 4


def test_a_stage_reports_each_kept_file_with_the_pool_of_its_directory(tmp_path):
    """Worker side of a restart: files kept in the state directory are reported as pool 1's, those
    in the rank's directory as pool 0's; a start without a state pool deletes the state files."""
    import numpy as np

    from tpuoffload.backend.disk_tier import ChunkKey, DiskTier, file_bytes_for
    from tpuoffload.messages import DISK_ROW
    from tpuoffload.worker.disk_stage import DiskStage, pool_path

    class Engine:  # test-only: what DiskStage asks of a pool's TransferEngine at start-up
        def __init__(self, width):
            self.width = width
            self.slot_table = type("Table", (), {"shards": 1})()

        def disk_chunk_bytes(self, shard=0):
            return self.width

    path = str(tmp_path / "disk")
    for pool, width, k1 in ((0, 64, 40), (1, 96, 50)):
        with DiskTier(pool_path(path, pool), 4 * file_bytes_for(width), width, deployment="d") as tier:
            key = ChunkKey(7, np.array([k1, k1 + 1], "<u8").tobytes())
            assert tier.write(key, np.full(width, pool + 1, np.uint8)).future.result().ok
    stage = DiskStage([Engine(64), Engine(96)], path, [4, 4], 1.0, deployment="d")
    rows = np.frombuffer(stage.kept_rows(), DISK_ROW)
    assert sorted(zip(rows["pool"].tolist(), rows["k1"].tolist())) == [(0, 40), (1, 50)]
    read = stage.tiers[1].read(ChunkKey(7, np.array([50, 51], "<u8").tobytes())).result()
    assert read.ok and read.data.tolist() == [2] * 96
    stage.close()
    one = DiskStage([Engine(64)], path, [4], 1.0, deployment="d")
    assert [k1 for k1 in np.frombuffer(one.kept_rows(), DISK_ROW)["k1"].tolist()] == [40]
    assert not [e for e in os.scandir(pool_path(path, 1)) if e.name.endswith(".kv")]
    one.close()
