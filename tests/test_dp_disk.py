"""The disk tier under tpu-inference's DPScheduler (issue 36): each DP rank's scheduler half plans its
own spills and fetches (its own disk index, disk ids from 0), and each rank's files are its own.

A rank's chunk lives on the devices of its batch shard only (backend/slot_table.py), so on a host
its file holds those devices' pieces and a fetch writes them back into that shard's store rows.
What these tests prove, on tpu-inference's own DP cache layout:

* the workers (one host holding both batch shards of DP 2 x TP 4): two ranks spill chunks of the
  same hash under the same disk id in the same step and fetch them back, each its own bytes; two
  negative controls remove one mechanism each: ranks sharing one file namespace (the second
  rank's spill of the hash is taken as written, its fetch serves the first rank's bytes), and
  installs not routed to the rank's batch shard (a fetch overwrites the other rank's slot row);
* through tpu-inference's own DPScheduler (its forked rank processes, a 2-process pod slice):
  host RAM too small for the workload, prefixes spilled to each rank's disk and fetched back by
  that rank, byte-exact on every host, identical dispatch digests, per-rank files within the
  budget, nothing leaked.
"""

from __future__ import annotations

import dataclasses
import glob
import os

import numpy as np
import pytest

from dp_helpers import dp_worker, serve_groups, rank_plan as _plan, run_step as _step
from tpuoffload import counters as C
from tpuoffload.backend.disk_tier import NoChunkFiles
from tpuoffload.messages import DiskBatch, DiskPlan, LoadRequest, SaveBatch, pack_keys
from tpuoffload.manager.disk_index import DiskIndex

KEY = pack_keys(np.array([0x1234_5678], np.uint64), np.array([0x9ABC], np.uint64))  # one hash, both ranks
DISK_BYTES = 1 << 24


def _worker(tmp_path, layout: str = "bf16-dp2-tp4"):
    """One host holding both batch shards of tpu-inference's DP 2 x TP 4 cache (or ``layout``), random
    contents, the disk tier on."""
    return dp_worker({"disk_path": str(tmp_path / "disk-{host}"), "disk_bytes_to_use": DISK_BYTES}, 36, layout)


def _spill_and_fetch(worker, per_rank: int, bpr: int) -> tuple[dict, set[str]]:
    """Both ranks, in the same steps and with the same local numbers: save local block 3 into slot
    0, spill it to disk as disk id 0 under one hash, fetch it into slot 1, load slot 1 into local
    block 9. Returns each rank's disk report and the requests whose load failed."""
    both = range(2)
    _step(worker, [_plan(r, bpr, 0, per_rank, save=SaveBatch((3,), (0,), (0,))) for r in both])
    worker.build_report()
    spill = DiskBatch((0,), (0,), (0,), KEY)
    _step(worker, [_plan(r, bpr, 1, per_rank, tiers={"disk": DiskPlan(spill=spill)}) for r in both])
    report = worker.build_report()
    disk = {r: report.tier_parts("disk", 1000 + r) for r in both}
    fetch = DiskBatch((1,), (1,), (0,), KEY)
    _step(worker, [_plan(r, bpr, 2, per_rank, tiers={"disk": DiskPlan(fetch=fetch)}) for r in both])
    _step(worker, [_plan(r, bpr, 3, per_rank) for r in both])  # the fetches are installed
    assert {s for r in both for s in worker.build_report().outcomes(1000 + r)} == {(0, ((1, 2),), ())}
    failed = _step(worker, [_plan(r, bpr, 4, per_rank, loads=(LoadRequest(f"r{r}", (9,), (1,), (1,)),))
                            for r in both])
    return disk, failed


def _rank_blocks(runner, original, bpr: int) -> list[bool]:
    """Whether each rank's local block 9 holds its own local block 3's bytes, in every layer."""
    return [all(np.array_equal(np.asarray(c)[r * bpr + 9], o[r * bpr + 3]) for c, o in zip(runner.kv_caches, original))
            for r in range(2)]


def test_each_rank_spills_and_fetches_its_own_bytes(tmp_path):
    worker, runner, original, per_rank, bpr = _worker(tmp_path)
    stages = [t for t in worker.tiers if t.name == "disk"]
    assert [s.rank for s in stages] == [0, 1]
    files = DiskIndex.capacity(DISK_BYTES, worker.engine.tables[0].slot_bytes, 2)
    # Each rank's chunk on this host is the pieces of its 4 devices: half the host's bytes.
    assert [s.tier.capacity_chunks for s in stages] == [files, files]
    assert 2 * files * (4096 + stages[0].tier.slot_bytes) <= DISK_BYTES
    disk, failed = _spill_and_fetch(worker, per_rank, bpr)
    assert disk == {r: {0: dataclasses.replace(disk[r][0], saved=((0, 1),))} for r in range(2)}, disk
    assert failed == set()
    assert _rank_blocks(runner, original, bpr) == [True, True]
    names = {r: [os.path.basename(p) for p in glob.glob(str(tmp_path / "disk-0" / f"rank-{r}" / "*.kv"))]
             for r in range(2)}
    assert len(names[0]) == 1 and names[0] == names[1], names  # one hash: a file of that name per rank
    counters = worker.take_stats().reduce()
    assert counters[C.DISK_WRITTEN_CHUNKS] == 2 and counters[C.DISK_READ_CHUNKS] == 2, counters
    worker.close()


