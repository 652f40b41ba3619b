"""TPUOffloadConnector against vLLM 0.32's REAL Scheduler and AsyncScheduler.

Every test drives ``tpuoffload.sim.engine.InProcessEngine`` through ``tests/offload_harness.py``:
vLLM's scheduler, the connector's scheduler half, and one SyntheticRunner + worker half per
simulated host (merged by vLLM's KVOutputAggregator when there are two). The runner verifies every
context position of a request on its first step after (re)admission, so
``engine.mismatches() == 0`` means that no step ever read a wrong KV value; loads are also checked
byte for byte against ``SyntheticRunner.expected_block``.
"""

from __future__ import annotations

import logging
import pickle
import random
from collections import Counter

import pytest

from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from offload_harness import BS, Harness, LoseSlots, chunk_bytes, rand_tokens
from tpuoffload import counters as C
from tpuoffload.connector import TPUOffloadConnector
from tpuoffload.messages import OffloadWorkerReport
from tpuoffload.manager.index import READY, SAVING
from tpuoffload.sim.engine import InProcessEngine
from tpuoffload.sim.vllm_setup import make_request
from tpuoffload.stats import OffloadStats

# hosts x scheduler kind: the four combinations the connector must survive.
VARIANTS = [
    pytest.param(1, False, id="1host-sync"),
    pytest.param(2, False, id="2host-sync"),
    pytest.param(1, True, id="1host-async"),
    pytest.param(2, True, id="2host-async"),
]


def full_blocks(n_tokens: int) -> int:
    return n_tokens // BS


CHUNK = chunk_bytes()


@pytest.fixture(autouse=True)
def _close_engines(monkeypatch):
    made = []
    orig_init = InProcessEngine.__init__

    def init(self, *a, **kw):
        orig_init(self, *a, **kw)
        made.append(self)

    monkeypatch.setattr(InProcessEngine, "__init__", init)
    yield
    for eng in made:
        eng.close()


# ============================================================================ 1. shared prefixes
@pytest.mark.parametrize("hosts,async_sched", VARIANTS)
def test_shared_prefix_second_wave_loads_from_host_ram(hosts, async_sched):
    h = Harness(hosts, async_sched)
    rng = random.Random(1)
    prefixes = [rand_tokens(rng, 3 * BS + 5) for _ in range(3)]  # 3 full blocks each (+ a partial)
    for i, p in enumerate(prefixes):
        h.add(f"a{i}", p + rand_tokens(rng, 6))
    h.run()
    h.eng.settle()
    first = h.totals()
    prompt_blocks = sum(full_blocks(len(h.prompts[f"a{i}"])) for i in range(3))
    assert first["saves_issued"] == prompt_blocks == 9
    assert first["chunks_saved"] == prompt_blocks * hosts  # every host wrote its shard of each
    assert "chunks_loaded" not in first

    h.new_wave()
    for i, p in enumerate(prefixes):
        for j in range(2):
            h.add(f"b{i}{j}", p + rand_tokens(rng, 9 + j))
    h.run()
    h.check_idle()
    t = h.totals()
    assert t["chunks_loaded"] > 0 and t["hit_tokens"] > 0
    # Each wave-2 request shares 3 full blocks with wave 1 (its 4th block differs): 3 blocks each,
    # unless vLLM's prefix cache already has them from a sibling admitted earlier.
    assert t["hit_tokens"] % BS == 0 and t["hit_tokens"] <= 6 * 3 * BS
    assert t["chunks_loaded"] == hosts * t["hit_tokens"] // BS
    assert "load_errors" not in t
    h.check_loaded_bytes(min_blocks=hosts * 3)
    loaded_reqs = {r for _, r, *_ in h.loaded}
    assert loaded_reqs and all(r.startswith("b") for r in loaded_reqs)
    assert h.eng.finished >= set(h.prompts)


