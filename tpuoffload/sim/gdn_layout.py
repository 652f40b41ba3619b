"""A Gated DeltaNet (GDN) hybrid model's KV cache (Qwen3.5-like: 3 GDN layers to 1 full-attention
layer) exactly as tpu-inference 0.32 allocates and schedules it with prefix caching (vLLM's mamba
cache mode "align") and vLLM's hybrid KV cache manager (HMA) on, on CPU JAX, for tests (issue 21).

What is run, all installed code, in the order the engine runs it:

* vLLM's own config resolution of a hybrid GDN model: ``ModelConfig`` over a tiny
  ``Qwen3NextForCausalLM`` config (``is_hybrid``), ``VllmConfig`` (its hybrid hook
  ``MambaModelConfig.verify_and_update_config`` picks mamba cache mode "align" and
  ``mamba_block_size = block_size`` because prefix caching is on), then vLLM's Qwen3.5 hook
  ``Qwen3_5ForCausalLMConfig.verify_and_update_config`` (the conv state keeps the model dtype, the
  SSM state takes the config's ``mamba_ssm_dtype``, float32) and tpu-inference's
  ``TpuPlatform.update_block_size_for_backend``;
* tpu-inference's ``KVCacheManager.get_kv_cache_spec`` (runner/kv_cache_manager.py) over the layers
  in ``compilation_config.static_forward_context``, which for a GDN hybrid runs its
  ``update_mamba_page_size_padded`` (one page size for every layer: attention page + 3 unpadded
  mamba pages) and ``_maybe_set_compact_mamba_num_blocks_override`` (the compact mamba pool M and
  the attention pool, as ``cache_config.num_gpu_blocks_override``); each GDN layer's ``MambaSpec``
  comes from vLLM's own ``MambaBase.get_kv_cache_spec`` / ``QwenGatedDeltaNetAttention
  .get_state_shape`` / ``GatedDeltaNetAttention.get_state_dtype``;
* ``TPUWorker.determine_available_memory`` and ``TPUWorker.get_mamba_num_blocks``, compiled by name
  from the installed worker/tpu_worker.py (see below) and run against a stand-in worker;
* vLLM's engine-core sequence (v1/engine/core.py ``_initialize_kv_caches``): ``get_kv_cache_configs``,
  ``generate_scheduler_kv_cache_config``, the block size / ``update_kv_cache_capacity`` /
  ``resolve_kv_cache_block_sizes`` / ``resolve_cache_hit_alignment_tokens`` steps;
* tpu-inference's ``KVCacheManager.initialize_kv_cache`` (and its ``_log_kv_cache_init``): the arrays
  the runner really allocates (``runner.kv_caches``: a (conv, ssm) tuple per GDN layer, M rows; a KV
  array per attention layer) and ``runner.layer_name_to_kvcache_index``;
* tpu-inference's ``propagate_mamba_num_blocks`` (what its executors' ``MambaPoolSyncExecutorMixin``
  runs after the workers allocated) and ``maybe_install_hybrid_coordinator_hooks`` (core/
  hybrid_coordinator.py: ``install_hybrid_coordinator_hooks`` under the condition the platform and
  executors use), then vLLM's real ``Scheduler``, whose KV cache manager is then tpu-inference's
  ``TPUKVCacheManager`` over its ``TPUHybridKVCacheCoordinator`` (an attention pool and a separate
  compact mamba pool of M blocks).

Stand-ins, none of which decides a shape, a size or a block id:

* the HBM query: ``tpu_inference.utils.hbm_usage_bytes`` asks the devices for TPU memory figures
  (on CPU it raises "Expected TPU devices", and the compact mamba sizing is then skipped); inside
  ``hbm_budget`` (the one place it is patched) it reports ``spec.hbm_bytes`` split evenly over the
  mesh's devices, none used;
* the layers: vLLM ``Attention`` and ``QwenGatedDeltaNetAttention`` objects created without their
  ``__init__`` (which would build attention backends and weights), holding the attributes vLLM's
  and tpu-inference's code reads (heads, head sizes, conv kernel, the model and cache configs, and
  ``tp_size = 1``: tpu-inference's worker initializes vLLM's distributed state with a world of 1,
  tpu_worker.py, and shards with JAX instead). The GDN layer object on TPU is tpu-inference's
  subclass ``VllmGatedDeltaNetAttention`` (layers/vllm/custom_ops/gdn_attention_op.py), which adds a
  kernel backend and a forward only; it cannot be imported here (torchax's package on torch 2.13:
  ``aten.prod.dim_Dimname`` is gone), so its parent, which declares the states, stands in;
* the model config: vLLM's ``Qwen3_5ForCausalLM`` cannot be inspected here (its module imports
  qwen3_vl, which needs torchvision), so the tiny config is a ``Qwen3NextForCausalLM`` (the same
  GDN + full-attention hybrid in vLLM's registry) and Qwen3.5's own config hook is applied to it.
  vLLM inspects that architecture in a subprocess once per machine (about 40 s here), then reads
  its cache (~/.cache/vllm/modelinfos);
* the runner and worker: namespaces with what the manager and the compiled worker methods read
  (mesh, configs, dtype, ``max_num_reqs`` computed as tpu_runner.py does with its ``MIN_NUM_SEQS``
  read from the installed source); the manager's ``maybe_reinitialize_input_batch`` (the runner's
  per-request input batch, not the cache) is skipped; the executor's ``collective_rpc`` is a call
  of the one stand-in worker;
* the hybrid-coordinator hooks are tpu-inference's, installed by its own function;
  ``hybrid_coordinator_hooks`` puts vLLM's module attributes back once the scheduler is built (the
  built scheduler keeps tpu-inference's manager), and ``build`` puts back the process-global pool
  size tpu-inference publishes, so other tests in the same process see stock vLLM.

Not run: the GDN kernel. How it uses the mamba block table in align mode is read from
layers/vllm/custom_ops/gdn_attention_op.py (``gdn_attention_core_tpu``): it reads a request's state
from block table column ``(num_computed - 1) // mamba_block_size`` and writes the new state to
column ``(seq_len - 1) // mamba_block_size``; ``state_block_column`` states that rule.

This module is simulation support: product code never imports it.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import importlib.util
import types
from dataclasses import dataclass, field
from functools import cache

import jax

from tpuoffload.sim.tpu_layouts import TpuLayoutSpec, runner_mesh, tpu_inference

GDN, ATTN = "linear_attention", "full_attention"


@dataclass(frozen=True)
class GdnLayoutSpec:
    """A Qwen3.5-like GDN hybrid on a tpu-inference deployment (small sizes)."""

    name: str = "qwen3.5-like"
    layer_types: tuple[str, ...] = ((GDN,) * 3 + (ATTN,)) * 2
    # full attention
    num_attention_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    # Gated DeltaNet (Qwen3.5 names: linear_*)
    linear_num_key_heads: int = 4
    linear_num_value_heads: int = 8
    linear_key_head_dim: int = 32
    linear_value_head_dim: int = 32
    linear_conv_kernel_dim: int = 4
    mamba_ssm_dtype: str = "float32"  # Qwen3.5 checkpoints' config field
    dtype: str = "bfloat16"
    block_size: int = 16
    tp: int = 4
    # Data parallelism (tpu-inference's ``data_parallelism``: DPScheduler, one vLLM scheduler per
    # rank; the attention blocks and the compact state pool split over the ranks along axis 0,
    # ``ATTN_DATA``, each rank getting ``mamba_num_blocks // dp`` state rows).
    dp: int = 1
    max_model_len: int = 512
    max_num_seqs: int = 4
    max_num_batched_tokens: int = 256
    async_scheduling: bool = False  # vLLM's Scheduler (True: AsyncScheduler)
    gpu_memory_utilization: float = 0.9
    # What the patched HBM query reports for the whole mesh (tpu-inference sizes both pools from it).
    hbm_bytes: int = 40 << 20
    additional_config: dict = field(default_factory=dict)

    def layer_name(self, i: int) -> str:
        # vLLM's qwen3_next / qwen3_5 decoder layers: `{prefix}.linear_attn`, `{prefix}.self_attn.attn`.
        return f"model.layers.{i}.linear_attn" if self.layer_types[i] == GDN else f"model.layers.{i}.self_attn.attn"

    def layer_names(self) -> list[str]:
        return [self.layer_name(i) for i in range(len(self.layer_types))]

    @property
    def gdn_layers(self) -> list[str]:
        return [self.layer_name(i) for i, t in enumerate(self.layer_types) if t == GDN]

    @property
    def attention_layers(self) -> list[str]:
        return [self.layer_name(i) for i, t in enumerate(self.layer_types) if t == ATTN]

    @property
    def num_devices(self) -> int:
        return self.tp * self.dp

    def tpu_spec(self) -> TpuLayoutSpec:
        return TpuLayoutSpec(self.name, num_layers=len(self.layer_types), block_size=self.block_size,
                             num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype=self.dtype, tp=self.tp,
                             dp=self.dp)


#: 8 layers, GDN GDN GDN full, twice (Qwen3.5's 3:1 pattern).
QWEN35_LIKE = GdnLayoutSpec()
#: The same model under data parallelism: 2 ranks (DPScheduler) x TP 2, as tpu-inference's 2D mesh
#: ('data', 'model') holds it; the whole mesh's HBM doubles with its devices.
QWEN35_LIKE_DP2 = GdnLayoutSpec("qwen3.5-like-dp2", tp=2, dp=2, hbm_bytes=2 * QWEN35_LIKE.hbm_bytes)
GDN_LAYOUTS = {s.name: s for s in (QWEN35_LIKE, QWEN35_LIKE_DP2)}


def model_dir(spec: GdnLayoutSpec) -> str:
    """A directory holding only a tiny config.json for ``spec`` (one per shape, as vllm_setup's)."""
    hidden = spec.num_attention_heads * spec.head_dim
    cfg = {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
        "hidden_size": hidden, "head_dim": spec.head_dim, "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_kv_heads, "num_hidden_layers": len(spec.layer_types),
        "layer_types": list(spec.layer_types), "full_attention_interval": 4,
        "linear_num_key_heads": spec.linear_num_key_heads, "linear_num_value_heads": spec.linear_num_value_heads,
        "linear_key_head_dim": spec.linear_key_head_dim, "linear_value_head_dim": spec.linear_value_head_dim,
        "linear_conv_kernel_dim": spec.linear_conv_kernel_dim, "mamba_ssm_dtype": spec.mamba_ssm_dtype,
        "intermediate_size": 2 * hidden, "vocab_size": 32000, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": spec.dtype,
        "tie_word_embeddings": False,
    }
    from tpuoffload.sim.vllm_setup import config_dir

    return config_dir(cfg, "vllm_tiny_gdn_")


def make_vllm_config(spec: GdnLayoutSpec, kv_connector_extra_config: dict | None = None,
                     connector: tuple[str, str] = ("TPUOffloadConnector", "tpuoffload.connector"),
                     kv_load_failure_policy: str = "recompute"):
    """vLLM's config for ``spec`` with prefix caching on; with ``kv_connector_extra_config``, with
    ``connector`` (class name, module path; default ``TPUOffloadConnector``) configured (vLLM then
    decides HMA from the connector, as on TPU). A failed load is recomputed, as in the README's
    configuration and ``vllm_setup.make_vllm_config`` (vLLM's own default, ``fail``, would finish
    the request with an error)."""
    from tpuoffload.sim import vllm_setup  # noqa: F401  (VLLM_TARGET_DEVICE=cpu before vLLM's platform)
    from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig,
                             SchedulerConfig, VllmConfig)
    from vllm.model_executor.models.config import Qwen3_5ForCausalLMConfig

    d = model_dir(spec)
    model_config = ModelConfig(model=d, tokenizer=d, skip_tokenizer_init=True, dtype=spec.dtype, seed=0,
                               max_model_len=spec.max_model_len, enforce_eager=True)
    scheduler_config = SchedulerConfig(max_num_seqs=spec.max_num_seqs,
                                       max_num_batched_tokens=spec.max_num_batched_tokens,
                                       max_model_len=spec.max_model_len, enable_chunked_prefill=True,
                                       is_encoder_decoder=False, async_scheduling=spec.async_scheduling)
    cache_config = CacheConfig(block_size=spec.block_size, gpu_memory_utilization=spec.gpu_memory_utilization,
                               cache_dtype="auto", enable_prefix_caching=True)
    kv_transfer_config = None
    if kv_connector_extra_config is not None:
        kv_transfer_config = KVTransferConfig(kv_connector=connector[0],
                                              kv_connector_module_path=connector[1], kv_role="kv_both",
                                              kv_load_failure_policy=kv_load_failure_policy,
                                              kv_connector_extra_config=dict(kv_connector_extra_config))
    with vllm_setup.tpu_platform_hybrid_kv_cache():
        vllm_config = VllmConfig(model_config=model_config, scheduler_config=scheduler_config,
                                 cache_config=cache_config, parallel_config=ParallelConfig(),
                                 kv_transfer_config=kv_transfer_config, device_config=DeviceConfig("cpu"),
                                 additional_config=dict(spec.additional_config))
    assert vllm_config.cache_config.block_size == spec.block_size, vllm_config.cache_config.block_size
    vllm_config.scheduler_config.async_scheduling = spec.async_scheduling  # as vllm_setup.make_vllm_config
    # vLLM's hook for Qwen3.5 checkpoints (see module doc): mamba_ssm_cache_dtype from the config.
    Qwen3_5ForCausalLMConfig.verify_and_update_config(vllm_config)
    tpu_inference()
    from tpu_inference.platforms.tpu_platform import TpuPlatform

    TpuPlatform.update_block_size_for_backend(vllm_config)
    return vllm_config


