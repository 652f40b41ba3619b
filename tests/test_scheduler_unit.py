"""The scheduler half (``OffloadScheduler``) on its own: no vLLM scheduler, no workers. Requests,
scheduler outputs, the KV cache manager and the workers' outputs are small fakes carrying exactly
the fields the scheduler half reads, so every hook order vLLM can produce in one step is written
out explicitly (issue 12: admitted, preempted, resumed, finished, reset, in any order)."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from vllm.v1.request import RequestStatus

from tpuoffload import counters as C
from tpuoffload.config import parse_config
from tpuoffload.messages import OffloadWorkerReport, StepPlan, metadata_bytes
from tpuoffload.manager import OffloadScheduler
from tpuoffload.manager.index import READY

BS = 4
CHUNK = 100
WAITING_FOR_KV = RequestStatus.WAITING_FOR_REMOTE_KVS


def block_hashes(prompt: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{prompt}/{i}".encode()).digest() for i in range(n)]


@dataclass
class Req:
    """The fields of vllm.v1.request.Request the scheduler half reads."""

    request_id: str
    block_hashes: list[bytes]
    num_tokens: int
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING


@dataclass
class Fake:
    """The scheduler half plus fakes of vLLM's KV cache manager and of the workers."""

    hosts: int = 1
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        self.now = 0.0
        cfg = parse_config({"num_cpu_chunks": 16, "num_staging_blocks": 64, **self.extra})
        self.off = OffloadScheduler(cfg, block_size=BS, chunk_bytes=CHUNK, num_hosts=self.hosts,
                                    hosts_source="test", clock=lambda: self.now)
        self.blocks: dict[str, list[int]] = {}  # vLLM's block table
        self.next_block = 100
        self.off.bind_kv_cache_manager(SimpleNamespace(get_block_ids=lambda r: (self.blocks[r],)))
        self.metas: list[StepPlan] = []

    def request(self, rid: str, prompt: str, n_blocks: int, extra_tokens: int = 1) -> Req:
        n = n_blocks * BS + extra_tokens
        return Req(rid, block_hashes(prompt, n_blocks), n, n)

    def admit(self, req: Req, local_tokens: int = 0) -> int:
        """vLLM's admission of a waiting request: lookup, allocation, update_state_after_alloc.
        Returns the external tokens it asked for (a load: the request then waits for it)."""
        ext, is_async = self.off.get_num_new_matched_tokens(req, local_tokens)
        assert is_async == (ext > 0)
        self.blocks[req.request_id] = list(range(self.next_block, self.next_block + len(req.block_hashes) + 1))
        self.next_block += 1000
        self.off.update_state_after_alloc(req, None, ext)
        req.num_computed_tokens = local_tokens + ext
        req.status = WAITING_FOR_KV if ext else RequestStatus.RUNNING
        return ext

    def plan(self, scheduled: dict[str, int] | None = None, preempted=()) -> StepPlan:
        so = SimpleNamespace(num_scheduled_tokens=dict(scheduled or {}), preempted_req_ids=set(preempted))
        meta = self.off.build_connector_meta(so).plan
        self.metas.append(meta)
        return meta

    def workers(self, meta: StepPlan, hosts=None, failed_blocks=(), confirm=True) -> None:
        """Every host executes ``meta`` and reports it (the report vLLM merged from all of them)."""
        hosts = range(self.hosts) if hosts is None else hosts
        ids = [*meta.save.save_ids, *meta.flush.save_ids]
        report = OffloadWorkerReport()
        if confirm:
            for h in hosts:
                report = report.aggregate(OffloadWorkerReport.from_host(h, ids))
        self.off.update_connector_output(SimpleNamespace(
            kv_connector_worker_meta=report or None, invalid_block_ids=set(failed_blocks),
            finished_recving={ld.req_id for ld in meta.loads} or None,
            finished_sending=set(meta.release_req_ids) or None))

    def step(self, scheduled=None, preempted=(), **kw) -> StepPlan:
        meta = self.plan(scheduled, preempted)
        self.workers(meta, **kw)
        return meta

    def prefill(self, req: Req) -> StepPlan:
        """Schedule the whole (rest of the) prompt in one step."""
        n = req.num_tokens - req.num_computed_tokens
        meta = self.step({req.request_id: n})
        req.num_computed_tokens += n
        return meta

    def finish(self, req: Req, blocks=None) -> bool:
        req.status = RequestStatus.FINISHED_STOPPED
        delay, params = self.off.request_finished(req, self.blocks[req.request_id] if blocks is None else blocks)
        assert params is None
        return delay

    def preempt(self, req: Req) -> None:
        """What vLLM's _preempt_request does to the request (reported at the next schedule())."""
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1

    def ready(self, req: Req) -> int:
        return len(self.off.index.ready_prefix(req.block_hashes))

    def idle(self) -> dict[str, int]:
        return {k: v for k, v in self.off.leak_report().items() if v}


