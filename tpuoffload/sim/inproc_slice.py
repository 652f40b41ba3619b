"""The hosts of a pod slice inside one process: the soak's fast mode.

``InProcSlice`` is a ``PodSlice`` (tpuoffload.sim.podslice) whose transport is a function call
instead of a pipe to a worker process. It inherits everything above the transport unchanged: the
chaos of the scheduler side (random aborts, dropped and doubled worker reports), vLLM's
``KVOutputAggregator`` merging the hosts' outputs, the per-step comparison of every host's dispatch
digest and sampled tokens (``DigestMismatch`` / ``MisplacedDispatch``, the same errors with the
same messages), ``run``, ``settle``, ``worker_state`` and ``shutdown`` (vLLM's clean shutdown: each
host's connector shuts down, with warm restart on writing its checkpoint, and answers its counters;
then the scheduler). It replaces only ``_start`` (build the hosts here), ``_exchange_once`` (hand
each host the message in turn), ``_tail`` and ``close``.

Each host is what a worker process of the pod slice is (tpuoffload/sim/slice_worker.py): a
WORKER-role ``TPUOffloadConnector`` whose ``OffloadWorker`` has ``host_id=i``, the deployment and
KV cache config the engine gives it, its own injected ``ChaosInjector`` and chaos disk faults, and a
``SyntheticRunner`` on its own mesh of a disjoint subset of this process's CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count`` must provide ``num_hosts x
devices_per_host``), holding its own cache as tpu-inference allocates it: ``SliceSpec.host_layout()``,
the host's part of the slice's cache (its ``num_kv_heads // num_hosts`` heads), so each host's slot
shape and bytes are those of a host of the multi-process slice.
Every host gets its own unpickled copy of each message and every reply is pickled back, as
between processes, so nothing is shared by reference and the stats survive serialization.

Differences from the multi-process slice, and what they mean:

* The hosts run one after another on this thread, so host-to-host timing differences come only
  from the injected delays and the background save threads, and a step delay costs N times.
* Nothing in-process can interrupt a host that hangs. Run it under an outside deadline that kills
  the process (tools/soak.py runs it in a child process and kills that process group).
* There are no per-host logs: a SliceError quotes no log lines.
* A host cannot be SIGKILLed alone: ``Chaos.die_in_checkpoint_host`` is refused (it needs the
  worker processes of ``PodSlice``).

Beyond the pod slice, ``restored_loads`` counts, per host, the chunks restored from a warm-restart
checkpoint (save ids ``restored_save_id``) that the steps' plans loaded and the host did not report
failed (the requests in its ``failed_recving``, or blocks in its ``invalid_block_ids``): the
evidence that a restarted slice read its restored host RAM.
"""

from __future__ import annotations

import os
import pickle
import random
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

from typing_extensions import override
from tpuoffload.sim.podslice import PodSlice, SliceError, SliceSpec
from tpuoffload.messages import RESTORED_BASE
from tpuoffload.sim.chaos import Chaos, ChaosDiskFaults, ChaosInjector, PointFaults
from tpuoffload.sim.dispatch_marks import mark_hooks
from tpuoffload.sim.tpu_layouts import create_caches

_LOG_DIR = os.path.join(tempfile.gettempdir(), "tpuoffload-inproc-slice")


@dataclass
class _Host:
    rank: int
    runner: Any  # SyntheticRunner
    connector: Any  # TPUOffloadConnector, WORKER role
    injector: ChaosInjector
    rng: random.Random  # step delays
    stall_at_step: int | None = None  # negative control: block forever at this step
    shut_down: bool = False  # its connector was shut down ("shutdown"): ``close`` leaves it


