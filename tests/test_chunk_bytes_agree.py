"""``cpu_bytes_to_use`` means what it says for every layout: the scheduler half and the workers agree
on a chunk's bytes on a host.

The scheduler half divides ``cpu_bytes_to_use`` by ``host_chunk_bytes(kv_cache_config, hosts,
storage_factor(vllm_config, kv_cache_config))`` (connector.py) to plan its slots; each worker divides
the same bytes by its ``CacheLayout.device_bytes_per_chunk`` to size its slot table
(worker/transfer_engine.py). If the two differ, the scheduler plans slots a host does not have (the
worker refuses at the first step) or leaves host RAM unused. Both sides are built here from
tpu-inference's own code: the scheduler's KV cache config from the per-layer specs its KVCacheManager
reports (``tpu_layouts.kv_cache_spec``: ``MLAAttentionSpec`` for MLA, its page sizes), grouped by
vLLM's engine-core functions, and its ``ShardingConfigManager``; the workers' caches from its
``create_kv_caches`` on its runner's mesh.
"""

from __future__ import annotations

import pytest

from tpuoffload.layout import CacheLayout
from tpuoffload.manager import topology
from tpuoffload.manager.topology import host_chunk_bytes, storage_factor
from tpuoffload.sim.tpu_layouts import LAYOUTS, create_caches, kv_cache_spec, sharding_config, slice_page_bytes
from tpuoffload.sim.vllm_setup import make_vllm_config, scheduler_kv_cache_config

HOST_COUNTS = (1, 2, 4)


def _scheduler_chunk_bytes(spec, hosts: int, factor=storage_factor) -> tuple[int, object]:
    """What the scheduler half of a slice of ``hosts`` hosts computes (connector.py), from the config
    the simulated slice gives it (sim/podslice.py)."""
    vllm_config = make_vllm_config(block_size=spec.block_size, kv_connector_extra_config=None,
                                   connector_module_path=None, connector_class="", tensor_parallel_size=hosts)
    vllm_config.sharding_config = sharding_config(spec)  # tpu-inference's platform attaches it
    kv = scheduler_kv_cache_config(vllm_config, kv_cache_spec(spec), spec.num_blocks)
    return host_chunk_bytes(kv, hosts, factor(vllm_config, kv)), kv


def _worker_chunk_bytes(spec, hosts: int) -> int:
    """What one host's worker stores per chunk: ``device_bytes_per_chunk`` of the caches
    tpu-inference allocates, over that host's devices. Built in one process (every device
    addressable), it covers all hosts' devices; CacheLayout refuses tiles of different sizes, so
    every device holds the same bytes and one host's part is its share of the devices."""
    caches, _ = create_caches(spec)
    total = CacheLayout.from_caches(caches).device_bytes_per_chunk
    assert total % hosts == 0
    return total // hosts


def _old_storage_factor(vllm_config, kv_cache_config) -> int:
    """The rule before: MLA replicas only when ``model_config.use_mla`` (the simulated scheduler's
    llama config does not set it; the KV cache config says MLA)."""
    sharding = vllm_config.sharding_config
    factor = int(sharding.total_dp_size)
    if getattr(vllm_config.model_config, "use_mla", False):
        factor *= int(sharding.tp_size) * int(sharding.expert_size)
    return factor


# A known disagreement, kept visible (strict: the test fails once it is fixed): layers of one attention
# type but different head sizes form one vLLM group of UniformTypeKVCacheSpecs, and vLLM 0.32's
# ``generate_scheduler_kv_cache_config`` hands the scheduler one arbitrary layer's spec for the whole
# group, so the scheduler's config no longer says what the other layers' pages are (2 x 256 + 1 x 512:
# the scheduler counts 3 x 256). Lifting it needs the bytes per block from somewhere else than the
# specs (the config's kv_cache_tensors, which tpu-inference's DPScheduler copies with the whole
# engine's sizes); the simulated slices so far used a float32 stand-in page that hid this.
MIXED_HEAD_SIZES = pytest.mark.xfail(strict=True, reason="vLLM gives the scheduler one spec per uniform-type group")


@pytest.mark.parametrize("name", [pytest.param(n, marks=MIXED_HEAD_SIZES) if LAYOUTS[n].extra_layers else n
                                  for n in sorted(LAYOUTS)])
