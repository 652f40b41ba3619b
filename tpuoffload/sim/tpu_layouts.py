"""KV caches exactly as tpu-inference 0.32 allocates them, on CPU JAX, for tests and the demo.

Everything that decides a cache's shape and sharding is tpu-inference's own installed code:
``runner/kv_cache.py`` ``create_kv_caches`` (shape, packing, dtype, sharding spec), ``utils.py``
``get_padded_num_heads`` / ``get_padded_head_dim`` (what the runner pads before calling it),
``layers/common/sharding.py`` (axis names, ``ShardingConfigManager``), and the runner's own mesh
methods (``TPUModelRunner._create_2d_mesh`` / ``_create_new_model_mesh`` and the single-slice mesh
helper), executed from the installed ``runner/tpu_runner.py``.

Two things cannot run here as they are, and are worked around without changing what is computed:

* ``torchax``'s package ``__init__`` fails to import on torch 2.13; the only torchax module these
  tpu-inference modules use, ``torchax.ops.mappings``, imports fine on its own, so the package is
  entered as a namespace without running its ``__init__``.
* ``runner/tpu_runner.py`` as a module imports the whole model stack (qwix, tokamax, vLLM model
  loaders) that has no CPU build here; its mesh methods only use numpy, jax and the sharding
  config, so they are taken from the installed file's source by name and run against a stand-in
  runner holding ``devices`` and ``vllm_config.sharding_config``. CPU devices have no TPU
  coordinates, so the 2-D mesh takes the runner's explicit device-order path (``device_indexes``).

This module is simulation support: product code never imports it.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import sys
import types
from dataclasses import dataclass, field
from functools import cache

import jax
import numpy as np

_RUNNER_MESH_METHODS = ("_create_2d_mesh", "_create_new_model_mesh", "_create_single_slice_mesh",
                        "_create_multi_slice_mesh")


def _enter_torchax_namespace() -> None:
    if "torchax" in sys.modules:
        return
    spec = importlib.util.find_spec("torchax")
    if spec is None:
        raise ImportError("torchax is not installed (scripts/setup.sh installs torchax==0.0.13 --no-deps)")
    pkg = types.ModuleType("torchax")
    pkg.__path__ = list(spec.submodule_search_locations)
    sys.modules["torchax"] = pkg


@cache
def tpu_inference() -> types.SimpleNamespace:
    """tpu-inference's layout, sharding and utility modules, imported from the installed package."""
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v6e-8")  # skip the GCE metadata lookups at import
    _enter_torchax_namespace()
    kv_cache = importlib.import_module("tpu_inference.runner.kv_cache")
    sharding = importlib.import_module("tpu_inference.layers.common.sharding")
    utils = importlib.import_module("tpu_inference.utils")
    envs = importlib.import_module("tpu_inference.envs")
    return types.SimpleNamespace(kv_cache=kv_cache, sharding=sharding, utils=utils, envs=envs,
                                 mesh_methods=_runner_mesh_methods())


def _runner_mesh_methods() -> dict:
    """TPUModelRunner's mesh methods, compiled from the installed tpu_runner.py (see module doc)."""
    spec = importlib.util.find_spec("tpu_inference.runner.tpu_runner")
    source = open(spec.origin).read()
    tree = ast.parse(source)
    runner_cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TPUModelRunner")
    methods = [f for f in runner_cls.body if isinstance(f, ast.FunctionDef) and f.name in _RUNNER_MESH_METHODS]
    module = ast.Module(body=methods, type_ignores=[])
    from jax.experimental import mesh_utils

    from tpu_inference.layers.common import sharding as sharding_mod
    from tpu_inference import envs, utils
    namespace = {
        "jax": jax, "np": np, "mesh_utils": mesh_utils, "envs": envs, "logger": _Quiet(),
        "MESH_AXIS_NAMES": sharding_mod.MESH_AXIS_NAMES, "MESH_AXIS_NAMES_2D": sharding_mod.MESH_AXIS_NAMES_2D,
        "ShardingConfigManager": sharding_mod.ShardingConfigManager, "make_optimized_mesh": utils.make_optimized_mesh,
        "common_utils": utils,
    }
    exec(compile(module, spec.origin, "exec"), namespace)  # noqa: S102 - tpu-inference's own code
    return {name: namespace[name] for name in _RUNNER_MESH_METHODS}


class _Quiet:
    def __getattr__(self, name):
        return lambda *a, **k: None


@dataclass(frozen=True)
class TpuLayoutSpec:
    """One tpu-inference deployment's attention KV cache, as its runner would allocate it."""

    name: str = "bf16-8kv-tp4"
    num_layers: int = 2
    num_blocks: int = 64
    block_size: int = 16
    num_kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"
    tp: int = 4
    dp: int = 1
    attn_dp: int = 1
    dcp: int = 1
    use_mla: bool = False
    new_model_design: bool = False
    # Extra layers of another head_dim (hybrid attention models): (num_layers, head_dim).
    extra_layers: tuple[tuple[int, int], ...] = field(default_factory=tuple)

    @property
    def num_devices(self) -> int:
        return self.tp * self.dp * self.attn_dp * self.dcp


