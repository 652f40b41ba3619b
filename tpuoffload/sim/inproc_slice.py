"""The hosts of a pod slice inside one process: the soak's fast mode.

``InProcSlice`` is a ``PodSlice`` (tpuoffload.sim.podslice) whose transport is a function call
instead of a pipe to a worker process. It inherits everything above the transport unchanged: the
chaos of the scheduler side (random aborts, dropped and doubled worker reports), vLLM's
``KVOutputAggregator`` merging the hosts' outputs, the per-step comparison of every host's dispatch
digest and sampled tokens (``DigestMismatch`` / ``MisplacedDispatch``, the same errors with the
same messages), ``run``, ``settle`` and ``worker_state``. It replaces only ``_start`` (build the
hosts here), ``_exchange_once`` (hand each host the message in turn), ``_tail`` and ``close``.

Each host is what a worker process of the pod slice is: a WORKER-role ``TPUOffloadConnector``
whose ``OffloadWorker`` has ``host_id=i`` and its own injected ``ChaosInjector``, and a
``SyntheticRunner`` on its own ``Mesh`` of a disjoint subset of this process's CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count`` must provide ``num_hosts x
devices_per_host``), holding its own cache: its shard of ``num_kv_heads // num_hosts`` heads.
Every host gets its own unpickled copy of each message and every reply is pickled back, as
between processes, so nothing is shared by reference and the stats survive serialization.

Differences from the multi-process slice, and what they mean:

* The hosts run one after another on this thread, so host-to-host timing differences come only
  from the injected delays and the background save threads, and a step delay costs N times.
* Nothing in-process can interrupt a host that hangs. Run it under an outside deadline that kills
  the process (tools/soak.py runs it in a child process and kills that process group).
* There are no per-host logs: a SliceError quotes no log lines.
"""

from __future__ import annotations

import os
import pickle
import random
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from tpuoffload.sim.podslice import Chaos, PodSlice, SliceError, SliceSpec, _mark_hooks
from tpuoffload.worker.faults import FaultInjector, FaultPoint

_LOG_DIR = os.path.join(tempfile.gettempdir(), "tpuoffload-inproc-slice")


@dataclass(frozen=True)
class PointFaults:
    """Exceptions at the worker's declared fault points on one host (beyond ``Chaos``):
    at each point named in ``points``, the whole operation raises with probability ``rate``."""

    host: int = 0
    rate: float = 0.0
    points: tuple[str, ...] = field(default_factory=lambda: tuple(p.name for p in FaultPoint))


class ChaosInjector(FaultInjector):
    """``Chaos`` (and optional ``PointFaults``) for one host, as a ``FaultInjector``.

    ================  ===========================================================
    point             what this host does there
    ================  ===========================================================
    WRITE_SLOTS       sleeps up to ``write_delay_s`` (every host), plus
                      ``slow_host_delay_s`` on ``slow_host``
    D2H               raises with ``fail_d2h_rate`` on ``fail_d2h_host`` (the save fails)
    READ_SLOTS        with ``lose_slot_rate`` on ``lose_slot_host``: one random position
                      fails alone (a lost slot: a load error, recomputed on every host)
    any point         raises with ``PointFaults.rate`` on ``PointFaults.host``
    ================  ===========================================================

    Seeded per host. ``hit`` runs on the engine's main thread and on its save threads.
    """

    def __init__(self, chaos: Chaos, host: int, point_faults: PointFaults | None = None) -> None:
        self.chaos = chaos
        self.host = host
        self.point_faults = point_faults if point_faults is not None and point_faults.host == host else None
        # One stream per point: the main-thread points (READ_SLOTS, H2D) then draw in an order fixed
        # by the step sequence, whatever the timing of the save threads.
        self._rngs = {p.name: random.Random(f"{chaos.seed}-{host}-{p.name}") for p in FaultPoint}
        self._lock = threading.Lock()  # guards _rngs and hits (hit runs on the main thread and the save threads)
        self.hits: dict[str, int] = {}  # point name -> faults injected there; guarded by _lock

    def hit(self, point: FaultPoint, n: int) -> set[int]:
        c, name = self.chaos, point.name
        delay, fail, lost = 0.0, None, set()
        with self._lock:
            rng = self._rngs[name]
            pf = self.point_faults
            if pf is not None and name in pf.points and rng.random() < pf.rate:
                fail = f"chaos: {name} failed on host {self.host}"
            elif name == "WRITE_SLOTS":
                if c.write_delay_s:
                    delay = rng.uniform(0, c.write_delay_s)
                if c.slow_host == self.host:
                    delay += c.slow_host_delay_s
            elif name == "D2H" and c.fail_d2h_host == self.host and rng.random() < c.fail_d2h_rate:
                fail = f"chaos: device-to-host copy failed on host {self.host}"
            elif name == "READ_SLOTS" and c.lose_slot_host == self.host and n and rng.random() < c.lose_slot_rate:
                lost = {rng.randrange(n)}
            if fail is not None or lost:
                self.hits[name] = self.hits.get(name, 0) + 1
        if delay:
            time.sleep(delay)
        if fail is not None:
            raise RuntimeError(fail)
        return lost


