"""vLLM's reset paths against the connector (issue 12, part 1), with vLLM's real schedulers.

``scheduler.reset_prefix_cache(reset_running_requests=True)`` and ``pause_scheduler(mode="keep",
clear_cache=True)`` preempt running requests outside ``schedule()``. The next ``schedule()``
re-admits them, finds their prefix in host RAM (a load vLLM then waits for) and also lists them in
``preempted_req_ids``. Before the scheduler half reconciled vLLM's view of each request, it handled
the preemption after the admission and dropped the load: the requests waited in
WAITING_FOR_REMOTE_KVS forever (reproduced on commit d4f92f2 with the sync Scheduler, 1 and 2
hosts, eager and lazy: ``engine not idle`` with every request stuck there).

How the engine core runs these resets (vllm/v1/engine/core.py): ``pause_scheduler(mode="keep")``
sets PAUSED_ALL (nothing is scheduled), keeps stepping until the engine has no work (in-flight
batches processed, finished requests released), then resets with ``reset_running_requests=True,
reset_connector=True`` and later resumes. A direct ``reset_prefix_cache(reset_running_requests=True)``
with a batch in flight (AsyncScheduler) is refused by vLLM itself (the preempted requests' blocks
are freed only when the in-flight step is processed), so with the AsyncScheduler the tests reset
after such a drain, as the engine core's pause does.
"""

from __future__ import annotations

import random

import pytest

from vllm.v1.core.sched.interface import PauseState
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from offload_harness import BS, Harness, chunk_bytes, rand_tokens
from tpuoffload import counters as C
from tpuoffload.messages import OffloadWorkerReport
from tpuoffload.worker.faults import FaultInjector, FaultPoint

VARIANTS = [
    pytest.param(1, False, id="1host-sync"),
    pytest.param(2, False, id="2host-sync"),
    pytest.param(1, True, id="1host-async"),
    pytest.param(2, True, id="2host-async"),
]
MODES = [pytest.param(False, id="eager"), pytest.param(True, id="lazy")]


@pytest.fixture
def harnesses():
    made: list[Harness] = []
    yield made
    for h in made:
        h.close()


def drain_paused(h: Harness, max_steps: int = 200) -> None:
    """PAUSED_ALL, then step until the engine has no work: what pause_scheduler(mode="keep") waits for."""
    h.eng.scheduler.set_pause_state(PauseState.PAUSED_ALL)
    for _ in range(max_steps):
        if not h.eng.has_work():
            return
        h.eng.step()
    raise AssertionError("engine did not drain while paused")


def reset(h: Harness, kind: str) -> None:
    """``reset_running``: reset_prefix_cache(reset_running_requests=True) between steps (after a
    drain when a batch may be in flight); ``pause_keep``: pause_scheduler(mode="keep",
    clear_cache=True) then resume."""
    sched = h.eng.scheduler
    if kind == "pause_keep" or h.eng.spec.async_scheduling:
        drain_paused(h)
    connector = kind == "pause_keep"
    assert sched.reset_prefix_cache(reset_running_requests=True, reset_connector=connector)
    sched.set_pause_state(PauseState.UNPAUSED)


def track_connector_resets(h: Harness) -> list[tuple[int, int]]:
    """(index of the next SchedulerOutput, first save id handed out after it) per connector reset:
    no load planned after a reset may read a save id below it."""
    off = h.eng.offload
    marks: list[tuple[int, int]] = []
    orig = off.reset_cache

    def reset_cache():
        marks.append((len(h.outputs), off.ledger.next_save_id))
        return orig()

    off.reset_cache = reset_cache
    return marks


def check_nothing_saved_before_a_reset_is_loaded(h: Harness, marks) -> None:
    metas = h.metas()
    for first_output, first_id in marks:
        for m in metas[first_output:]:
            for load in m.loads:
                assert all(sid >= first_id for sid in load.save_ids), (m.step, load, first_id)


