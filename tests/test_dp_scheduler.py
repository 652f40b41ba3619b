"""Data parallelism as tpu-inference 0.32 runs it: its ``DPScheduler``, one vLLM scheduler (and so one
tpuoffload scheduler half) per DP rank, each in a process it forks.

The pod-slice tests drive tpu-inference's own ``DPScheduler`` (installed by its own
``update_vllm_config_for_dp_scheduler``, its forked rank processes included), vLLM's real per-rank
schedulers, and N JAX worker processes holding the cache tpu-inference's ``create_kv_caches`` lays out
over its runner's DP / attention-DP mesh. What DPScheduler does to a connector, and what these prove
tpuoffload survives:

* it merges the ranks' metadata as ``type(meta)()`` plus ``requests_meta`` (block ids translated):
  every rank's plan reaches every host (the saves and loads happen, bytes checked);
* it hands the whole worker output to every rank: each rank's half reads only its own save
  outcomes, and no ``finished_recving`` / ``finished_sending`` id reaches a rank that does not
  own it (vLLM's scheduler asserts on those);
* every rank plans its own slots: no two ranks' chunks meet in one slot (bytes checked);
* a rank loads a chunk another rank saved (cross-rank hits: the ranks' news through the workers'
  report, the rows moved across the batch axes), byte-exact, and a slot its owner reused meanwhile
  is a load error, never wrong bytes.
"""

from __future__ import annotations

import dataclasses
import os
import types

import jax
import numpy as np
import pytest

from tpuoffload.config import parse_config
from tpuoffload.messages import RANK_SAVE_ID_SHIFT, LoadRequest, OffloadMetadata, SaveBatch, StepPlan
from tpuoffload.manager.topology import DPRank
from tpuoffload.sim.podslice import PodSlice, SliceSpec
from tpuoffload.sim.chaos import Chaos
from tpuoffload.sim.tpu_layouts import LAYOUTS, create_caches, tpu_inference
from tpuoffload.sim.workload import PrefixRepetition, run_prefix_repetition
from tpuoffload.stats import OffloadStats, make_report
from tpuoffload.worker.offload_worker import OffloadWorker

from test_podslice import _assert_clean_end

# One request per prefix per wave: each prefix is saved by the one rank its first request went to,
# and DPScheduler routes the second wave by load (vLLM's prefix cache was reset): most requests land
# on another rank than their prefix's.
SPREAD = PrefixRepetition(num_prefixes=8, prefix_blocks=6, suffix_len=(8, 16), output_len=(4, 8),
                          num_requests=8, waves=2, arrivals_per_step=4, seed=1)


def _spec(layout: str | None, num_blocks: int = 96, **extra) -> SliceSpec:
    # 16 MiB per host unless ``extra`` says otherwise; short timeouts, so that chaos (dropped
    # reports, lost slots) resolves within a few steps.
    config = {"cpu_bytes_to_use": 1 << 24, "save_timeout_s": 3.0, "load_wait_timeout_s": 2.0, **extra}
    return SliceSpec(num_hosts=2, devices_per_host=4, layout=layout, num_blocks=num_blocks, max_num_seqs=16,
                     max_num_batched_tokens=256, extra_config=config, step_timeout_s=60.0)


def _rank_pids(pod: PodSlice) -> list[int]:
    return [p.pid for p in getattr(pod.scheduler, "processes", ())]


