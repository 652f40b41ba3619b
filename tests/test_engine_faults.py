"""Invariant 2 at every declared fault point: a fault changes what a host reports, never what it
dispatches (the same programs, in the same order, with the same digest as a clean host).
"""

from __future__ import annotations

import types
from functools import cache

import numpy as np
import pytest

from tpuoffload.config import parse_config
from tpuoffload.layout import CacheLayout
from tpuoffload.messages import LoadRequest, OffloadMetadata, StepPlan, SaveBatch
from tpuoffload.sim.tpu_layouts import LAYOUTS
from tpuoffload.worker.faults import FaultPoint
from tpuoffload.worker.offload_worker import OffloadWorker
from tpuoffload.worker.transfer_engine import TransferEngine

from engine_helpers import (
    BF16, MIXED, DP, NUM_SLOTS, template, random_caches, host, chunk, Injected)


# ---------------------------------------------------------------- invariant 2: every fault point
SAVE_SIDE = (FaultPoint.SAVE_PROGRAM, FaultPoint.SAVE_RECORD)
LOAD_SIDE = (FaultPoint.LOAD_SLOT_CHECK, FaultPoint.LOAD_PREPARE)
FAULT_CASES = ([(p, m) for p in (*LOAD_SIDE, *SAVE_SIDE) for m in ("raise", "positions")]
               + [(p, "block") for p in SAVE_SIDE])
# Every case on one layout; the load side (one program per layer group, blocks per batch shard)
# also with two layer groups and with blocks split over four batch shards.
FAULT_MATRIX = ([(BF16, p, m) for p, m in FAULT_CASES]
                + [(MIXED, FaultPoint.LOAD_SLOT_CHECK, "positions"), (MIXED, FaultPoint.LOAD_PREPARE, "raise"),
                   (DP[1], FaultPoint.LOAD_PREPARE, "positions")])


def test_fault_cases_cover_every_fault_point():
    assert set(FaultPoint) == {p for p, _ in FAULT_CASES}


# Chunk i of every step lives in block range i (of 16 blocks): with blocks split over batch shards
# (up to 4 here) the chunks of one call span every shard and each stays in its own.
SEQ_OLD, SEQ_SAVE1, SEQ_SAVE3 = [2, 18, 34, 50], [3, 19, 35, 51], [4, 20, 36, 52]
SEQ_LOADS = {2: ([6, 22, 38, 54], SEQ_SAVE1), 3: ([8, 24, 40, 56], SEQ_SAVE3),
             4: ([10, 26, 42, 58], SEQ_SAVE1)}  # step -> (destination blocks, source blocks)