# ---------------------------------------------------------------- stand-ins
def _layers(spec: GdnLayoutSpec, vllm_config) -> dict:
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
    from vllm.v1.attention.backend import AttentionType

    layers = {}
    for i, kind in enumerate(spec.layer_types):
        name = spec.layer_name(i)
        if kind == GDN:
            layer = QwenGatedDeltaNetAttention.__new__(QwenGatedDeltaNetAttention)
            layer.__dict__.update(
                prefix=name, layer_idx=i, tp_size=1, tp_rank=0, num_spec=0,
                model_config=vllm_config.model_config, cache_config=vllm_config.cache_config,
                speculative_config=None, num_k_heads=spec.linear_num_key_heads,
                num_v_heads=spec.linear_num_value_heads, head_k_dim=spec.linear_key_head_dim,
                head_v_dim=spec.linear_value_head_dim, conv_kernel_size=spec.linear_conv_kernel_dim)
        else:
            layer = Attention.__new__(Attention)
            layer.__dict__.update(num_kv_heads=spec.num_kv_heads, head_size=spec.head_dim, sliding_window=None,
                                  kv_sharing_target_layer_name=None, attn_type=AttentionType.DECODER)
        layers[name] = layer
    return layers


@cache
def _installed_source_defs(module: str, names: tuple[str, ...], cls: str | None = None) -> dict[str, ast.AST]:
    """Top-level assignments / a class's methods of an installed module, parsed from its source
    (for modules that cannot be imported here)."""
    origin = importlib.util.find_spec(module).origin
    tree = ast.parse(open(origin).read())
    body = tree.body
    if cls is not None:
        body = next(n for n in body if isinstance(n, ast.ClassDef) and n.name == cls).body
    found = {}
    for node in body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            found[node.name] = node
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and getattr(node.targets[0], "id", None) in names:
            found[node.targets[0].id] = node
    missing = set(names) - set(found)
    if missing:
        raise LookupError(f"{module}{'.' + cls if cls else ''} has no {sorted(missing)}")
    return found