@pytest.mark.parametrize("kind", ["reset_running", "pause_keep"])
@pytest.mark.parametrize("lazy", MODES)
@pytest.mark.parametrize("hosts,async_sched", VARIANTS)
def test_reset_with_running_requests_that_hit_host_ram(harnesses, hosts, async_sched, lazy, kind):
    h = Harness(hosts, async_sched, extra={"cpu_bytes_to_use": 1 << 22, "lazy_offload": lazy})
    harnesses.append(h)
    marks = track_connector_resets(h)
    rng = random.Random(21)
    prompts = [rand_tokens(rng, 3 * BS + 5) for _ in range(3)]
    for i, p in enumerate(prompts):
        h.add(f"a{i}", p, max_tokens=2)
    h.run()
    h.new_wave()  # vLLM forgets; host RAM keeps the three prefixes
    for i, p in enumerate(prompts):
        h.add(f"b{i}", p + rand_tokens(rng, 3), max_tokens=24)
    for _ in range(100):  # until every b request runs and has decoded a few tokens
        h.eng.step()
        reqs = [h.eng.scheduler.requests[f"b{i}"] for i in range(3)]
        if all(r.status == RequestStatus.RUNNING and r.num_output_tokens >= 3 for r in reqs):
            break
    else:
        raise AssertionError("the b requests never ran")
    assert {ld.req_id for m in h.metas() for ld in m.loads} == {"b0", "b1", "b2"}
    before = len(h.outputs)

    reset(h, kind)
    h.run(max_steps=300)  # before the fix: "engine not idle after 300 steps", all stuck loading

    after = h.outputs[before:]
    preempted = {r for so in after for r in (so.preempted_req_ids or ())}
    assert preempted == {"b0", "b1", "b2"}
    reloads = {ld.req_id for so in after for ld in so.kv_connector_metadata.plan.loads}
    if kind == "reset_running":
        # Re-admitted in the schedule() that reports the preemption, with a load of the prefix.
        first = next(so for so in after if so.preempted_req_ids)
        assert {ld.req_id for ld in first.kv_connector_metadata.plan.loads} == {"b0", "b1", "b2"}
        assert reloads == {"b0", "b1", "b2"}
    else:  # the connector was reset too: nothing from before may come back
        assert len(marks) == 1
        check_nothing_saved_before_a_reset_is_loaded(h, marks)
    h.check_idle()
    h.check_loaded_bytes(min_blocks=3 * hosts)
    assert h.eng.finished == set(h.prompts)
    for i in range(3):
        assert len(h.eng.outputs[f"b{i}"]) == 24
    assert h.totals().get(C.LOADS_CANCELLED, 0) == 0


@pytest.mark.parametrize("hosts,async_sched", [VARIANTS[0], VARIANTS[3]])
def test_reset_cache_revokes_saves_in_flight(harnesses, hosts, async_sched):
    """reset_cache() with saves not yet confirmed: their late confirmations free the slots and
    never make them loadable; the same prompt after the reset recomputes and saves again."""
    h = Harness(hosts, async_sched)
    harnesses.append(h)
    off = h.eng.offload
    marks = track_connector_resets(h)
    h.eng.drop_report = lambda step, host: True  # confirmations held back
    prompt = rand_tokens(random.Random(22), 3 * BS + 1)
    h.add("a", prompt, max_tokens=2)
    h.run()
    h.eng.settle()
    assert off.index.num_saving() == 3 and len(off.ledger) == 3
    assert h.eng.scheduler.reset_prefix_cache(reset_connector=True)
    assert off.index.num_saving() == 3 and len(off.index) == 0  # slots kept until resolved
    h.eng.drop_report = None
    # The held-back confirmations arrive now, after the reset, from every host.
    sids = [sid for m in h.metas() for sid in m.save.save_ids]
    late = OffloadWorkerReport()
    for host in range(hosts):
        late = late.aggregate(OffloadWorkerReport.from_host(host, sids))
    off.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=late))
    assert off.index.num_saving() == 0 and len(off.index) == 0 and off.staging.in_use == 0
    assert off.index.num_free_slots == off.index.num_slots
    h.new_wave()
    h.add("b", prompt, max_tokens=2)
    h.run()
    h.check_idle()
    check_nothing_saved_before_a_reset_is_loaded(h, marks)
    assert not h.loaded
    assert h.totals()[C.SAVES_ISSUED] == 6 and h.totals()[C.REVOKED] == 3
    assert h.eng.outputs["b"] == h.eng.outputs["a"]


# ---------------------------------------------------------------------------- seeded soak
class FlakyReads(FaultInjector):
    """Chaos on one host: now and then a load's slot read fails for one position."""

    def __init__(self, seed: int, p: float) -> None:
        self.rng = random.Random(seed)
        self.p = p

    def hit(self, point: FaultPoint, n: int) -> set[int]:
        if point is FaultPoint.LOAD_SLOT_CHECK and n and self.rng.random() < self.p:
            return {self.rng.randrange(n)}
        return set()


