"""An in-process engine: vLLM's real Scheduler (or AsyncScheduler), the connector, and one
SyntheticRunner per simulated host, stepped the way vLLM's EngineCore steps them (a GdnRunner, and
tpu-inference's hybrid coordinator under the scheduler, for a GDN hybrid: ``EngineSpec.gdn``).

Each host's cache is what tpu-inference's ``create_kv_caches`` allocates for ``EngineSpec.layout``
on that host's own devices (a full copy of the mesh per host); the multi-process pod slice
(tpuoffload.sim.podslice) spreads one mesh across processes instead. The scheduler's KV cache
config reports the page size a slice of ``num_hosts`` such hosts would.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jax

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from tpuoffload.connector import TPUOffloadConnector
from tpuoffload.layout import CacheLayout
from tpuoffload.sim import gdn_layout as gl
from tpuoffload.sim.gdn_runner import GdnRunner
from tpuoffload.sim.hybrid_layouts import HybridLayoutSpec, create_hybrid_cache, runner_roles
from tpuoffload.sim.runner import SyntheticRunner
from tpuoffload.sim.tpu_layouts import TpuLayoutSpec, create_caches, scheduler_kv_shape
from tpuoffload.sim.vllm_setup import make_scheduler, make_worker_connector
from tpuoffload.stats import OffloadStats
from tpuoffload.worker.faults import FaultInjector
from tpuoffload.worker.offload_worker import OffloadWorker

# The default simulated deployment: bf16 ragged-paged-attention cache, 4 KV heads, tensor parallel 2.
SIM_LAYOUT = TpuLayoutSpec("bf16-4kv-tp2", num_layers=2, num_blocks=128, block_size=16, num_kv_heads=4, tp=2)


@dataclass
class EngineSpec:
    """Simulation only: what ``InProcessEngine`` builds: hosts, cache layout (tpu-inference's), vLLM
    scheduler limits, connector config and the optional hybrid or GDN model."""

    num_hosts: int = 1
    layout: TpuLayoutSpec = SIM_LAYOUT  # its num_blocks and block_size are vLLM's too ...
    num_blocks: int | None = None  # ... unless set here
    block_size: int | None = None
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 256
    async_scheduling: bool = False
    extra_config: dict[str, Any] = field(default_factory=lambda: {"cpu_bytes_to_use": 1 << 22})
    scheduler_kwargs: dict[str, Any] = field(default_factory=dict)
    # A hybrid model (vLLM's hybrid KV cache manager on) instead of ``layout``: tpu-inference's
    # arrays and vLLM's KV cache config for ``kv_budget_bytes`` of KV memory per host.
    hybrid: HybridLayoutSpec | None = None
    kv_budget_bytes: int = 0
    # A GDN (Qwen3.5-like) hybrid instead of ``layout``: every host's arrays, vLLM's config and its
    # scheduler (tpu-inference's hybrid coordinator) as sim/gdn_layout.py builds them; the spec's
    # own batch sizes apply.
    gdn: gl.GdnLayoutSpec | None = None
    kv_events: dict[str, Any] | None = None  # vLLM's --kv-events-config (KVEventsConfig fields)


def absorb_outputs(engine, engine_core_outputs) -> None:
    """Fold what ``update_from_output`` returned into ``engine.stats`` (the connector stats vLLM
    delivered, rebuilt the way vLLM's frontend rebuilds them), ``engine.outputs`` and
    ``engine.finished``."""
    for outs in engine_core_outputs.values():
        sched_stats = outs.scheduler_stats
        if sched_stats is not None and sched_stats.kv_connector_stats:
            data = dict(sched_stats.kv_connector_stats)
            engine.stats = engine.stats.aggregate(TPUOffloadConnector.build_kv_connector_stats(data))
        for o in outs.outputs:
            engine.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                engine.finished.add(o.request_id)


def run_waves(engine, waves, on_step=None) -> None:
    """Run each wave of requests to completion on an InProcessEngine or a PodSlice. Between waves
    vLLM's prefix cache is reset, as eviction under load would, so a later wave finds the shared
    prefixes only in host RAM."""
    for i, wave in enumerate(waves):
        if i and not engine.scheduler.reset_prefix_cache():
            raise RuntimeError("reset_prefix_cache() failed: blocks still in use between waves")
        for request in wave:
            engine.add_request(request)
        engine.run(on_step=on_step)
        engine.settle()


class InProcessEngine:
    """Simulation only: vLLM's real scheduler with the connector's scheduler half and one worker half
    per simulated host in one process, synthetic runners on real sharded JAX caches, outputs
    merged by vLLM's ``KVOutputAggregator``."""

    def __init__(self, spec: EngineSpec, faults: Sequence[FaultInjector | None] | None = None) -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

        self.spec = spec
        layout = dataclasses.replace(spec.layout, num_blocks=spec.num_blocks or spec.layout.num_blocks,
                                     block_size=spec.block_size or spec.layout.block_size)
        devices = jax.devices()
        per_host = spec.hybrid.num_devices if spec.hybrid is not None else \
            spec.gdn.tp if spec.gdn is not None else layout.num_devices
        need = spec.num_hosts * per_host
        if len(devices) < need:
            raise ValueError(f"{spec.num_hosts} hosts x {per_host} devices need {need} devices; "
                             f"JAX has {len(devices)} (set XLA_FLAGS=--xla_force_host_platform_device_count)")
        host_devices = [devices[h * per_host:(h + 1) * per_host] for h in range(spec.num_hosts)]
        faults = list(faults) if faults is not None else [None] * spec.num_hosts
        if spec.gdn is not None:
            self._init_gdn(spec, host_devices, faults)
        else:
            self._init_attention(spec, layout, host_devices, faults)
        self.aggregator = (KVOutputAggregator.from_connector(self.scheduler.connector, spec.num_hosts)
                           if spec.num_hosts > 1 else None)
        self._queue: deque = deque()
        self.outputs: dict[str, list[int]] = {}
        self.finished: set[str] = set()
        self.steps = 0
        self.stats = OffloadStats()  # everything vLLM's stats path delivered, merged
        self.drop_report = None  # test hook: callable(step, host) -> bool, drops that host's worker report

    def _init_gdn(self, spec: EngineSpec, host_devices, faults) -> None:
        """Every host's GDN layout, one scheduler (tpu-inference's hybrid coordinator under vLLM's
        real scheduler) with the connector configured, a GdnRunner and a worker connector per host."""
        gdn = dataclasses.replace(spec.gdn, async_scheduling=spec.async_scheduling)
        layouts = [gl.build(gdn, d) for d in host_devices]
        self.gdn_layout = layouts[0]  # what requests are built from (gl.make_request)
        extra = dict(spec.extra_config, **({"num_hosts": spec.num_hosts} if spec.num_hosts > 1 else {}))
        vllm_config = gl.make_vllm_config(gdn, extra)
        if spec.kv_events is not None:  # what --kv-events-config parses into (vllm_setup.make_vllm_config)
            from vllm.config.kv_events import KVEventsConfig

            vllm_config.kv_events_config = KVEventsConfig(**spec.kv_events)
        self.scheduler, _ = gl.make_scheduler(layouts[0], vllm_config=vllm_config)
        self.runners, self.connectors = [], []
        for host, layout in enumerate(layouts):
            runner = GdnRunner.of(layout)
            connector = TPUOffloadConnector(vllm_config, KVConnectorRole.WORKER,
                                            copy.deepcopy(layout.worker_kv_cache_config))
            self._attach(host, runner, connector, faults)

    def _attach(self, host: int, runner, connector, faults) -> None:
        """Give ``connector`` this host's worker (its host id and faults) and register ``runner``."""
        connector.worker = OffloadWorker(connector.config, host_id=host, faults=faults[host],
                                         deployment=connector.worker.deployment,
                                         kv_cache_config=connector.worker.kv_cache_config)
        connector.register_runner(runner)
        self.runners.append(runner)
        self.connectors.append(connector)

    def _init_attention(self, spec: EngineSpec, layout: TpuLayoutSpec, host_devices, faults) -> None:
        """Every host's attention cache (tpu-inference's create_kv_caches, or a hybrid layout's
        arrays), vLLM's scheduler over it, a SyntheticRunner and a worker connector per host."""
        common = dict(kv_connector_extra_config=spec.extra_config, async_scheduling=spec.async_scheduling,
                      max_num_seqs=spec.max_num_seqs, max_num_batched_tokens=spec.max_num_batched_tokens,
                      tensor_parallel_size=spec.num_hosts, kv_events=spec.kv_events, **spec.scheduler_kwargs)
        roles: dict[str, Any] = {}
        if spec.hybrid is not None:
            hybrid = [create_hybrid_cache(spec.hybrid, spec.kv_budget_bytes, d) for d in host_devices]
            host_caches = [(h.kv_caches, h.mesh) for h in hybrid]
            cfg = hybrid[0].kv_cache_config
            self.scheduler = make_scheduler(num_blocks=cfg.num_blocks, block_size=spec.hybrid.block_size,
                                            kv_cache_config=cfg, max_model_len=spec.hybrid.max_model_len, **common)
            roles = runner_roles(hybrid[0])
            block_size = spec.hybrid.block_size
        else:
            host_caches = [create_caches(layout, d) for d in host_devices]
            slot_bytes = CacheLayout.from_caches(host_caches[0][0]).device_bytes_per_chunk
            self.scheduler = make_scheduler(
                num_blocks=layout.num_blocks, block_size=layout.block_size,
                **scheduler_kv_shape(slot_bytes * spec.num_hosts, layout.block_size), **common)
            block_size = layout.block_size
        self.runners: list[SyntheticRunner] = []
        self.connectors = []
        for host, (caches, mesh) in enumerate(host_caches):
            runner = SyntheticRunner(caches, mesh, block_size=block_size, serves=roles.get("serves"),
                                     windows=roles.get("windows", (None,)))
            if roles:
                runner.layer_name_to_kvcache_index = roles["layer_name_to_kvcache_index"]
            self._attach(host, runner, make_worker_connector(self.scheduler), faults)

    @property
    def offload(self):
        """The connector's scheduler half."""
        return self.scheduler.connector.scheduler

    def add_request(self, request) -> None:
        self.scheduler.add_request(request)

    def _execute(self, so):
        outs = []
        for host, (runner, conn) in enumerate(zip(self.runners, self.connectors)):
            out = runner.execute(so, conn)
            if self.drop_report is not None and out.kv_connector_output is not None and self.drop_report(self.steps, host):
                out.kv_connector_output.kv_connector_worker_meta = None
            outs.append(out)
        if self.aggregator is None:
            return outs[0]
        return self.aggregator.aggregate(outs, output_rank=0)

    def _process(self, so, out) -> None:
        absorb_outputs(self, self.scheduler.update_from_output(so, out))

    def step(self) -> None:
        """One EngineCore step: step() for the Scheduler, step_with_batch_queue() (depth 2) for the
        AsyncScheduler, where the next batch is scheduled before the previous output is processed."""
        self.steps += 1
        sched = self.scheduler
        if not self.spec.async_scheduling:
            if sched.has_requests():
                so = sched.schedule()
                self._process(so, self._execute(so))
            return
        if sched.has_requests():
            so = sched.schedule()
            self._queue.appendleft((so, self._execute(so)))
            if len(self._queue) < 2 and (so.total_num_scheduled_tokens > 0 or sched.has_requests()):
                return
        if self._queue:
            self._process(*self._queue.pop())

    def has_work(self) -> bool:
        return self.scheduler.has_requests() or bool(self._queue)

    def run(self, max_steps: int = 10_000, on_step=None) -> int:
        n = 0
        while self.has_work():
            self.step()
            n += 1
            if on_step is not None:
                on_step(self)
            if n >= max_steps:
                raise RuntimeError(f"engine not idle after {max_steps} steps")
        return n

    def settle(self, timeout: float = 30.0) -> None:
        """Wait for every background save, then run empty steps until all reports reached the scheduler."""
        for conn in self.connectors:
            conn.worker.wait_idle(timeout)
        for _ in range(3):
            so = self.scheduler.schedule()
            self._process(so, self._execute(so))

    def mismatches(self) -> int:
        return sum(r.wrong_reads() for r in self.runners)

    def close(self) -> None:
        """Shut down as vLLM's engine core does: the workers (executor) first, then the scheduler
        (its KV event publisher and its connector)."""
        for conn in self.connectors:
            conn.shutdown()
        self.scheduler.shutdown()
