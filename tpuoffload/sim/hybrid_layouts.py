"""Hybrid-model KV caches exactly as tpu-inference 0.32 allocates them with vLLM's hybrid KV cache
manager (HMA) on, on CPU JAX, for tests.

What is run, all installed code:

* tpu-inference's ``KVCacheManager.get_kv_cache_spec`` (runner/kv_cache_manager.py) over the
  model's attention layers, as its vLLM-model path reads them from
  ``compilation_config.static_forward_context``: the per-layer specs (``SlidingWindowSpec`` for a
  layer with a window, ``FullAttentionSpec`` otherwise, page sizes from tpu-inference's own
  ``get_attention_page_size_bytes``);
* vLLM's ``get_kv_cache_configs`` + ``generate_scheduler_kv_cache_config`` (v1/core/kv_cache_utils.py)
  with HMA on or off: the KV cache groups, the tensors and the number of blocks for a byte budget;
* tpu-inference's ``KVCacheManager.initialize_kv_cache``: the arrays the runner really allocates
  (``runner.kv_caches``) and ``runner.layer_name_to_kvcache_index`` (which array each layer uses).

Stand-ins, none of which decides a shape: the attention layers are vLLM ``Attention`` objects
created without their ``__init__`` (which would build a whole attention backend) holding the
attributes tpu-inference reads (heads, head size, window, type); the runner is a namespace with
what the manager reads (mesh, configs, dtype); two of the manager's methods that do not touch the
cache are skipped: ``maybe_reinitialize_input_batch`` (the runner's per-request input batch) and
``_log_kv_cache_init`` (a log line that asks the devices for TPU HBM figures).

This module is simulation support: product code never imports it.
"""

from __future__ import annotations

import copy
import types
from dataclasses import dataclass

import jax

from tpuoffload.sim.tpu_layouts import TpuLayoutSpec, runner_mesh, tpu_inference


@dataclass(frozen=True)
class HybridLayoutSpec:
    """A hybrid model's attention layers on a tpu-inference deployment. ``windows[i]`` is layer
    i's sliding window in tokens (None: full attention)."""

    name: str
    windows: tuple[int | None, ...]
    num_kv_heads: int = 8
    head_dim: int = 64
    block_size: int = 16
    tp: int = 4
    # Data parallelism (tpu-inference's ``data_parallelism``: DPScheduler, one vLLM scheduler per
    # rank, blocks split over the ranks along the cache's batch axis).
    dp: int = 1
    dtype: str = "bfloat16"
    max_model_len: int = 4096

    @property
    def num_devices(self) -> int:
        return self.tp * self.dp

    def layer_names(self) -> list[str]:
        return [f"model.layers.{i}.self_attn.attn" for i in range(len(self.windows))]

    def tpu_spec(self) -> TpuLayoutSpec:
        return TpuLayoutSpec(self.name, num_layers=len(self.windows), block_size=self.block_size,
                             num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype=self.dtype, tp=self.tp,
                             dp=self.dp)


#: gpt-oss-like: 4 layers alternating sliding window 128 and full attention, 8 KV heads, head_dim 64.
GPT_OSS_LIKE = HybridLayoutSpec("gpt-oss-like", windows=(128, None, 128, None), max_model_len=2048)
#: Gemma-3-like: 5 local (sliding window) layers to 1 global, twice (vLLM groups them as 5 sliding
#: groups and 1 full group of 2 layers each; tpu-inference shares 2 arrays between the 6 groups).
GEMMA3_LIKE = HybridLayoutSpec("gemma3-like", windows=((64,) * 5 + (None,)) * 2, num_kv_heads=4, head_dim=128,
                               max_model_len=2048)
#: gpt-oss-like under data parallelism: 2 ranks (DPScheduler) x TP 2.
GPT_OSS_LIKE_DP2 = HybridLayoutSpec("gpt-oss-like-dp2", windows=GPT_OSS_LIKE.windows, tp=2, dp=2,
                                    max_model_len=GPT_OSS_LIKE.max_model_len)
HYBRID_LAYOUTS = {s.name: s for s in (GPT_OSS_LIKE, GEMMA3_LIKE, GPT_OSS_LIKE_DP2)}


@dataclass
class HybridCache:
    """What a tpu-inference runner holds after ``initialize_kv_cache`` with HMA on."""

    spec: HybridLayoutSpec
    kv_cache_config: object  # vLLM's KVCacheConfig (the scheduler's: generate_scheduler_kv_cache_config)
    kv_caches: list[jax.Array]
    layer_name_to_kvcache_index: dict[str, int]
    mesh: jax.sharding.Mesh


def _attention_layers(spec: HybridLayoutSpec) -> dict:
    from vllm.model_executor.layers.attention import Attention
    from vllm.v1.attention.backend import AttentionType

    layers = {}
    for name, window in zip(spec.layer_names(), spec.windows):
        layer = Attention.__new__(Attention)  # no attention backend: tpu-inference reads attributes only
        layer.__dict__.update(num_kv_heads=spec.num_kv_heads, head_size=spec.head_dim, sliding_window=window,
                              kv_sharing_target_layer_name=None, attn_type=AttentionType.DECODER)
        layers[name] = layer
    return layers