def saved_and_ready(f: Fake, prompt: str, n_blocks: int, rid: str | None = None) -> Req:
    req = f.request(rid or f"seed-{prompt}", prompt, n_blocks)
    f.admit(req)
    f.prefill(req)
    if f.finish(req):  # lazy: saved by the flush of the next plan, which also releases it
        assert f.step().release_req_ids == (req.request_id,)
    assert f.ready(req) == n_blocks
    return req


# ---------------------------------------------------------------------------- saves
def test_eager_saves_exactly_the_blocks_each_forward_fills():
    f = Fake()
    req = f.request("a", "p", 3, extra_tokens=2)  # 14 tokens: 3 full blocks
    f.admit(req)
    m1 = f.step({"a": 6})  # tokens 0..5: block 0 fills
    req.num_computed_tokens = 6
    m2 = f.step({"a": 8})  # tokens 6..13: blocks 1 and 2
    req.num_computed_tokens = 14
    m3 = f.step({"a": 1})  # decode: nothing (prompt blocks only)
    ids = f.blocks["a"]
    assert (m1.save.block_ids, m2.save.block_ids, m3.save.block_ids) == ((ids[0],), (ids[1], ids[2]), ())
    assert list(m1.save.save_ids) == [0] and list(m2.save.save_ids) == [1, 2]
    assert f.ready(req) == 3 and f.off.staging.in_use == 0
    assert not f.finish(req) and f.idle() == {}


def test_a_chunk_is_loadable_only_once_every_host_confirmed():
    """Invariant 7 at the scheduler half: with 3 hosts, two confirmations are not enough."""
    f = Fake(hosts=3)
    req = f.request("a", "p", 2)
    f.admit(req)
    meta = f.plan({"a": req.num_tokens})
    f.workers(meta, hosts=[0, 2])
    assert f.off.get_num_new_matched_tokens(f.request("b", "p", 2), 0) == (0, False)
    f.workers(meta, hosts=[1])
    assert f.off.get_num_new_matched_tokens(f.request("c", "p", 2), 0) == (2 * BS, True)


def test_a_repeated_lookup_reuses_its_answer_until_a_chunk_leaves():
    """vLLM asks again every step until it admits a request: the first answer is given again
    (its slots are still READY) until a chunk leaves the index; chunks that became READY since
    are not counted (at worst a few blocks recomputed)."""
    f = Fake(extra={"num_cpu_chunks": 3})
    saved_and_ready(f, "p", 1)
    b = f.request("b", "p", 2)
    assert f.off.get_num_new_matched_tokens(b, 0) == (BS, True)
    saved_and_ready(f, "p", 2, rid="more")  # block 1 of "p" becomes READY too
    assert f.off.get_num_new_matched_tokens(b, 0) == (BS, True)  # the memoised answer
    saved_and_ready(f, "q", 2)  # evicts: the memo is no longer trusted
    assert f.off.get_num_new_matched_tokens(b, 0) == (0, False)  # LRU: the first chunk of "p" went
    assert f.off.index.counters[C.EVICTED] > 0


def test_lookup_has_no_side_effect_and_leaves_one_token():
    f = Fake()
    seed = saved_and_ready(f, "p", 3)
    full = f.request("x", "p", 3, extra_tokens=0)  # 12 tokens, all 3 blocks held
    for _ in range(3):
        assert f.off.get_num_new_matched_tokens(full, 0) == (2 * BS, True)  # the last token is computed
        assert f.off.get_num_new_matched_tokens(full, BS) == (BS, True)  # beyond vLLM's own hit
    assert f.off.index.num_pinned() == 0 and f.idle() == {} and f.ready(seed) == 3


