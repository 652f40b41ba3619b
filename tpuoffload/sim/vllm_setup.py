"""Build vLLM 0.32's REAL v1 Scheduler / AsyncScheduler on CPU, with no model
and no accelerator, with a KV connector loaded via kv_connector_module_path.

Used by tpuoffload.sim.engine (in-process hosts) and tpuoffload.sim.podslice (one process per
host). Pitfalls handled here (docs/vllm-integration-notes.md has the details):
  * VLLM_TARGET_DEVICE=cpu must be set before vllm.platforms.current_platform is
    first touched, otherwise the platform is "UnspecifiedPlatform" (device_type
    "") on a machine without GPU/TPU.
  * HF_HUB_OFFLINE=1 + skip_tokenizer_init=True + a local dir with config.json:
    ModelConfig never touches the network or a tokenizer.
  * Request block hashes must be computed with the same hash fn + NONE_HASH as
    the scheduler's prefix cache (engine core: get_hash_fn_by_name(
    cache_config.prefix_caching_hash_algo) -> init_none_hash ->
    get_request_block_hasher(hash_block_size, fn)).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Irrelevant for a bare Scheduler, but keeps any accidental LLM() in-process.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402

from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import (  # noqa: E402
    KVConnectorFactory,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorRole,
)
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

EOS_TOKEN_ID = 2
VOCAB_SIZE = 32000

_MODEL_DIR: str | None = None
_DEFAULT_HASH_BLOCK_SIZE: int | None = None
_DEFAULT_HASH_FN: Callable[[Any], bytes] | None = None


# --------------------------------------------------------------------------
# model dir / configs
# --------------------------------------------------------------------------
def tiny_model_dir(
    num_layers: int = 2, num_kv_heads: int = 2, head_size: int = 16
) -> str:
    """Temp dir with only a tiny llama-style config.json (cached per process
    for the default shape)."""
    global _MODEL_DIR
    default = (num_layers, num_kv_heads, head_size) == (2, 2, 16)
    if default and _MODEL_DIR is not None:
        return _MODEL_DIR
    num_heads = num_kv_heads * 2
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": num_heads * head_size,
        "head_dim": head_size,
        "intermediate_size": 4 * num_heads * head_size,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "num_hidden_layers": num_layers,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "bos_token_id": 1,
        "eos_token_id": EOS_TOKEN_ID,
        "torch_dtype": "float32",
        "tie_word_embeddings": False,
    }
    d = config_dir(cfg, "vllm_tiny_model_")
    if default:
        _MODEL_DIR = d
    return d


def config_dir(cfg: dict, prefix: str) -> str:
    """A temp directory holding only ``cfg`` as config.json, named by its content: the same "model"
    in every process and run, as a real model path is (warm-restart checkpoints are matched by it)."""
    text = json.dumps(cfg, sort_keys=True)
    d = os.path.join(tempfile.gettempdir(), prefix + hashlib.sha256(text.encode()).hexdigest()[:16])
    if not os.path.exists(os.path.join(d, "config.json")):
        os.makedirs(d, exist_ok=True)
        tmp = os.path.join(d, f".config.{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, os.path.join(d, "config.json"))
    return d


def layer_names(num_layers: int) -> list[str]:
    """Attention layer names as vLLM's llama would register them."""
    return [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]