class InProcSlice(PodSlice):
    """``InProcSlice(spec, chaos)``: a PodSlice whose hosts live in this process (see the module
    docstring). ``point_faults`` adds exceptions at the worker's fault points on one host;
    ``stall=(host, step)`` is a negative control for outside hang detection: that host blocks
    forever when it receives that step."""

    def __init__(self, spec: SliceSpec, chaos: Chaos | None = None, log_dir: str | None = None, *,
                 point_faults: PointFaults | None = None, stall: tuple[int, int] | None = None) -> None:
        self.hosts: list[_Host] = []
        self._stall = stall
        self.restored_loads: list[int] = []  # per host (module docstring)
        super().__init__(spec, chaos, log_dir=log_dir or _LOG_DIR, point_faults=point_faults)

    # ---------------------------------------------------------------- hosts
    @override
    def _start(self) -> None:
        import jax
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        from tpuoffload.connector import TPUOffloadConnector
        from tpuoffload.sim.runner import SyntheticRunner
        from tpuoffload.worker.offload_worker import OffloadWorker
        from tpuoffload.worker.persistence import Deployment

        spec, chaos = self.spec, self.chaos
        if chaos.die_in_checkpoint_host is not None:
            raise SliceError("a host killed in its checkpoint (die_in_checkpoint_host) needs the worker processes "
                             "of PodSlice: in one process it would kill them all")
        devices = jax.devices()
        need = spec.num_hosts * spec.devices_per_host
        if len(devices) < need:
            raise SliceError(f"{spec.num_hosts} hosts x {spec.devices_per_host} devices need {need} devices; JAX has "
                             f"{len(devices)} (set XLA_FLAGS=--xla_force_host_platform_device_count={need})")
        if spec.hybrid is not None and spec.num_hosts != 1:
            raise SliceError("a hybrid slice in one process has one host: tpu-inference's hybrid arrays span one mesh")
        host_layout = None if spec.hybrid is not None else spec.host_layout()  # this host's part, a cache of its own
        for rank in range(spec.num_hosts):
            own = devices[rank * spec.devices_per_host:(rank + 1) * spec.devices_per_host]
            roles = {}
            if spec.hybrid is not None:  # tpu-inference's initialize_kv_cache with vLLM's hybrid KV cache manager
                from tpuoffload.sim.hybrid_layouts import create_hybrid_cache, runner_roles

                hybrid = create_hybrid_cache(spec.hybrid_layout(), spec.kv_budget_bytes, own)
                caches, mesh, roles = hybrid.kv_caches, hybrid.mesh, runner_roles(hybrid)
            else:
                caches, mesh = create_caches(host_layout, own)
            runner = SyntheticRunner(caches, mesh, block_size=spec.block_size, dp_ranks=self.dp_ranks,
                                     serves=roles.get("serves"), windows=roles.get("windows", (None,)))
            if roles:
                runner.layer_name_to_kvcache_index = roles["layer_name_to_kvcache_index"]
            vllm_config, kv_cache_config = self.scheduler.vllm_config, self._kv_cache_config()
            connector = TPUOffloadConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
            injector = ChaosInjector(chaos, rank, self.point_faults)
            connector.worker = OffloadWorker(connector.config, host_id=rank, faults=injector, deployment=Deployment(
                vllm_config.model_config.model, vllm_config.cache_config.block_size),
                disk_faults=ChaosDiskFaults(chaos, rank), kv_cache_config=kv_cache_config)
            connector.register_runner(runner)
            mark_hooks(connector, runner)
            if chaos.broken:
                from tpuoffload.sim.broken import break_engine

                break_engine(connector.worker.engine.engines[0], chaos.broken, rank)
            stall = self._stall[1] if self._stall is not None and self._stall[0] == rank else None
            self.hosts.append(_Host(rank, runner, connector, injector, random.Random(chaos.seed * 7 + rank), stall))
        self.restored_loads = [0] * len(self.hosts)
        self.start_state = self.worker_state()

    def _serve(self, host: _Host, msg: tuple) -> Any:
        """What a worker process of the pod slice answers to ``msg`` (slice_worker.worker_main)."""
        runner, connector = host.runner, host.connector
        if msg[0] == "step":
            if self.chaos.step_delay_s:
                time.sleep(host.rng.uniform(0, self.chaos.step_delay_s))
            if host.stall_at_step is not None and runner.stats.steps >= host.stall_at_step:
                threading.Event().wait()  # negative control: a host that never answers
            out = runner.execute(msg[1], connector)
            self.restored_loads[host.rank] += _restored_loaded(msg[1], out)
            return out, connector.worker.digests[-1], runner.wrong_reads()
        if msg[0] == "shutdown":  # vLLM's clean shutdown of a worker: the connector's last word
            host.shut_down = True
            connector.shutdown()
            return dict(connector.worker.totals)
        engine = connector.worker.engine
        if msg[0] == "idle":
            return engine.wait_idle(msg[1])
        if msg[0] == "state":
            idle = engine.wait_idle(30)
            chunks, staging, _ = engine.inflight()
            state = {"host": host.rank, "mismatches": runner.stats.mismatches,
                     "mismatched_requests": sorted(runner.stats.mismatched_requests),
                     "positions_verified": runner.stats.positions_verified,
                     "poisoned_steps": runner.stats.poisoned_steps,
                     "inflight_chunks": chunks, "staging_bytes": staging, "idle": idle,
                     "backend_bytes": sum(t.nbytes for t in engine.tables),
                     "backend_slots_used": sum(t.num_used() for t in engine.tables),
                     "steps": runner.stats.steps, "faults_injected": dict(host.injector.hits),
                     "idle_report": connector.worker.idle_report()}
            return state
        raise ValueError(f"unknown message {msg[0]!r}")

    @override
    def _exchange_once(self, msg: Any, timeout: float, what: str) -> list[Any]:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        t0 = time.monotonic()
        idle_deadline = t0 + msg[1] if msg[0] == "idle" else None  # one deadline for all hosts, as in the pod slice
        replies = []
        for host in self.hosts:
            if idle_deadline is not None:
                data = pickle.dumps(("idle", max(0.0, idle_deadline - time.monotonic())),
                                    protocol=pickle.HIGHEST_PROTOCOL)
            try:
                reply = self._serve(host, pickle.loads(data))
                replies.append(pickle.loads(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)))
            except Exception:
                raise self._error(f"{what}: host {host.rank} raised:\n{traceback.format_exc()}", [host.rank]) from None
        took = time.monotonic() - t0
        if took > timeout:
            raise self._error(f"{what}: the hosts took {took:.0f} s, more than {timeout:.0f} s (hang?)",
                              range(len(self.hosts)))
        return replies

    @override
    def _tail(self, rank: int) -> str:
        return "(an in-process host: its log lines are in this process's log)"

    @override
    def close(self) -> None:
        """Shut every host's connector down (waits for its background writes) unless ``shutdown``
        did, and end DPScheduler's rank processes; safe to call twice."""
        if self.closed:
            return
        self.closed = True
        try:
            for host in self.hosts:
                if not host.shut_down:
                    host.shut_down = True
                    host.connector.shutdown()
        finally:
            self._rank_finalizer()  # DPScheduler's rank processes block forever on their pipes otherwise


def _restored_loaded(scheduler_output, output) -> int:
    """Chunks restored from a checkpoint that this step's plans loaded and the host did not report
    failed (InProcSlice.restored_loads)."""
    meta = getattr(scheduler_output, "kv_connector_metadata", None)
    plans = getattr(meta, "requests_meta", None) or ()
    kv = output.kv_connector_output
    failed = set(kv.failed_recving or ()) if kv is not None else set()
    invalid = set(kv.invalid_block_ids or ()) if kv is not None else set()
    n = 0
    for plan in plans:
        for load in plan.loads:
            if load.req_id in failed or invalid.intersection(load.block_ids):
                continue
            # A restored id, possibly moved by another rank's offset (LoadRequest): far above every
            # id a scheduler issues.
            n += sum(1 for i in load.save_ids if i >= _RESTORED_FLOOR)
    return n


_RESTORED_FLOOR = RESTORED_BASE >> 1
