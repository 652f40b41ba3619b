"""One worker process of a simulated pod slice (``worker_main``, started by tpuoffload/sim/launch.py):
joins the others with ``jax.distributed``, holds its shard of tpu-inference's cache, and runs each
step's SchedulerOutput through the synthetic runner and tpuoffload's worker half, answering the
driver (tpuoffload/sim/podslice.py) over framed pipes."""

from __future__ import annotations

import os
import random
import threading
import time

from tpuoffload.sim.dispatch_marks import mark_hooks
from tpuoffload.sim.chaos import Chaos, ChaosDiskFaults, ChaosInjector, DieInCheckpoint, PointFaults
from tpuoffload.sim.frames import recv_frame, send_frame
from tpuoffload.sim.podslice import SliceSpec
from tpuoffload.sim.tpu_layouts import create_caches

def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(3)


def worker_main(rank: int, num_hosts: int, port: int) -> None:
    """Serve the driver's frames on fd 0 (answers on fd 1, the log on fd 2) until it is gone."""
    import traceback

    # Keep the pipe for frames only: anything a library prints to fd 1 goes to the log instead.
    stdout = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    stdin = os.fdopen(os.dup(0), "rb")
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True, name="parent-watch").start()

    def receive():
        try:
            return recv_frame(stdin)
        except EOFError:  # the scheduler is gone: do not linger in jax.distributed's shutdown
            os._exit(0)

    # The config carries tpu-inference's sharding config: its modules must import (see tpu_layouts).
    from tpuoffload.sim.tpu_layouts import tpu_inference

    tpu_inference()
    init = receive()
    try:
        spec, chaos = SliceSpec(**init["spec"]), Chaos(**init["chaos"])
        injector = ChaosInjector(chaos, rank, PointFaults(**init["point_faults"]) if init.get("point_faults") else None)

        import jax

        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{port}", num_hosts, rank,
                                   initialization_timeout=int(spec.start_timeout_s),
                                   heartbeat_timeout_seconds=10, shutdown_timeout_seconds=10)
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        from tpuoffload.connector import TPUOffloadConnector
        from tpuoffload.sim.runner import SyntheticRunner
        from tpuoffload.worker.offload_worker import OffloadWorker
        from tpuoffload.worker.persistence import Deployment

        # tpu-inference's mesh over every process's devices (ordered by process): each host holds its heads.
        roles = {}
        kv_cache_config = init["kv_cache_config"]
        vllm_config = init["vllm_config"]
        if spec.gdn is not None:  # tpu-inference's KV cache setup for the GDN hybrid, over the slice's mesh
            from tpuoffload.sim.gdn_layout import build
            from tpuoffload.sim.gdn_runner import GdnRunner

            layout = build(spec.gdn_layout(), jax.devices())
            runner = GdnRunner.of(layout, fresh=False)
            kv_cache_config = layout.worker_kv_cache_config
        elif spec.hybrid is not None:  # tpu-inference's initialize_kv_cache with vLLM's hybrid KV cache manager
            from tpuoffload.sim.hybrid_layouts import create_hybrid_cache, runner_roles

            hybrid = create_hybrid_cache(spec.hybrid_layout(), spec.kv_budget_bytes, jax.devices())
            caches, mesh, roles = hybrid.kv_caches, hybrid.mesh, runner_roles(hybrid)
        else:
            caches, mesh = create_caches(spec.slice_layout(), jax.devices())
        if spec.gdn is None:
            runner = SyntheticRunner(caches, mesh, block_size=spec.block_size,
                                     dp_ranks=vllm_config.sharding_config.total_dp_size,
                                     serves=roles.get("serves"), windows=roles.get("windows", (None,)))
        if roles:
            runner.layer_name_to_kvcache_index = roles["layer_name_to_kvcache_index"]
        connector = TPUOffloadConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
        connector.worker = OffloadWorker(connector.config, host_id=rank, faults=injector, deployment=Deployment(
            vllm_config.model_config.model, vllm_config.cache_config.block_size),
            disk_faults=ChaosDiskFaults(chaos, rank),
            persist_faults=DieInCheckpoint() if chaos.die_in_checkpoint_host == rank else None,
            kv_cache_config=kv_cache_config)
        connector.register_runner(runner)
        mark_hooks(connector, runner)
        if chaos.broken:
            from tpuoffload.sim.broken import break_engine

            break_engine(connector.worker.engine.engines[0], chaos.broken, rank)
    except Exception:
        send_frame(stdout, ("error", traceback.format_exc()))
        os._exit(1)
    rng = random.Random(chaos.seed * 7 + rank)
    send_frame(stdout, "ready")
    while True:
        msg = receive()
        try:
            if msg[0] == "step":
                if chaos.step_delay_s:
                    time.sleep(rng.uniform(0, chaos.step_delay_s))
                out = runner.execute(msg[1], connector)
                send_frame(stdout, (out, connector.worker.digests[-1], runner.wrong_reads()))
            elif msg[0] == "shutdown":  # vLLM's clean shutdown of a worker: the connector's last word
                connector.shutdown()
                send_frame(stdout, dict(connector.worker.totals))
            elif msg[0] == "idle":
                send_frame(stdout, connector.worker.wait_idle(msg[1]))
            elif msg[0] == "state":
                eng = connector.worker.engine
                idle = connector.worker.wait_idle(30)
                chunks, staging, _ = eng.inflight()
                send_frame(stdout, {"host": rank, "mismatches": runner.stats.mismatches,
                               "mismatched_requests": sorted(runner.stats.mismatched_requests),
                               "positions_verified": runner.stats.positions_verified,
                               "poisoned_steps": runner.stats.poisoned_steps,
                               "inflight_chunks": chunks, "staging_bytes": staging, "idle": idle,
                               "idle_report": connector.worker.idle_report(),
                               "backend_bytes": sum(t.nbytes for t in eng.tables),
                               "backend_slots_used": sum(t.num_used() for t in eng.tables),
                               "pool_slots_used": [t.num_used() for t in eng.tables],
                               "pool_totals": [dict(t) for t in eng.pool_totals],
                               "states_verified": getattr(runner.stats, "states_verified", 0),
                               "state_mismatches": getattr(runner.stats, "state_mismatches", 0),
                               "steps": runner.stats.steps})
            else:
                raise ValueError(f"unknown message {msg[0]!r}")
        except Exception:
            send_frame(stdout, ("error", traceback.format_exc()))