def make_vllm_config(
    block_size: int,
    kv_connector_extra_config: dict | None,
    connector_module_path: str | None,
    connector_class: str = "TPUOffloadConnector",
    async_scheduling: bool = False,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 256,
    max_model_len: int = 4096,
    num_layers: int = 2,
    num_kv_heads: int = 2,
    head_size: int = 16,
    kv_role: str = "kv_both",
    kv_load_failure_policy: str = "recompute",
    enable_chunked_prefill: bool = True,
    enable_prefix_caching: bool = True,
    tensor_parallel_size: int = 1,
    parallel_overrides: dict | None = None,
    kv_events: dict | None = None,
) -> VllmConfig:
    # The model holds num_kv_heads per tensor-parallel rank, so that vLLM's check "attention heads
    # divisible by tensor_parallel_size" holds for any size.
    parallel = {"tensor_parallel_size": tensor_parallel_size, **(parallel_overrides or {})}
    backend = parallel.pop("distributed_executor_backend", None)
    model_dir = tiny_model_dir(num_layers, num_kv_heads * parallel["tensor_parallel_size"], head_size)
    model_config = ModelConfig(
        model=model_dir,
        tokenizer=model_dir,
        skip_tokenizer_init=True,
        dtype="float32",
        seed=0,
        max_model_len=max_model_len,
        enforce_eager=True,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=enable_chunked_prefill,
        is_encoder_decoder=model_config.is_encoder_decoder,
        async_scheduling=async_scheduling,
    )
    cache_config = CacheConfig(
        block_size=block_size,
        gpu_memory_utilization=0.9,
        cache_dtype="auto",
        enable_prefix_caching=enable_prefix_caching,
    )
    kv_transfer_config = None
    if connector_module_path is not None or connector_class in (
        KVConnectorFactory._registry
    ):
        kv_transfer_config = KVTransferConfig(
            kv_connector=connector_class,
            kv_connector_module_path=connector_module_path,
            kv_role=kv_role,
            kv_connector_extra_config=dict(kv_connector_extra_config or {}),
            kv_load_failure_policy=kv_load_failure_policy,
        )
    from vllm.config import ParallelConfig

    parallel_config = ParallelConfig(**parallel)
    kv_events_config = None
    if kv_events is not None:  # what --kv-events-config parses into
        from vllm.config.kv_events import KVEventsConfig

        kv_events_config = KVEventsConfig(**kv_events)
    with tpu_platform_hybrid_kv_cache():
        vllm_config = VllmConfig(
            model_config=model_config,
            scheduler_config=scheduler_config,
            cache_config=cache_config,
            parallel_config=parallel_config,
            kv_transfer_config=kv_transfer_config,
            kv_events_config=kv_events_config,
            device_config=DeviceConfig("cpu"),
        )
    # PITFALL: CpuPlatform.check_and_update_config (platforms/cpu.py:330-331)
    # unconditionally forces async_scheduling=False. Restore the requested
    # value; max_concurrent_batches (config/vllm.py:577-587) then becomes 2.
    vllm_config.scheduler_config.async_scheduling = async_scheduling
    if backend is not None:
        # Set after validation, as tpu-inference's platform does ("uni" with tensor parallel 8).
        vllm_config.parallel_config.distributed_executor_backend = backend
    # CpuPlatform would replace a non-user-specified block size with 128.
    assert vllm_config.cache_config.block_size == block_size, (
        vllm_config.cache_config.block_size
    )
    return vllm_config


@contextlib.contextmanager
def tpu_platform_hybrid_kv_cache():
    """While vLLM resolves a config: answer vLLM's "does the platform support the hybrid KV cache
    manager" as tpu-inference's ``TpuPlatform.support_hybrid_kv_cache`` does (yes), whatever
    platform this process resolved (tests touch vLLM's platform before VLLM_TARGET_DEVICE can
    select the CPU one, and the unspecified platform says no). vLLM then decides HMA from the
    connector, as it does on TPU."""
    from vllm.platforms import current_platform

    cls = type(current_platform)
    saved = cls.__dict__.get("support_hybrid_kv_cache")
    cls.support_hybrid_kv_cache = classmethod(lambda c: True)
    try:
        yield
    finally:
        if saved is None:
            del cls.support_hybrid_kv_cache
        else:
            cls.support_hybrid_kv_cache = saved


def make_kv_cache_config(
    num_blocks: int,
    block_size: int,
    num_layers: int = 2,
    num_kv_heads: int = 2,
    head_size: int = 16,
    dtype: torch.dtype = torch.float32,
) -> KVCacheConfig:
    """Scheduler-side KVCacheConfig: one FullAttentionSpec group, no tensors."""
    cfg = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                layer_names(num_layers),
                FullAttentionSpec(
                    block_size=block_size,
                    num_kv_heads=num_kv_heads,
                    head_size=head_size,
                    dtype=dtype,
                ),
            )
        ],
    )
    # EngineCore resolves these before building the scheduler (core.py:361-374).
    cfg.hash_block_size = block_size
    cfg.cache_hit_alignment_tokens = block_size
    return cfg