@pytest.mark.slow
@pytest.mark.timeout(900)  # three slices, each compiling its programs for its own layout
def test_dp_and_attention_dp_serve_through_dpscheduler(make_slice):
    """DP 2 x TP 4 and attention-DP 4 x TP 2 over 2 hosts x 4 devices, and the same slice without
    DP, on one repeated-prefix workload: through DPScheduler every request finishes with the right
    tokens, every context position read is exact, every host dispatched the same programs, every
    rank loads from host RAM, nothing leaks, and the rank processes die with the slice. A request
    DPScheduler routes to another rank than the one that saved its prefix loads it from that rank's
    slots (cross-rank hits), so the DP hit rates are those of the slice without DP, within a few
    points."""
    hit_rate, rank_pids, table = {}, {}, {}
    for name, layout, ranks in (("tp8", None, 1), ("dp2-tp4", "bf16-dp2-tp4", 2), ("attndp4-tp2", "bf16-attndp4-tp2", 4)):
        # Saves are confirmed within a few steps; a generous timeout keeps a slow shared machine's
        # steps from expiring them, so the hit rates compare the layouts, not the machine's load.
        # 16 MiB per host, where TP 8 evicts nothing: every device's slot rows serve its own rank,
        # so no DP rank evicts either (when a slot kept a row per batch shard and each rank planned
        # 1/ranks of the slots, attention DP 4 evicted 22 chunks here and hit 40.8%).
        pod = make_slice(_spec(layout, save_timeout_s=30.0))
        assert pod.dp_ranks == ranks
        if ranks > 1:  # tpu-inference's own scheduler class, with one live process per rank
            assert type(pod.scheduler).__module__ == "tpu_inference.core.sched.dp_scheduler"
            assert type(pod.scheduler).__name__ == "DPScheduler" and len(_rank_pids(pod)) == ranks
        res = run_prefix_repetition(pod, SPREAD)
        assert res.finished == res.requests == 2 * SPREAD.num_requests and res.wrong_outputs == [], name
        totals = pod.stats.totals()
        # The only load errors allowed: another rank's chunk evicted by its owner before the load
        # (the view lags); each is recomputed, never read.
        assert totals["load_errors"] == totals["cross_rank_load_errors"] and totals["save_failures"] == 0, \
            (name, res.stats)
        assert pod.mismatches == [0, 0], (name, pod.mismatches)
        assert res.per_wave_loaded[1] > 0, f"{name}: the wave after reset_prefix_cache() must load from host RAM"
        if ranks > 1:
            assert totals["cross_rank_chunks_loaded"] > 0 and totals["cross_rank_hit_tokens"] > 0, (name, res.stats)
        hit_rate[name] = totals["hit_tokens"] / totals["lookup_tokens"]
        table[name] = (round(hit_rate[name], 4), totals["cross_rank_chunks_loaded"], totals["load_errors"],
                       totals["evicted"])
        assert totals["evicted"] == 0, (name, table[name])
        _assert_clean_end(pod)
        if ranks > 1:
            names = sorted(os.listdir(pod.stats_dir))  # each rank named itself once the workers placed it
            assert [n for n in names if n.startswith("scheduler")] == [f"scheduler-dp{r}.json" for r in range(ranks)]
            rank_pids[name] = _rank_pids(pod)
        pod.close()
    for name, pids in rank_pids.items():  # DPScheduler's rank processes are gone with the slice
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    # Without cross-rank hits (every rank seeing only its own chunks) this workload measured tp8
    # 16.6%, dp2 8.3%, attn-dp4 5.4%: the router spreads the second wave over the ranks.
    print("layout: (host-RAM hit rate, cross-rank chunks loaded, load errors, evicted):", table)
    assert hit_rate["tp8"] > 0.05, hit_rate
    assert all(hit_rate[n] >= hit_rate["tp8"] - 0.03 for n in ("dp2-tp4", "attndp4-tp2")), hit_rate


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_dp_chaos_failures_stay_with_their_rank_and_recompute_everywhere(make_slice):
    """DP 2 x TP 4 through DPScheduler under the chaos storm: failed device-to-host copies on host 0,
    slots lost on host 1 (load errors: vLLM recomputes on every host), dropped and doubled reports,
    aborts, a tiny block pool (preemptions). No rank crashes on another rank's completions, no wrong
    token, no wrong KV position (loads are asynchronous: no forward reads a block whose load
    failed, and the model's outputs depend on every read), identical digests, nothing leaked on
    any rank. Two requests per prefix per wave: loads of another rank's
    chunks run too, and a slot lost on host 1 fails them whichever host holds the source rows."""
    # Host 1 loses a slot at most loads: the few load steps of this workload must see some.
    chaos = dataclasses.replace(Chaos.storm(2, seed=7), lose_slot_rate=0.8)
    pod = make_slice(_spec("bf16-dp2-tp4", num_blocks=56), chaos)
    res = run_prefix_repetition(pod, dataclasses.replace(SPREAD, num_requests=16))
    assert res.finished + res.aborted == res.requests and res.wrong_outputs == [], res
    totals = pod.stats.totals()
    assert totals["chunks_loaded"] > 0 and totals["load_errors"] > 0 and totals["save_failures"] > 0, res.stats
    assert totals["cross_rank_chunks_loaded"] > 0, res.stats
    _assert_clean_end(pod)


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("cache_at_allocation", [False, True], ids=["vllm", "negative-control"])
def test_a_failed_load_never_stays_in_the_prefix_cache_of_its_rank(make_slice, monkeypatch, cache_at_allocation):
    """Issue 35's reproduction, through tpu-inference's DPScheduler on 2 hosts (DP 2 x TP 4): host
    0 loses a row of every load. Request A's prefix is in host RAM only (HBM reset); A's load fails
    on host 0 and A is aborted right after (a client disconnect); B, with the same 6-block prefix,
    arrives next. B must read the right KV on every host, compute the right tokens, and nothing
    wrong may become loadable.

    The mechanism: loads are asynchronous, so vLLM caches the loaded blocks in its prefix cache
    only once every host loaded them, and a failed load's blocks never (the blocks go back free,
    unhashed). When loads were synchronous, vLLM cached the blocks when it allocated them, before
    the load ran; under ``recompute`` it left them cached for the request to overwrite, and an
    abort first left them there for B (16 wrong positions per host). Negative control: vLLM made
    to cache at allocation, as it does for a synchronous load (``delay_cache_blocks=False``):
    B's first step reads the block host 0 never got."""
    if cache_at_allocation:
        from vllm.v1.core.kv_cache_manager import KVCacheManager

        allocate = KVCacheManager.allocate_slots

        def caching_at_allocation(self, *args, **kwargs):
            kwargs["delay_cache_blocks"] = False
            return allocate(self, *args, **kwargs)

        # Before the slice forks DPScheduler's rank processes, so every rank's vLLM has it.
        monkeypatch.setattr(KVCacheManager, "allocate_slots", caching_at_allocation)
    from tpuoffload.sim.vllm_setup import make_request
    from tpuoffload.sim.workload import expected_output

    chaos = Chaos(seed=3, lose_slot_host=0, lose_slot_rate=1.0)
    pod = make_slice(_spec("bf16-dp2-tp4", save_timeout_s=30.0), chaos)
    rng = np.random.default_rng(35)
    prefix = rng.integers(3, 30000, 6 * 16).tolist()
    prompts = {name: prefix + rng.integers(3, 30000, 5).tolist() for name in ("p", "a", "b")}
    pod.add_request(make_request("p", prompts["p"], max_tokens=3))
    pod.run()
    assert pod.settle(60.0)
    assert pod.stats.totals()["chunks_saved"] >= 6 * 2, pod.stats.totals()  # every host saved the prefix
    assert pod.scheduler.reset_prefix_cache()  # HBM forgets: the prefix is in host RAM only
    pod.add_request(make_request("a", prompts["a"], max_tokens=3))
    pod.step()  # A is admitted and its load planned, dispatched and failed on host 0
    assert pod.stats.totals()["load_errors"] >= 1, pod.stats.totals()
    assert pod.abort(["a"]) == ["a"]
    pod.add_request(make_request("b", prompts["b"], max_tokens=3))
    pod.run()
    wrong = pod.mismatches
    if cache_at_allocation:
        assert sum(wrong) > 0, "the negative control must read the block host 0 never loaded"
        return
    assert wrong == [0, 0], (wrong, pod.first_mismatch_step)
    assert pod.outputs["b"] == expected_output(prompts["b"], 3, 32000)
    assert pod.settle(60.0)
    _assert_clean_end(pod)


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("own_ids_only", [True, False], ids=["filtered", "negative-control"])
def test_lazy_offload_under_dpscheduler_each_rank_frees_only_its_own(make_slice, monkeypatch, own_ids_only):
    """Lazy offload under DPScheduler (DP 2 x TP 4, 2 hosts): a finished request's blocks are held
    until its flush is dispatched, and the workers' ``finished_sending`` (every rank's) reaches
    every rank's vLLM scheduler, which asserts that each id is its own. Each rank's half leaves
    only its own ids in its copy of the output: every request finishes with the right tokens, the
    next wave loads the flushed prefixes (cross-rank too), every read is exact, nothing leaks.
    Negative control: a half that keeps every id (``RequestLifecycle.released`` claiming all of
    them) makes a rank's vLLM scheduler assert on another rank's request: the slice fails."""
    if not own_ids_only:
        from tpuoffload.manager.lifecycle import RequestLifecycle

        released = RequestLifecycle.released
        monkeypatch.setattr(RequestLifecycle, "released", lambda self, ids: released(self, ids) | set(ids))
    pod = make_slice(_spec("bf16-dp2-tp4", save_timeout_s=30.0, lazy_offload=True))
    assert pod.dp_ranks == 2
    if not own_ids_only:
        from tpu_inference.core.sched.dp_scheduler import SchedulerWorkerError

        with pytest.raises(SchedulerWorkerError):  # a rank's vLLM scheduler: assert req_id in self.requests
            run_prefix_repetition(pod, SPREAD)
        return
    res = run_prefix_repetition(pod, SPREAD)
    assert res.finished == res.requests == 2 * SPREAD.num_requests and res.wrong_outputs == [], res
    totals = pod.stats.totals()
    assert res.per_wave_loaded[1] > 0 and totals["chunks_saved"] > 0, res.stats
    assert pod.mismatches == [0, 0], pod.mismatches
    _assert_clean_end(pod)