def sharding_config(spec: TpuLayoutSpec, device_indexes: list[int] | None = None):
    """tpu-inference's ShardingConfigManager for this deployment (what its platform attaches to
    ``vllm_config.sharding_config``)."""
    ti = tpu_inference()
    strategy = ti.sharding.ShardingStrategy(
        tensor_parallelism=spec.tp, data_parallelism=spec.dp, attention_data_parallelism=spec.attn_dp,
        decode_context_parallelism=spec.dcp)
    return ti.sharding.ShardingConfigManager(strategy, device_indexes=device_indexes)


def runner_mesh(spec: TpuLayoutSpec, devices) -> jax.sharding.Mesh:
    """The mesh tpu-inference's runner builds for this deployment on ``devices``."""
    ti = tpu_inference()
    stand_in = types.SimpleNamespace(
        devices=list(devices),
        # device_indexes: CPU devices have no TPU coordinates for make_optimized_mesh, so take the
        # runner's explicit-device-order path (the one `device_indexes` selects on TPU).
        vllm_config=types.SimpleNamespace(sharding_config=sharding_config(spec, list(range(len(devices))))))
    methods = ti.mesh_methods
    for name, fn in methods.items():
        setattr(stand_in, name, types.MethodType(fn, stand_in))
    with _model_design(spec.new_model_design):
        return stand_in._create_new_model_mesh() if spec.new_model_design else stand_in._create_2d_mesh()


class _model_design:
    """Select tpu-inference's axis names (NEW_MODEL_DESIGN) for the duration of a mesh/cache build."""

    def __init__(self, new: bool) -> None:
        self.new = new

    def __enter__(self):
        ti = tpu_inference()
        self.saved = os.environ.get("NEW_MODEL_DESIGN")
        os.environ["NEW_MODEL_DESIGN"] = "1" if self.new else "0"
        ti.sharding.ShardingAxisName._cls = None  # it caches the choice on first use
        return self

    def __exit__(self, *exc):
        if self.saved is None:
            os.environ.pop("NEW_MODEL_DESIGN", None)
        else:
            os.environ["NEW_MODEL_DESIGN"] = self.saved


def create_caches(spec: TpuLayoutSpec, devices=None) -> tuple[list[jax.Array], jax.sharding.Mesh]:
    """``runner.kv_caches`` and ``runner.mesh`` for ``spec``, built by tpu-inference's own code."""
    ti = tpu_inference()
    devices = list(devices if devices is not None else jax.devices())[:spec.num_devices]
    if len(devices) < spec.num_devices:
        raise ValueError(f"{spec.name} needs {spec.num_devices} devices, {len(devices)} available")
    mesh = runner_mesh(spec, devices)
    dtype = jax.numpy.dtype(spec.dtype)
    with _model_design(spec.new_model_design):
        kv_heads = ti.utils.get_mesh_shape_product(mesh, ti.sharding.ShardingAxisName.KV_HEAD)
        caches = []
        for count, head_dim in ((spec.num_layers, spec.head_dim), *spec.extra_layers):
            heads = 1 if spec.use_mla else ti.utils.get_padded_num_heads(spec.num_kv_heads, kv_heads)
            caches += ti.kv_cache.create_kv_caches(
                num_blocks=spec.num_blocks, block_size=spec.block_size, num_kv_heads=heads,
                head_size=head_dim if spec.use_mla else ti.utils.get_padded_head_dim(head_dim), mesh=mesh,
                layer_names=[f"layer.{len(caches) + i}" for i in range(count)], cache_dtype=dtype,
                use_mla=spec.use_mla)
    return caches, mesh


# The layouts tests and the demo run on (issue 8's list); each needs ``num_devices`` CPU devices.
LAYOUTS: dict[str, TpuLayoutSpec] = {s.name: s for s in (
    TpuLayoutSpec("bf16-8kv-tp4"),
    TpuLayoutSpec("fp8-8kv-tp4", dtype="float8_e4m3fn"),
    TpuLayoutSpec("int8-8kv-tp4", dtype="int8"),
    TpuLayoutSpec("bf16-hd64-tp4", head_dim=64),
    TpuLayoutSpec("bf16-2kv-tp8", num_kv_heads=2, tp=8),
    TpuLayoutSpec("mla-tp4", use_mla=True, head_dim=576, block_size=64),
    # DeepSeek-V3-like MLA as tpu-inference serves it: NEW_MODEL_DESIGN, attention data parallelism
    # (blocks split over the attention-DP ranks, so DPScheduler), each rank's latent cache replicated
    # over its tensor-parallel devices; 576 = kv_lora_rank 512 + qk_rope_head_dim 64 (tpu-inference's MLA
    # cache pads it to 640 either way: its KVCacheManager aligns the rope part, the kernel the whole).
    TpuLayoutSpec("mla-attndp2-tp2", use_mla=True, head_dim=576, attn_dp=2, tp=2, new_model_design=True),
    TpuLayoutSpec("mla-attndp4-tp2", use_mla=True, head_dim=576, attn_dp=4, tp=2, new_model_design=True),
    TpuLayoutSpec("bf16-dp2-tp4", dp=2),
    TpuLayoutSpec("bf16-attndp4-tp2", attn_dp=4, tp=2, new_model_design=True),
    TpuLayoutSpec("bf16-dcp2-tp2", dcp=2, tp=2, new_model_design=True),
    TpuLayoutSpec("bf16-mixed-hd256-512-tp4", head_dim=256, extra_layers=((1, 512),)),
    # configs/qwen3-coder-480b-multihost: fp8, tensor parallel 16, 8 KV heads (4 hosts x 4 devices).
    TpuLayoutSpec("qwen3-coder-480b-fp8-tp16", dtype="float8_e4m3fn", tp=16, num_layers=2, num_blocks=32),
)}


