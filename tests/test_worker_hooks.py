"""The worker half against the hook orders tpu-inference's runner really produces.

tpu-inference's continue-decode path (``runner/tpu_runner.py``: ``enable_continue_decode``) runs
its donating decode loop *inside* the connector context and assigns ``runner.kv_caches`` only after
the context exits, so at ``wait_for_save`` (and at an async ``start_load_kv``, which vLLM's mixin
calls on exit) the runner still holds deleted arrays. The worker loads in ``bind`` and skips,
symmetrically, a save it cannot gather.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np

from tpuoffload.config import parse_config
from tpuoffload.messages import LoadRequest, OffloadMetadata, StepPlan, OffloadWorkerReport, SaveBatch
from tpuoffload.sim.tpu_layouts import LAYOUTS, create_caches
from tpuoffload.worker.offload_worker import OffloadWorker


def _fill(caches, seed):
    rng = np.random.default_rng(seed)
    return [jax.device_put(rng.integers(0, 100, size=c.shape).astype(c.dtype), c.sharding) for c in caches]


def _decode_loop(caches):
    """Stands in for continue_decode: a jitted loop that donates the caches and returns new ones."""
    step = jax.jit(lambda cs: tuple(c.at[0].set(c[0] + 1) for c in cs), donate_argnums=0)
    return list(step(tuple(caches)))


def test_continue_decode_hook_order_loads_exact_saves_skipped_no_crash():
    caches, mesh = create_caches(LAYOUTS["bf16-8kv-tp4"])
    runner = types.SimpleNamespace(kv_caches=_fill(caches, 0), mesh=mesh)
    worker = OffloadWorker(parse_config({"cpu_bytes_to_use": 1 << 22}), host_id=0)
    worker.register_runner(runner)
    original = [np.asarray(c) for c in runner.kv_caches]

    # Step 0: a normal step saves blocks 3 and 4 into slots 0 and 1.
    worker.bind(OffloadMetadata([StepPlan(step=0, num_slots=worker.engine.num_slots(0),
                                save=SaveBatch((3, 4), (0, 1), (100, 101)))]))
    worker.start_load()
    worker.wait_for_save()
    worker.clear()
    assert worker.engine.wait_idle(30)
    assert worker.build_report() == OffloadWorkerReport.from_host(0, saved_ids=[100, 101])

    # Step 1, continue-decode: loads of slots 0, 1 into blocks 10, 11 and a save of block 5.
    meta = OffloadMetadata([StepPlan(step=1, num_slots=worker.engine.num_slots(0),
                           save=SaveBatch((5,), (2,), (102,)),
                           loads=(LoadRequest("r", (10, 11), (0, 1), (100, 101)),))])
    worker.bind(meta)  # the loads are dispatched here, before the loop reads runner.kv_caches
    final = _decode_loop(runner.kv_caches)  # donates them; the runner assigns only after exit
    worker.start_load()  # vLLM's mixin calls it on exit for async loads: must not touch deleted arrays
    worker.wait_for_save()  # the caches are deleted: skipped, reported failed, no crash
    _, recving = worker.get_finished()
    errors = worker.take_load_errors()
    report = worker.build_report()
    worker.clear()
    runner.kv_caches = final

    assert recving == {"r"} and errors == set()
    assert report == OffloadWorkerReport.from_host(0, failed_ids=[102])
    for layer, c in enumerate(runner.kv_caches):
        got = np.asarray(c)
        want = original[layer][[3, 4]]
        assert np.array_equal(got[[10, 11]], want), f"layer {layer}: loaded blocks differ"
    stats = worker.take_stats().totals()
    assert stats["save_failures"] == 1 and stats["chunks_loaded"] == 2


def test_load_failure_in_dispatch_is_counted_and_reported():
    """Issue 12: blocks that reach vLLM as failed are counted in load_errors, whatever failed."""
    caches, mesh = create_caches(LAYOUTS["bf16-8kv-tp4"])
    runner = types.SimpleNamespace(kv_caches=_fill(caches, 0), mesh=mesh)
    worker = OffloadWorker(parse_config({"cpu_bytes_to_use": 1 << 22}), host_id=0)
    worker.register_runner(runner)
    # Slots never written: every block of the load fails on this host.
    worker.bind(OffloadMetadata([StepPlan(step=0, num_slots=worker.engine.num_slots(0),
                                loads=(LoadRequest("r", (1, 2, 3), (0, 1, 2), (7, 8, 9), (4,)),))]))
    worker.wait_for_save()
    errors = worker.take_load_errors()
    worker.clear()
    assert errors == {1, 2, 3, 4}
    assert worker.take_stats().totals()["load_errors"] == 3  # the 4th was never promised to this host
    assert jnp.all(np.asarray(runner.kv_caches[0])[[1, 2, 3]] == 0)  # placeholders, never stale bytes