def _rank_plan(rank: int, blocks_per_rank: int, step: int, num_slots: int, **fields) -> StepPlan:
    """A DP rank's plan after DPScheduler's merge: its local_block_ids entry translated by the rank's
    block offset, as ``_combine_scheduler_outputs`` does."""
    return StepPlan(step, num_slots, source=1000 + rank, num_blocks=blocks_per_rank, failures_by_request=True,
                    local_block_ids=[rank * blocks_per_rank], **fields)


def test_ranks_with_the_same_local_blocks_and_slots_never_meet():
    """Two ranks plan the same local block ids, slots and save ids in one step (they plan
    independently). The workers place each in its own blocks and its own share of the slots: both
    load back their own bytes, and each rank's save outcomes come back under its own source, its
    load failures by request. (Without the placement both chunks land in slot 0.)"""
    caches, mesh = create_caches(LAYOUTS["bf16-dp2-tp4"])
    rng = np.random.default_rng(0)
    caches = [jax.device_put(rng.integers(0, 100, size=c.shape).astype(c.dtype), c.sharding) for c in caches]
    original = [np.asarray(c) for c in caches]
    runner = types.SimpleNamespace(kv_caches=caches, mesh=mesh)
    worker = OffloadWorker(parse_config({"cpu_bytes_to_use": 1 << 23}), host_id=0)
    worker.register_runner(runner)
    per_rank_slots = worker.engine.num_slots(0) // 2
    bpr = caches[0].shape[0] // 2  # blocks per rank

    save = [_rank_plan(r, bpr, 0, per_rank_slots, save=SaveBatch((3,), (0,), (0,))) for r in range(2)]
    worker.bind(OffloadMetadata(save))
    worker.wait_for_save()
    worker.clear()
    assert worker.engine.wait_idle(30)
    report = worker.build_report()
    for r in range(2):
        assert list(report.outcomes(1000 + r)) == [(0, ((0, 1),), ())]
    assert report.ranks == {1000: 0, 1001: 1}

    # Both ranks load their slot 0 into their local block 7; rank 1 also asks for slot 1, never saved.
    load = [_rank_plan(0, bpr, 1, per_rank_slots, loads=(LoadRequest("a", (7,), (0,), (0,)),)),
            _rank_plan(1, bpr, 1, per_rank_slots, loads=(LoadRequest("b", (7, 8), (0, 1), (0, 1)),))]
    worker.bind(OffloadMetadata(load))
    worker.wait_for_save()
    sending, recving = worker.get_finished()
    failed, errors = worker.take_failed_recving(), worker.take_load_errors()
    worker.clear()
    # Asynchronous loads: every load is reported finished (each rank's half keeps its own ids);
    # a failure goes by request id, never by a rank-local block id that another rank would misread.
    assert sending is None and recving == {"a", "b"}
    assert failed == {"b"} and errors == set()
    for layer, c in enumerate(runner.kv_caches):
        got = np.asarray(c)
        assert np.array_equal(got[7], original[layer][3]), f"layer {layer}: rank 0's chunk"
        assert np.array_equal(got[bpr + 7], original[layer][bpr + 3]), f"layer {layer}: rank 1's chunk"
    worker.close()