@pytest.mark.parametrize("hosts,async_sched", VARIANTS)
def test_local_prefix_hit_then_host_ram_beyond_it(hosts, async_sched):
    """vLLM's own prefix cache covers the first blocks, host RAM the next ones: the load must land
    in the request's blocks after the local hit."""
    h = Harness(hosts, async_sched)
    rng = random.Random(12)
    prompt = rand_tokens(rng, 5 * BS + 3)
    h.add("a", prompt, max_tokens=2)
    h.run()
    h.new_wave()
    h.add("b", prompt[:2 * BS] + rand_tokens(rng, 5), max_tokens=2)  # loads blocks 0-1 from host RAM
    h.run()
    h.add("c", prompt, max_tokens=2)  # blocks 0-1 from vLLM's cache (b's), 2-4 from host RAM
    h.run()
    h.check_idle()
    assert sorted({(r, i) for host, r, i, _, _ in h.loaded if host == 0}) == [
        ("b", 0), ("b", 1), ("c", 2), ("c", 3), ("c", 4)]
    h.check_loaded_bytes(min_blocks=5 * hosts)
    assert h.eng.outputs["c"] == h.eng.outputs["a"]


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("hosts,async_sched", [VARIANTS[0], VARIANTS[3]])
def test_multi_turn_reuses_saved_decode_blocks(hosts, async_sched, lazy):
    """save_decode_blocks: blocks filled by generated tokens are saved too, so the next turn of a
    chat (previous prompt + answer + new tokens) loads the answer's KV as well."""
    h = Harness(hosts, async_sched, extra={"cpu_bytes_to_use": 1 << 22, "save_decode_blocks": True,
                                            "lazy_offload": lazy})
    rng = random.Random(13)
    h.add("turn1", rand_tokens(rng, 2 * BS + 5), max_tokens=40)  # 77 tokens: KV for 76, 4 full blocks
    h.run()
    assert len(h.eng.outputs["turn1"]) == 40
    h.new_wave()
    h.add("turn2", h.prompts["turn1"] + h.eng.outputs["turn1"] + rand_tokens(rng, 10), max_tokens=2)
    h.run()
    h.check_idle()
    assert sorted({i for _, r, i, _, _ in h.loaded if r == "turn2"}) == [0, 1, 2, 3]  # 2 prompt + 2 decode
    h.check_loaded_bytes(min_blocks=4 * hosts)
    assert h.totals()["hit_tokens"] == 4 * BS

# ============================================================================ 2. parallel sampling
@pytest.mark.parametrize("hosts,async_sched", VARIANTS)
def test_parallel_sampling_n8_saves_each_chunk_once(hosts, async_sched):
    """n=8 reaches the scheduler as 8 requests with one prompt (vLLM's frontend fans it out)."""
    h = Harness(hosts, async_sched)
    prompt = rand_tokens(random.Random(2), 4 * BS + 7)  # 4 full blocks
    for k in range(8):
        h.add(f"s{k}", prompt, max_tokens=6)
    h.run()
    h.eng.settle()
    t = h.totals()
    assert t["saves_issued"] == 4
    assert t["chunks_saved"] == 4 * hosts
    assert "save_failures" not in t
    save_ids = [s for m in h.metas() for s in [*m.save.save_ids, *m.flush.save_ids]]
    assert len(save_ids) == len(set(save_ids)) == 4
    index = h.eng.offload.index
    assert len(index) == 4
    hashes = make_request("x", prompt, block_size=BS).block_hashes[:4]
    assert [index.state_of(index.slot_of(hh)) for hh in hashes] == [READY] * 4

    # All 8 siblings of a second batch read the same 4 host slots, concurrently.
    h.new_wave()
    for k in range(8):
        h.add(f"t{k}", prompt, max_tokens=6)
    h.run()
    h.check_idle()
    t = h.totals()
    assert t["saves_issued"] == 4  # nothing new to save
    # vLLM admits the 8 in one step; none can share another's blocks before its load lands, so
    # one plan carries 8 loads of the same 4 slots into 8 different block sets.
    with_loads = [m for m in h.metas() if m.loads]
    assert len(with_loads) == 1 and len(with_loads[0].loads) == 8
    assert len({ld.slots for ld in with_loads[0].loads}) == 1
    assert len({b for ld in with_loads[0].loads for b in ld.block_ids}) == 32
    assert t["chunks_loaded"] == 32 * hosts and t["hit_tokens"] == 32 * BS
    h.check_loaded_bytes(min_blocks=32 * hosts)
    assert h.eng.finished == set(h.prompts)
    outs = {tuple(h.eng.outputs[r]) for r in h.prompts}
    assert len(outs) == 1 and len(next(iter(outs))) == 6  # same prefix, same deterministic samples