def _vllm_config(spec: HybridLayoutSpec, hma: bool):
    from tpuoffload.sim.vllm_setup import make_vllm_config

    cfg = make_vllm_config(block_size=spec.block_size, kv_connector_extra_config=None, connector_module_path=None,
                           connector_class="", num_layers=len(spec.windows), max_model_len=spec.max_model_len)
    cfg.scheduler_config.disable_hybrid_kv_cache_manager = not hma
    cfg.compilation_config.static_forward_context = _attention_layers(spec)
    return cfg


def _stand_in_runner(spec: HybridLayoutSpec, vllm_config, mesh):
    import torch

    return types.SimpleNamespace(
        vllm_config=vllm_config, model_config=vllm_config.model_config, cache_config=vllm_config.cache_config,
        parallel_config=vllm_config.parallel_config, speculative_config=None, mesh=mesh,
        kv_cache_dtype=getattr(torch, spec.dtype), attention_backend=None, kv_caches=[],
        layer_name_to_kvcache_index={}, max_num_reqs=vllm_config.scheduler_config.max_num_seqs)


def _manager(spec: HybridLayoutSpec, hma: bool, mesh):
    tpu_inference()  # the torchax namespace and tpu-inference's environment, before its runner modules
    from tpu_inference.runner.kv_cache_manager import KVCacheManager

    vllm_config = _vllm_config(spec, hma)
    manager = KVCacheManager(_stand_in_runner(spec, vllm_config, mesh))
    manager.maybe_reinitialize_input_batch = lambda kv_cache_config: None  # the input batch, not the cache
    manager._log_kv_cache_init = lambda *args, **kwargs: None  # a log line that asks for TPU HBM figures
    # The engine core resolves one KV cache layout before sizing the cache; tpu-inference's is its
    # manager's answer ("NHD", an alias vLLM maps).
    from vllm.v1.attention.backends.utils import record_kv_cache_layout

    record_kv_cache_layout(vllm_config.cache_config, manager.get_kv_cache_layout())
    return manager, vllm_config


def kv_cache_config(spec: HybridLayoutSpec, budget_bytes: int, *, hma: bool, mesh=None):
    """vLLM's scheduler KV cache config for ``spec`` at ``budget_bytes`` of KV memory, from
    tpu-inference's specs and vLLM's own grouping and block-count computation."""
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config, get_kv_cache_configs

    # The specs read only the mesh's axis sizes (as ``tpu_layouts.slice_page_bytes``): a scheduler
    # process of a simulated slice, which has no such mesh, can ask too.
    mesh = mesh if mesh is not None else types.SimpleNamespace(shape={"data": spec.dp, "model": spec.tp},
                                                               axis_names=("data", "model"))
    manager, vllm_config = _manager(spec, hma, mesh)
    specs = manager.get_kv_cache_spec()
    configs = get_kv_cache_configs(vllm_config, [specs], [budget_bytes])
    cfg = generate_scheduler_kv_cache_config(configs)
    cfg.hash_block_size = spec.block_size  # as EngineCore resolves them before building the scheduler
    cfg.cache_hit_alignment_tokens = spec.block_size
    return cfg


def num_blocks(spec: HybridLayoutSpec, budget_bytes: int, *, hma: bool) -> int:
    """KV blocks vLLM gets for ``spec`` at ``budget_bytes`` (its own computation)."""
    return kv_cache_config(spec, budget_bytes, hma=hma).num_blocks


def create_hybrid_cache(spec: HybridLayoutSpec, budget_bytes: int, devices=None) -> HybridCache:
    """The arrays tpu-inference's ``initialize_kv_cache`` allocates with HMA on, on ``devices``."""
    devices = list(devices if devices is not None else jax.devices())[:spec.num_devices]
    mesh = runner_mesh(spec.tpu_spec(), devices)
    cfg = kv_cache_config(spec, budget_bytes, hma=True, mesh=mesh)
    from vllm.config import set_current_vllm_config

    manager, vllm_config = _manager(spec, True, mesh)
    manager.get_kv_cache_spec()  # as the runner does before initialize_kv_cache (records shared layers)
    with set_current_vllm_config(vllm_config):
        manager.initialize_kv_cache(copy.deepcopy(cfg))
    runner = manager.runner
    return HybridCache(spec, cfg, list(runner.kv_caches), dict(runner.layer_name_to_kvcache_index), mesh)


def runner_roles(cache: HybridCache) -> dict:
    """What a synthetic runner needs to act as tpu-inference's over these arrays: per array the
    (KV cache group, layer index) pairs it serves, each group's window, and the runner's
    ``layer_name_to_kvcache_index``."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    layer_index = {name: i for i, name in enumerate(cache.spec.layer_names())}
    serves: list[list[tuple[int, int]]] = [[] for _ in cache.kv_caches]
    for g, group in enumerate(cache.kv_cache_config.kv_cache_groups):
        for name in group.layer_names:
            serves[cache.layer_name_to_kvcache_index[name]].append((g, layer_index[name]))
    windows = tuple(group.kv_cache_spec.sliding_window if isinstance(group.kv_cache_spec, SlidingWindowSpec)
                    else None for group in cache.kv_cache_config.kv_cache_groups)
    return {"serves": serves, "windows": windows, "layer_name_to_kvcache_index": cache.layer_name_to_kvcache_index}