def run_random_workload(h: Harness, seed: int, steps: int) -> dict:
    """Arrivals (shared prefixes, n > 1 siblings), aborts, resets of every kind (with and without
    running requests, with and without the connector), pauses, dropped worker reports, under
    preemption pressure; then drain. Returns what happened."""
    rng = random.Random(seed)
    eng, sched, off = h.eng, h.eng.scheduler, h.eng.offload
    now = [0.0]
    off.clock = lambda: now[0]  # save deadlines in simulated time: 0.1 s per step
    marks = track_connector_resets(h)
    prefixes = [rand_tokens(rng, rng.choice((BS, 2 * BS, 3 * BS))) for _ in range(5)]
    aborted: set[str] = set()
    events = {"arrivals": 0, "aborts": 0, "resets": 0, "refused": 0, "pauses": 0, "drops": 0}
    n_req = 0

    def maybe_reset():
        running = rng.random() < 0.6
        connector = rng.random() < 0.5
        pause = rng.random() < 0.3
        events["resets"] += 1
        if pause or (running and eng.spec.async_scheduling):
            events["pauses"] += pause
            drain_paused(h)
        try:
            sched.reset_prefix_cache(reset_running_requests=running, reset_connector=connector)
        except RuntimeError:
            # vLLM refuses when blocks are still held by loads in flight (its own limitation);
            # the running requests were preempted all the same.
            events["refused"] += 1
        sched.set_pause_state(PauseState.UNPAUSED)

    for step in range(steps):
        now[0] += 0.1
        if rng.random() < 0.4 and len(sched.requests) < 14:
            head = rng.choice(prefixes) if rng.random() < 0.7 else []
            prompt = head + rand_tokens(rng, rng.randrange(1, 2 * BS))
            for k in range(rng.choice((1, 1, 1, 2, 4))):  # n > 1: siblings with one prompt
                h.add(f"r{n_req}-{k}", prompt, max_tokens=rng.randrange(1, 20))
                events["arrivals"] += 1
            n_req += 1
        if rng.random() < 0.06:
            live = [r for r, q in sched.requests.items() if not q.is_finished() and r not in aborted]
            if live:
                victim = rng.choice(live)
                sched.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
                aborted.add(victim)
                events["aborts"] += 1
        if rng.random() < 0.04:
            maybe_reset()
        drop = rng.random() < 0.03
        events["drops"] += drop
        eng.drop_report = (lambda s, host, _h=rng.randrange(eng.spec.num_hosts): host == _h) if drop else None
        eng.step()
    eng.drop_report = None
    h.run(max_steps=2000)
    now[0] += 1000.0  # every unconfirmed save expires
    eng.settle()
    h.check_idle()
    assert h.eng.finished | aborted == set(h.prompts), set(h.prompts) - h.eng.finished - aborted
    check_nothing_saved_before_a_reset_is_loaded(h, marks)
    h.check_loaded_bytes(min_blocks=0)
    events["connector_resets"] = len(marks)
    events["loads"] = sum(len(m.loads) for m in h.metas())
    events["preemptions"] = len(h.preempted())
    return events


@pytest.mark.parametrize("seed,hosts,async_sched,lazy", [
    pytest.param(1, 1, False, False, id="seed1-1host-sync-eager"),
    pytest.param(2, 2, True, True, id="seed2-2host-async-lazy"),
    pytest.param(3, 1, True, False, id="seed3-1host-async-eager"),
    pytest.param(4, 2, False, True, id="seed4-2host-sync-lazy"),
])
def test_random_workload_with_resets_ends_clean(harnesses, seed, hosts, async_sched, lazy):
    faults = [None] * (hosts - 1) + [FlakyReads(seed, 0.1)]
    h = Harness(hosts, async_sched, num_blocks=40, max_num_batched_tokens=64, max_num_seqs=8, faults=faults,
                extra={"cpu_bytes_to_use": 48 * chunk_bytes(), "lazy_offload": lazy, "save_timeout_s": 2.0})
    harnesses.append(h)
    ev = run_random_workload(h, seed, steps=300)
    # The workload really exercised what it is meant to.
    assert ev["resets"] >= 5 and ev["connector_resets"] >= 2 and ev["aborts"] >= 5
    assert ev["preemptions"] > 0 and ev["loads"] > 0 and ev["arrivals"] > 50