def test_dp_rank_comes_from_tpu_inference_config_and_refuses_what_it_cannot_do():
    from tpu_inference.core.sched.dp_scheduler import DPScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    def config(dp: int, sched_cls) -> types.SimpleNamespace:
        return types.SimpleNamespace(sharding_config=types.SimpleNamespace(total_dp_size=dp),
                                     scheduler_config=types.SimpleNamespace(scheduler_cls=sched_cls))

    kv = types.SimpleNamespace(num_blocks=48)
    rank = DPRank.of(config(2, DPScheduler), kv)
    assert (rank.ranks, rank.num_blocks, rank.source, rank.failures_by_request) == (2, 48, os.getpid(), True)
    assert DPRank.of(config(1, Scheduler), kv) == DPRank()  # no DP: one scheduler for the whole engine
    assert DPRank.of(config(2, Scheduler), kv) == DPRank()  # DP layout under vLLM's scheduler


def test_every_rank_plan_survives_dpscheduler_merge_whole():
    """tpu-inference's own merge (``DPScheduler._combine_scheduler_outputs``, run on a stand-in
    holding only the state it reads): ``type(meta)()`` then ``requests_meta`` extended with each
    rank's entries, ``local_block_ids`` translated, every other field dropped. Every field of every
    rank's plan comes through, and the translated entry is each rank's block offset."""
    import functools

    import cloudpickle
    from tpu_inference.core.sched.dp_scheduler import DPScheduler
    from vllm.v1.core.sched.output import CachedRequestData

    bpr = 48
    plans = [StepPlan(3, 16, save=SaveBatch((5, 6), range(2, 4), range(10, 12)), loads=(LoadRequest("r", (9,), (1,), (4,)),),
                      source=100 + r, num_blocks=bpr, failures_by_request=True) for r in range(2)]
    outputs = [types.SimpleNamespace(
        scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData.make_empty(), num_scheduled_tokens={},
        total_num_scheduled_tokens=0, scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
        finished_req_ids=set(), num_common_prefix_blocks=[], aux_output_connector_metadata=None,
        # the rank processes send their outputs through pipes, pickled with cloudpickle
        kv_connector_metadata=cloudpickle.loads(cloudpickle.dumps(OffloadMetadata([plan])))) for plan in plans]
    stand_in = types.SimpleNamespace(per_rank_kv_cache_configs=[types.SimpleNamespace(num_blocks=bpr)] * 2,
                                     assigned_dp_rank={}, _combine_aux_output_metadata=DPScheduler._combine_aux_output_metadata)
    stand_in._combine_cached_request_data = functools.partial(DPScheduler._combine_cached_request_data, stand_in)
    combined = DPScheduler._combine_scheduler_outputs(stand_in, outputs).kv_connector_metadata
    assert type(combined) is OffloadMetadata and len(combined.requests_meta) == 2
    for rank, (got, sent) in enumerate(zip(combined.requests_meta, plans)):
        assert got.local_block_ids == [rank * bpr]
        assert got.placement() == (rank * bpr, rank * 16, rank << 40)
        assert dataclasses.replace(got, local_block_ids=[0]) == sent  # nothing else changed