def test_negative_control_ranks_sharing_one_file_namespace_serve_the_wrong_bytes(tmp_path):
    """The two ranks' stages on one set of files: the spill written second, of the same hash under
    the same disk id, is taken as written (the file is the other rank's), and its rank's fetch
    installs the other rank's bytes. Which rank's spill writes the file first is up to the two
    stages' threads."""
    worker, runner, original, per_rank, bpr = _worker(tmp_path)
    stages = [t for t in worker.tiers if t.name == "disk"]
    stages[1].tier.close()
    stages[1].tiers = (stages[0].tier,)
    _, failed = _spill_and_fetch(worker, per_rank, bpr)
    assert failed == set()  # nothing noticed ...
    own = _rank_blocks(runner, original, bpr)
    assert sorted(own) == [False, True], own  # ... and one rank got the other's bytes
    wrong, right = own.index(False), own.index(True)
    assert all(np.array_equal(np.asarray(c)[wrong * bpr + 9], o[right * bpr + 3])
               for c, o in zip(runner.kv_caches, original))
    stages[1].tiers = (NoChunkFiles(str(tmp_path)),)  # the shared files are closed once, by stage 0
    worker.close()


def test_negative_control_installs_not_routed_to_the_ranks_shard_overwrite_another_rank(tmp_path, monkeypatch):
    """Installs written as blocks of shard 0 (what one scheduler's disk tier did): rank 1's fetch,
    installed after rank 0's in the same step, is written into shard 0's store row of the same
    local slot (its rows for shard 0's devices: none of its bytes, zeros), over rank 0's fetched
    chunk, whose record still says it is there: rank 0 loads zeros, silently."""
    worker, runner, original, per_rank, bpr = _worker(tmp_path)
    monkeypatch.setattr(worker.engine.engines[0], "_shard_block", lambda shard: 0)
    _, failed = _spill_and_fetch(worker, per_rank, bpr)
    assert _rank_blocks(runner, original, bpr) == [False, False]
    assert all(not np.asarray(c)[9].any() for c in runner.kv_caches), "rank 0's row was overwritten"
    assert failed == {"r1"}  # rank 1's slot record names shard 0: only its own load is refused
    worker.close()


def test_a_start_with_another_dp_size_deletes_the_files_of_the_ranks_it_does_not_have(tmp_path):
    """Chunk files are never reused across a change of the DP size (another size splits a chunk's
    bytes over other devices): DP 2 leaves a file per rank; a start without DP (TP 4), then one with
    attention DP 4, each delete what the other layout left, and nothing outside their own ranks'
    directories stays behind. Negative control: without ``clear_other_ranks`` the DP 2 files outlive
    the TP 4 start, outside its budget."""
    import tpuoffload.worker.offload_worker as offload_worker

    def kv_files() -> dict[str, int]:
        return {os.path.relpath(d, tmp_path / "disk-0"): len(glob.glob(os.path.join(d, "*.kv")))
                for d in [str(tmp_path / "disk-0")] + glob.glob(str(tmp_path / "disk-0" / "rank-*"))}

    worker, runner, original, per_rank, bpr = _worker(tmp_path)
    _spill_and_fetch(worker, per_rank, bpr)
    worker.close()
    assert kv_files() == {".": 0, "rank-0": 1, "rank-1": 1}
    for layout, left in (("bf16-8kv-tp4", {".": 0, "rank-0": 0, "rank-1": 0}),
                         ("bf16-attndp4-tp2", {".": 0, "rank-0": 0, "rank-1": 0, "rank-2": 0, "rank-3": 0})):
        worker = _worker(tmp_path, layout)[0]
        assert [t.rank for t in worker.tiers] == list(range(worker.engine.tables[0].shards))
        assert kv_files() == left, layout
        worker.close()
    # Negative control: the DP 2 files again, then a TP 4 start that clears nothing.
    worker, runner, original, per_rank, bpr = _worker(tmp_path)
    _spill_and_fetch(worker, per_rank, bpr)
    worker.close()
    original_clear = offload_worker.clear_other_ranks
    offload_worker.clear_other_ranks = lambda path, ranks: 0
    try:
        worker = _worker(tmp_path, "bf16-8kv-tp4")[0]
    finally:
        offload_worker.clear_other_ranks = original_clear
    assert kv_files()["rank-0"] == kv_files()["rank-1"] == 1  # left behind, outside the TP 4 tier's budget
    worker.close()