# ============================================================================ 3. preemption
@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("hosts,async_sched", VARIANTS)
def test_preemption_resumed_requests_load_back(hosts, async_sched, lazy):
    h = Harness(hosts, async_sched, num_blocks=20, extra={"cpu_bytes_to_use": 1 << 22, "lazy_offload": lazy})
    rng = random.Random(3)
    held_after_finish: set[str] = set()

    def watch(eng):
        held_after_finish.update(r for r in eng.finished if r in eng.scheduler.requests)

    # 6 requests x (40 prompt + 40 generated) tokens need 30 blocks; the pool has 19.
    for i in range(6):
        h.add(f"p{i}", rand_tokens(rng, 40), max_tokens=40)
    h.run(on_step=watch)
    preempted = set(h.preempted())
    assert preempted, "the small pool must force vLLM to preempt"
    assert all(h.requests[r].num_preemptions >= 1 for r in preempted)
    assert sum(q.num_preemptions for q in h.requests.values()) == len(h.preempted())
    t = h.totals()
    resumed_loads = {r for _, r, *_ in h.loaded} & preempted
    assert resumed_loads, "a resumed request must load back what was saved"
    assert t["chunks_loaded"] > 0 and t["hit_tokens"] > 0
    assert t["saves_issued"] == 6 * 2  # 2 full prompt blocks per request, each saved once
    h.check_loaded_bytes(min_blocks=hosts)
    assert h.eng.finished == set(h.prompts)
    assert all(len(h.eng.outputs[r]) == 40 for r in h.prompts)

    metas = h.metas()
    if lazy:
        assert all(len(m.save) == 0 for m in metas)  # nothing saved while running
        # Preempted requests are flushed in the very step that preempted them.
        flushed_at_preemption = [so for so in h.outputs if so.preempted_req_ids and len(so.kv_connector_metadata.plan.flush)]
        assert flushed_at_preemption
        delayed = {r for r, d in h.finished_answers.items() if d}
        assert delayed, "finished requests with unsaved blocks are held"
        assert delayed <= held_after_finish
        released = [m for m in metas if m.release_req_ids]
        assert {r for m in released for r in m.release_req_ids} == delayed
        for m in released:  # released in the step whose flush saves their blocks
            for r in m.release_req_ids:
                assert set(m.flush.block_ids) & set(h.finished_blocks[r]), r
        assert not h.released_too_early
    else:
        assert not any(h.finished_answers.values())
        assert all(len(m.flush) == 0 for m in metas)

    # Wave 2: the same prompts after vLLM forgot its prefix cache still hit host RAM.
    h.new_wave()
    loaded_before = h.totals().get("chunks_loaded", 0)
    for i in range(3):
        h.add(f"q{i}", h.prompts[f"p{i}"], max_tokens=2)
    h.run(on_step=watch)
    h.check_idle()
    assert h.totals()["chunks_loaded"] - loaded_before == 3 * 2 * hosts
    h.check_loaded_bytes()