def _dp_worker(seed: int = 0):
    """One host holding both batch shards of tpu-inference's DP 2 x TP 4 cache, random contents."""
    caches, mesh = create_caches(LAYOUTS["bf16-dp2-tp4"])
    rng = np.random.default_rng(seed)
    caches = [jax.device_put(rng.integers(0, 100, size=c.shape).astype(c.dtype), c.sharding) for c in caches]
    original = [np.asarray(c) for c in caches]
    runner = types.SimpleNamespace(kv_caches=caches, mesh=mesh)
    worker = OffloadWorker(parse_config({"cpu_bytes_to_use": 1 << 23}), host_id=0)
    worker.register_runner(runner)
    return worker, runner, original, worker.engine.num_slots(0) // 2, caches[0].shape[0] // 2


def _step(worker: OffloadWorker, plans: list[StepPlan]) -> set[str]:
    """One step of the worker; returns the requests whose load failed (DP: failures by request)."""
    worker.bind(OffloadMetadata(plans))
    worker.wait_for_save()
    worker.get_finished()
    assert worker.take_load_errors() == set()
    failed = worker.take_failed_recving()
    worker.clear()
    assert worker.engine.wait_idle(30)
    return failed


def _cross(slot: int, save_id: int, owner: int, planner: int, per_rank_slots: int) -> tuple[int, int]:
    """Rank ``owner``'s slot and save id as rank ``planner`` names them in a load (LoadRequest)."""
    return slot + (owner - planner) * per_rank_slots, save_id + ((owner - planner) << RANK_SAVE_ID_SHIFT)