def fault_sequence(name: str, faults: Injected | None = None) -> list[dict]:
    """One engine through the plan sequence below, a fault (if any) armed where it applies.

    0. save SEQ_OLD into slots 0..3 (never faulted: what a failed overwrite could leave behind)
    1. save SEQ_SAVE1 into slots 0..3 as ids 10..13 (a save-side fault acts here)
    2. load slots 0..3 (a load-side fault acts here; a slow save makes the load time out)
    3. save SEQ_SAVE3 into slots 4..7 as ids 20..23 and load them in the same step (every fault
       acts here)
    4. load slots 0..3 again, no fault: what the faults left loadable

    Checked here for every load: each destination block either holds its source block's bytes
    exactly or is reported failed and holds zeros; every other block is untouched. Returns per
    step: the dispatch digest and ops, the failed blocks, the save outcomes and the counters."""
    save_side = faults is not None and faults.point in SAVE_SIDE
    block = faults is not None and faults.mode == "block"

    def arm(when: bool) -> None:
        if faults is not None and when:
            faults.arm()

    caches = random_caches(name, 70)
    src = host(caches)
    eng = TransferEngine(caches, NUM_SLOTS * CacheLayout.from_caches(caches).device_bytes_per_chunk, faults=faults,
                         load_wait_timeout_s=0.3 if block else 10.0)
    steps: list[dict] = []
    shard_of, rows = eng.layout.groups[0].shard_of, eng.slot_table.shard_slots
    low = [i + shard_of(b) * rows for i, b in enumerate(SEQ_OLD)]  # "slots 0..3", each in its chunk's shard
    high = [x + 4 for x in low]  # "slots 4..7"

    def load(step: int, slots: list[int], ids: list[int]) -> list[int]:
        nonlocal caches
        dst, srcs = SEQ_LOADS[step]
        before = host(caches)
        caches, failed = eng.load(caches, dst, slots, ids)
        after = host(caches)
        for d, b in zip(dst, srcs):
            if d in failed:
                assert not chunk(after, d).any(), f"step {step}: failed block {d} is not zeros"
            else:
                assert np.array_equal(chunk(after, d), chunk(src, b)), f"step {step}: block {d} differs"
        rest = [x for x in range(LAYOUTS[name].num_blocks) if x not in dst]
        for layer in range(len(after)):
            assert np.array_equal(after[layer][rest], before[layer][rest]), f"step {step}: other blocks changed"
        return failed

    def close_step(failed=()) -> None:
        d = eng.finish_step()
        c = eng.take_counters()
        assert c["bytes_saved"] == c["chunks_saved"] * eng.slot_table.slot_bytes
        assert c["bytes_loaded"] == c["chunks_loaded"] * eng.slot_table.slot_bytes
        steps.append({"digest": d.digest, "ops": d.ops, "failed": list(failed),
                      "results": {r.save_id: r.ok for r in eng.drain_results()},
                      "counters": {k: c[k] for k in ("chunks_saved", "save_failures", "chunks_loaded", "load_errors")}})

    try:
        eng.save(caches, SEQ_OLD, low, [1, 2, 3, 4])
        assert eng.wait_idle(30)
        close_step()

        arm(save_side)
        eng.save(caches, SEQ_SAVE1, low, [10, 11, 12, 13])
        if not block:
            assert eng.wait_idle(30)
        close_step()

        arm(not save_side)
        failed = load(2, low, [10, 11, 12, 13])
        if faults is not None:
            faults.disarm()  # also releases a slow save
        assert eng.wait_idle(30)
        close_step(failed)

        arm(True)
        eng.save(caches, SEQ_SAVE3, high, [20, 21, 22, 23])
        failed = load(3, high, [20, 21, 22, 23])
        if faults is not None:
            faults.disarm()
        assert eng.wait_idle(30)
        close_step(failed)

        failed = load(4, low, [10, 11, 12, 13])
        close_step(failed)
    finally:
        if faults is not None:
            faults.disarm()
        eng.wait_idle(10)
        eng.close()
    return steps


@cache
def clean_sequence(name: str) -> tuple[dict, ...]:
    """The sequence without faults (the same for every fault case of a layout: run once)."""
    steps = fault_sequence(name)
    assert [s["failed"] for s in steps] == [[]] * 5
    assert all(all(s["results"].values()) for s in steps)
    assert [s["counters"] for s in steps] == [
        {"chunks_saved": 4, "save_failures": 0, "chunks_loaded": 0, "load_errors": 0},
        {"chunks_saved": 4, "save_failures": 0, "chunks_loaded": 0, "load_errors": 0},
        {"chunks_saved": 0, "save_failures": 0, "chunks_loaded": 4, "load_errors": 0},
        {"chunks_saved": 4, "save_failures": 0, "chunks_loaded": 4, "load_errors": 0},
        {"chunks_saved": 0, "save_failures": 0, "chunks_loaded": 4, "load_errors": 0}]
    return tuple(steps)


@pytest.mark.parametrize("name,point,mode", FAULT_MATRIX, ids=[f"{n}-{p.name}-{m}" for n, p, m in FAULT_MATRIX])
def test_fault_changes_reports_never_dispatch(name, point, mode):
    """The same plans on two engines of one layout, one with a fault at ``point``: identical
    dispatch at every step; exactly the affected blocks are load errors (and the affected saves
    not ok); counters right; unaffected blocks byte-exact, affected blocks zeros, never stale
    (checked inside ``fault_sequence``)."""
    clean = clean_sequence(name)
    faults = Injected(point, mode)
    faulty = fault_sequence(name, faults)
    for step, (c, f) in enumerate(zip(clean, faulty)):
        assert f["digest"] == c["digest"] and f["ops"] == c["ops"], f"step {step}: dispatch diverged"
    assert {p for p, _ in faults.calls} == set(FaultPoint)  # every point was reached

    n = 4
    bad = list(range(n)) if mode in ("raise", "block") else sorted(faults.positions)
    lost = point in SAVE_SIDE and mode != "block"  # the affected saves failed: never loadable
    slow = mode == "block"  # the affected saves landed late: loads timed out, later ones succeed

    def outcomes(ids):
        return {sid: not (lost and i in bad) for i, sid in enumerate(ids)}

    def blocks(step, positions):
        return [SEQ_LOADS[step][0][i] for i in positions]

    # Step 1's save completes during step 2 when it is slow.
    assert faulty[1]["results"] | faulty[2]["results"] == outcomes([10, 11, 12, 13])
    assert faulty[3]["results"] == outcomes([20, 21, 22, 23])
    assert [f["failed"] for f in faulty] == [[], [], blocks(2, bad), blocks(3, bad), blocks(4, bad if lost else [])]
    f = len(bad)
    saved = [4, (n - f if lost else 0 if slow else n), (n if slow else 0), (n - f if lost else n), 0]
    save_failures = [0, f if lost else 0, 0, f if lost else 0, 0]
    load_errors = [0, 0, f, f, f if lost else 0]
    assert [x["counters"] for x in faulty] == [
        {"chunks_saved": saved[s], "save_failures": save_failures[s],
         "chunks_loaded": (n - load_errors[s] if s >= 2 else 0), "load_errors": load_errors[s]} for s in range(5)]


