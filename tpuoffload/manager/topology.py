"""How many worker processes report each step, and how many bytes one of them stores per chunk.

tpu-inference runs one JAX process per host, holding all of that host's chips
(``platforms/tpu_platform.py`` picks the executor; ``executors/``):

* one host, no pipeline parallelism: the ``uni`` executor, one process;
* one host with pipeline parallelism: its ``MultiprocExecutor``, one process per stage
  (``world_size = pipeline_parallel_size``);
* several hosts: its Ray executors, one actor per placement-group bundle, one bundle per host.

vLLM's ``parallel_config.world_size`` stays pp * tp * pcp (8 for ``--tensor-parallel-size 8`` on
one host), so it is the wrong count there; with vLLM's own executors (``mp``, ``ray``) it is the
right one (one process per rank). The count is both the number of confirmations a chunk needs
(invariant 7) and what ``get_finished_count()`` tells vLLM's KVOutputAggregator to wait for.
``kv_connector_extra_config['num_hosts']`` overrides the detection.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tpuoffload.backend.slot_table import shard_slots
from tpuoffload.compat import is_tpu_inference_name

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


def _backend_name(backend: Any) -> str:
    if backend is None or isinstance(backend, str):
        return backend or ""
    return f"{getattr(backend, '__module__', '')}.{getattr(backend, '__qualname__', type(backend).__name__)}"


def reporting_workers(vllm_config: "VllmConfig", override: int | None = None) -> tuple[int, str]:
    """(number of worker processes that report each step, how it was found). Invariant 7: the
    number of hosts comes from the engine (its executor), not from guessing."""
    if override is not None:
        return override, "kv_connector_extra_config['num_hosts']"
    pc = vllm_config.parallel_config
    backend = pc.distributed_executor_backend
    name = _backend_name(backend)
    if name == "uni":
        return 1, "the 'uni' executor: one worker process"
    if is_tpu_inference_name(name) and name.endswith(".MultiprocExecutor"):
        pp = pc.pipeline_parallel_size
        return pp, f"tpu-inference's MultiprocExecutor: one process per pipeline stage ({pp})"
    if is_tpu_inference_name(name) and getattr(backend, "uses_ray", False):
        group = getattr(pc, "placement_group", None)
        bundles = getattr(group, "bundle_specs", None)
        if bundles:
            return len(bundles), f"tpu-inference's Ray executor: one process per placement-group bundle ({len(bundles)})"
    return pc.world_size, f"executor {name or 'default'}: one process per rank (world_size {pc.world_size})"


def storage_factor(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> int:
    """How many times a host stores its share of a block, beyond the share itself.

    A worker keeps its slots where its devices' shards live (tpuoffload/worker/programs.py): with
    blocks split over ``D`` batch shards (data / attention-data parallelism) every device keeps a
    slot row for its own shard, and an MLA latent cache, sharded ``P(BATCH, KV_CONTEXT)`` and so
    replicated over the KV-head axes (``model``, ``expert``), keeps a copy per replica.
    tpu-inference records the parallelism on ``vllm_config.sharding_config`` (its platform sets
    it); without it the factor is 1.

    Whether the cache is MLA is read from the KV cache config, not from ``model_config.use_mla``:
    tpu-inference's KVCacheManager reports every attention layer of an MLA model as an
    ``MLAAttentionSpec`` whose page is one latent copy (``_create_attention_spec``, page from
    ``get_attention_page_size_bytes(..., use_mla=True)``) and allocates those layers replicated
    (``create_kv_caches(use_mla=...)``), both from the workers' one ``use_mla`` flag. The spec is
    the workers' own report of what they allocated; the scheduler process's ``use_mla`` is a second
    derivation of it (it reads ``VLLM_MLA_DISABLE`` in that process). MLA and non-MLA attention
    groups in one config are refused: tpu-inference never mixes them, and one factor could not
    describe both.
    """
    sharding = getattr(vllm_config, "sharding_config", None)
    if sharding is None:
        return 1
    factor = int(sharding.total_dp_size)
    mla = {_is_mla(g.kv_cache_spec) for g in kv_cache_config.kv_cache_groups if not _is_state(g.kv_cache_spec)}
    if mla == {True, False}:
        raise ValueError("the KV cache config mixes MLA and non-MLA attention groups; tpuoffload sizes a chunk "
                         "for one or the other (tpu-inference reports every attention layer of an MLA model "
                         "as MLAAttentionSpec)")
    if mla == {True}:
        factor *= int(sharding.tp_size) * int(sharding.expert_size)
    return factor


def _is_mla(spec) -> bool:
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, UniformTypeKVCacheSpecs

    if isinstance(spec, UniformTypeKVCacheSpecs):
        return all(isinstance(s, MLAAttentionSpec) for s in spec.kv_cache_specs.values())
    return isinstance(spec, MLAAttentionSpec)


def _is_state(spec) -> bool:
    from vllm.v1.kv_cache_interface import MambaSpec

    return isinstance(spec, MambaSpec)


def host_chunk_bytes(kv_cache_config: "KVCacheConfig", num_workers: int, factor: int = 1) -> int:
    """Bytes one worker process stores per KV chunk (one block of every attention array): vLLM's
    page sizes cover the whole mesh, so the sum over KV cache groups of ``page_size_bytes *
    layers``, times ``storage_factor``, is divided by the number of reporting processes."""
    groups = kv_cache_config.kv_cache_groups
    if any(_is_state(g.kv_cache_spec) for g in groups):
        # A GDN/mamba hybrid: one array per attention layer, each block of it tpu-inference's
        # attention page (read back from the padded page every spec reports).
        total = factor * _hybrid_attention_page(groups) * max(
            len(g.layer_names) for g in groups if not _is_state(g.kv_cache_spec))
    elif len(groups) > 1:
        # vLLM's hybrid KV cache manager: the groups share one block pool and tpu-inference's
        # arrays each serve one layer of every group, so a chunk (one block of every array, keyed
        # by its group) is a page of the largest group's layers.
        total = factor * max(g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in groups)
    else:
        total = factor * sum(g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in groups)
    return _per_worker(total, num_workers, "one block of every layer")


def _hybrid_attention_page(groups) -> int:
    """Bytes of one block of one attention layer's array in a GDN/mamba hybrid, as tpu-inference
    allocates it.

    tpu-inference's ``KVCacheManager.update_mamba_page_size_padded`` reports every layer of such a
    model (attention and mamba) with one padded page, ``attention groups x A + mamba groups x S``:
    A its attention page (``get_attention_page_size_bytes``: the array's real block, head_dim
    padded to 128, KV heads padded to the model shards, packed by dtype) and S the mamba layers'
    unpadded page (the spec's ``real_page_size_bytes``). A spec's own ``real_page_size_bytes`` of an
    attention layer is vLLM's count, without tpu-inference's head_dim padding (half of A for
    head_dim 64), so A is read back from the padded page. Refused when the specs are not what that
    rule gives (pages of several sizes, mamba layers of several sizes, an attention page smaller
    than vLLM's count): the scheduler could not know an attention block's bytes."""
    attn = [g.kv_cache_spec for g in groups if not _is_state(g.kv_cache_spec)]
    mamba = [g.kv_cache_spec for g in groups if _is_state(g.kv_cache_spec)]
    pages = {s.page_size_bytes for s in attn + mamba}
    states = {s.real_page_size_bytes for s in mamba}
    page, rest = 0, 1
    if len(pages) == len(states) == 1:
        page, rest = divmod(pages.pop() - len(mamba) * states.pop(), len(attn))
    if rest or page < max(s.real_page_size_bytes for s in attn):
        raise ValueError(
            "the KV cache config of this GDN/mamba hybrid is not padded as tpu-inference pads it (one page for "
            "every layer: attention groups x attention page + mamba groups x mamba page): page sizes "
            f"{sorted({s.page_size_bytes for s in attn + mamba})}, mamba pages "
            f"{sorted({s.real_page_size_bytes for s in mamba})}, {len(attn)} attention groups; tpuoffload cannot "
            "tell an attention block's bytes")
    return page


def host_state_bytes(kv_cache_config: "KVCacheConfig", num_workers: int, factor: int = 1) -> int:
    """Bytes one worker process stores per state chunk (one row of every GDN/mamba state array:
    the real, unpadded state of every mamba layer); 0 without mamba layers. ``factor``: the batch
    shards (DP ranks) the state pool splits over, each device keeping a slot row of its own
    shard's (tpu-inference shards the pool ``P(ATTN_DATA, ...)`` like the attention blocks)."""
    total = factor * sum(g.kv_cache_spec.real_page_size_bytes * len(g.layer_names)
                         for g in kv_cache_config.kv_cache_groups if _is_state(g.kv_cache_spec))
    return _per_worker(total, num_workers, "one state row of every GDN layer") if total else 0


def _per_worker(total: int, num_workers: int, what: str) -> int:
    if total <= 0:
        raise ValueError("the KV cache config has no layers: nothing to offload")
    if total % num_workers:
        raise ValueError(f"{what} is {total} bytes, which does not divide over {num_workers} reporting worker "
                         "processes")
    return total // num_workers


@dataclass(frozen=True)
class DPRank:
    """Which part of the engine one scheduler half plans for.

    With data parallelism tpu-inference 0.32 replaces vLLM's scheduler with its ``DPScheduler``
    (``tpu_inference/core/sched/dp_scheduler.py``): one vLLM scheduler, and so one scheduler-role
    connector, per DP rank, each in its own forked process over ``num_blocks`` (the rank's share of
    the blocks). What that asks of a half:

    * ``ranks``: a rank's blocks are one batch shard of the cache, and every device's store rows
      hold its own shard's chunks (worker/programs.py), so a rank plans over a device's slot rows
      (less ``SHARD_SPARE_ROWS``) and the workers place them in its shard's range of slots
      (``StepPlan.placement``): no two halves hand out the same slot, and none wastes host RAM;
    * ``source``: its reports come back under this id (the rank process's pid: unique among the
      ranks of one engine), since every rank's scheduler receives every worker report;
    * ``failures_by_request``: DPScheduler hands the whole worker output to every rank's vLLM
      scheduler, and ``invalid_block_ids`` are rank-local block ids, so a rank would truncate its
      own requests at another rank's failed blocks. Load failures go by request id instead
      (``failed_recving``, which vLLM ignores for ids it does not know), so only the owning rank
      recomputes. Loads are asynchronous, as with one scheduler: vLLM caches loaded blocks in its
      prefix cache only once every host loaded them (a failed load is never cached), and each
      rank's half keeps only its own requests' completions
      (``OffloadScheduler.update_connector_output``).

    The default is one vLLM scheduler for the whole engine.
    """

    ranks: int = 1
    num_blocks: int = 0
    source: int = 0
    # The rank's rows of tpu-inference's compact GDN/mamba state pool (DPScheduler's
    # ``mamba_num_blocks // ranks`` on the rank's KV cache config); 0 without one.
    state_rows: int = 0

    @property
    def failures_by_request(self) -> bool:
        return self.ranks > 1

    def num_slots(self, rows: int) -> int:
        """The slots this half plans over when each host keeps ``rows`` slot rows per device."""
        return shard_slots(rows, self.ranks)

    def stats_source(self, rank: int | None) -> str:
        """The source this half's stats reports carry (stats.py): ``sched``, or under DPScheduler
        one per rank, so that two ranks' reports of the same number never merge into one (the
        merge keeps one value per key). Its process id until the workers said which rank it is."""
        if self.ranks == 1:
            return "sched"
        return f"sched-dp{rank}" if rank is not None else f"sched-pid{self.source}"

    def snapshot_name(self, rank: int | None) -> str | None:
        """The half's stats file: ``scheduler.json``, or ``scheduler-dp<rank>.json`` once the
        workers said which rank it is (None until then)."""
        if self.ranks == 1:
            return "scheduler.json"
        return None if rank is None else f"scheduler-dp{rank}.json"

    @classmethod
    def of(cls, vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> "DPRank":
        """The rank this process's scheduler plans for: tpu-inference's DPScheduler is installed
        exactly when ``sharding_config.total_dp_size > 1`` (``update_vllm_config_for_dp_scheduler``)."""
        sharding = getattr(vllm_config, "sharding_config", None)
        ranks = int(sharding.total_dp_size) if sharding is not None else 1
        sched_cls = getattr(vllm_config.scheduler_config, "scheduler_cls", None)
        name = sched_cls if isinstance(sched_cls, str) else getattr(sched_cls, "__qualname__", "")
        if ranks <= 1 or not str(name).endswith("DPScheduler"):
            return cls()
        return cls(ranks, kv_cache_config.num_blocks, os.getpid(),
                   int(getattr(kv_cache_config, "mamba_num_blocks", None) or 0))


def dp_scheduler_rank() -> int | None:
    """The DP rank this process schedules for, when it is one of tpu-inference's DPScheduler rank
    processes (None otherwise). DPScheduler forks one process per rank, all with the same
    ``vllm_config``, and builds each rank's vLLM scheduler (and so this connector) inside
    ``_scheduler_worker_process(rank, ...)``: the rank is that call's argument, read from the stack
    (it is not in the config). Checked against tpu-inference's own DPScheduler by
    tests/test_events.py."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_scheduler_worker_process" and \
                is_tpu_inference_name(frame.f_globals.get("__name__", ""), "core.sched.dp_scheduler"):
            rank = frame.f_locals.get("rank")
            return rank if isinstance(rank, int) else None
        frame = frame.f_back
    return None


def publish_as_dp_rank(vllm_config: "VllmConfig", dp: DPRank) -> int | None:
    """Under DPScheduler every rank's vLLM scheduler builds its own KV event publisher, after its
    connector, from the same config: all of them would bind the same endpoint (the second bind
    fails: address in use) and label their batches ``data_parallel_rank`` 0, so a router would mix
    the ranks' caches. vLLM's own data parallelism gives each engine's publisher its DP index
    (``parallel_config.data_parallel_index``: the endpoint's port is offset by it and it labels the
    batches); this gives each DPScheduler rank process the same, ``index * ranks + rank``. Only
    this forked process's copy of the config changes, and only when KV events are on. Returns the
    index set (None: nothing to do)."""
    kv_events = getattr(vllm_config, "kv_events_config", None)
    if dp.ranks <= 1 or kv_events is None or not kv_events.enable_kv_cache_events:
        return None
    rank = dp_scheduler_rank()
    if rank is None:
        return None
    pc = vllm_config.parallel_config
    pc.data_parallel_index = pc.data_parallel_index * dp.ranks + rank
    return pc.data_parallel_index
