"""TPUOffloadConnector against vLLM 0.32's REAL Scheduler and AsyncScheduler.

Every test drives ``tpuoffload.sim.engine.InProcessEngine``: vLLM's scheduler, the connector's
scheduler half, and one SyntheticRunner + worker half per simulated host (merged by vLLM's
KVOutputAggregator when there are two). The runner verifies every context position of a request on
its first step after (re)admission, so ``engine.mismatches() == 0`` means that no step ever read a
wrong KV value; loads are also checked byte for byte against ``SyntheticRunner.expected_block``.
"""

from __future__ import annotations

import pickle
import random
import time
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from tpuoffload.connector import TPUOffloadConnector
from tpuoffload.manager import ChunkState
from tpuoffload.messages import OffloadMetadata, OffloadWorkerReport
from tpuoffload.sim.engine import EngineSpec, InProcessEngine
from tpuoffload.sim.vllm_setup import assert_scheduler_empty, make_request
from tpuoffload.stats import OffloadStats
from tpuoffload.worker.transfer_engine import Faults

BS = 16
SHAPE = dict(block_size=BS, num_layers=2, num_kv_heads=4, head_dim=16, devices_per_host=2)
# hosts x scheduler kind: the four combinations the connector must survive.
VARIANTS = [
    pytest.param(1, False, id="1host-sync"),
    pytest.param(2, False, id="2host-sync"),
    pytest.param(1, True, id="1host-async"),
    pytest.param(2, True, id="2host-async"),
]
HOST_CHUNK = 2 * BS * 4 * 16 * 4  # one worker slot: layers x block x heads x head_dim x f32
SCHED_CHUNK = 2 * HOST_CHUNK  # the scheduler sizes chunks by vLLM's page size (K and V)


# ============================================================================ helpers
class Harness:
    """An InProcessEngine plus recorders: every SchedulerOutput (preemptions, connector metadata),
    every request_finished answer, and a byte snapshot of every block right after it was loaded."""

    def __init__(self, hosts=1, async_scheduling=False, num_blocks=64, extra=None, faults=None,
                 max_num_batched_tokens=256, max_num_seqs=16):
        extra = {"cpu_bytes_to_use": 1 << 22} if extra is None else extra
        self.eng = InProcessEngine(
            EngineSpec(num_hosts=hosts, num_blocks=num_blocks, async_scheduling=async_scheduling,
                       max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                       extra_config=extra, **SHAPE),
            faults=faults,
        )
        self.prompts: dict[str, list[int]] = {}
        self.outputs: list = []  # SchedulerOutputs, in schedule order
        self.finished_answers: dict[str, bool] = {}  # req_id -> delay_free returned to vLLM
        self.loaded: list[tuple[int, str, int, int, np.ndarray]] = []  # host, req, block idx, block id, bytes
        self.load_failed: list[tuple[int, str, int]] = []  # host, req, block id

        sched = self.eng.scheduler
        orig_schedule = sched.schedule

        def schedule():
            so = orig_schedule()
            self.outputs.append(so)
            return so

        sched.schedule = schedule
        off = self.eng.offload
        orig_finished = off.request_finished

        def request_finished(request, block_ids):
            delay, params = orig_finished(request, block_ids)
            self.finished_answers[request.request_id] = delay
            return delay, params

        off.request_finished = request_finished
        for host, (runner, conn) in enumerate(zip(self.eng.runners, self.eng.connectors)):
            self._wrap_load(host, runner, conn.worker)

    def _wrap_load(self, host, runner, worker):
        orig = worker.start_load
        kvm = self.eng.scheduler.kv_cache_manager

        def start_load():
            meta, already = worker._meta, worker._loaded
            orig()
            if meta is None or already:
                return
            errors = worker._load_errors
            for load in meta.loads:
                req_blocks = kvm.get_block_ids(load.req_id)[0]
                for b in load.block_ids:
                    if b in errors:
                        self.load_failed.append((host, load.req_id, b))
                        continue
                    data = np.stack([np.asarray(c[b]) for c in runner.kv_caches])
                    self.loaded.append((host, load.req_id, req_blocks.index(b), b, data))

        worker.start_load = start_load

    # ---- driving
    def add(self, req_id, tokens, max_tokens=4):
        self.prompts[req_id] = list(tokens)
        self.eng.add_request(make_request(req_id, tokens, max_tokens=max_tokens))

    def run(self, **kw):
        return self.eng.run(**kw)

    def metas(self) -> list[OffloadMetadata]:
        return [so.kv_connector_metadata for so in self.outputs]

    def preempted(self) -> list[str]:
        return [r for so in self.outputs for r in (so.preempted_req_ids or ())]

    def totals(self) -> dict:
        return self.eng.stats.reduce()

    def wipe_device_caches(self):
        """Zero every host's KV cache, so a block that holds the right bytes after a load can only
        have come from host RAM (vLLM may hand the same physical blocks out again)."""
        for runner in self.eng.runners:
            runner.kv_caches = [jax.device_put(jnp.zeros(c.shape, c.dtype), c.sharding) for c in runner.kv_caches]

    def new_wave(self, wipe=True):
        """Forget vLLM's prefix cache (and the device bytes) so the next requests must hit host RAM."""
        self.eng.settle()
        assert self.eng.scheduler.reset_prefix_cache()
        if wipe:
            self.wipe_device_caches()

    # ---- checks
    def check_loaded_bytes(self, min_blocks=1):
        """Every block snapshotted right after a load equals what the synthetic model computes."""
        runner = self.eng.runners[0]
        for host, req_id, idx, block_id, data in self.loaded:
            want = runner.expected_block(self.prompts[req_id], idx)
            assert want.shape == (SHAPE["num_layers"], BS, SHAPE["num_kv_heads"], SHAPE["head_dim"])
            assert data.shape == want.shape
            np.testing.assert_array_equal(data, want, err_msg=f"host {host} {req_id} block #{idx} (id {block_id})")
        assert len(self.loaded) >= min_blocks

    def check_idle(self):
        eng = self.eng
        eng.settle()
        assert eng.mismatches() == 0, [r.stats.mismatched_requests for r in eng.runners]
        leaks = eng.offload.leak_report()
        assert all(v == 0 for v in leaks.values()), leaks
        # private bookkeeping that must drain too
        off = eng.offload
        assert not off._loading_blocks and not off._loading_reqs and not off._pending_loads
        assert not off._flush_queue and not off._release_queue
        assert_scheduler_empty(eng.scheduler)
        for conn in eng.connectors:
            assert conn.worker.engine.inflight()[0] == 0


