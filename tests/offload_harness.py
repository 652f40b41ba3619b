"""Shared driver for the vLLM-driven connector tests: an ``InProcessEngine`` (vLLM's real
Scheduler or AsyncScheduler, the connector's scheduler half, one SyntheticRunner + worker half per
simulated host) plus recorders, all through public interfaces:

* every SchedulerOutput (preemptions, the connector metadata);
* every ``request_finished_all_groups`` answer and the block ids vLLM passed;
* right after each host executed a step, the bytes of every block that step's loads wrote (a load
  lands before the forward and the loading request is not scheduled in that step, so nothing else
  writes those blocks in it), and the blocks the host reported as load errors;
* plans that release a request vLLM no longer holds (a release must come while vLLM still holds
  the blocks, invariant 9).

The SyntheticRunner checks every context position a request reads on its first step after
(re)admission, so ``engine.mismatches() == 0`` means no step ever read a wrong KV value.
"""

from __future__ import annotations

import dataclasses
import functools
import random

import jax
import jax.numpy as jnp
import numpy as np

from tpuoffload.layout import CacheLayout
from tpuoffload.messages import OffloadMetadata, StepPlan
from tpuoffload.sim import gdn_layout as gl
from tpuoffload.sim.engine import SIM_LAYOUT, EngineSpec, InProcessEngine
from tpuoffload.sim.tpu_layouts import create_caches
from tpuoffload.sim.vllm_setup import assert_scheduler_empty, make_request
from tpuoffload.worker.faults import FaultInjector, FaultPoint

BS = SIM_LAYOUT.block_size


@functools.cache
def chunk_bytes() -> int:
    """One host slot of the simulated layout (all layers of one block, this host's share)."""
    return CacheLayout.from_caches(create_caches(SIM_LAYOUT, jax.devices()[:SIM_LAYOUT.num_devices])[0]).slot_bytes


def zeroed(kv_caches) -> list:
    """Zeroed copies of a runner's caches, same shardings (a GDN layer's state tuple stays a tuple)."""
    def zero(c):
        return jax.device_put(jnp.zeros(c.shape, c.dtype), c.sharding)

    return [tuple(map(zero, c)) if isinstance(c, tuple) else zero(c) for c in kv_caches]


def rand_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 30000) for _ in range(n)]