def scheduler_kv_cache_config(vllm_config: VllmConfig, kv_cache_spec: dict, num_blocks: int) -> KVCacheConfig:
    """The scheduler's KVCacheConfig for the workers' per-layer specs, as vLLM's engine core builds
    it (``EngineCore._initialize_kv_caches``): vLLM's own ``get_kv_cache_groups`` groups the layers,
    ``generate_scheduler_kv_cache_config`` keeps one spec per group. No tensors (nothing is
    allocated here); ``num_blocks`` instead of a memory budget."""
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config, get_kv_cache_groups

    groups = get_kv_cache_groups(vllm_config, dict(kv_cache_spec))
    cfg = generate_scheduler_kv_cache_config([KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                                            kv_cache_groups=groups)])
    block_size = vllm_config.cache_config.block_size
    # EngineCore resolves these before building the scheduler (core.py:361-374).
    cfg.hash_block_size = block_size
    cfg.cache_hit_alignment_tokens = block_size
    return cfg


def make_scheduler(
    num_blocks: int,
    block_size: int,
    kv_connector_extra_config: dict | None = None,
    connector_module_path: str | None = "tpuoffload.connector",
    async_scheduling: bool = False,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 256,
    num_layers: int = 2,
    num_kv_heads: int = 2,
    head_size: int = 16,
    connector_class: str = "TPUOffloadConnector",
    max_model_len: int = 4096,
    kv_role: str = "kv_both",
    kv_load_failure_policy: str = "recompute",
    enable_chunked_prefill: bool = True,
    tensor_parallel_size: int = 1,
    log_stats: bool = True,
    model_runner_v2: bool = False,
    parallel_overrides: dict | None = None,
    sharding_config=None,
    kv_events: dict | None = None,
    kv_cache_config: KVCacheConfig | None = None,
    kv_cache_spec: dict | None = None,
) -> Scheduler:
    """Build vLLM's real Scheduler (or AsyncScheduler) exactly as EngineCore does,
    minus the executor. The connector (role SCHEDULER) is ``sched.connector``.

    Set connector_module_path=None and connector_class="" for no connector.
    tensor_parallel_size only changes parallel_config (vLLM's default 'mp'
    executor: one reporting worker per rank); nothing is launched.
    kv_events is vLLM's --kv-events-config (KVEventsConfig fields), e.g.
    {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:5557"}:
    the scheduler then builds its own publisher from it.
    parallel_overrides replaces ParallelConfig arguments the way a deployment
    would, e.g. {"tensor_parallel_size": 8, "distributed_executor_backend": "uni"}
    for tpu-inference on one host (the backend is set after validation, as
    tpu-inference's platform does). The KV cache config describes the page of
    the whole mesh, as tpu-inference reports it; the connector divides it by
    the number of reporting workers. kv_cache_spec (layer name -> KVCacheSpec, what the workers
    report: tpu_layouts.kv_cache_spec) builds it as vLLM's engine core does (scheduler_kv_cache_config).
    model_runner_v2=True emulates Model Runner V2's SchedulerOutput shape
    (resumed requests go to scheduled_new_reqs with prefill_token_ids). The
    real switch (VLLM_USE_V2_MODEL_RUNNER=1) fails config validation without
    Triton, so this only flips Scheduler.use_v2_model_runner after __init__
    (the only scheduler-side uses: scheduler.py:363,1418,1450,1731,
    async_scheduler.py:52); vllm_config.use_v2_model_runner stays False.
    """
    global _DEFAULT_HASH_BLOCK_SIZE, _DEFAULT_HASH_FN
    vllm_config = make_vllm_config(
        block_size=block_size,
        kv_connector_extra_config=kv_connector_extra_config,
        connector_module_path=connector_module_path,
        connector_class=connector_class,
        async_scheduling=async_scheduling,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        kv_role=kv_role,
        kv_load_failure_policy=kv_load_failure_policy,
        enable_chunked_prefill=enable_chunked_prefill,
        tensor_parallel_size=tensor_parallel_size,
        parallel_overrides=parallel_overrides,
        kv_events=kv_events,
    )
    if sharding_config is not None:
        # tpu-inference's platform attaches its ShardingConfigManager to the config, then installs
        # its DPScheduler when total_dp_size > 1: its own function decides.
        vllm_config.sharding_config = sharding_config
        from tpu_inference.core.sched.dp_scheduler import update_vllm_config_for_dp_scheduler

        update_vllm_config_for_dp_scheduler(vllm_config)
    # EngineCore sets this from the resolved scheduler KV cache config.
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    if kv_cache_spec is not None:
        kv_cache_config = scheduler_kv_cache_config(vllm_config, kv_cache_spec, num_blocks)
    elif kv_cache_config is None:
        kv_cache_config = make_kv_cache_config(
            num_blocks, block_size, num_layers, num_kv_heads, head_size
        )
    # Same hashing setup as EngineCore.__init__ (v1/engine/core.py:231-240).
    hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    _DEFAULT_HASH_BLOCK_SIZE = block_size
    _DEFAULT_HASH_FN = hash_fn

    sched_cls = vllm_config.scheduler_config.get_scheduler_cls()
    assert sched_cls is (AsyncScheduler if async_scheduling else Scheduler) or is_dp_scheduler(sched_cls), sched_cls
    sched = sched_cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        hash_block_size=block_size,
        include_finished_set=False,
        log_stats=log_stats,
    )
    if model_runner_v2:
        sched.use_v2_model_runner = True
    return sched


