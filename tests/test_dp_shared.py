"""The shared tier under tpu-inference's DPScheduler (issue 36): each DP rank's scheduler half plans its
own probes, fetches, installs, cancels and publishes; the workers keep a shared stage per rank
(worker/shared_stage.py), each acting on its rank's plan part in its rank's share of the host store.

A rank's chunk lives on the devices of its batch shard only, so its object holds those devices'
pieces, named by this host's place among the processes holding the shard and a namespace of the
rank's layout, not of the rank: every rank computes the same KV for the same tokens, so an object
one rank wrote is read by any rank with the same layout (docs/design.md, "The shared tier").

* the workers (one host holding both batch shards of DP 2 x TP 4): rank 1 publishes a chunk,
  rank 0 fetches it and loads it, byte-exact (rank 1's bytes in rank 0's block); negative
  control: objects written from batch shard 0's pieces whatever the rank (what one scheduler's
  stage did) -> rank 0 loads other bytes, silently;
* through tpu-inference's own DPScheduler (attention DP 4 x TP 2 over a 2-process pod slice):
  slice A fills the store; slice B serves the same prompts, each group rotated so that every rank
  gets a prompt another rank of A computed, and loads them from the store: every output right,
  every context position read exact on every host, identical dispatch digests, nothing leaked;
  one host's objects corrupt -> a miss on every host, recomputed, tokens right.
"""

from __future__ import annotations

import glob
import os
import shutil

import numpy as np
import pytest

from dp_helpers import dp_worker, serve_groups, rank_plan, run_step as _step
from tpuoffload import counters as C
from tpuoffload.backend.shared_store import HEADER_BYTES
from tpuoffload.messages import DiskBatch, LoadRequest, SaveBatch, SharedPlan, StepPlan, pack_keys

KEY = pack_keys(np.array([0x1234_5678], np.uint64), np.array([0x9ABC], np.uint64))


def _worker(tmp_path):
    """One host holding both batch shards of tpu-inference's DP 2 x TP 4 cache, random contents (each
    rank's local block 3 differs), the shared tier on a directory."""
    return dp_worker({"shared_url": f"file://{tmp_path}/shared?timeout_s=10"}, 37)


def _plan(rank: int, bpr: int, step: int, per_rank: int, shared: SharedPlan | None = None, **fields) -> StepPlan:
    return rank_plan(rank, bpr, step, per_rank, tiers={"shared": shared} if shared is not None else {}, **fields)


def _write_on_1_read_on_0(worker, per_rank: int, bpr: int) -> set[str]:
    """Rank 1 saves its local block 3 into slot 0 and publishes it under KEY; rank 0 fetches KEY into
    its slot 1, installs it once this host verified it, and loads slot 1 into its local block 9.
    Returns the requests whose load failed."""
    def shared(**f) -> SharedPlan:
        return SharedPlan("scope", 1, **f)

    _step(worker, [_plan(0, bpr, 0, per_rank), _plan(1, bpr, 0, per_rank, save=SaveBatch((3,), (0,), (0,)))])
    worker.build_report()
    _step(worker, [_plan(0, bpr, 1, per_rank),
                   _plan(1, bpr, 1, per_rank, shared(publish=DiskBatch((0,), (0,), keys=KEY)))])
    for stage in worker.tiers:
        assert stage.wait_idle(30)  # the background write
    _step(worker, [_plan(0, bpr, 2, per_rank, shared(fetch=DiskBatch((1,), (1,), keys=KEY))), _plan(1, bpr, 2, per_rank)])
    for stage in worker.tiers:
        assert stage.wait_idle(30)  # the background read
    report = worker.build_report()
    assert report.tier_parts("shared", 1000)[0].fetched == ((1, 2),), report  # rank 0's own part ...
    assert report.tier_parts("shared", 1001) == {}  # ... and none for rank 1
    _step(worker, [_plan(0, bpr, 3, per_rank, shared(install=(1,))), _plan(1, bpr, 3, per_rank)])
    _step(worker, [_plan(0, bpr, 4, per_rank), _plan(1, bpr, 4, per_rank)])
    assert (0, ((1, 2),), ()) in set(worker.build_report().outcomes(1000))  # the install confirmed
    return _step(worker, [_plan(0, bpr, 5, per_rank, loads=(LoadRequest("r0", (9,), (1,), (1,)),)),
                          _plan(1, bpr, 5, per_rank)])


def _rank0_has_rank1s_block(runner, original, bpr: int) -> bool:
    return all(np.array_equal(np.asarray(c)[9], o[bpr + 3]) for c, o in zip(runner.kv_caches, original))