def test_both_halves_agree_on_a_chunks_bytes(name):
    spec = LAYOUTS[name]
    worker_total = _worker_chunk_bytes(spec, 1)
    for hosts in HOST_COUNTS:
        if spec.num_devices % hosts:
            continue
        sched, kv = _scheduler_chunk_bytes(spec, hosts)
        assert sched == worker_total // hosts, (name, hosts, sched, worker_total // hosts)
    # The scheduler's config is what tpu-inference reports: MLA layers as MLAAttentionSpec, every
    # page tpu-inference's own size.
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    assert all(isinstance(g.kv_cache_spec, MLAAttentionSpec) == spec.use_mla for g in kv.kv_cache_groups)
    pages = sum(s.page_size_bytes for s in kv_cache_spec(spec).values())
    assert pages == slice_page_bytes(spec)


@pytest.mark.parametrize("name", ["mla-tp4", "mla-attndp2-tp2", "bf16-attndp4-tp2"])
def test_negative_control_the_old_rule_misses_mla_replicas(name):
    """The rule before this change (MLA from ``model_config.use_mla``): on the simulated scheduler's
    config, which reports MLA only through its KV cache specs, the MLA layouts disagree (the
    scheduler plans a latent copy per host where every device keeps one: 4x, 2x the slots a host
    has; issue 36's "plans host slots up to 102 but this host has 25"); the non-MLA one agrees."""
    spec = LAYOUTS[name]
    worker = _worker_chunk_bytes(spec, 2)
    old, _ = _scheduler_chunk_bytes(spec, 2, factor=_old_storage_factor)
    new, _ = _scheduler_chunk_bytes(spec, 2)
    assert new == worker
    if spec.use_mla:
        assert old * spec.tp == worker, (old, worker)
    else:
        assert old == worker


def test_mla_and_non_mla_groups_together_are_refused():
    """One factor cannot describe a latent (replicated) group and a head-sharded one."""
    import dataclasses

    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    mla = kv_cache_spec(LAYOUTS["mla-tp4"])["layer.0"]
    full = kv_cache_spec(LAYOUTS["bf16-8kv-tp4"])["layer.0"]
    kv = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["a"], mla), KVCacheGroupSpec(["b"], dataclasses.replace(full))])
    vllm_config = type("C", (), {"sharding_config": sharding_config(LAYOUTS["mla-tp4"])})()
    with pytest.raises(ValueError, match="mixes MLA and non-MLA"):
        topology.storage_factor(vllm_config, kv)


# ------------------------------------------------------------------ GDN (mamba) hybrids: two pools
# tpu-inference's and vLLM's own code for a Qwen3.5-like model (sim/gdn_layout.py): vLLM's specs as
# tpu-inference reports them (every page padded to one size, update_mamba_page_size_padded), the
# scheduler's KV cache config (each DPScheduler rank's from tpu-inference's _create_per_rank_configs),
# the arrays its KVCacheManager allocates. Both halves are the connector's own, built from one config.
# Under DPScheduler each device keeps SHARD_SPARE_ROWS spare rows of each pool: host RAM for more.
GDN_BUDGET = {"cpu_bytes_to_use": 24 << 20, "state_ram_fraction": 0.5, "disk_bytes_to_use": 5 << 20}


@pytest.fixture(scope="module", params=["qwen3.5-like", "qwen3.5-like-dp2"])
def gdn(request):
    from tpuoffload.sim import gdn_layout as gl

    return gl.build(gl.GDN_LAYOUTS[request.param])


def _gdn_scheduler_halves(layout, extra: dict) -> list:
    """The scheduler half as the engine builds it: one, or under DPScheduler one per rank over that
    rank's KV cache config (tpu-inference's own split)."""
    import copy
    import types

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from tpuoffload.connector import TPUOffloadConnector
    from tpuoffload.sim import gdn_layout as gl
    from tpuoffload.sim.tpu_layouts import tpu_inference

    spec = layout.spec
    vc = gl.make_vllm_config(spec, extra)
    vc.sharding_config = sharding_config(spec.tpu_spec())  # tpu-inference's platform attaches it
    configs = [copy.deepcopy(layout.kv_cache_config)]
    if spec.dp > 1:
        tpu_inference()
        from tpu_inference.core.sched.dp_scheduler import DPScheduler, update_vllm_config_for_dp_scheduler

        update_vllm_config_for_dp_scheduler(vc)
        vc.cache_config.mamba_num_blocks = layout.mamba_num_blocks  # propagate_mamba_num_blocks
        dp = types.SimpleNamespace(vllm_config=vc, dp_size=spec.dp)
        DPScheduler._create_per_rank_configs(dp, layout.kv_cache_config)
        configs = dp.per_rank_kv_cache_configs
    return [TPUOffloadConnector(vc, KVConnectorRole.SCHEDULER, cfg) for cfg in configs]