def is_dp_scheduler(scheduler_or_cls) -> bool:
    """tpu-inference's DPScheduler (one vLLM scheduler per DP rank, each in a forked process)."""
    cls = scheduler_or_cls if isinstance(scheduler_or_cls, type) else type(scheduler_or_cls)
    return cls.__name__ == "DPScheduler"


def make_worker_connector(scheduler: Scheduler) -> KVConnectorBase_V1:
    """A WORKER-role instance of the same connector class (what
    ensure_kv_transfer_initialized() builds in each worker). Real workers get a
    kv_cache_config with kv_cache_tensors filled in; this one has none, and
    register_kv_caches() is NOT called (do it yourself with fake tensors)."""
    return KVConnectorFactory.create_connector(
        config=scheduler.vllm_config,
        role=KVConnectorRole.WORKER,
        kv_cache_config=scheduler.kv_cache_config,
    )


# --------------------------------------------------------------------------
# requests
# --------------------------------------------------------------------------
def make_request(
    req_id: str,
    prompt_token_ids: Sequence[int],
    max_tokens: int = 8,
    block_size: int | None = None,
    ignore_eos: bool = True,
    kv_transfer_params: dict | None = None,
    priority: int = 0,
    arrival_time: float | None = None,
) -> Request:
    """Build a vllm.v1.request.Request the way EngineCore.preprocess_add_request
    does (Request.from_engine_core_request with the engine's block hasher).

    n>1 does not exist at this level: the v1 frontend fans n>1 out into n
    independent child Requests (vllm/v1/engine/parallel_sampling.py), so just
    make several requests with the same prompt.
    """
    bs = block_size if block_size is not None else _DEFAULT_HASH_BLOCK_SIZE
    if bs is None:
        raise RuntimeError("call make_scheduler() first or pass block_size=")
    hash_fn = _DEFAULT_HASH_FN
    if hash_fn is None:
        hash_fn = get_hash_fn_by_name("sha256")
        init_none_hash(hash_fn)
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
    sp.update_from_generation_config({}, EOS_TOKEN_ID)
    req = Request(
        request_id=req_id,
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=sp,
        pooling_params=None,
        arrival_time=arrival_time,
        priority=priority,
        block_hasher=get_request_block_hasher(bs, hash_fn),
    )
    if kv_transfer_params is not None:
        req.kv_transfer_params = kv_transfer_params
    return req


# --------------------------------------------------------------------------
# fake model runner
# --------------------------------------------------------------------------
def assert_scheduler_empty(scheduler: Scheduler) -> None:
    """No leaked requests/blocks (mirrors vLLM's tests/v1/kv_connector/unit/utils.py)."""
    assert not scheduler.requests, list(scheduler.requests)
    assert len(scheduler.waiting) == 0 and len(scheduler.kv_holding_waiting) == 0
    assert not scheduler.running
    assert not scheduler.finished_recving_kv_req_ids
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # null block
    for b in pool.blocks:
        # vLLM does not maintain the null block's ref_cnt (block_pool.py; sliding-window and
        # skipped blocks point at it).
        assert b.ref_cnt == 0 or b.is_null, b