class Harness:
    def __init__(self, hosts=1, async_scheduling=False, num_blocks=64, extra=None, faults=None,
                 max_num_batched_tokens=256, max_num_seqs=16, scheduler_kwargs=None, same_chunk=True,
                 hybrid=None, kv_budget_bytes=0, gdn=None):
        """``hybrid``: a ``HybridLayoutSpec`` (vLLM's hybrid KV cache manager on, tpu-inference's
        arrays for ``kv_budget_bytes`` of KV memory) instead of the default one-group layout;
        ``gdn``: a ``GdnLayoutSpec`` (a GDN hybrid, its state checked by the GdnRunner; loads are
        not snapshotted, the runner reads every loaded state row and attention position back)."""
        extra = {"cpu_bytes_to_use": 1 << 22} if extra is None else extra
        if gdn is not None:
            gdn = dataclasses.replace(gdn, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs)
        self.eng = InProcessEngine(
            EngineSpec(num_hosts=hosts, num_blocks=num_blocks, async_scheduling=async_scheduling,
                       max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                       extra_config=extra, scheduler_kwargs=dict(scheduler_kwargs or {}),
                       hybrid=hybrid, kv_budget_bytes=kv_budget_bytes, gdn=gdn),
            faults=faults,
        )
        self.gdn = gdn
        if gdn is None:
            # The scheduler plans in units of one host slot: both halves must agree on its size
            # (same_chunk=False: a test that misconfigures the number of reporting workers on
            # purpose). (A hybrid layout's hosts each hold the whole mesh, vLLM's config the mesh
            # once: the scheduler's share per host is 1/hosts of a host's slot, and num_cpu_chunks
            # sets the slots.)
            want = chunk_bytes() if hybrid is None else self.eng.connectors[0].worker.engine.tables[0].slot_bytes
            if same_chunk:
                assert self.eng.offload.chunk_bytes * (hosts if hybrid is not None else 1) == want
            assert all(c.worker.engine.tables[0].slot_bytes == want for c in self.eng.connectors)
        self.prompts: dict[str, list[int]] = {}
        self.requests: dict = {}  # req_id -> vllm Request
        self.outputs: list = []  # SchedulerOutputs, in schedule order
        self.finished_answers: dict[str, bool] = {}  # req_id -> delay_free returned to vLLM
        self.finished_blocks: dict[str, list[int]] = {}  # req_id -> block ids vLLM passed
        self.released_too_early: list[str] = []  # released when vLLM no longer held the request
        self.loaded: list[tuple[int, str, int, int, list[np.ndarray]]] = []  # host, req, block idx, id, per-array bytes
        self.loaded_groups: list[int] = []  # the KV cache group of each entry of ``loaded``
        self.load_failed: list[tuple[int, str, int]] = []  # host, req, block id

        sched = self.eng.scheduler
        orig_schedule = sched.schedule

        def schedule():
            so = orig_schedule()
            self.outputs.append(so)
            return so

        sched.schedule = schedule
        # Wrapped on the connector vLLM calls (its scheduler-side hooks are the scheduler half's
        # bound methods, taken at construction: wrapping the scheduler half would not be seen).
        # The connector is SupportsHMA, so vLLM calls request_finished_all_groups (every group's
        # block ids); finished_blocks keeps the first group's.
        off = sched.connector
        orig_finished = off.request_finished_all_groups

        def request_finished_all_groups(request, block_ids):
            delay, params = orig_finished(request, block_ids)
            self.finished_answers[request.request_id] = delay
            self.finished_blocks[request.request_id] = list(block_ids[0]) if block_ids else []
            return delay, params

        off.request_finished_all_groups = request_finished_all_groups
        for host, (runner, conn) in enumerate(zip(self.eng.runners, self.eng.connectors)):
            if gdn is None:
                self._wrap_execute(host, runner)
            self._wrap_bind(conn)

    def _wrap_bind(self, conn):
        orig = conn.bind_connector_metadata
        sched = self.eng.scheduler

        def bind(meta):
            # When a step's flush is dispatched, vLLM must still hold the blocks of every request
            # this step releases (delay_free): they are freed only after this step's output.
            self.released_too_early.extend(r for r in meta.plan.release_req_ids if r not in sched.requests)
            return orig(meta)

        conn.bind_connector_metadata = bind

    def _wrap_execute(self, host, runner):
        orig = runner.execute
        kvm = self.eng.scheduler.kv_cache_manager

        def execute(so, connector=None):
            out = orig(so, connector)
            meta = so.kv_connector_metadata
            if connector is None or not isinstance(meta, OffloadMetadata) or not meta.plan.loads:
                return out
            errors = out.kv_connector_output.invalid_block_ids if out.kv_connector_output else set()
            failed_reqs = out.kv_connector_output.failed_recving if out.kv_connector_output else set()
            for load in meta.plan.loads:
                groups = kvm.get_block_ids(load.req_id)
                for b in (*load.block_ids, *load.unavailable_block_ids):
                    if b in errors or load.req_id in failed_reqs:
                        self.load_failed.append((host, load.req_id, b))
                    elif b in load.block_ids:
                        # A block id belongs to one KV cache group (they share one pool).
                        g = next(g for g, ids in enumerate(groups) if b in ids)
                        data = [np.asarray(c[b]) for c in runner.kv_caches]
                        self.loaded.append((host, load.req_id, groups[g].index(b), b, data))
                        self.loaded_groups.append(g)
            return out

        runner.execute = execute

    # ---- driving
    def add(self, req_id, tokens, max_tokens=4):
        self.prompts[req_id] = list(tokens)
        self.requests[req_id] = (make_request(req_id, tokens, max_tokens=max_tokens, block_size=BS) if self.gdn is None
                                 else gl.make_request(self.eng.gdn_layout, req_id, tokens, max_tokens=max_tokens))
        self.eng.add_request(self.requests[req_id])

    def run(self, **kw):
        return self.eng.run(**kw)

    def metas(self) -> list[StepPlan]:
        return [so.kv_connector_metadata.plan for so in self.outputs]

    def preempted(self) -> list[str]:
        return [r for so in self.outputs for r in (so.preempted_req_ids or ())]

    def totals(self) -> dict:
        return self.eng.stats.reduce()

    def wipe_device_caches(self):
        """Zero every host's KV cache, so a block that holds the right bytes after a load can only
        have come from host RAM (vLLM may hand the same physical blocks out again)."""
        for runner in self.eng.runners:
            runner.kv_caches = zeroed(runner.kv_caches)

    def new_wave(self, wipe=True):
        """Forget vLLM's prefix cache (and the device bytes) so the next requests must hit host RAM."""
        self.eng.settle()
        assert self.eng.scheduler.reset_prefix_cache()
        if wipe:
            self.wipe_device_caches()

    def two_waves(self, prefix_blocks, seed: int, one_at_a_time: bool = False) -> list[list[int]]:
        """Prefixes of ``prefix_blocks`` blocks each, asked for twice: ``a<i>`` (prefix + 7 tokens),
        then, after ``new_wave`` (vLLM forgets, the device bytes are wiped), ``b<i>`` (prefix + 11
        tokens; ``one_at_a_time``: each run to the end before the next). Returns the prefixes."""
        rng = random.Random(seed)
        prefixes = [rand_tokens(rng, n * BS) for n in prefix_blocks]
        for i, p in enumerate(prefixes):
            self.add(f"a{i}", p + rand_tokens(rng, 7))
        self.run()
        self.new_wave()
        for i, p in enumerate(prefixes):
            self.add(f"b{i}", p + rand_tokens(rng, 11))
            if one_at_a_time:
                self.run()
        self.run()
        return prefixes

    # ---- checks
    def check_loaded_bytes(self, min_blocks=1):
        """Every block snapshotted right after a load equals what the synthetic model computes."""
        runner = self.eng.runners[0]
        checked = 0
        for (host, req_id, idx, block_id, data), group in zip(self.loaded, self.loaded_groups):
            tokens = self.prompts[req_id] + self.eng.outputs.get(req_id, [])  # a resumed request's context
            for array, got in enumerate(data):
                want = runner.expected_block(tokens, idx, array, group)
                if want is None:  # this array serves no layer of that KV cache group
                    continue
                assert got.shape == want.shape
                np.testing.assert_array_equal(
                    got, want, err_msg=f"host {host} {req_id} group {group} block #{idx} (id {block_id}) array {array}")
                checked += got.nbytes
        assert len(self.loaded) >= min_blocks
        return checked

    def check_group_loads(self, prefixes, windows, block_size: int = BS, tag: str = "b") -> None:
        """Per load of request ``tag + str(i)`` (a hit on ``prefixes[i]``): a full-attention group
        (window None) moved every hit block, a sliding-window group only the window's tail ending
        at the hit."""
        by_req: dict = {}
        for (_, req_id, idx, _, _), g in zip(self.loaded, self.loaded_groups):
            by_req.setdefault(req_id, {}).setdefault(g, set()).add(idx)
        for i, p in enumerate(prefixes):
            n = len(p) // block_size
            for g, window in enumerate(windows):
                want = set(range(n)) if window is None else set(range(max(0, n - window), n))
                assert by_req[f"{tag}{i}"][g] == want, (i, g, by_req[f"{tag}{i}"])

    def check_idle(self):
        """Nothing held anywhere: vLLM, the scheduler half (its public gauges), every worker."""
        eng = self.eng
        eng.settle()
        assert eng.mismatches() == 0, [r.stats.mismatched_requests for r in eng.runners]
        leaks = eng.offload.leak_report()
        assert all(v == 0 for v in leaks.values()), leaks
        assert_scheduler_empty(eng.scheduler)
        assert not self.released_too_early
        for conn in eng.connectors:
            idle = conn.worker.idle_report()
            assert all(v == 0 for v in idle.values()), idle

    def close(self):
        self.eng.close()


class LoseSlots(FaultInjector):
    """A host loses some of the slots a load reads: the second of each load (or all of them),
    ``times`` times; ``lost`` counts them."""

    def __init__(self, times: int, every: bool = False):
        self.times = times
        self.every = every
        self.lost = 0

    def hit(self, point: FaultPoint, n: int) -> set[int]:
        if point is not FaultPoint.LOAD_SLOT_CHECK or self.times <= 0 or not n:
            return set()
        self.times -= 1
        victims = set(range(n)) if self.every else {min(1, n - 1)}
        self.lost += len(victims)
        return victims