def rand_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 30000) for _ in range(n)]


def full_blocks(n_tokens: int) -> int:
    return n_tokens // BS


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
    save_ids = [s for m in h.metas() for s in m.save.save_ids + m.flush.save_ids]
    assert len(save_ids) == len(set(save_ids)) == 4
    index = h.eng.offload.index
    assert len(index) == 4
    hashes = make_request("x", prompt).block_hashes[:4]
    assert [index.get(hh).state for hh in hashes] == [ChunkState.READY] * 4

    # All 8 siblings of a second batch read the same 4 host slots, concurrently.
    h.new_wave()
    for k in range(8):
        h.add(f"t{k}", prompt, max_tokens=6)
    h.run()
    h.check_idle()
    t = h.totals()
    assert t["saves_issued"] == 4  # nothing new to save
    assert t["chunks_loaded"] >= 4 * hosts and t["hit_tokens"] >= 4 * BS
    assert t["chunks_loaded"] == hosts * t["hit_tokens"] // BS
    h.check_loaded_bytes(min_blocks=4 * hosts)
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
    assert sum(h.eng.scheduler.requests.get(r) is None for r in preempted) == len(preempted)
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
        flushed_at_preemption = [so for so in h.outputs if so.preempted_req_ids and len(so.kv_connector_metadata.flush)]
        assert flushed_at_preemption
        delayed = {r for r, d in h.finished_answers.items() if d}
        assert delayed, "finished requests with unsaved blocks are held"
        assert delayed <= held_after_finish
        released = [m for m in metas if m.release_req_ids]
        assert {r for m in released for r in m.release_req_ids} == delayed
        assert all(len(m.flush) > 0 for m in released)  # released in the step whose flush saves them
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
        assert set(so.kv_connector_metadata.save.block_ids) == filled
    h.new_wave()
    for i, p in enumerate(prompts):
        h.add(f"d{i}", p + rand_tokens(rng, 40), max_tokens=3)  # loads 5 blocks, then 3 chunks
    h.run()
    h.check_idle()
    t = h.totals()
    assert t["chunks_loaded"] == 2 * 5 * hosts and t["hit_tokens"] == 2 * 5 * BS
    h.check_loaded_bytes(min_blocks=10 * hosts)
    assert h.eng.finished == set(h.prompts)