def test_worker_reports_and_counts_load_read_failure():
    """Issue 12's bug at the worker level: reading slots raises on one host; the blocks reach vLLM
    as load errors AND are counted in the host's stats, and the host dispatched what a healthy
    host did."""
    n, slots_total = 18, NUM_SLOTS
    faults = Injected(FaultPoint.LOAD_SLOT_CHECK, "raise")
    runners, workers = {}, {}
    chunk_bytes = CacheLayout.from_caches(template(BF16)).device_bytes_per_chunk
    config = parse_config({"cpu_bytes_to_use": slots_total * chunk_bytes})
    for key, inj in (("clean", None), ("faulty", faults)):
        runners[key] = types.SimpleNamespace(kv_caches=random_caches(BF16, 80))
        workers[key] = OffloadWorker(config, host_id=0, faults=inj)
        workers[key].register_runner(runners[key])
    src = host(runners["clean"].kv_caches)
    blocks, dst = list(range(n)), list(range(30, 30 + n))
    try:
        save = OffloadMetadata([StepPlan(step=0, num_slots=slots_total,
                               save=SaveBatch(tuple(blocks), tuple(range(n)), range(100, 100 + n)))])
        loads = (LoadRequest("a", tuple(dst[:10]), tuple(range(10)), tuple(range(100, 110))),
                 LoadRequest("b", tuple(dst[10:]), tuple(range(10, n)), tuple(range(110, 100 + n))))
        load = OffloadMetadata([StepPlan(step=1, num_slots=slots_total, loads=loads)])
        out = {}
        for step, meta in enumerate((save, load)):
            if step == 1:
                faults.arm()
            for key, w in workers.items():
                w.bind(meta)
                w.start_load()
                w.wait_for_save()
                assert w.engine.wait_idle(30)
                out[key, step] = (w.get_finished(), w.take_load_errors(), w.build_report(), w.take_stats(),
                                  w.clear())
            faults.disarm()
            assert out["clean", step][4].digest == out["faulty", step][4].digest
            assert out["clean", step][4].ops == out["faulty", step][4].ops
        assert out["faulty", 1][0] == out["clean", 1][0] == (None, {"a", "b"})
        assert out["clean", 1][1] == set()
        assert out["faulty", 1][1] == set(dst)
        clean_stats, faulty_stats = out["clean", 1][3].totals(), out["faulty", 1][3].totals()
        assert (clean_stats["chunks_loaded"], clean_stats["load_errors"]) == (n, 0)
        assert (faulty_stats["chunks_loaded"], faulty_stats["load_errors"]) == (0, n)
        assert out["faulty", 0][3].totals()["chunks_saved"] == n
        clean_after, faulty_after = host(runners["clean"].kv_caches), host(runners["faulty"].kv_caches)
        for b, d in zip(blocks, dst):
            assert np.array_equal(chunk(clean_after, d), chunk(src, b))
            assert not chunk(faulty_after, d).any()
        assert workers["faulty"].idle_report() == workers["clean"].idle_report() == {
            "inflight_saves": 0, "staging_bytes": 0, "unreported_save_failures": 0, "pending_load_reports": 0}
    finally:
        faults.disarm()
        for w in workers.values():
            w.close()


