"""Helpers of the DP tier tests (tests/test_dp_disk.py, test_dp_restart.py, test_dp_shared.py): one
host's worker over every batch shard of a tpu-inference DP layout, driven plan by plan as
DPScheduler's merge hands the ranks' plans to the workers (tests/test_dp_scheduler.py shows the
merge), and groups of requests served on a DPScheduler pod slice."""

from __future__ import annotations

import types

import jax
import numpy as np

from tpuoffload.config import parse_config
from tpuoffload.messages import OffloadMetadata, StepPlan
from tpuoffload.sim.tpu_layouts import LAYOUTS, create_caches
from tpuoffload.worker.offload_worker import OffloadWorker


def dp_worker(extra: dict, seed: int, layout: str = "bf16-dp2-tp4"):
    """A worker on one host holding every batch shard of ``layout`` (random contents from ``seed``),
    16 MiB of host RAM and ``extra`` config. Returns (worker, runner, the caches' original contents,
    slots per rank, blocks per rank)."""
    caches, mesh = create_caches(LAYOUTS[layout])
    rng = np.random.default_rng(seed)
    caches = [jax.device_put(rng.integers(0, 100, size=c.shape).astype(c.dtype), c.sharding) for c in caches]
    original = [np.asarray(c) for c in caches]
    runner = types.SimpleNamespace(kv_caches=caches, mesh=mesh)
    worker = OffloadWorker(parse_config({"cpu_bytes_to_use": 1 << 24, **extra}), host_id=0)
    worker.register_runner(runner)
    return worker, runner, original, worker.engine.num_slots(0) // 2, caches[0].shape[0] // 2


def rank_plan(rank: int, bpr: int, step: int, per_rank: int, **fields) -> StepPlan:
    """Rank ``rank``'s plan as DPScheduler's merge hands it to the workers (its blocks moved by
    ``rank * bpr``)."""
    return StepPlan(step, per_rank, source=1000 + rank, num_blocks=bpr, failures_by_request=True,
                    local_block_ids=[rank * bpr], **fields)


def run_step(worker, plans) -> set[str]:
    """One step of ``plans`` on ``worker``, waited until idle; the requests whose load failed."""
    worker.bind(OffloadMetadata(plans))
    worker.wait_for_save()
    worker.get_finished()
    failed = worker.take_failed_recving()
    worker.clear()
    assert worker.wait_idle(30)
    return failed


def serve_groups(pod, prompts: list[list[list[int]]], tag: str) -> list[list[int]]:
    """Each group's requests added together (DPScheduler gives the i-th to rank i when the ranks are
    idle), run until idle and settled (what a group's saves caused, spills included, is done before
    the next group is looked up); every output equal to what the synthetic model computes from
    scratch. Returns the ranks each group's requests went to."""
    from tpuoffload.sim.vllm_setup import make_request
    from tpuoffload.sim.workload import expected_output

    placed = []
    for g, group in enumerate(prompts):
        ids = [f"{tag}{g}-{i}" for i in range(len(group))]
        for rid, prompt in zip(ids, group):
            pod.add_request(make_request(rid, prompt, max_tokens=2))
        placed.append([pod.scheduler.assigned_dp_rank[rid] for rid in ids])
        pod.run()
        for rid, prompt in zip(ids, group):
            assert pod.outputs[rid] == expected_output(prompt, 2, 32000), rid
        assert pod.settle(60.0)
    return placed