# ---------------------------------------------------------------------------- loads
def test_load_planned_at_admission_is_emitted_pinned_and_reported():
    f = Fake(extra={"num_cpu_chunks": 4})
    saved_and_ready(f, "p", 3)
    req = f.request("b", "p", 3, extra_tokens=3)
    assert f.admit(req) == 3 * BS
    # The same plan saves 3 fresh chunks of another request into a full host RAM (4 slots):
    # only the one chunk not being loaded can be evicted, so only 1 of the 3 is saved.
    other = f.request("c", "q", 3)
    f.admit(other)
    meta = f.plan({"c": other.num_tokens})
    assert [ld.req_id for ld in meta.loads] == ["b"]
    load = meta.loads[0]
    assert load.block_ids == tuple(f.blocks["b"][:3]) and load.unavailable_block_ids == ()
    assert len(meta.save) == 1 and f.off.counters[C.SKIPPED_NO_SPACE] == 2
    assert f.ready(req) == 3  # the chunks being loaded were not evicted
    f.workers(meta)
    assert f.idle() == {"requests": 2}
    f.finish(req)
    f.finish(other)
    assert f.idle() == {}


def test_failed_load_discards_the_chunk_and_promised_blocks_that_vanished_are_errors():
    f = Fake()
    seed = saved_and_ready(f, "p", 2)
    req = f.request("b", "p", 2, extra_tokens=1)
    assert f.admit(req) == 2 * BS
    meta = f.plan()
    first_block = meta.loads[0].block_ids[0]
    f.workers(meta, failed_blocks={first_block})
    assert f.ready(seed) == 0 and f.ready(f.request("z", "p", 2)) == 0  # never offered again
    assert f.off.index.counters[C.DISCARDED] == 1


@pytest.mark.parametrize("vanish", [0, 1])
def test_promised_blocks_that_vanished_before_admission_are_load_errors(vanish):
    """Looked up (3 hits), then chunk ``vanish`` leaves host RAM before vLLM admits the request:
    the load covers the READY prefix that remains, the rest of the promise is listed as
    unavailable (the workers report it as load errors, vLLM recomputes)."""
    f = Fake()
    seed = saved_and_ready(f, "p", 3)
    req = f.request("b", "p", 3)
    ext, _ = f.off.get_num_new_matched_tokens(req, 0)
    assert ext == 3 * BS
    slot = f.off.index.slot_of(seed.block_hashes[vanish])
    assert f.off.index.discard(slot, f.off.index.save_id_of(slot))
    f.blocks["b"] = [7, 8, 9, 10]
    f.off.update_state_after_alloc(req, None, ext)
    req.status = WAITING_FOR_KV
    (load,) = f.plan().loads
    assert load.block_ids == (7, 8, 9)[:vanish] and load.unavailable_block_ids == (7, 8, 9)[vanish:]
    assert list(load.slots) == [f.off.index.slot_of(x) for x in seed.block_hashes[:vanish]]
    assert list(load.save_ids) == [f.off.index.save_id_of(s) for s in load.slots]


def test_load_of_a_request_vllm_no_longer_waits_for_is_cancelled_and_counted():
    """Admitted with a load, then (in the same schedule()) no longer waiting: the load is never
    sent (vLLM would assert on its completion) and its pins are released."""
    f = Fake()
    saved_and_ready(f, "p", 2)
    req = f.request("b", "p", 2)
    f.admit(req)
    f.preempt(req)
    meta = f.plan(preempted={"b"})
    assert meta.loads == () and f.off.counters[C.LOADS_CANCELLED] == 1
    assert f.off.index.num_pinned() == 0


# ---------------------------------------------------------------------------- hook orders (issue 12)
@pytest.mark.parametrize("lazy", [False, True])
def test_preempted_by_a_reset_then_readmitted_in_the_same_schedule_keeps_its_load(lazy):
    """reset_prefix_cache(reset_running_requests=True): vLLM preempts a running request outside
    schedule(); the next schedule() admits it again with a load and reports the preemption in the
    same output. The load must be sent (vLLM waits for it) and, in lazy mode, the blocks computed
    before the preemption flushed before anything overwrites them."""
    f = Fake(extra={"lazy_offload": lazy})
    saved_and_ready(f, "p", 2)
    req = f.request("b", "p", 4)
    assert f.admit(req) == 2 * BS
    f.step()  # the load
    req.status = RequestStatus.RUNNING
    f.prefill(req)  # computes blocks 2, 3 (lazy: remembered, not saved)
    old_blocks = list(f.blocks["b"])
    f.preempt(req)  # the reset, between steps
    # Re-admitted with its prefix from host RAM (eager mode saved blocks 2 and 3 as well).
    assert f.admit(req) == (2 if lazy else 4) * BS
    meta = f.plan(preempted={"b"})
    assert [ld.req_id for ld in meta.loads] == ["b"]
    if lazy:
        assert meta.flush.block_ids == tuple(old_blocks[2:4])  # computed before the preemption
    f.workers(meta)
    assert f.ready(req) == 4
    f.step()
    req.status = RequestStatus.RUNNING
    assert not f.finish(req)
    assert f.idle() == {} and f.off.counters[C.LOADS_CANCELLED] == 0