@dataclass
class _Host:
    rank: int
    runner: Any  # SyntheticRunner
    connector: Any  # TPUOffloadConnector, WORKER role
    injector: ChaosInjector
    rng: random.Random  # step delays
    stall_at_step: int | None = None  # negative control: block forever at this step


class InProcSlice(PodSlice):
    """``InProcSlice(spec, chaos)``: a PodSlice whose hosts live in this process (see the module
    docstring). ``point_faults`` adds exceptions at the worker's fault points on one host;
    ``stall=(host, step)`` is a negative control for outside hang detection: that host blocks
    forever when it receives that step."""

    def __init__(self, spec: SliceSpec, chaos: Chaos | None = None, log_dir: str | None = None, *,
                 point_faults: PointFaults | None = None, stall: tuple[int, int] | None = None) -> None:
        self.hosts: list[_Host] = []
        self._point_faults = point_faults
        self._stall = stall
        super().__init__(spec, chaos, log_dir=log_dir or _LOG_DIR)

    # ---------------------------------------------------------------- hosts
    def _start(self) -> None:
        import jax
        import numpy as np
        from jax.sharding import Mesh
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        from tpuoffload.connector import TPUOffloadConnector
        from tpuoffload.sim.runner import SyntheticRunner
        from tpuoffload.worker.offload_worker import OffloadWorker

        spec, chaos = self.spec, self.chaos
        devices = jax.devices()
        need = spec.num_hosts * spec.devices_per_host
        if len(devices) < need:
            raise SliceError(f"{spec.num_hosts} hosts x {spec.devices_per_host} devices need {need} devices; JAX has "
                             f"{len(devices)} (set XLA_FLAGS=--xla_force_host_platform_device_count={need})")
        for rank in range(spec.num_hosts):
            mesh = Mesh(np.array(devices[rank * spec.devices_per_host:(rank + 1) * spec.devices_per_host]), ("model",))
            runner = SyntheticRunner(mesh, num_blocks=spec.num_blocks, block_size=spec.block_size,
                                     num_layers=spec.num_layers, num_heads=spec.num_kv_heads // spec.num_hosts,
                                     head_dim=spec.head_dim)
            connector = TPUOffloadConnector(self.scheduler.vllm_config, KVConnectorRole.WORKER,
                                            self.scheduler.kv_cache_config)
            injector = ChaosInjector(chaos, rank, self._point_faults)
            connector.worker = OffloadWorker(connector.config, host_id=rank, faults=injector)
            connector.register_runner(runner)
            _mark_hooks(connector, runner)
            if chaos.broken:
                from tpuoffload.sim.broken import break_engine

                break_engine(connector.worker.engine, chaos.broken, rank)
            stall = self._stall[1] if self._stall is not None and self._stall[0] == rank else None
            self.hosts.append(_Host(rank, runner, connector, injector, random.Random(chaos.seed * 7 + rank), stall))
        self.start_state = self.worker_state()

    def _serve(self, host: _Host, msg: tuple) -> Any:
        """What a worker process of the pod slice answers to ``msg`` (podslice._worker_main)."""
        runner, connector = host.runner, host.connector
        if msg[0] == "step":
            if self.chaos.step_delay_s:
                time.sleep(host.rng.uniform(0, self.chaos.step_delay_s))
            if host.stall_at_step is not None and runner.stats.steps >= host.stall_at_step:
                threading.Event().wait()  # negative control: a host that never answers
            out = runner.execute(msg[1], connector)
            return out, connector.worker.digests[-1], runner.stats.mismatches
        engine = connector.worker.engine
        if msg[0] == "idle":
            return engine.wait_idle(msg[1])
        if msg[0] == "state":
            idle = engine.wait_idle(30)
            chunks, staging, _ = engine.inflight()
            state = {"host": host.rank, "mismatches": runner.stats.mismatches,
                     "mismatched_requests": sorted(runner.stats.mismatched_requests),
                     "positions_verified": runner.stats.positions_verified,
                     "inflight_chunks": chunks, "staging_bytes": staging, "idle": idle,
                     "backend_bytes": engine.backend.nbytes, "backend_slots_used": engine.backend.num_used(),
                     "steps": runner.stats.steps, "faults_injected": dict(host.injector.hits)}
            idle_report = getattr(connector.worker, "idle_report", None)
            if idle_report is not None:
                state["idle_report"] = idle_report()
            return state
        raise ValueError(f"unknown message {msg[0]!r}")

    def _exchange_once(self, msg: Any, timeout: float, what: str) -> list[Any]:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        t0 = time.monotonic()
        replies = []
        for host in self.hosts:
            if msg[0] == "idle":  # one deadline for all hosts, as in the pod slice
                msg = ("idle", max(0.0, t0 + msg[1] - time.monotonic()))
                data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
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

    def _tail(self, rank: int) -> str:
        return "(an in-process host: its log lines are in this process's log)"

    def close(self) -> None:
        """Shut every host's connector down (waits for its background writes); safe to call twice."""
        if self.closed:
            return
        self.closed = True
        for host in self.hosts:
            host.connector.shutdown()