def test_an_object_rank_1_wrote_is_loaded_by_rank_0_byte_exact(tmp_path):
    worker, runner, original, per_rank, bpr = _worker(tmp_path)
    stages = [t for t in worker.tiers if t.name == "shared"]
    assert [s.rank for s in stages] == [0, 1]
    assert [(s.part, s.parts) for s in stages] == [(0, 1), (0, 1)]  # each rank on this host's 4 devices
    assert stages[0].deployment == stages[1].deployment  # one namespace for both ranks
    assert not any(np.array_equal(o[3], o[bpr + 3]) for o in original)  # the ranks' blocks differ
    assert _write_on_1_read_on_0(worker, per_rank, bpr) == set()
    assert _rank0_has_rank1s_block(runner, original, bpr)
    objects = glob.glob(str(tmp_path / "shared" / "*" / "h0of1" / "*" / "*.kv"))
    assert len(objects) == 1, objects
    assert os.path.getsize(objects[0]) - HEADER_BYTES == worker.engine.engines[0].disk_chunk_bytes(1)  # rank 1's 4 devices
    counters = worker.take_stats().reduce()
    assert counters[C.SHARED_WRITTEN_CHUNKS] == 1 and counters[C.SHARED_READ_CHUNKS] == 1, counters
    worker.close()


def test_negative_control_objects_written_from_shard_0_whatever_the_rank_load_other_bytes(tmp_path, monkeypatch):
    """The one mechanism removed: the rank's shard when its slots' rows become an object's bytes (the
    stage reads batch shard 0's pieces, as one scheduler's stage did). Rank 1's object then holds
    shard 0's row of slot 0 (not rank 1's chunk), verifies, and rank 0 loads it, silently."""
    worker, runner, original, per_rank, bpr = _worker(tmp_path)
    engine = worker.engine.engines[0]
    to_payloads = engine.rows_to_payloads
    monkeypatch.setattr(engine, "rows_to_payloads", lambda rows, shard=0: to_payloads(rows, 0))
    assert _write_on_1_read_on_0(worker, per_rank, bpr) == set()  # nothing noticed ...
    assert not _rank0_has_rank1s_block(runner, original, bpr)  # ... and rank 0 got other bytes
    worker.close()


# ---------------------------------------------------------------------------- through DPScheduler
RANKS = 4


def _dp_spec(url: str):
    from tpuoffload.sim.podslice import SliceSpec

    config = {"num_cpu_chunks": 64, "shared_url": url, "save_timeout_s": 30.0, "load_wait_timeout_s": 10.0}
    return SliceSpec(num_hosts=2, devices_per_host=4, layout="bf16-attndp4-tp2", num_blocks=96, max_num_seqs=16,
                     max_num_batched_tokens=256, extra_config=config, step_timeout_s=60.0)


def _rank_totals(pod) -> list[dict]:
    from tpuoffload.snapshot import read_rank_snapshots

    snaps = read_rank_snapshots(pod.stats_dir)
    assert len(snaps) == RANKS, list(snaps)
    return [snap["totals"] for _, snap in sorted(snaps.items())]