def test_preemption_reported_after_the_request_finished_lazy():
    """Preempted by a reset, then aborted before the next schedule(): vLLM freed the blocks at the
    preemption (request_finished gets none), so nothing is held; the flush is still planned (the
    blocks are intact until the next plan's flush is gathered) and the late report is ignored."""
    f = Fake(extra={"lazy_offload": True})
    req = f.request("a", "p", 3)
    f.admit(req)
    f.prefill(req)
    f.preempt(req)
    assert f.finish(req, blocks=[]) is False
    meta = f.step(preempted={"a"})
    assert len(meta.flush) == 3 and meta.release_req_ids == ()
    assert f.ready(req) == 3 and f.idle() == {}


def test_two_preemptions_in_one_gap_flush_once_and_an_unreported_one_is_applied_when_seen():
    f = Fake(extra={"lazy_offload": True})
    req = f.request("a", "p", 2)
    f.admit(req)
    f.prefill(req)
    f.preempt(req)
    f.preempt(req)  # two resets before the next schedule()
    meta = f.step(preempted={"a"})
    assert len(meta.flush) == 2
    # Re-admitted and computed again, then preempted without any report reaching the connector:
    # its next scheduling applies it (flushes nothing new: the same chunks are held).
    f.admit(req)
    f.prefill(req)
    f.preempt(req)
    f.admit(req)
    meta = f.step({"a": req.num_tokens})
    assert len(meta.flush) == 0 and f.off.counters[C.DEDUP_INDEX] == 0
    req.status = RequestStatus.RUNNING
    assert not f.finish(req)
    assert f.idle() == {}


def test_lazy_finish_holds_blocks_until_the_flush_is_released():
    f = Fake(extra={"lazy_offload": True})
    req = f.request("a", "p", 2)
    f.admit(req)
    f.prefill(req)
    assert f.finish(req) is True  # vLLM must hold the blocks
    assert f.idle() == {"requests": 1, "awaiting_release": 1, "queued_flush_or_release": 3}
    meta = f.plan()
    assert meta.flush.block_ids == tuple(f.blocks["a"][:2]) and meta.release_req_ids == ("a",)
    f.workers(meta)
    assert f.idle() == {} and f.ready(req) == 2


def test_lazy_abort_while_loading_is_not_held():
    """vLLM itself holds an aborted request's blocks until its load is reported; a second hold
    (delay_free) would free them twice."""
    f = Fake(extra={"lazy_offload": True})
    saved_and_ready(f, "p", 2)
    req = f.request("b", "p", 2)
    f.admit(req)
    meta = f.plan()  # the load is sent; not reported yet
    assert f.finish(req) is False
    f.workers(meta)
    assert f.idle() == {}


# ---------------------------------------------------------------------------- reset_cache
def test_reset_cache_makes_nothing_from_before_loadable():
    f = Fake(hosts=2)
    seed = saved_and_ready(f, "p", 2)
    inflight = f.request("b", "q", 2)
    f.admit(inflight)
    meta = f.plan({"b": inflight.num_tokens})  # saves in flight
    assert f.off.reset_cache() is True
    assert f.ready(seed) == 0 and f.off.get_num_new_matched_tokens(f.request("x", "p", 2), 0) == (0, False)
    f.workers(meta)  # late confirmations of saves from before the reset
    assert f.ready(inflight) == 0 and f.off.index.num_saving() == 0
    assert f.off.index.num_free_slots == f.off.index.num_slots and f.off.staging.in_use == 0
    # Blocks computed after the reset are saved again.
    again = f.request("c", "q", 2)
    f.admit(again)
    f.prefill(again)
    assert f.ready(again) == 2
    assert f.off.index.counters[C.REVOKED] == 4 and f.off.counters[C.RESETS] == 1