# ---------------------------------------------------------------------------- through DPScheduler
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dpscheduler_ranks_spill_to_their_own_disk_and_fetch_back_byte_exact(make_slice, tmp_path):
    """Attention DP 4 x TP 2 over 2 hosts x 4 devices, through tpu-inference's own DPScheduler: host
    RAM of 10 slots per rank, groups of one 6-block prompt per rank. The first pass spills each
    rank's oldest prefixes to that rank's own disk; after vLLM's prefix cache forgets, the same
    groups go to the same ranks, and each rank fetches its spilled chunks back and loads them:
    every output right, every context position read exact on every host, identical dispatch
    digests, every rank's files in its own directory on the host holding its batch shard and
    within the budget, nothing leaked on any rank."""
    from test_podslice import _assert_clean_end
    from tpuoffload.sim.podslice import SliceSpec
    from tpuoffload.snapshot import read_rank_snapshots

    # A chunk's bytes on one host of this layout: 4 devices (2 batch shards x TP 2), each keeping
    # half the heads of its shard's block, so twice vLLM's 128 KiB page; a rank's file holds its 2
    # devices' halves (the files' size below checks both).
    ranks, chunk = 4, 262144
    files = 24
    config = {"num_cpu_chunks": 10 + 16, "disk_path": str(tmp_path / "disk-{host}"),
              "disk_bytes_to_use": files * (ranks * 4096 + chunk), "save_timeout_s": 30.0, "load_wait_timeout_s": 5.0}
    spec = SliceSpec(num_hosts=2, devices_per_host=4, layout="bf16-attndp4-tp2", num_blocks=96, max_num_seqs=16,
                     max_num_batched_tokens=256, extra_config=config, step_timeout_s=60.0)
    pod = make_slice(spec)
    assert pod.dp_ranks == ranks and type(pod.scheduler).__name__ == "DPScheduler"
    rng = np.random.default_rng(36)
    prompts = [[rng.integers(3, 30000, 6 * 16 + 5).tolist() for _ in range(ranks)] for _ in range(4)]

    def rank_totals() -> list[dict]:
        return [snap["totals"] for snap in read_rank_snapshots(pod.stats_dir).values()]

    first = serve_groups(pod, prompts, "a")
    assert first == [list(range(ranks))] * len(prompts), first
    spilled = [t.get(C.SPILLS_CONFIRMED, 0) for t in rank_totals()]
    assert all(s > 0 for s in spilled), spilled  # 24 chunks per rank into 10 slots
    assert pod.scheduler.reset_prefix_cache()  # HBM forgets; host RAM and every rank's disk remain
    assert serve_groups(pod, prompts, "b") == first  # the same ranks (DPScheduler: by load)
    totals = rank_totals()
    for r, t in enumerate(totals):  # each rank fetched its own spilled chunks back and loaded them
        assert t.get(C.FETCHES_ISSUED, 0) > 0 and t.get(C.FETCHES_FAILED, 0) == 0, (r, t)
        assert t[C.HIT_TOKENS] >= 6 * 16 * len(prompts), (r, t)  # every prefix whole, RAM and disk
    host = pod.stats.totals()
    assert host[C.LOAD_ERRORS] == 0 and host[C.DISK_READ_FAILED] == 0 and host[C.DISK_WRITE_FAILED] == 0, host
    # Each rank's chunks on the host holding its batch shard, in the rank's own directory.
    dirs = {h: sorted(os.listdir(tmp_path / f"disk-{h}")) for h in range(2)}
    assert dirs == {0: ["rank-0", "rank-1"], 1: ["rank-2", "rank-3"]}, dirs
    capacity = DiskIndex.capacity(config["disk_bytes_to_use"], chunk, ranks)
    assert capacity == files
    for h, names in dirs.items():
        for name in names:
            kv = glob.glob(str(tmp_path / f"disk-{h}" / name / "*.kv"))
            assert 0 < len(kv) <= capacity, (h, name, len(kv))
            assert all(os.path.getsize(p) == 4096 + chunk // 2 for p in kv)  # the shard's 2 devices' pieces
    assert host[C.DISK_WRITTEN_CHUNKS] == sum(t[C.SPILLS_CONFIRMED] for t in totals)  # one host per shard
    assert host[C.DISK_READ_CHUNKS] == sum(t[C.FETCHES_ISSUED] for t in totals)
    _assert_clean_end(pod)