def test_a_rank_loads_a_chunk_another_rank_saved_byte_exact():
    """Rank 1 loads rank 0's chunk (and rank 0 rank 1's) into its own blocks: the rows cross the
    batch axis inside the one load program, byte for byte; the counters say so."""
    worker, runner, original, per_rank, bpr = _dp_worker()
    saves = [_rank_plan(r, bpr, 0, per_rank, save=SaveBatch((3 + r,), (0,), (0,))) for r in range(2)]
    assert _step(worker, saves) == set()
    worker.build_report()
    s1, i1 = _cross(0, 0, owner=0, planner=1, per_rank_slots=per_rank)
    s0, i0 = _cross(0, 0, owner=1, planner=0, per_rank_slots=per_rank)
    loads = [_rank_plan(0, bpr, 1, per_rank, loads=(LoadRequest("a", (9, 10), (s0, 0), (i0, 0)),)),
             _rank_plan(1, bpr, 1, per_rank, loads=(LoadRequest("b", (9,), (s1,), (i1,)),))]
    assert _step(worker, loads) == set()
    for layer, c in enumerate(runner.kv_caches):
        got = np.asarray(c)
        assert np.array_equal(got[9], original[layer][bpr + 4]), f"layer {layer}: rank 1's chunk in rank 0"
        assert np.array_equal(got[10], original[layer][3]), f"layer {layer}: rank 0's own chunk"
        assert np.array_equal(got[bpr + 9], original[layer][3]), f"layer {layer}: rank 0's chunk in rank 1"
    counters = worker.engine.take_counters()
    assert counters["cross_rank_chunks_loaded"] == 2 and counters["chunks_loaded"] == 3, counters
    assert any("cross=True" in op for op in worker.digests[-1].ops)
    worker.close()