def _clean_end(pod) -> None:
    """Every host: no wrong context position read, idle, nothing under way in any tier (worker
    idle_report); every rank half: nothing leaked; identical digests at every step."""
    from test_podslice import _assert_clean_end

    for state in _assert_clean_end(pod):
        busy = {k: v for k, v in state["idle_report"].items() if v}
        assert not busy, (state["host"], busy)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_dpscheduler_slices_share_prefixes_across_ranks_and_hosts(make_slice, tmp_path):
    """Attention DP 4 x TP 2 over 2 hosts x 4 devices (ranks 0-1 on host 0, 2-3 on host 1), through
    tpu-inference's own DPScheduler. Slice A serves groups of one 6-block prompt per rank and
    publishes them. Slice B (a copy of the store with every object's payload damaged by one bit)
    fetches nothing: the owning host fails each fetch, the host without the rank is overruled, a
    miss on every host, recomputed. Slice C (the intact store) gets each group rotated by one rank,
    so rank r loads what A's rank r-1 wrote (rank 1 what rank 0 wrote, on the same host; rank 2
    what rank 1 wrote, on the other host): every output right, every context position every host
    read exact, identical digests, nothing leaked."""
    store = tmp_path / "lustre-kv"
    rng = np.random.default_rng(37)
    prompts = [[rng.integers(3, 30000, 6 * 16 + 5).tolist() for _ in range(RANKS)] for _ in range(2)]

    a = make_slice(_dp_spec(f"file://{store}?timeout_s=30"))
    assert a.dp_ranks == RANKS and type(a.scheduler).__name__ == "DPScheduler"
    assert serve_groups(a, prompts, "a") == [list(range(RANKS))] * len(prompts)
    published = [t.get(C.SHARED_PUBLISH_ISSUED, 0) for t in _rank_totals(a)]
    assert all(p >= 6 * len(prompts) for p in published), published  # every rank published its own
    _clean_end(a)
    a.shutdown()  # the hosts finish their background writes
    objects = sorted(glob.glob(str(store / "*" / "*" / "*" / "*.kv")))
    # One namespace, every object a whole rank's chunk on one host ("h0of1"); one per chunk.
    assert {os.path.relpath(p, store).split(os.sep)[1] for p in objects} == {"h0of1"}, objects[:4]
    assert len({os.path.relpath(p, store).split(os.sep)[0] for p in objects}) == 1
    assert len(objects) == sum(published), (len(objects), published)

    damaged = tmp_path / "damaged"
    shutil.copytree(store, damaged)
    for path in glob.glob(str(damaged / "*" / "*" / "*" / "*.kv")):
        with open(path, "r+b") as f:  # one flipped bit in the payload
            f.seek(128 + 100)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 1]))
    b = make_slice(_dp_spec(f"file://{damaged}?timeout_s=30"))
    serve_groups(b, prompts, "b")
    for r, t in enumerate(_rank_totals(b)):
        assert t.get(C.SHARED_FETCHES_ISSUED, 0) > 0, (r, t)
        assert t.get(C.SHARED_FETCHES_FAILED, 0) == t[C.SHARED_FETCHES_ISSUED] and not t.get(C.SHARED_FETCHES_READY), (r, t)
    hb = b.stats.totals()
    assert hb[C.SHARED_MISS_CORRUPT] > 0 and hb[C.SHARED_READ_CHUNKS] == 0 and hb[C.CHUNKS_LOADED] == 0, hb
    _clean_end(b)
    b.close()

    c = make_slice(_dp_spec(f"file://{store}?timeout_s=30"))
    rotated = [group[-1:] + group[:-1] for group in prompts]  # rank r gets A's rank r-1's prompt
    assert serve_groups(c, rotated, "c") == [list(range(RANKS))] * len(prompts)
    totals = _rank_totals(c)
    for r, t in enumerate(totals):  # each rank fetched another rank's objects and loaded them
        assert t.get(C.SHARED_FETCHES_READY, 0) >= 6 * len(prompts) and not t.get(C.SHARED_FETCHES_FAILED), (r, t)
        assert t[C.HIT_TOKENS] >= 6 * 16 * len(prompts), (r, t)
        assert not t.get(C.SHARED_PUBLISH_ISSUED), (r, t)  # what came from the store is not sent back
    hc = c.stats.totals()
    assert hc[C.LOAD_ERRORS] == 0 and hc[C.SHARED_MISS_CORRUPT] == 0, hc
    # Each chunk read once, by the host holding the rank that fetched it.
    assert hc[C.SHARED_READ_CHUNKS] == sum(t[C.SHARED_FETCHES_READY] for t in totals), hc
    _clean_end(c)
    c.close()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_negative_control_slice_publishing_shard_0s_pieces_for_every_rank_is_caught(make_slice, tmp_path):
    """The one mechanism removed in slice A's workers: a rank's slot rows become an object's bytes
    from batch shard 0's devices whatever the rank (sim/broken.py ``shard0_payloads``). Slice C,
    intact, loads the rotated prompts from that store: the objects rank 1 wrote verify (they hold
    what was written) but are other bytes, and C's wrong-read audit finds the context positions
    read wrong, with the rest of the harness unchanged."""
    from tpuoffload.sim.chaos import Chaos

    store = tmp_path / "lustre-kv"
    rng = np.random.default_rng(37)
    prompts = [[rng.integers(3, 30000, 6 * 16 + 5).tolist() for _ in range(RANKS)]]
    a = make_slice(_dp_spec(f"file://{store}?timeout_s=30"), Chaos(broken="shard0_payloads"))
    serve_groups(a, prompts, "a")
    a.shutdown()
    c = make_slice(_dp_spec(f"file://{store}?timeout_s=30"))
    rotated = [group[-1:] + group[:-1] for group in prompts]
    from tpuoffload.sim.vllm_setup import make_request

    for i, prompt in enumerate(rotated[0]):
        c.add_request(make_request(f"c-{i}", prompt, max_tokens=2))
    c.run()
    assert c.settle(60.0)
    assert sum(t.get(C.SHARED_FETCHES_READY, 0) for t in _rank_totals(c)) > 0  # loaded from the store ...
    assert sum(s["mismatches"] for s in c.worker_state()) > 0  # ... and read wrong: the audit catches it
    c.close()


def test_write_all_ends_on_an_empty_buffer(tmp_path):
    """backend/files.py:write_all with an empty buffer among others (a header and no payload: what
    the negative control above writes on the host without shard 0's devices) writes the rest and
    returns; it looped forever on writev's 0 before."""
    from tpuoffload.backend.files import write_new_file

    path = str(tmp_path / "object")
    write_new_file(path, [b"head", b"", memoryview(b"tail")], fsync=False)
    with open(path, "rb") as f:
        assert f.read() == b"headtail"