# ============================================================================ 4. chunked prefill
@pytest.mark.parametrize("hosts,async_sched", VARIANTS)
def test_chunked_prefill_saves_as_blocks_fill(hosts, async_sched):
    h = Harness(hosts, async_sched, max_num_batched_tokens=32, num_blocks=48)
    rng = random.Random(4)
    prompts = [rand_tokens(rng, 5 * BS + 3) for _ in range(2)]  # 5 full blocks; 3 steps of 32 each
    for i, p in enumerate(prompts):
        h.add(f"c{i}", p, max_tokens=3)
    h.run()
    h.eng.settle()
    steps_with_saves = [len(m.save) for m in h.metas() if len(m.save)]
    assert sum(steps_with_saves) == 10
    assert len(steps_with_saves) >= 5 and max(steps_with_saves) <= 2  # a block saved as soon as it is full
    # Each save is planned in exactly the step whose forward fills the block (mirror vLLM's
    # per-request block tables from the SchedulerOutputs, as a model runner does).
    blocks: dict[str, list[int]] = {}
    computed: dict[str, int] = {}
    for so in h.outputs:
        for new in so.scheduled_new_reqs:
            blocks[new.req_id] = list(new.block_ids[0])
            computed[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for i, r in enumerate(cached.req_ids):
            if cached.new_block_ids[i] is not None:
                blocks[r].extend(cached.new_block_ids[i][0])
            computed[r] = cached.num_computed_tokens[i]
        filled = set()
        for r, n in so.num_scheduled_tokens.items():
            filled.update(blocks[r][computed[r] // BS:min((computed[r] + n) // BS, 5)])
        assert set(so.kv_connector_metadata.plan.save.block_ids) == filled
    h.new_wave()
    for i, p in enumerate(prompts):
        h.add(f"d{i}", p + rand_tokens(rng, 40), max_tokens=3)  # loads 5 blocks, then 3 chunks
    h.run()
    h.check_idle()
    t = h.totals()
    assert t["chunks_loaded"] == 2 * 5 * hosts and t["hit_tokens"] == 2 * 5 * BS
    h.check_loaded_bytes(min_blocks=10 * hosts)
    assert h.eng.finished == set(h.prompts)


# ============================================================================ 5. aborts
@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("hosts,async_sched", VARIANTS)
def test_aborts_mid_flight_leak_nothing(hosts, async_sched, lazy):
    h = Harness(hosts, async_sched, max_num_batched_tokens=64,
                extra={"cpu_bytes_to_use": 1 << 22, "lazy_offload": lazy})
    rng = random.Random(5)
    prefixes = [rand_tokens(rng, 3 * BS) for _ in range(4)]
    for i, p in enumerate(prefixes):
        h.add(f"w{i}", p + rand_tokens(rng, 4), max_tokens=2)
    h.run()
    h.new_wave()

    # Wave 2: requests that load a prefix, long ones in chunked prefill, and one never scheduled.
    for i, p in enumerate(prefixes):
        h.add(f"load{i}", p + rand_tokens(rng, 20), max_tokens=8)
    for i in range(3):
        h.add(f"long{i}", rand_tokens(rng, 6 * BS + 2), max_tokens=8)
    h.add("never", rand_tokens(rng, 40), max_tokens=8)
    aborted: dict[str, str] = {}  # req_id -> status when aborted
    load_done_at_abort: list[bool] = []  # for requests aborted while waiting for their load

    def abort(eng, req_id):
        status = eng.scheduler.requests[req_id].status
        if status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            load_done_at_abort.append(req_id in eng.scheduler.finished_recving_kv_req_ids)
        assert eng.scheduler.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)
        aborted[req_id] = status.name

    abort(h.eng, "never")

    def on_step(eng):
        reqs = eng.scheduler.requests
        loading = [r for r, q in reqs.items() if q.status == RequestStatus.WAITING_FOR_REMOTE_KVS and r not in aborted]
        if loading and not any(s == "WAITING_FOR_REMOTE_KVS" for s in aborted.values()):
            abort(eng, loading[0])
        for r, q in list(reqs.items()):
            if r in aborted or q.is_finished() or q.status != RequestStatus.RUNNING:
                continue
            if r == "long0" and 0 < q.num_computed_tokens < q.num_prompt_tokens:
                abort(eng, r)  # mid chunked prefill
            elif r in ("long1", "load1") and q.num_output_tokens >= 2:
                abort(eng, r)  # mid decode

    h.run(on_step=on_step)
    assert {"never", "long0", "long1", "load1"} <= set(aborted)
    assert "WAITING_FOR_REMOTE_KVS" in aborted.values(), aborted
    # With the async scheduler the load's completion has not been processed yet: vLLM keeps the
    # aborted request's blocks until finished_recving arrives (the load is still writing them).
    assert load_done_at_abort == [not async_sched]
    assert not (set(aborted) & h.eng.finished)
    assert h.eng.finished == set(h.prompts) - set(aborted)
    assert h.totals()["chunks_loaded"] > 0
    h.check_loaded_bytes()
    if lazy:  # an aborted running request is flushed like a finished one
        assert h.finished_answers["long1"] is True
    h.check_idle()


# ============================================================================ 6. host RAM pressure
@pytest.mark.parametrize("limit", ["ram", "staging"])
@pytest.mark.parametrize("hosts,async_sched", [VARIANTS[0], VARIANTS[3]])
def test_host_ram_pressure_skips_and_evicts(hosts, async_sched, limit):
    if limit == "ram":  # 4 chunks of host RAM for 24 distinct chunks
        extra = {"cpu_bytes_to_use": 4 * CHUNK}
    else:  # plenty of RAM, but only 2 chunks may be in flight
        extra = {"cpu_bytes_to_use": 1 << 22, "staging_bytes": 2 * CHUNK}
    h = Harness(hosts, async_sched, extra=extra)
    rng = random.Random(6)
    prefixes = [rand_tokens(rng, 3 * BS) for _ in range(8)]
    max_chunks = []
    for wave in range(2):
        for i, p in enumerate(prefixes):
            h.add(f"r{wave}{i}", p + rand_tokens(rng, 5), max_tokens=2)
        h.run(on_step=lambda eng: max_chunks.append(len(eng.offload.index)))
        if wave == 0:
            h.new_wave()
    h.check_idle()
    t = h.totals()
    index = h.eng.offload.index
    # Every full prompt block of every request (16 requests x 3) is accounted exactly once: saved,
    # already held (dedup), or skipped for lack of host RAM or of staging.
    assert (t["saves_issued"] + t.get("dedup_batch", 0) + t.get("dedup_index", 0) + t.get("skipped_no_space", 0)
            + t.get("skipped_staging", 0)) == 16 * 3
    # Every save was confirmed; what is not held any more was evicted.
    assert t["ledger_confirmed"] == t["saves_issued"] and len(index) == t["saves_issued"] - t.get("evicted", 0)
    if limit == "ram":
        assert index.num_slots == 4
        assert max(max_chunks) <= 4
        assert t["skipped_no_space"] > 0 and t["evicted"] > 0
        assert "skipped_staging" not in t
    else:
        assert h.eng.offload.staging.capacity == 2 * CHUNK
        assert t["skipped_staging"] > 0
        assert "skipped_no_space" not in t and "evicted" not in t
        # Nothing is evicted, and each step's cut keeps the first candidates, a prefix's head
        # blocks: wave 2 hits. (Under RAM pressure whether any head chunk survives LRU eviction
        # depends on when the saves were confirmed, so no hit is asserted there.)
        assert t["hit_tokens"] > 0
    assert t["chunks_saved"] == t["saves_issued"] * hosts and "save_failures" not in t
    assert "load_errors" not in t
    h.check_loaded_bytes(min_blocks=0)
    assert h.eng.finished == set(h.prompts)


def test_staging_budget_is_not_spent_on_sibling_duplicates():
    """8 siblings are scheduled in one step and share the 4 prompt blocks (vLLM hands s1..s7 the
    blocks s0 is computing): 32 save candidates, 4 distinct. Dedup happens before the staging cut,
    so the 2 chunks that fit are 2 distinct ones, and only the 2 distinct chunks left out are
    counted as skipped (never the duplicate copies)."""
    h = Harness(1, False, extra={"cpu_bytes_to_use": 1 << 22, "staging_bytes": 2 * CHUNK})
    prompt = rand_tokens(random.Random(66), 4 * BS + 7)
    for k in range(8):
        h.add(f"s{k}", prompt, max_tokens=2)
    h.run()
    h.check_idle()
    first = h.metas()[0]
    assert len(first.save) == 2 and len(set(first.save.save_ids)) == 2
    hashes = make_request("x", prompt, block_size=BS).block_hashes[:4]
    index = h.eng.offload.index
    assert [index.contains(x) for x in hashes] == [True, True, False, False]
    t = h.totals()
    # The 28 copies are the siblings' (one step: within the batch); never counted as skipped.
    assert t["saves_issued"] == 2 and t["skipped_staging"] == 2 and t["dedup_batch"] == 32 - 4
    assert "dedup_index" not in t


# ============================================================================ 7. failed loads
@pytest.mark.parametrize("hosts,async_sched", VARIANTS)
def test_failed_load_on_one_host_recomputes(hosts, async_sched):
    fault = LoseSlots(times=1)
    h = Harness(hosts, async_sched, faults=[None] * (hosts - 1) + [fault])
    rng = random.Random(7)
    prefixes = [rand_tokens(rng, 4 * BS) for _ in range(2)]
    for i, p in enumerate(prefixes):
        h.add(f"a{i}", p + rand_tokens(rng, 3), max_tokens=5)
    h.run()
    h.new_wave()
    for i, p in enumerate(prefixes):
        h.add(f"b{i}", h.prompts[f"a{i}"], max_tokens=5)
    h.run(max_steps=200)
    h.check_idle()
    t = h.totals()
    assert t["load_errors"] == fault.lost == 1
    assert h.eng.stats.totals()["discarded"] == 1
    assert len(h.load_failed) == 1 and h.load_failed[0][0] == hosts - 1
    # vLLM recomputed: every request finished with the outputs the model gives without offload.
    assert h.eng.finished == set(h.prompts)
    for i in range(2):
        assert h.eng.outputs[f"b{i}"] == h.eng.outputs[f"a{i}"]
    # The lost chunk (its save id) is never offered again.
    _, lost_req, lost_block = h.load_failed[0]
    loads = [(step, ld.req_id, b, sid) for step, m in enumerate(h.metas()) for ld in m.loads
             for b, sid in zip(ld.block_ids, ld.save_ids)]
    lost_step, _, _, lost_sid = next(x for x in loads if x[1:3] == (lost_req, lost_block))
    assert not [x for x in loads if x[3] == lost_sid and x[0] != lost_step]
    h.check_loaded_bytes(min_blocks=hosts)


@pytest.mark.parametrize("hosts,async_sched", [VARIANTS[1], VARIANTS[3]])
def test_persistent_load_failures_do_not_loop(hosts, async_sched):
    """Host 1 loses every slot it is asked to load: each attempt fails, the chunk is dropped, vLLM
    recomputes, the recomputed chunk is saved again, and the requests still finish."""
    fault = LoseSlots(times=10**9, every=True)
    h = Harness(hosts, async_sched, faults=[None, fault])
    rng = random.Random(8)
    prompt = rand_tokens(rng, 3 * BS + 4)
    h.add("a", prompt, max_tokens=3)
    h.run()
    for wave in range(3):
        h.new_wave()
        for k in range(2):
            h.add(f"b{wave}{k}", prompt, max_tokens=3)
        h.run(max_steps=100)
    h.check_idle()
    t = h.totals()
    assert t["load_errors"] == fault.lost > 0
    attempts = Counter(ld.req_id for m in h.metas() for ld in m.loads)
    assert attempts and max(attempts.values()) <= 2
    # a failed chunk is offered to the requests of one scheduling step at most
    for sid in {sid for m in h.metas() for ld in m.loads for sid in ld.save_ids}:
        steps = {i for i, m in enumerate(h.metas()) for ld in m.loads if sid in ld.save_ids}
        assert len(steps) == 1, (sid, steps)
    assert h.eng.finished == set(h.prompts)
    assert all(h.eng.outputs[r] == h.eng.outputs["a"] for r in h.prompts)


# ============================================================================ 8. seed hazards
def report(*entries) -> KVConnectorOutput:
    """A KVConnectorOutput as vLLM hands it to update_connector_output, carrying worker reports
    (host, save_id, ok) already merged the way KVOutputAggregator merges them."""
    merged = OffloadWorkerReport()
    for host, sid, ok in entries:
        merged = merged.aggregate(OffloadWorkerReport.from_host(host, [sid] if ok else [], [] if ok else [sid]))
    return KVConnectorOutput(kv_connector_worker_meta=merged)


def test_odd_completion_signals_are_tolerated_and_counted_once():
    h = Harness(2, False)
    eng, off = h.eng, h.eng.offload
    rng = random.Random(9)
    # Every worker report is lost: 3 saves stay pending (staged, not loadable).
    eng.drop_report = lambda step, host: True
    h.add("a", rand_tokens(rng, 3 * BS + 2), max_tokens=2)
    h.run()
    eng.settle()
    saved = [(sid, slot) for m in h.metas() for sid, slot in zip(m.save.save_ids, m.save.slots)]
    (s0, _), (s1, _), (s2, _) = saved
    slot = dict(saved)
    assert len(off.ledger) == 3 and off.index.num_saving() == 3 and off.staging.in_use == 3 * CHUNK
    led = off.ledger.counters
    led.clear()

    def state(sid):
        return off.index.state_of(slot[sid]) if off.index.save_id_of(slot[sid]) == sid else None

    off.update_connector_output(report((0, s0, True)))
    assert state(s0) == SAVING  # one host of two
    off.update_connector_output(report((0, s0, True)))  # duplicate
    assert led[C.LEDGER_DUPLICATE] == 1 and state(s0) == SAVING
    assert off.staging.in_use == 3 * CHUNK
    off.update_connector_output(report((1, s0, True)))
    assert state(s0) == READY and off.staging.in_use == 2 * CHUNK
    off.update_connector_output(report((1, s0, True), (0, s0, True)))  # late: already resolved
    assert led[C.LEDGER_LATE] == 2 and state(s0) == READY and off.staging.in_use == 2 * CHUNK
    assert led[C.LEDGER_CONFIRMED] == 1

    # Both hosts in one merged report; then the same merged report again (all late).
    off.update_connector_output(report((0, s1, True), (1, s1, True)))
    off.update_connector_output(report((0, s1, True), (1, s1, True)))
    assert state(s1) == READY and led[C.LEDGER_CONFIRMED] == 2 and led[C.LEDGER_LATE] == 4
    # A failure from one host drops the chunk at once; the other host's success is then late.
    off.update_connector_output(report((1, s2, False)))
    off.update_connector_output(report((0, s2, True)))
    assert state(s2) is None and led[C.LEDGER_FAILED] == 1 and led[C.LEDGER_LATE] == 5
    assert off.staging.in_use == 0 and len(off.ledger) == 0 and off.index.num_saving() == 0
    # Unknown hosts, unknown requests, blocks that were never loading: counted, never raised.
    off.update_connector_output(report((7, s0, True)))
    assert led[C.LEDGER_UNKNOWN_HOST] == 1
    before = off.counters[C.UNKNOWN_REQUEST]
    off.update_connector_output(KVConnectorOutput(finished_sending={"never-seen"}, finished_recving={"nor-this"},
                                                  invalid_block_ids={1, 2, 3}))
    assert off.counters[C.UNKNOWN_REQUEST] == before + 2
    assert state(s0) == READY and state(s1) == READY

    # Early: host 1's confirmation of a save id the scheduler has not handed out yet is staged,
    # then resolves that save when it is registered (host 1's real report is lost).
    nxt = off.ledger.next_save_id
    off.update_connector_output(report((1, nxt, True)))
    assert led[C.LEDGER_EARLY] == 1 and off.index.num_saving() == 0
    eng.drop_report = lambda step, host: host == 1
    h.add("b", rand_tokens(rng, BS + 3), max_tokens=2)  # exactly one full block: one save, id nxt
    h.run()
    eng.settle()
    assert [sid for m in h.metas() for sid in m.save.save_ids][-1] == nxt
    assert len(off.index.ready_prefix(make_request("x", h.prompts["b"], block_size=BS).block_hashes[:1])) == 1
    assert len(off.ledger) == 0 and off.staging.in_use == 0

    # The confirmed chunks really load, byte for byte, on both hosts.
    eng.drop_report = None
    h.new_wave()
    h.add("a2", h.prompts["a"], max_tokens=2)
    h.add("b2", h.prompts["b"] + rand_tokens(rng, 20), max_tokens=2)
    h.run()
    h.check_idle()
    assert {(r, i) for _, r, i, _, _ in h.loaded} == {("a2", 0), ("a2", 1), ("b2", 0)}
    h.check_loaded_bytes(min_blocks=2 * 3)


@pytest.mark.parametrize("hosts,async_sched", [VARIANTS[0], VARIANTS[3]])
def test_dropped_reports_expire_and_release_staging(hosts, async_sched):
    h = Harness(hosts, async_sched, extra={"cpu_bytes_to_use": 1 << 22, "save_timeout_s": 1.0})
    eng, off = h.eng, h.eng.offload
    now = [100.0]
    off.clock = lambda: now[0]  # the scheduler's monotonic clock, under the test's control
    eng.drop_report = lambda step, host: host == hosts - 1  # one host's reports never arrive
    prompt = rand_tokens(random.Random(10), 2 * BS + 1)
    h.add("a", prompt, max_tokens=2)
    h.run()
    eng.settle()
    sids = [sid for m in h.metas() for sid in m.save.save_ids]
    assert len(sids) == 2 and off.staging.in_use == 2 * CHUNK and len(off.ledger) == 2
    now[0] += 0.9
    eng.settle()
    assert len(off.ledger) == 2  # not yet
    now[0] += 0.2
    eng.settle()  # the next plan expires them
    assert off.staging.in_use == 0 and len(off.ledger) == 0 and len(off.index) == 0
    assert eng.stats.totals()["ledger_expired"] == 2
    # A report that shows up after all is late, never resurrects the chunk.
    off.update_connector_output(report(*[(hosts - 1, sid, True) for sid in sids]))
    assert off.ledger.counters[C.LEDGER_LATE] == 2 and len(off.index) == 0
    # Never loadable: the same prompt is recomputed (and saved again, this time confirmed).
    eng.drop_report = None
    h.new_wave()
    h.add("b", prompt, max_tokens=2)
    h.run()
    h.check_idle()
    assert not h.loaded and "chunks_loaded" not in h.totals()
    assert h.totals()["saves_issued"] == 4 and len(off.index) == 2
    assert h.eng.outputs["b"] == h.eng.outputs["a"]


# ============================================================================ 9. stats
def test_stats_survive_vllm_serialization_and_merge_by_union():
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: F401
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from tpuoffload.stats import make_report

    # Real stats, from a 2-host run with saves and loads.
    h = Harness(2, False)
    rng = random.Random(11)
    prompt = rand_tokens(rng, 2 * BS + 3)
    h.add("a", prompt, max_tokens=2)
    h.run()
    h.new_wave()
    h.add("b", prompt, max_tokens=2)
    h.run()
    h.check_idle()
    stats = h.eng.stats
    want = stats.reduce()
    assert want["chunks_saved"] == 4 and want["chunks_loaded"] == 4 and want["saves_issued"] == 2
    assert want["hit_tokens"] == 2 * BS

    # Engine core -> frontend: vLLM's msgpack encoder, inside the real EngineCoreOutputs.
    out = EngineCoreOutputs(scheduler_stats=SchedulerStats(kv_connector_stats=stats.to_dict()))
    decoded = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(out))
    data = decoded.scheduler_stats.kv_connector_stats
    assert data == stats.data
    rebuilt = TPUOffloadConnector.build_kv_connector_stats(data)
    assert isinstance(rebuilt, OffloadStats) and rebuilt.reduce() == want
    # ... and pickle (the multiprocessing executors and Ray).
    assert pickle.loads(pickle.dumps(stats)).reduce() == want
    assert TPUOffloadConnector.build_kv_connector_stats(pickle.loads(pickle.dumps(stats.to_dict()))).reduce() == want
    assert TPUOffloadConnector.build_kv_connector_stats(None).is_empty()

    # The frontend's accumulator, fed the same dict twice (a re-delivered interval), counts it once.
    kv_logging = KVConnectorLogging(h.eng.scheduler.vllm_config.kv_transfer_config)
    kv_logging.observe(data)
    kv_logging.observe(dict(data))
    assert kv_logging.transfer_stats_accumulator.reduce() == want

    # Counter-union algebra.
    a = OffloadStats(make_report(0, 1, {"chunks_saved": 5, "bytes_saved": 50, "save_seconds": 0.5}))
    b = OffloadStats(make_report(1, 1, {"chunks_saved": 5, "bytes_saved": 50, "save_seconds": 0.5}))
    c = OffloadStats(make_report("sched", 1, {"saves_issued": 5, "lookup_tokens": 100, "hit_tokens": 25}))
    d = OffloadStats(make_report(0, 2, {"chunks_loaded": 3}))
    assert a.aggregate(a).data == a.data  # idempotent
    assert a.aggregate(b).data == b.aggregate(a).data  # order-free
    assert a.aggregate(b).aggregate(c).data == a.aggregate(b.aggregate(c)).data  # associative
    merged = d.aggregate(c).aggregate(b).aggregate(a).aggregate(b)
    r = merged.reduce()
    assert r["chunks_saved"] == 10 and r["bytes_saved"] == 100  # two hosts' identical counters add up
    assert r["saves_issued"] == 5 and r["chunks_loaded"] == 3 and r["hit_rate"] == 0.25
    # Through vLLM's own per-step merge of the workers' outputs.
    agg = KVOutputAggregator(expected_finished_count=2)
    outs = [h.eng.runners[0].execute(h.eng.scheduler.schedule(), None) for _ in range(2)]
    outs[0].kv_connector_output = KVConnectorOutput(kv_connector_stats=a)
    outs[1].kv_connector_output = KVConnectorOutput(kv_connector_stats=b)
    assert agg.aggregate(outs).kv_connector_output.kv_connector_stats.reduce()["chunks_saved"] == 10


# ============================================================================ 10. reporting workers
def test_one_worker_with_tensor_parallel_8_gets_hits():
    """tpu-inference on one host: the 'uni' executor, one JAX process holding all 8 chips, while
    vLLM's world size is 8. One confirmation per chunk, one report per request for vLLM's
    aggregator, and the per-host chunk is the whole page (one reporting process)."""
    h = Harness(1, False, scheduler_kwargs={
        "parallel_overrides": {"tensor_parallel_size": 8, "distributed_executor_backend": "uni"}})
    conn = h.eng.scheduler.connector
    assert h.eng.scheduler.vllm_config.parallel_config.world_size == 8
    assert conn.get_finished_count() == 1 and h.eng.offload.num_hosts == 1
    prompt = rand_tokens(random.Random(30), 3 * BS + 2)
    h.add("a", prompt, max_tokens=2)
    h.run()
    h.new_wave()
    h.add("b", prompt, max_tokens=2)
    h.run()
    h.check_idle()
    t = h.totals()
    assert t[C.LEDGER_CONFIRMED] == t[C.SAVES_ISSUED] == 3 and C.LEDGER_EXPIRED not in t
    assert t[C.HIT_TOKENS] == 3 * BS and t[C.CHUNKS_LOADED] == 3
    h.check_loaded_bytes(min_blocks=3)
    assert TPUOffloadConnector.supports_sleep_mode() is False and conn.supports_sleep_mode() is False


def test_fewer_reporting_workers_than_expected_is_reported_loudly(caplog):
    """The scheduler expects 2 reporting workers (num_hosts), only one exists: no save can ever be
    confirmed. Within a few steps an error names the missing host and the setting. (Host RAM in
    chunks, so the slot counts agree and nothing else gives the mismatch away.)"""
    h = Harness(1, False, extra={"num_cpu_chunks": 64, "num_hosts": 2}, same_chunk=False)
    assert h.eng.offload.num_hosts == 2
    with caplog.at_level(logging.ERROR, logger="tpuoffload"):
        h.add("a", rand_tokens(random.Random(31), 2 * BS + 1), max_tokens=12)
        h.run()
    t = h.totals()
    assert t[C.REPORTERS_MISSING] == 1 and C.LEDGER_CONFIRMED not in t
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("expects 2 reporting workers" in m and "host(s) [1] never reported" in m and "num_hosts" in m
               for m in errors), errors


def test_more_reporting_workers_than_expected_is_reported_loudly(caplog):
    """Two workers report, the scheduler expects one: host 1's reports are refused and named."""
    h = Harness(2, False, extra={"num_cpu_chunks": 64, "num_hosts": 1}, same_chunk=False)
    assert h.eng.offload.num_hosts == 1 and h.eng.scheduler.connector.get_finished_count() == 1
    with caplog.at_level(logging.ERROR, logger="tpuoffload"):
        h.add("a", rand_tokens(random.Random(32), 2 * BS + 1), max_tokens=2)
        h.run()
        h.eng.settle()
    t = h.totals()
    assert t[C.LEDGER_UNKNOWN_HOST] == 2 and t[C.LEDGER_CONFIRMED] == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert sum("reported as host 1" in m for m in errors) == 1, errors


def test_reporting_workers_follow_the_executor():
    """The count vLLM's aggregator waits for and each chunk's confirmations, per executor."""
    from types import SimpleNamespace

    from tpuoffload.manager.topology import host_chunk_bytes, reporting_workers

    def cfg(backend, tp=8, pp=1, group=None):
        pc = SimpleNamespace(distributed_executor_backend=backend, pipeline_parallel_size=pp,
                             world_size=tp * pp, placement_group=group)
        return SimpleNamespace(parallel_config=pc)

    tpu_mp = type("MultiprocExecutor", (), {"__module__": "tpu_inference.executors.multiproc_executor"})
    tpu_ray = type("RayDistributedExecutorV2", (), {"__module__": "tpu_inference.executors.ray_distributed_executor_v2",
                                                    "uses_ray": True})
    group = SimpleNamespace(bundle_specs=[{"TPU": 4}] * 4)
    assert reporting_workers(cfg("uni"))[0] == 1
    assert reporting_workers(cfg(tpu_mp, tp=8, pp=2))[0] == 2
    assert reporting_workers(cfg(tpu_ray, tp=16, group=group))[0] == 4
    assert reporting_workers(cfg("mp", tp=4))[0] == 4  # vLLM's own executors: one process per rank
    assert reporting_workers(cfg("uni"), override=3) == (3, "kv_connector_extra_config['num_hosts']")
    kv = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=SimpleNamespace(page_size_bytes=4096),
                                                          layer_names=["a", "b", "c"])])
    assert host_chunk_bytes(kv, 1) == 3 * 4096 and host_chunk_bytes(kv, 4) == 3 * 1024
    with pytest.raises(ValueError, match="does not divide"):
        host_chunk_bytes(kv, 5)