@pytest.mark.parametrize("when", ["flush", "save"])
def test_a_slot_reused_by_its_rank_in_the_step_another_rank_loads_it_is_never_garbage(when, monkeypatch):
    """The race the ranks' independent planning allows: rank 0 saves a new chunk into its slot 0 in
    the very step rank 1 loads the old chunk from it (rank 1's view lags). A flush is dispatched
    before the loads: the load waits for it, sees the slot's new save id and becomes a load error
    (zeros, the block reported). An eager save is dispatched after the loads: the load reads the old
    chunk, whole (the save's program takes the store after the load's reads). 0 wrong bytes either
    way. Negative control (flush): without the slot check the load serves the new chunk's bytes as
    if they were the old one's."""
    for check in ((True, False) if when == "flush" else (True,)):
        worker, runner, original, per_rank, bpr = _dp_worker(seed=1)
        if not check:
            monkeypatch.setattr(worker.engine.engines[0], "_unusable", lambda *a: set())
        assert _step(worker, [_rank_plan(0, bpr, 0, per_rank, save=SaveBatch((3,), (0,), (0,)))]) == set()
        s, i = _cross(0, 0, owner=0, planner=1, per_rank_slots=per_rank)
        reuse = SaveBatch((5,), (0,), (1,))  # rank 0's new chunk (block 5) in the same slot
        rank0 = _rank_plan(0, bpr, 1, per_rank, **{when: reuse})
        # Rank 1 also saves a block its forward of this step filled (its local block 12).
        rank1 = _rank_plan(1, bpr, 1, per_rank, loads=(LoadRequest("b", (9,), (s,), (i,)),),
                           save=SaveBatch((12,), (0,), (0,)))
        errors = _step(worker, [rank0, rank1])
        rank1_saves = list(worker.build_report().outcomes(1001))
        got = [np.asarray(c)[bpr + 9] for c in runner.kv_caches]
        if not check:  # the hazard: the new chunk's bytes served as the old chunk, silently
            assert errors == set() and all(np.array_equal(g, o[5]) for g, o in zip(got, original))
            worker.close()
            continue
        if when == "flush":
            assert errors == {"b"}, errors  # rank 1's request: recomputed
            assert all(not g.any() for g in got), "a stale load scatters zeros, never another chunk's bytes"
            assert worker.engine.take_counters()["cross_rank_load_errors"] == 1
            # The load is asynchronous: no forward read the placeholder (vLLM schedules "b" only
            # after the load, and recomputes it), so rank 1's save of the step stands.
            assert rank1_saves == [(0, ((0, 1),), ())], rank1_saves
        else:
            assert errors == set()
            assert all(np.array_equal(g, o[3]) for g, o in zip(got, original)), "the old chunk, whole"
            assert rank1_saves == [(0, ((0, 1),), ())], rank1_saves
        # Rank 0's new chunk is in its slot, intact.
        assert _step(worker, [_rank_plan(0, bpr, 2, per_rank, loads=(LoadRequest("c", (11,), (0,), (1,)),))]) == set()
        assert all(np.array_equal(np.asarray(c)[11], o[5]) for c, o in zip(runner.kv_caches, original))
        worker.close()


def test_one_scheduler_over_a_cache_split_by_data_parallelism_is_refused():
    """Each batch shard's devices keep their own shard's chunks: one scheduler planning slots for
    every shard's blocks (not how tpu-inference runs DP) is refused at its first step, by name."""
    worker, _, _, per_rank, _ = _dp_worker()
    with pytest.raises(ValueError, match="DPScheduler"):
        worker.bind(OffloadMetadata([StepPlan(0, per_rank)]))
    worker.close()