def scheduler_kv_shape(page_bytes: int, block_size: int) -> dict[str, int]:
    """Arguments for ``vllm_setup.make_scheduler`` whose (float32) KV cache config reports
    ``page_bytes`` per block over all layers, so the scheduler half sizes chunks as it would
    beside tpu-inference's runner."""
    per_elem = 2 * block_size * 4  # K and V, float32
    if page_bytes % per_elem:
        raise ValueError(f"page of {page_bytes} bytes is not a whole number of float32 heads of {block_size} tokens")
    return {"num_layers": 1, "num_kv_heads": 1, "head_size": page_bytes // per_elem}


def _layer_pages(spec: TpuLayoutSpec) -> list[tuple[int, int, int, int]]:
    """(layers, KV heads, head size, page bytes) per kind of layer, as tpu-inference's KVCacheManager
    computes them for its KV cache specs: heads and head size padded as its runner pads them (MLA:
    one latent "head"), the page from its own ``get_attention_page_size_bytes``. That function reads
    only the mesh's axis sizes, so a stand-in mesh of those sizes serves the scheduler process of a
    simulated slice, which has no such mesh."""
    ti = tpu_inference()
    if spec.new_model_design:
        sizes = {"data": spec.dp, "attn_dp": spec.attn_dp, "attn_dp_expert": 1, "expert": 1, "model": spec.tp,
                 "dcp": spec.dcp, "pcp": 1}
    else:
        sizes = {"data": spec.dp, "model": spec.tp}
    mesh = types.SimpleNamespace(shape=sizes, axis_names=tuple(sizes))
    out = []
    with _model_design(spec.new_model_design):
        kv_heads = ti.utils.get_mesh_shape_product(mesh, ti.sharding.ShardingAxisName.KV_HEAD)
        for count, head_dim in ((spec.num_layers, spec.head_dim), *spec.extra_layers):
            heads = 1 if spec.use_mla else ti.utils.get_padded_num_heads(spec.num_kv_heads, kv_heads)
            size = head_dim if spec.use_mla else ti.utils.get_padded_head_dim(head_dim)
            page = ti.kv_cache.get_attention_page_size_bytes(
                mesh, spec.block_size, heads, size, jax.numpy.dtype(spec.dtype), spec.use_mla)
            out.append((count, heads, size, int(page)))
    return out


def slice_page_bytes(spec: TpuLayoutSpec) -> int:
    """Bytes per block over all layers and the whole mesh, as tpu-inference's own
    ``get_attention_page_size_bytes`` reports it to vLLM."""
    return sum(count * page for count, _, _, page in _layer_pages(spec))


def kv_cache_spec(spec: TpuLayoutSpec) -> dict:
    """The per-layer KV cache specs tpu-inference's runner reports to vLLM for this deployment
    (``KVCacheManager.get_kv_cache_spec`` on its JAX model path, layers named ``layer.<i>``): each
    built as its ``_create_attention_spec`` builds one, an ``MLAAttentionSpec`` (one latent "head")
    for an MLA model, a ``FullAttentionSpec`` otherwise, both with ``page_size_padded`` set to
    tpu-inference's own page size and its torch dtype. vLLM groups them (``vllm_setup.make_scheduler``
    with ``kv_cache_spec=``) as its engine core does."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    ti = tpu_inference()
    dtype = ti.utils.to_torch_dtype(spec.dtype)
    specs, i = {}, 0
    for count, heads, size, page in _layer_pages(spec):
        for _ in range(count):
            if spec.use_mla:
                layer = MLAAttentionSpec(block_size=spec.block_size, num_kv_heads=1, head_size=size, dtype=dtype,
                                         cache_dtype_str="auto" if spec.dtype == "bfloat16" else spec.dtype,
                                         page_size_padded=page)
            else:
                layer = FullAttentionSpec(block_size=spec.block_size, num_kv_heads=heads, head_size=size,
                                          dtype=dtype, page_size_padded=page)
            specs[f"layer.{i}"] = layer
            i += 1
    return specs
