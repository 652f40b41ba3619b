"""Issue 21, stage 5 (part): a 2-host pod slice (2 JAX processes x 2 CPU devices, gloo) on the
gpt-oss-like hybrid layout with vLLM's hybrid KV cache manager on, under chaos: per-host delays,
failed device-to-host copies, lost slots (with several KV cache groups vLLM recomputes the whole
request, by ``failed_recving``), dropped and doubled reports, aborts, preemption storms. Every host
holds its heads of tpu-inference's shared arrays; the harness compares every host's dispatch digest
at every step, and every host's runner checks every position it reads."""

from __future__ import annotations

import dataclasses

import pytest
from test_podslice import WORKLOAD, _assert_clean_end

from tpuoffload import counters as C
from tpuoffload.sim.chaos import Chaos
from tpuoffload.sim.podslice import SliceSpec
from tpuoffload.sim.workload import run_prefix_repetition

# 48 blocks of 2 arrays x 32 KiB pages (whole mesh): a small pool, for preemption storms (vLLM needs
# 41 for one request of 256 tokens: 16 full-attention blocks, 25 for the window and a prefill chunk).
BUDGET = 48 * 2 * 32768


def _spec(**extra) -> SliceSpec:
    config = {"cpu_bytes_to_use": 1 << 22, "save_timeout_s": 3.0, "load_wait_timeout_s": 2.0, **extra}
    return SliceSpec(num_hosts=2, devices_per_host=2, hybrid="gpt-oss-like", kv_budget_bytes=BUDGET,
                     max_model_len=256, max_num_seqs=16, max_num_batched_tokens=256, extra_config=config,
                     step_timeout_s=60.0)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_hybrid_prefix_repetition_chaos(make_slice):
    pod = make_slice(_spec(), Chaos.storm(2, seed=7))
    assert len(pod.scheduler.kv_cache_config.kv_cache_groups) == 2
    assert pod.scheduler.kv_cache_config.num_blocks == 48
    res = run_prefix_repetition(pod, WORKLOAD)
    assert res.finished + res.aborted == res.requests, res
    assert res.aborted > 0 and pod.preemptions > 0, (res.aborted, pod.preemptions)
    assert res.wrong_outputs == []
    totals = pod.stats.totals()
    assert totals["chunks_loaded"] > 0, res.stats
    assert totals["load_errors"] > 0 and totals["save_failures"] > 0, res.stats
    _assert_clean_end(pod)
    print(f"hybrid pod slice: {res}")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_hybrid_model_under_dpscheduler_hits_across_ranks_and_recomputes_failures(make_slice, tmp_path, monkeypatch):
    """The gpt-oss-like hybrid (sliding window + full attention) under tpu-inference's DPScheduler:
    DP 2 x TP 2 over 2 hosts x 2 devices, every rank's per-group block ids rank-local (DPScheduler
    passes them through; the runner and the worker place them by rank), a small host RAM with each
    rank's disk tier below it. Slots lost on host 1 make loads fail (by request: several groups and
    DP both need it); vLLM recomputes them on every host. Every request finishes with the right
    tokens, no position is read wrong (the model's outputs depend on every read), a rank loads
    chunks another rank saved (cross-rank hits of both groups), every rank spills to its own files
    and fetches back, every host dispatched the same programs, nothing leaks.

    Then warm restart: the slice shuts down (every host checkpoints every rank's slots of both
    groups), the same deployment starts again on its ``persist_path`` and disk directories, every
    rank adopts the rows its own part of each host's checkpoint reports and the chunk files its
    hosts kept, and the first wave after the restart (vLLM's HBM empty) loads its prefixes from
    them, every position read exact.

    KV events all along (both lifetimes): each rank publishes on its own port as its own DP rank,
    every group's chunks with their group and kind, in host RAM and on disk, and after every batch
    a rank published, its events say exactly what that rank's indexes can serve
    (test_events.py:RankEvents), restored chunks included."""
    from test_dp_scheduler import SPREAD
    from test_events import RankEvents

    from tpuoffload.snapshot import read_rank_snapshots

    chaos = Chaos(seed=11, lose_slot_host=1, lose_slot_rate=0.3)
    events = RankEvents(monkeypatch, tmp_path / "events", ranks=2)
    spec = dataclasses.replace(
        _spec(save_timeout_s=30.0, num_cpu_chunks=12 + 16, cpu_bytes_to_use=None,
              disk_path=str(tmp_path / "disk-{host}"), disk_bytes_to_use=1 << 26,
              persist_path=str(tmp_path / "ckpt"), persist_timeout_s=60.0),
        hybrid="gpt-oss-like-dp2", kv_budget_bytes=2 * BUDGET, **events.spec_fields)
    pod = make_slice(spec, chaos)
    assert type(pod.scheduler).__name__ == "DPScheduler" and pod.dp_ranks == 2
    res = run_prefix_repetition(pod, dataclasses.replace(SPREAD, num_requests=16))
    assert res.finished == res.requests and res.wrong_outputs == [], res
    totals = pod.stats.totals()
    assert pod.mismatches == [0, 0], pod.mismatches
    assert res.per_wave_loaded[1] > 0 and totals["cross_rank_chunks_loaded"] > 0, res.stats
    assert totals["load_errors"] > 0, res.stats  # the failure path ran
    ranks = [snap["totals"] for snap in read_rank_snapshots(pod.stats_dir).values()]
    assert len(ranks) == 2 and all(t.get("spills_confirmed", 0) > 0 for t in ranks), ranks
    assert totals["disk_read_chunks"] > 0 and totals.get("disk_read_failed", 0) == 0, totals
    _assert_clean_end(pod)
    print(f"hybrid under DPScheduler: {res}")
    _assert_events_exact(events)

    held = [t.get(C.PERSIST_SAVED_CHUNKS, 0) for t in pod.shutdown()]  # each host: every rank's slots
    assert held[0] == held[1], held
    events.close()
    events = RankEvents(monkeypatch, tmp_path / "events-again", ranks=2, after=events)
    spec = dataclasses.replace(spec, **events.spec_fields)
    again = make_slice(spec)  # no fault now: every restored load must be exact
    for _ in range(4):  # empty steps: the restore reports reach every rank (DPScheduler does not
        again.step()    # ask has_pending_push_work, so vLLM would wait for a request)
    events.note_restored()
    # Each rank's chunks: the few host RAM still held at shutdown, and the files its spills left on
    # the host that holds its batch shard (the other host holds no byte of them, and says so:
    # before, its empty report made every file "not kept alike" and all were deleted).
    ranks = [snap["totals"] for snap in read_rank_snapshots(again.stats_dir).values()]
    restored = [(t.get(C.RESTORED_READY, 0), t.get(C.DISK_RESTORED_READY, 0)) for t in ranks]
    assert len(ranks) == 2 and all(disk > 0 for _, disk in restored), (restored, held)
    assert sum(ram for ram, _ in restored) == held[0] and not any(t.get(C.DISK_RESTORED_DROPPED) for t in ranks), ranks
    res2 = run_prefix_repetition(again, dataclasses.replace(SPREAD, num_requests=16, waves=1))
    assert res2.finished == res2.requests and res2.wrong_outputs == [], res2
    assert res2.per_wave_loaded[0] > 0 and again.mismatches == [0, 0], (res2, again.mismatches)
    after = again.stats.totals()
    assert after["disk_read_chunks"] > 0 and after["load_errors"] == 0 and after.get("disk_read_failed", 0) == 0, after
    _assert_clean_end(again)
    print(f"hybrid under DPScheduler, restarted: {restored} chunks restored per rank, {res2}")
    # The restart announced, rank by rank, what that rank restored (host RAM and disk), before any request.
    announced = [(sum(k[1] == "CPU" for k in got), sum(k[1] == "STORAGE" for k in got)) for got in events.restored]
    assert announced == restored, (announced, restored)
    _assert_events_exact(events)
    events.close()


def _assert_events_exact(events) -> None:
    """Every batch each rank published arrived on its own port, labelled with its rank, and left the
    router's view of the rank equal to what the rank's indexes could serve then; every KV cache
    group's chunks were announced with their group and kind, in host RAM and on disk, and some
    withdrawn from host RAM."""
    events.check()
    kinds = {}
    for r, (view, sub) in enumerate(zip(events.views, events.subs)):
        assert events.checks[r] > 0 and events.diffs[r] == 0, (r, events.checks, events.diffs)
        assert view.ranks == {r} and sub.gaps == 0 and not view.errors, (r, view.ranks, sub.gaps, view.errors[:5])
        for medium in ("CPU", "STORAGE"):
            assert {k[2] for k in view.ever if k[1] == medium} == {0, 1}, (r, medium, view.stored)
        assert view.removed["CPU"] > 0, (r, view.removed)
        for g, kind in view.kinds.items():
            kinds.setdefault(g, set()).update(kind)
    assert sorted(map(sorted, kinds.values())) == [["full_attention"], ["sliding_window"]], kinds
    print(f"KV events per rank: {events.checks} batches checked, {events.diffs} differences; announced "
          f"{[v.stored for v in events.views]}, withdrawn {[v.removed for v in events.views]}")