def _gdn_bytes_per_chunk(kv_caches) -> tuple[int, int]:
    """What tpu-inference allocated, read off its arrays: the bytes of one block of every attention
    array and of one row of every state array, on every device (a device's shard of a block or row,
    padding and replicated KV heads included), summed over the devices: what the workers copy."""
    def per_row(arrays) -> int:
        return sum(s.data.nbytes // s.data.shape[0] for a in arrays for s in a.addressable_shards)

    return (per_row([c for c in kv_caches if not isinstance(c, tuple)]),
            per_row([a for c in kv_caches if isinstance(c, tuple) for a in c]))


def test_gdn_both_halves_agree_on_each_pools_chunk_bytes_and_slots(gdn, tmp_path):
    """``cpu_bytes_to_use`` and ``disk_bytes_to_use`` mean what they say on a GDN hybrid: per host,
    the scheduler half's KV chunk and state chunk are the bytes the workers store (one block of
    every attention array, one row of every state array, as tpu-inference allocated them), and one
    byte budget gives both halves the same slots of each pool and the same chunk files of each
    pool. The worker here holds every device (one process); per host it stores its share."""
    import copy

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from tpuoffload.connector import TPUOffloadConnector
    from tpuoffload.sim import gdn_layout as gl

    spec = gdn.spec
    truth = _gdn_bytes_per_chunk(gdn.kv_caches)
    wrong = []  # every disagreement, then one assert (each names what it counts: scheduler, workers)
    for hosts in (1, 2, 4):
        halves = _gdn_scheduler_halves(gdn, {"num_cpu_chunks": 1024, "state_ram_fraction": 0.5, "num_hosts": hosts})
        assert len(halves) == spec.dp
        for h in halves:
            sched, host = tuple(h.scheduler.saves.pool_chunk_bytes), (truth[0] // hosts, truth[1] // hosts)
            if sched != host:
                wrong.append(f"{hosts} hosts, bytes per (KV, state) chunk per host: {sched} != {host}")
            h.shutdown()
    # One host's byte budget, through both halves' own code: the same slots of each pool and the
    # same chunk files of each pool (under DPScheduler: each rank's half and that rank's stage).
    extra = dict(GDN_BUDGET, disk_path=str(tmp_path / "disk"))
    halves = _gdn_scheduler_halves(gdn, extra)
    gdn.runner.kv_caches = list(gdn.kv_caches)
    worker = TPUOffloadConnector(gl.make_vllm_config(spec, extra), KVConnectorRole.WORKER,
                                 copy.deepcopy(gdn.worker_kv_cache_config))
    worker.register_runner(gdn.runner)
    try:
        engine = worker.worker.engine
        assert tuple(e.slot_table.slot_bytes for e in engine.engines) == truth
        sched = [h.scheduler for h in halves]
        planned = tuple(sum(s.index.pool_sizes[p] for s in sched) for p in range(2))
        have = (engine.num_slots(0), engine.num_slots(1))
        if planned != have:
            wrong.append(f"slots per pool: {planned} != {have}")
        files_planned = [s.tier("disk").disk.index.pool_sizes for s in sched]
        files_kept = [tuple(t.capacity_chunks for t in stage.tiers) for stage in worker.worker.tiers
                      if stage.name == "disk"]
        if files_planned != files_kept:
            wrong.append(f"chunk files per pool, per rank: {files_planned} != {files_kept}")
        assert not wrong, (spec.name, wrong)
    finally:
        worker.shutdown()
        for h in halves:
            h.shutdown()


def test_gdn_negative_control_vllms_attention_page_misses_the_arrays_padding(gdn):
    """The rule before (the attention spec's ``real_page_size_bytes``, vLLM's count): head_dim 64
    without tpu-inference's padding to 128, half the bytes the workers store per KV chunk, so the
    scheduler planned twice the KV slots (and chunk files) a host has."""
    from tpuoffload.manager.topology import _is_state

    kv = gdn.kv_cache_config
    old = sum(g.kv_cache_spec.real_page_size_bytes * len(g.layer_names)
              for g in kv.kv_cache_groups if not _is_state(g.kv_cache_spec)) * gdn.spec.dp
    worker = _gdn_bytes_per_chunk(gdn.kv_caches)[0]
    assert gdn.spec.head_dim == 64 and 2 * old == worker, (old, worker)
    assert host_chunk_bytes(kv, 1, gdn.spec.dp) == worker