def test_rank_stats_stay_apart_and_what_dpscheduler_does_with_them():
    """Two DP ranks' scheduler halves report the same counter under the same report number: the
    reports keep one source per rank, so merged they add up instead of one hiding the other.
    tpu-inference 0.32's own DPScheduler then drops every rank's ``kv_connector_stats`` when it
    combines the ranks' SchedulerStats (``_combine_scheduler_stats``): under DPScheduler vLLM's
    Prometheus endpoint gets no tpuoffload series, and the per-rank snapshot files are the record."""
    tpu_inference()  # its package, entered as the suite's other tests do
    from tpu_inference.core.sched.dp_scheduler import DPScheduler
    from vllm.v1.metrics.stats import SchedulerStats

    reports = []
    for rank in range(2):
        dp = DPRank(ranks=2, num_blocks=48, source=1000 + rank)
        assert dp.stats_source(None) == f"sched-pid{1000 + rank}"
        reports.append(OffloadStats(make_report(dp.stats_source(rank), 1, {"hit_tokens": 16 * (rank + 1)})))
    assert reports[0].aggregate(reports[1]).reduce()["hit_tokens"] == 48
    assert DPRank().stats_source(0) == "sched"

    sched = object.__new__(DPScheduler)  # its stats method only, on the two fields it reads
    sched.dp_size, sched.log_stats = 2, False
    combined = sched._combine_scheduler_stats([SchedulerStats(num_running_reqs=1, kv_connector_stats=r.data)
                                               for r in reports])
    assert combined.num_running_reqs == 2 and combined.kv_connector_stats is None


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("replicas_from_spec", [True, False], ids=["mla-spec", "negative-control"])
def test_mla_attention_dp_serves_through_dpscheduler(make_slice, monkeypatch, replicas_from_spec):
    """MLA the way tpu-inference serves it (DeepSeek-V3-like, NEW_MODEL_DESIGN, attention DP 2 x TP
    2 over 2 hosts x 2 devices, so DPScheduler): the scheduler's KV cache config reports the layers
    as tpu-inference's ``MLAAttentionSpec`` (one latent copy per page) and each device keeps its
    rank's latent blocks, replicated over the tensor-parallel devices. With ``cpu_bytes_to_use`` sized
    the same on both halves, every request finishes with the right tokens, every context position
    read is exact, a rank loads prefixes another rank saved (cross-rank hits), the hosts dispatch
    the same programs, nothing leaks. Negative control: the rule before (MLA replicas only when
    ``model_config.use_mla``, which this scheduler's model config does not set): every rank plans
    more slots than a host has and the workers refuse at the first step."""
    from tpuoffload.sim.podslice import SliceError

    if not replicas_from_spec:
        import tpuoffload.connector as connector

        def old_rule(vllm_config, kv_cache_config):
            sharding = vllm_config.sharding_config
            factor = int(sharding.total_dp_size)
            if getattr(vllm_config.model_config, "use_mla", False):
                factor *= int(sharding.tp_size) * int(sharding.expert_size)
            return factor

        monkeypatch.setattr(connector, "storage_factor", old_rule)  # before DPScheduler forks its ranks
    spec = dataclasses.replace(_spec("mla-attndp2-tp2", save_timeout_s=30.0), devices_per_host=2)
    if not replicas_from_spec:
        with pytest.raises(SliceError, match="disagree on the chunk size"):
            pod = make_slice(spec)
            run_prefix_repetition(pod, SPREAD)
        return
    pod = make_slice(spec)
    assert pod.dp_ranks == 2 and type(pod.scheduler).__name__ == "DPScheduler"
    res = run_prefix_repetition(pod, SPREAD)
    assert res.finished == res.requests == 2 * SPREAD.num_requests and res.wrong_outputs == [], res
    totals = pod.stats.totals()
    assert totals["load_errors"] == totals["cross_rank_load_errors"] and totals["save_failures"] == 0, res.stats
    assert res.per_wave_loaded[1] > 0, res.stats
    assert totals["cross_rank_chunks_loaded"] > 0 and totals["cross_rank_hit_tokens"] > 0, res.stats
    assert pod.mismatches == [0, 0], pod.mismatches
    _assert_clean_end(pod)