def test_reset_cache_lazy_never_saves_kv_computed_before_it():
    f = Fake(extra={"lazy_offload": True})
    a = f.request("a", "p", 2)
    f.admit(a)
    f.prefill(a)  # computed before the reset, not saved yet
    b = f.request("b", "q", 2)
    f.admit(b)
    f.prefill(b)
    f.preempt(b)  # preempted by the same reset (reset_running_requests=True)
    f.off.reset_cache()
    assert f.finish(a) is False  # nothing to flush: computed with the old weights
    meta = f.step(preempted={"b"})
    assert len(meta.flush) == 0
    f.admit(b)
    f.prefill(b)  # recomputed after the reset: saved
    b.status = RequestStatus.RUNNING
    f.finish(b)
    f.step()
    assert f.ready(b) == 2 and f.ready(a) == 0 and f.idle() == {}


# ---------------------------------------------------------------------------- ledger, budgets, reporters
def test_expected_host_that_never_reports_is_logged_within_a_few_steps(caplog):
    f = Fake(hosts=2)
    req = f.request("a", "p", 2)
    f.admit(req)
    with caplog.at_level(logging.ERROR, logger="tpuoffload"):
        f.step({"a": req.num_tokens}, hosts=[0])
        for _ in range(8):
            f.step(hosts=[0])
    assert f.off.ledger.counters[C.REPORTERS_MISSING] == 1
    assert any("never reported" in r.getMessage() for r in caplog.records)


def test_saves_that_expire_release_staging_and_are_never_loadable():
    f = Fake(extra={"save_timeout_s": 5})
    req = f.request("a", "p", 2)
    f.admit(req)
    meta = f.step({"a": req.num_tokens}, confirm=False)
    assert f.off.staging.in_use == 2 * CHUNK
    f.now += 6
    f.step()
    assert f.off.staging.in_use == 0 and f.ready(req) == 0 and f.off.ledger.counters[C.LEDGER_EXPIRED] == 2
    f.workers(meta)  # late
    assert f.ready(req) == 0


def test_staging_budget_cut_and_counters_account_for_every_candidate():
    f = Fake(extra={"num_staging_blocks": 3})
    reqs = [f.request(f"s{i}", "same", 4) for i in range(3)]  # n=3 siblings: 12 candidates, 4 distinct
    for r in reqs:
        f.admit(r)
    meta = f.step({r.request_id: r.num_tokens for r in reqs})
    t = f.off.counters
    assert len(meta.save) == 3 and t[C.SKIPPED_STAGING] == 1 and t[C.DEDUP_BATCH] == 8 and t[C.SAVES_ISSUED] == 3
    assert sum(t[k] for k in (C.SAVES_ISSUED, C.DEDUP_BATCH, C.DEDUP_INDEX, C.SKIPPED_STAGING, C.SKIPPED_NO_SPACE)) == 12


def test_scarce_staging_goes_to_requests_in_the_schedulers_order():
    """When staging cannot take every candidate of a step, the scheduler's order (running requests
    first, then new ones) decides whose blocks are saved, never a set's order of request ids, which
    Python's hash seed picks anew in every process (so which prefixes hit later would too).
    Without the fix (iterating ``RequestLifecycle._saving``) 24 ids scheduled in the reverse of
    their admission come out in a hash-dependent order."""
    f = Fake(extra={"num_staging_blocks": 12, "num_cpu_chunks": 64})
    reqs = [f.request(f"r{i:02d}", f"p{i}", 1) for i in range(24)]
    for r in reqs:
        f.admit(r)
    order = list(reversed(reqs))
    meta = f.step({r.request_id: r.num_tokens for r in order})
    assert meta.save.block_ids == tuple(f.blocks[r.request_id][0] for r in order[:12])
    assert [f.ready(r) for r in order] == [1] * 12 + [0] * 12


def test_stats_and_snapshot_use_registered_names_and_metadata_stays_small():
    f = Fake()
    req = f.request("a", "p", 8)
    f.admit(req)
    meta = f.prefill(req)
    stats = f.off.take_stats()
    names = {k.rsplit("|", 1)[-1] for k in stats.data}
    assert names <= set(C.SCHEDULER_NAMES) and C.SAVES_ISSUED in names
    snap = f.off.snapshot()
    assert snap["slots_total"] == 16 and snap["totals"][C.SAVES_ISSUED] == 8
    empty = metadata_bytes(StepPlan(meta.step, meta.num_slots))
    assert (metadata_bytes(meta) - empty) / len(meta.save) < 16  # bytes per saved chunk on the wire
    assert f.off.index.state_of(meta.save.slots[0]) == READY