def min_num_seqs() -> int:
    """``MIN_NUM_SEQS`` of the installed runner/tpu_runner.py (the runner's floor on max_num_reqs)."""
    node = _installed_source_defs("tpu_inference.runner.tpu_runner", ("MIN_NUM_SEQS",))["MIN_NUM_SEQS"]
    return ast.literal_eval(node.value)


def _worker_methods() -> dict:
    """``TPUWorker.determine_available_memory`` and ``get_mamba_num_blocks``, compiled from the
    installed worker/tpu_worker.py (the module imports the model stack, which cannot load here)."""
    names = ("determine_available_memory", "get_mamba_num_blocks")
    defs = _installed_source_defs("tpu_inference.worker.tpu_worker", names, cls="TPUWorker")
    origin = importlib.util.find_spec("tpu_inference.worker.tpu_worker").origin
    module = ast.Module(body=[defs[n] for n in names], type_ignores=[])
    ti = tpu_inference()

    class _Quiet:
        def __getattr__(self, name):
            return lambda *a, **k: None

    namespace = {"utils": ti.utils, "envs": ti.envs, "logger": _Quiet()}
    exec(compile(module, origin, "exec"), namespace)  # noqa: S102 - tpu-inference's own code
    return {n: namespace[n] for n in names}


@contextlib.contextmanager
def hbm_budget(total_bytes: int):
    """The one patched query (see module doc): ``tpu_inference.utils.hbm_usage_bytes`` reports
    ``total_bytes`` over the given devices, none in use."""
    utils = tpu_inference().utils
    saved = utils.hbm_usage_bytes

    def hbm_usage_bytes(devices):
        devices = list(devices)
        return [(0, total_bytes // len(devices))] * len(devices)

    utils.hbm_usage_bytes = hbm_usage_bytes
    try:
        yield
    finally:
        utils.hbm_usage_bytes = saved


# ---------------------------------------------------------------- the build
@dataclass
class GdnLayout:
    """Everything tpu-inference's runner and vLLM's engine core hold for ``spec``."""

    spec: GdnLayoutSpec
    vllm_config: object
    kv_cache_specs: dict  # layer name -> spec, as tpu-inference's get_kv_cache_spec returned them
    available_memory: int  # TPUWorker.determine_available_memory under the budget
    worker_kv_cache_config: object  # what initialize_kv_cache was given (and annotated)
    kv_cache_config: object  # the scheduler's (generate_scheduler_kv_cache_config), after propagation
    kv_caches: list
    layer_name_to_kvcache_index: dict[str, int]
    mesh: jax.sharding.Mesh
    max_num_reqs: int
    mamba_num_blocks: int  # M: rows of every GDN state array (the compact pool)
    attention_num_blocks: int  # leading dim of every attention KV array
    scheduler_block_size: int
    hash_block_size: int
    manager: object = None  # tpu-inference's KVCacheManager
    runner: object = None

    def state_layers(self) -> list[int]:
        """Indices of ``kv_caches`` holding (conv, ssm) state tuples."""
        return [i for i, c in enumerate(self.kv_caches) if isinstance(c, tuple)]

    def group_kinds(self) -> list[str]:
        return [type(g.kv_cache_spec).__name__ for g in self.kv_cache_config.kv_cache_groups]

    def mamba_groups(self) -> list[int]:
        from vllm.v1.kv_cache_interface import MambaSpec

        return [g for g, grp in enumerate(self.kv_cache_config.kv_cache_groups)
                if isinstance(grp.kv_cache_spec, MambaSpec)]

    def attention_groups(self) -> list[int]:
        mamba = set(self.mamba_groups())
        return [g for g in range(len(self.kv_cache_config.kv_cache_groups)) if g not in mamba]


def _stand_in_runner(spec: GdnLayoutSpec, vllm_config, mesh, max_num_reqs: int):
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

    cache_dtype = vllm_config.cache_config.cache_dtype
    kv_cache_dtype = vllm_config.model_config.dtype if cache_dtype == "auto" else STR_DTYPE_TO_TORCH_DTYPE[cache_dtype]
    return types.SimpleNamespace(
        vllm_config=vllm_config, model_config=vllm_config.model_config, cache_config=vllm_config.cache_config,
        parallel_config=vllm_config.parallel_config, speculative_config=None, mesh=mesh,
        kv_cache_dtype=kv_cache_dtype, attention_backend=None, kv_caches=[], layer_name_to_kvcache_index={},
        max_num_reqs=max_num_reqs, max_model_len=vllm_config.model_config.max_model_len,
        block_size=vllm_config.cache_config.block_size)


def build(spec: GdnLayoutSpec = QWEN35_LIKE, devices=None) -> GdnLayout:
    """Run the engine's KV cache setup for ``spec`` (module doc): specs, pools, groups, arrays."""
    tpu_inference()  # torchax namespace and tpu-inference's environment, before its runner modules
    import tpu_inference.core.hybrid_coordinator as hc

    saved = hc.get_mamba_num_blocks()
    try:
        return _build(spec, devices)
    finally:
        # The runner and propagate_mamba_num_blocks publish M in a process global; the scheduler
        # here reads it from its KV cache config (carried there too), so other tests see none.
        hc._GLOBAL_MAMBA_NUM_BLOCKS = saved


def _build(spec: GdnLayoutSpec, devices) -> GdnLayout:
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.utils import record_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import (generate_scheduler_kv_cache_config, get_kv_cache_configs,
                                             resolve_cache_hit_alignment_tokens, resolve_kv_cache_block_sizes,
                                             update_kv_cache_capacity)

    from tpu_inference.core.hybrid_coordinator import propagate_mamba_num_blocks
    from tpu_inference.runner.kv_cache_manager import KVCacheManager

    devices = list(devices if devices is not None else jax.devices())[:spec.num_devices]
    mesh = runner_mesh(spec.tpu_spec(), devices)
    vllm_config = make_vllm_config(spec)
    vllm_config.compilation_config.static_forward_context = _layers(spec, vllm_config)
    dp_size = spec.dp  # sharding_config.total_dp_size (the runner's max_num_reqs counts every rank's)
    max_num_reqs = max(dp_size * vllm_config.scheduler_config.max_num_seqs, min_num_seqs())
    runner = _stand_in_runner(spec, vllm_config, mesh, max_num_reqs)
    runner.dp_size = dp_size
    manager = KVCacheManager(runner)
    runner.kv_cache_manager = manager
    manager.maybe_reinitialize_input_batch = lambda kv_cache_config: None  # the input batch, not the cache
    record_kv_cache_layout(vllm_config.cache_config, manager.get_kv_cache_layout())
    methods = _worker_methods()
    worker = types.SimpleNamespace(cache_config=vllm_config.cache_config, devices=mesh.devices.flatten(),
                                   vllm_config=vllm_config, model_runner=runner)

    with hbm_budget(spec.hbm_bytes), set_current_vllm_config(vllm_config):
        specs = manager.get_kv_cache_spec()  # worker.get_kv_cache_spec -> runner -> manager
        available = methods["determine_available_memory"](worker)
        # EngineCore._initialize_kv_caches
        configs = get_kv_cache_configs(vllm_config, [specs], [available])
        sched_cfg = generate_scheduler_kv_cache_config(configs)
        vllm_config.cache_config.num_gpu_blocks = sched_cfg.num_blocks
        participating = [g.kv_cache_spec.block_size for g in sched_cfg.kv_cache_groups
                         if g.kv_cache_spec.prefix_cacheable]
        vllm_config.cache_config.block_size = min(participating or [g.kv_cache_spec.block_size
                                                                    for g in sched_cfg.kv_cache_groups])
        update_kv_cache_capacity(vllm_config, sched_cfg)
        vllm_config.validate_block_size()
        scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(sched_cfg, vllm_config)
        alignment = resolve_cache_hit_alignment_tokens(sched_cfg, vllm_config, scheduler_block_size, hash_block_size)
        for cfg in (*configs, sched_cfg):
            cfg.hash_block_size = hash_block_size
            cfg.cache_hit_alignment_tokens = alignment
        # executor.initialize_from_config -> worker -> runner.initialize_kv_cache
        manager.initialize_kv_cache(configs[0])
        # MambaPoolSyncExecutorMixin.initialize_from_config: the workers' pool size to the engine core
        rpc_owner = types.SimpleNamespace(collective_rpc=lambda name: [methods[name](worker)])
        propagate_mamba_num_blocks(rpc_owner, sched_cfg, vllm_config)

    caches = list(runner.kv_caches)
    attn_rows = {c.shape[0] for c in caches if not isinstance(c, tuple)}
    state_rows = {a.shape[0] for c in caches if isinstance(c, tuple) for a in c}
    assert len(attn_rows) == 1 and len(state_rows) == 1, (attn_rows, state_rows)
    return GdnLayout(spec, vllm_config, specs, available, configs[0], sched_cfg, caches,
                     dict(runner.layer_name_to_kvcache_index), mesh, max_num_reqs, state_rows.pop(),
                     attn_rows.pop(), scheduler_block_size, hash_block_size, manager, runner)


# ---------------------------------------------------------------- the scheduler side
@contextlib.contextmanager
def hybrid_coordinator_hooks(vllm_config):
    """tpu-inference's hooks, installed by its own ``maybe_install_hybrid_coordinator_hooks`` (the
    executors' call; the platform calls ``install_hybrid_coordinator_hooks`` under the same
    condition), for the duration; vLLM's module attributes are restored afterwards."""
    import sys

    import vllm.v1.core.kv_cache_coordinator as coord_mod
    import vllm.v1.core.kv_cache_manager as mgr_mod
    import vllm.v1.core.sched.async_scheduler  # noqa: F401  (patched too when imported)
    import vllm.v1.core.sched.scheduler  # noqa: F401

    tpu_inference()
    import tpu_inference.core.hybrid_coordinator as hc

    saved = [(coord_mod, "get_kv_cache_coordinator"), (mgr_mod, "get_kv_cache_coordinator"),
             (mgr_mod, "KVCacheManager"), (sys.modules["vllm.v1.core.sched.scheduler"], "KVCacheManager"),
             (sys.modules["vllm.v1.core.sched.async_scheduler"], "KVCacheManager"), (hc, "_HOOKS_INSTALLED")]
    missing = object()
    saved = [(obj, name, getattr(obj, name, missing)) for obj, name in saved]
    try:
        hc.maybe_install_hybrid_coordinator_hooks(vllm_config)
        yield hc
    finally:
        for obj, name, value in saved:
            if value is missing:
                delattr(obj, name)
            else:
                setattr(obj, name, value)


def make_scheduler(layout: GdnLayout, *, hooks: bool = True, vllm_config=None):
    """vLLM's real scheduler over ``layout``'s scheduler KV cache config, built as EngineCore builds
    it; with ``hooks`` (as on TPU) under tpu-inference's hybrid-coordinator hooks, without them on
    stock vLLM's coordinator (for comparison). ``vllm_config`` replaces the layout's (e.g. one with
    a KV connector configured). Returns (scheduler, whether tpu-inference's hooks got installed)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.structured_output import StructuredOutputManager

    vllm_config = vllm_config if vllm_config is not None else layout.vllm_config
    vllm_config.cache_config.num_gpu_blocks = layout.kv_cache_config.num_blocks  # as EngineCore
    installed = False
    with hybrid_coordinator_hooks(vllm_config) if hooks else contextlib.nullcontext() as hc:
        installed = bool(hc and hc._HOOKS_INSTALLED)
        sched_cls = vllm_config.scheduler_config.get_scheduler_cls()
        sched = sched_cls(vllm_config=vllm_config, kv_cache_config=copy.deepcopy(layout.kv_cache_config),
                          structured_output_manager=StructuredOutputManager(vllm_config),
                          include_finished_set=False, log_stats=True,
                          block_size=layout.scheduler_block_size, hash_block_size=layout.hash_block_size)
    init_none_hash(get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo))
    return sched, installed


def make_dp_scheduler(layout: GdnLayout, vllm_config):
    """tpu-inference's DPScheduler over ``layout`` (``spec.dp > 1``), built as its platform and
    engine core build it: its sharding config on ``vllm_config`` (with the connector configured),
    its own ``update_vllm_config_for_dp_scheduler``, the pool size its executors propagate
    (``cache_config.mamba_num_blocks``, which ``_create_per_rank_configs`` splits into
    ``mamba_num_blocks // dp`` per rank); each rank process installs tpu-inference's hybrid
    coordinator hooks itself (mamba cache mode "align") over its share."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.structured_output import StructuredOutputManager

    from tpuoffload.sim.tpu_layouts import sharding_config

    tpu_inference()
    from tpu_inference.core.sched.dp_scheduler import update_vllm_config_for_dp_scheduler

    vllm_config.sharding_config = sharding_config(layout.spec.tpu_spec())
    update_vllm_config_for_dp_scheduler(vllm_config)
    vllm_config.cache_config.num_gpu_blocks = layout.kv_cache_config.num_blocks  # as EngineCore
    vllm_config.cache_config.mamba_num_blocks = layout.mamba_num_blocks  # propagate_mamba_num_blocks
    init_none_hash(get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo))
    sched_cls = vllm_config.scheduler_config.get_scheduler_cls()
    assert sched_cls.__name__ == "DPScheduler", sched_cls
    return sched_cls(vllm_config=vllm_config, kv_cache_config=copy.deepcopy(layout.kv_cache_config),
                     structured_output_manager=StructuredOutputManager(vllm_config),
                     include_finished_set=False, log_stats=True,
                     block_size=layout.scheduler_block_size, hash_block_size=layout.hash_block_size)


def step(sched):
    """One engine step with no model: schedule, then report one sampled token for every request
    whose prompt is complete after this step (what a runner returns). Returns the SchedulerOutput."""
    from vllm.v1.outputs import ModelRunnerOutput

    so = sched.schedule()
    ids = list(so.num_scheduled_tokens)
    sampled = []
    for req_id in ids:
        req = sched.requests[req_id]  # schedule() has advanced num_computed_tokens
        sampled.append([7] if req.num_computed_tokens >= req.num_tokens else [])
    sched.update_from_output(so, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                                   sampled_token_ids=sampled))
    return so


def block_table(sched, req_id: str) -> tuple[list[int], ...]:
    """The request's block ids per KV cache group, as the scheduler holds them (0: the null block)."""
    return tuple(list(ids) for ids in sched.kv_cache_manager.get_block_ids(req_id))


def make_request(layout: GdnLayout, req_id: str, prompt_token_ids, max_tokens: int = 4):
    """A request as EngineCore.preprocess_add_request builds it (the engine's block hasher)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sp.update_from_generation_config({}, 2)
    hash_fn = get_hash_fn_by_name(layout.vllm_config.cache_config.prefix_caching_hash_algo)
    return Request(request_id=req_id, prompt_token_ids=list(prompt_token_ids), sampling_params=sp,
                   pooling_params=None, block_hasher=get_request_block_hasher(layout.hash_block_size, hash_fn))


def state_block_column(num_tokens: int, mamba_block_size: int) -> int:
    """The mamba block table column that holds a request's state after ``num_tokens`` tokens: the
    GDN op's write column ``(seq_len - 1) // mamba_block_size`` (and the next step's read column
    ``(num_computed - 1) // mamba_block_size``), gdn_attention_op.py, align mode."""
    return max(num_tokens - 1, 0) // mamba_block_size
