"""Every shim that lets vLLM's engine run tpu-inference's TPU worker and model runner on CPU JAX.

ALL of them live here, each with one line saying what it replaces and why. Only
``tpuoffload.sim.real_engine`` (the real-engine test and demo) and ``tpuoffload.sim.vllm_cli`` (the
serving launcher's processes) call ``install()``; product code never imports this module. Nothing here touches the code paths around the connector: vLLM's
``LLM`` / ``EngineCore`` / ``UniProcExecutor`` / ``Scheduler``, tpu-inference's ``TpuPlatform``
(its ``check_and_update_config`` runs as is), ``TPUWorker``, ``TPUModelRunner`` (its connector
hooks, ``register_runner``, ``initialize_kv_cache``), its JAX Qwen3 model, its vLLM-model path
(vLLM's PyTorch model through torchax, for the hybrid model), its weight loaders and its sampler
are the installed ones. What is replaced is device detection, TPU-only compiler flags, imports with
no CPU build here (torchvision-bound multimodal modules, a newer tokamax kernel), the Pallas
attention kernel (by tpu-inference's own pure-JAX reference of the same kernel), one
float32-only weight-loading failure, the CPU hosts' join (shim 11) and, for the serving launcher's
fault case only, the worker half's fault injector (shim 12, inert unless the launcher asks). One
shim is not about CPU at all: shim 13 works around a vLLM defect a TPU deployment has too (a
remote worker's response read that its executor's shutdown cannot wake), so that the serving
launcher's killed-host case measures the connector, not that hang.
``dp_output_aggregator`` is not a shim but an experiment, installed only on request.

``install()`` must run before ``vllm.platforms.current_platform`` is first resolved and before
tpu-inference's model and sampling modules are imported (the compiler-options shim is read at
their import; importing the vLLM-model path's weight loading, shim 9, resolves the platform, so it
comes after shim 7); it is idempotent.
"""

from __future__ import annotations

import importlib
import os
import sys
import types

from typing_extensions import override

from tpuoffload.worker.faults import FaultInjector, FaultPoint

# The CPU "HBM" every device reports to tpu-inference's memory accounting (the KV cache size is set
# by num_gpu_blocks_override anyway).
CPU_HBM_BYTES_PER_DEVICE = 1 << 30

# torchax 0.0.13 names these named-tensor (Dimname) overloads of aten ops, which torch 2.13 no longer has.
_REMOVED_ATEN_OVERLOADS = {
    "all": ("dimname", "dimname_out"),
    "index_add": ("dimname",),
    "index_copy": ("dimname",),
    "index_copy_": ("dimname",),
    "index_fill": ("Dimname_Scalar", "Dimname_Tensor"),
    "index_fill_": ("Dimname_Scalar", "Dimname_Tensor"),
    "norm": ("names_ScalarOpt_dim", "names_ScalarOpt_dim_dtype", "names_dtype_out", "names_out"),
    "prod": ("dim_Dimname",),
    "std": ("correction_names", "correction_names_out", "names_dim", "names_out"),
    "std_mean": ("correction_names", "names_dim"),
    "unbind": ("Dimname",),
}

INSTALLED: list[str] = []  # names of the shims installed, in order (the demo prints them)


class _RemovedOverload:
    """An inert stand-in for an aten overload this torch does not have: hashable, never called."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<aten overload {self.name} absent from this torch>"

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self.name} does not exist in this torch build")


def _stub_module(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__path__ = []  # a package, so that deeper stubs can hang below it
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    parent, _, child = name.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], child, mod)
    return mod


def _not_on_cpu(what: str):
    def fail(*args, **kwargs):
        raise NotImplementedError(f"{what} is a TPU-only kernel; the real-engine model on CPU never calls it")
    return fail


def _text_only(vllm_model) -> None:
    """What tpu-inference's multimodal model patchers do for a text-only model: nothing."""
    from vllm.model_executor.models import supports_multimodal

    if supports_multimodal(vllm_model):
        raise NotImplementedError(f"{type(vllm_model).__name__} is multimodal: its tpu-inference patches need "
                                  "torchvision, which has no build for this CPU torch")


#: The shims a negative control may leave out (``install(without=...)``), by name.
DEVICE_PUT_COPY = "device_put_copy"
OPTIONAL = (DEVICE_PUT_COPY,)


def install(without: tuple[str, ...] = ()) -> list[str]:
    """Install every shim but those named in ``without`` (only the ``OPTIONAL`` ones: the copy
    shim's negative control leaves it out)."""
    if INSTALLED:
        return INSTALLED
    if set(without) - set(OPTIONAL):
        raise ValueError(f"only {OPTIONAL} may be left out, not {sorted(set(without) - set(OPTIONAL))}")
    if "vllm.platforms" in sys.modules and sys.modules["vllm.platforms"]._current_platform is not None:
        raise RuntimeError("engine_shims.install() must run before vLLM resolves its platform")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    # (1) tpu_info: env values in place of GCE metadata-server lookups (there is no TPU VM to ask).
    for key, value in {"TPU_ACCELERATOR_TYPE": "v6e-8", "TPU_NAME": "cpu", "TPU_WORKER_ID": "0"}.items():
        os.environ.setdefault(key, value)
    INSTALLED.append("tpu_info env (TPU_ACCELERATOR_TYPE/TPU_NAME/TPU_WORKER_ID) instead of GCE metadata lookups")

    # (2) torch: inert placeholders for the named-tensor overloads torchax 0.0.13 lists but torch 2.13 removed.
    import torch
    for op, overloads in _REMOVED_ATEN_OVERLOADS.items():
        packet = getattr(torch.ops.aten, op)
        for ov in overloads:
            if ov not in packet.overloads():
                setattr(packet, ov, _RemovedOverload(f"aten.{op}.{ov}"))
    INSTALLED.append("torch.ops.aten.*.<Dimname overloads>: placeholders for overloads torch 2.13 removed "
                     "(torchax 0.0.13's amp/decomposition tables name them at import)")

    # (3) tokamax: a stub gmm_v2 module; the registry's tokamax 0.0.12 predates it (tpu-inference pins 0.0.17.dev).
    try:
        importlib.import_module("tokamax._src.ops.experimental.gmm_v2.gmm_v2")
    except ModuleNotFoundError:
        importlib.import_module("tokamax._src.ops")
        for name in ("tokamax._src.ops.experimental", "tokamax._src.ops.experimental.gmm_v2"):
            try:
                importlib.import_module(name)
            except ModuleNotFoundError:
                _stub_module(name)
        _stub_module("tokamax._src.ops.experimental.gmm_v2.gmm_v2", gmm_v2=_not_on_cpu("tokamax gmm_v2"),
                     calculate_tiling=_not_on_cpu("tokamax gmm_v2 calculate_tiling"))
        INSTALLED.append("tokamax._src.ops.experimental.gmm_v2: stub (TPU grouped-matmul kernel for MoE and "
                         "quantized layers, absent from tokamax 0.0.12; the dense unquantized model never calls it)")

    # (4) tpu-inference's Gemma 4 multimodal module: a stub; its image processor needs torchvision (no CPU build here).
    _stub_module("tpu_inference.models.jax.gemma4_mm",
                 Gemma4ForConditionalGeneration=type("Gemma4ForConditionalGeneration", (), {
                     "__init__": _not_on_cpu("Gemma4ForConditionalGeneration (needs torchvision)")}))
    INSTALLED.append("tpu_inference.models.jax.gemma4_mm: stub (imported by the model registry; its image "
                     "processor needs torchvision, which has no build for the CPU torch 2.13)")

    # (4b) the multimodal helpers of its vLLM-model path: stubs that do what the originals do for a text-only
    # model; the originals import vLLM's Gemma 4 / Qwen3-VL / Qwen3-Omni models, whose processors need torchvision.
    experimental = "tpu_inference.models.vllm.experimental."
    _stub_module(experimental + "gemma4_mm_patcher", maybe_apply_gemma4_mm_patches=_text_only)
    _stub_module(experimental + "qwen3_omni_patcher", maybe_apply_qwen3_omni_patches=_text_only)
    _stub_module(experimental + "qwen3_vl_patcher", maybe_apply_qwen3_vl_patches=_text_only,
                 is_qwen3_vl=lambda model: _text_only(model) or False)
    _stub_module(experimental + "vision_tower_jit",
                 maybe_jit_embed_multimodal_func=lambda fn, model: _text_only(model) or fn,
                 maybe_precompile_vision_encoder_fn=lambda params, fn, model, config: _text_only(model),
                 maybe_prepare_for_jit=lambda kwargs, model: _text_only(model) or kwargs)
    INSTALLED.append("tpu_inference.models.vllm.experimental.{gemma4_mm,qwen3_omni,qwen3_vl}_patcher, "
                     "vision_tower_jit: text-only stubs (vLLM-model path; they import vLLM's multimodal models, "
                     "whose processors need torchvision; for a text-only model the originals do nothing)")

    # (5) compiler options: none instead of xla_tpu_* flags, which the CPU XLA compiler rejects.
    compiler_options = importlib.import_module("tpu_inference.models.common.compiler_options")
    for name in ("model_loader", "sampling", "decode_loop"):
        assert not any(m.endswith(name) and m.startswith("tpu_inference") for m in sys.modules), (
            f"install() must run before tpu-inference imports {name}")
    compiler_options.get_step_fn_compiler_options = lambda: {}
    compiler_options.get_sampling_compiler_options = lambda: {}
    INSTALLED.append("tpu_inference.models.common.compiler_options: {} instead of xla_tpu_* flags "
                     "(unknown to the CPU compiler)")

    # (6) HBM size: a fixed CPU budget instead of the per-TPU-generation table (raises on a non-TPU device).
    utils = importlib.import_module("tpu_inference.utils")
    utils.get_device_hbm_limit = lambda: CPU_HBM_BYTES_PER_DEVICE
    INSTALLED.append(f"tpu_inference.utils.get_device_hbm_limit: {CPU_HBM_BYTES_PER_DEVICE >> 20} MiB per CPU "
                     "device instead of the TPU generation's HBM (CPU devices report no memory stats)")

    # (7) platform: tpu-inference's TpuPlatform directly; vLLM detects it by importing libtpu (no TPU here).
    import vllm.platforms
    from tpu_inference.platforms import TpuPlatform
    vllm.platforms._current_platform = TpuPlatform()
    INSTALLED.append("vllm.platforms.current_platform = tpu_inference TpuPlatform (vLLM's TPU detection "
                     "imports libtpu)")

    # (8) attention: tpu-inference's pure-JAX reference of its ragged paged attention kernel (Pallas needs a TPU).
    attention_interface = importlib.import_module("tpu_inference.layers.common.attention_interface")
    attention_interface.ragged_paged_attention = _reference_ragged_paged_attention
    INSTALLED.append("tpu_inference attention_interface.ragged_paged_attention -> the kernel module's own "
                     "ref_ragged_paged_attention, run through jax.pure_callback (the Pallas kernel needs a "
                     "TPU; the reference loops over a concrete sequence count, so it cannot be traced)")

    # (9) float32 weights: tpu-inference's vLLM-model path hands a linear layer's float32 weight to numpy (torchax
    # t2j), which makes its torch storage non-resizable, then frees that storage with resize_(0) and fails (bf16
    # weights, the usual case, are widened into a new tensor first). A copy goes to numpy instead.
    unquantized = importlib.import_module("tpu_inference.layers.vllm.quantization.unquantized")
    torchax_t2j = unquantized.t2j
    unquantized.t2j = lambda tensor, use_dlpack=True: torchax_t2j(tensor.clone(), use_dlpack=use_dlpack)
    INSTALLED.append("tpu_inference unquantized linear loading: t2j of a copy (a float32 weight's storage, viewed "
                     "by numpy, cannot be freed with resize_(0); bf16 weights are copied by t2j anyway)")

    # (10) host inputs: tpu-inference's device put (tpu_inference.utils.device_array -> general_device_put) of a
    # copy of each numpy leaf. The runner rewrites its host buffers (positions_cpu, the DeviceBuffer metadata blob)
    # every step and puts views of them; a TPU put always copies host memory into HBM, but CPU JAX aliases a view
    # that starts on a 64-byte boundary, so with async scheduling (batch queue of 2) a step still queued on the
    # device reads the next step's positions and metadata.
    if DEVICE_PUT_COPY not in without:
        import jax
        import numpy as np

        tpu_utils = importlib.import_module("tpu_inference.utils")
        aliasing_put = tpu_utils.general_device_put

        def copying_put(tensor, *args, **kwargs):
            owned = jax.tree_util.tree_map(lambda t: np.array(t, copy=True) if isinstance(t, np.ndarray) else t,
                                           tensor)
            return aliasing_put(owned, *args, **kwargs)

        tpu_utils.general_device_put = copying_put
        INSTALLED.append("tpu_inference.utils.general_device_put (the runner's device_array): puts a copy of each "
                         "numpy input (a TPU put always copies to HBM; CPU JAX aliases a 64-byte-aligned view, "
                         "which the runner rewrites for the next step while this one is still queued)")

    # (11) hosts of a slice (TPU_MULTIHOST_BACKEND=ray, one Ray actor per host): on a TPU slice libtpu joins the
    # hosts by itself, jax.devices() is exactly the slice's chips and jax.devices("cpu") each host's own CPU.
    # Here, before tpu-inference's TPUWorker.init_device first touches JAX: jax.distributed across the hosts (CPU
    # devices, gloo collectives; coordinator and host count from the launcher, this host's index from its
    # TPU_WORKER_ID, as on a TPU VM); the worker's devices are every host's devices but its last (the attention
    # stand-in's scratch device, shim 8); the weight loader's one-device CPU mesh is this host's.
    # The launcher's variables reach a Ray worker after this runs (the executor's update_environment_variables,
    # before init_device), so they are read at the call; without them (one host) init_device runs as is.
    from tpu_inference.worker.tpu_worker import TPUWorker

    init_device = TPUWorker.init_device

    def init_device_on_cpu_hosts(self, *args, **kwargs):
        if os.environ.get(SLICE_COORDINATOR_ENV):
            _join_cpu_hosts()
            if not self.devices:
                self.devices = slice_devices()[:self.vllm_config.sharding_config.total_devices]
        return init_device(self, *args, **kwargs)

    TPUWorker.init_device = init_device_on_cpu_hosts
    # CPU devices have no TPU coordinates: the host's topology order (P/D KV mapping only) is its process index.
    tpu_worker_module = importlib.import_module("tpu_inference.worker.tpu_worker")
    tpu_worker_module.get_device_topology_order_id = lambda local_devices, global_devices: local_devices[0].process_index
    INSTALLED.append("tpu_inference TPUWorker.init_device on several hosts (the launcher's coordinator set): first "
                     "jax.distributed over the CPU hosts (libtpu joins a TPU slice's hosts itself), the slice's "
                     "devices without each host's scratch device, this host's CPU for the weight loader's CPU mesh, the "
                     "host's process index as its topology order (CPU devices have no TPU coordinates)")

    # (12) fault injection (the serving launcher's fault case; inert unless it sets LOAD_FAULT_FLAG_ENV): the
    # connector builds its worker half with the product's default injector (worker/faults.py NO_FAULTS); here the
    # worker half of the host whose JAX process index is LOAD_FAULT_HOST_ENV gets ``FlaggedLoadFaults`` instead,
    # through OffloadWorker's own ``faults`` parameter (the product's declared injection point). Read when the
    # connector is built: the launcher's variables reach a Ray worker after this runs (as for shim 11).
    import tpuoffload.connector as connector_module

    offload_worker = connector_module.OffloadWorker

    def offload_worker_with_faults(config, *args, **kwargs):
        flag = os.environ.get(LOAD_FAULT_FLAG_ENV)
        if flag and kwargs.get("faults") is None:
            import jax

            if jax.process_index() == int(os.environ.get(LOAD_FAULT_HOST_ENV, "-1")):
                kwargs["faults"] = FlaggedLoadFaults(flag)
        return offload_worker(config, *args, **kwargs)

    connector_module.OffloadWorker = offload_worker_with_faults
    INSTALLED.append("tpuoffload.connector.OffloadWorker: on the host the serving launcher names (only when it "
                     "asks, for its fault case), the worker half fails every load while a flag file exists "
                     "(instead of the product's default injector, which never fails)")

    # (13) a vLLM defect, not a CPU gap (a TPU deployment has it too): RayExecutorV2 reads the responses of a worker
    # on another node through a zmq socket (MessageQueue remote reader) that polls without a bound, and its shutdown
    # on a worker's death wakes only shared-memory readers. A host killed after host 0 answered a step but before it
    # did leaves EngineCore blocked for ever: /health stays 200 and every request hangs. Here such a read polls in
    # slices and gives up as a local reader does ("cancelled") once its queue is shut down.
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    MessageQueue.dequeue = dequeue_waking_on_shutdown(MessageQueue.dequeue)
    INSTALLED.append("vllm MessageQueue.dequeue of a remote reader (RayExecutorV2's read of another node's worker): "
                     "polls in slices and raises 'cancelled' once the queue is shut down, as a local reader does "
                     "(vLLM 0.32's poll has no bound, so a host killed mid-step hangs EngineCore; not CPU-specific)")
    return INSTALLED


#: How long a remote read polls before it looks at its queue's ``shutting_down`` again (shim 13).
REMOTE_READ_SLICE_S = 0.5


def dequeue_waking_on_shutdown(dequeue):
    """vLLM's ``MessageQueue.dequeue`` with shim 13: a remote reader's wait is cut into
    ``REMOTE_READ_SLICE_S`` polls, and raises ``RuntimeError("cancelled")`` (what a shared-memory
    reader raises) once ``shutdown()`` has been called; the read itself is vLLM's."""
    import time

    def waking_dequeue(self, timeout: float | None = None, indefinite: bool = False):
        if not self._is_remote_reader:
            return dequeue(self, timeout, indefinite)
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.remote_socket.poll(timeout=int(1000 * REMOTE_READ_SLICE_S)):
            if self.shutting_down:
                raise RuntimeError("cancelled")
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError
        return dequeue(self, timeout, indefinite)

    return waking_dequeue


#: Not a shim, an experiment (off unless this variable is 1; no test relies on it): see ``dp_output_aggregator``.
DP_AGGREGATOR_ENV = "TPUOFFLOAD_SIM_DP_AGGREGATOR"


def dp_output_aggregator() -> None:
    """The experiment that names why tpuoffload gets no loads under tpu-inference 0.32's DPScheduler on
    several hosts: DPScheduler sets ``self.connector = None`` (its connectors live in its rank
    processes), so vLLM's EngineCore never calls ``init_kv_output_aggregator`` and the executor returns
    only its output rank's (the last host's) connector output; the other hosts' save reports (and load
    errors) never reach the rank schedulers. Here, once the EngineCore is built under DPScheduler with a
    KV connector configured, the executor gets vLLM's own ``KVOutputAggregator`` (one report per worker
    process), as it would with any other scheduler. Installed by ``tpuoffload.sim.vllm_cli`` only when
    ``DP_AGGREGATOR_ENV`` is 1; it changes tpu-inference's code path, so nothing claimed as "runs as
    shipped" uses it."""
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.engine.core import EngineCore

    built = EngineCore.__init__

    def init_with_aggregator(self, *args, **kwargs):
        built(self, *args, **kwargs)
        executor = self.model_executor
        if (self.vllm_config.kv_transfer_config is not None and getattr(self.scheduler, "connector", 1) is None
                and getattr(executor, "kv_output_aggregator", None) is None):
            executor.kv_output_aggregator = KVOutputAggregator(executor.parallel_config.world_size)

    EngineCore.__init__ = init_with_aggregator


#: Set by the serving launcher for its load-fault case: a flag file, and the host (JAX process index) whose
#: loads all fail while that file exists (engine_shims 12).
LOAD_FAULT_FLAG_ENV = "TPUOFFLOAD_SIM_LOAD_FAULT_FLAG"
LOAD_FAULT_HOST_ENV = "TPUOFFLOAD_SIM_LOAD_FAULT_HOST"


class FlaggedLoadFaults(FaultInjector):
    """A host whose loads all fail while ``flag`` exists: at ``LOAD_PREPARE`` the whole load raises, so
    every chunk of it is reported as a load error (the host still dispatches its programs, with
    placeholders). Appends each failed load's size to ``<flag>.hits`` (what the launcher reads)."""

    def __init__(self, flag: str) -> None:
        self.flag = flag

    @override
    def hit(self, point: FaultPoint, n: int) -> set[int]:
        if point is FaultPoint.LOAD_PREPARE and n and os.path.exists(self.flag):
            with open(self.flag + ".hits", "a") as f:
                f.write(f"{n}\n")
            raise RuntimeError(f"injected: every load fails on this host while {self.flag} exists")
        return set()


#: Set by the serving launcher (tpuoffload.sim.serve_stack) for the Ray workers: the jax.distributed
#: coordinator (host:port), the number of hosts; each host's index is its TPU_WORKER_ID.
SLICE_COORDINATOR_ENV = "TPUOFFLOAD_SIM_JAX_COORDINATOR"
SLICE_HOSTS_ENV = "TPUOFFLOAD_SIM_HOSTS"


def _join_cpu_hosts() -> None:
    """jax.distributed.initialize over the launcher's hosts (once per process)."""
    import jax
    from jax._src import distributed

    if distributed.global_state.client is not None:
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(os.environ[SLICE_COORDINATOR_ENV], int(os.environ[SLICE_HOSTS_ENV]),
                               int(os.environ["TPU_WORKER_ID"]), initialization_timeout=120,
                               heartbeat_timeout_seconds=10, shutdown_timeout_seconds=10)
    from jax.sharding import Mesh
    from tpu_inference.layers.common import utils as layer_utils

    layer_utils._cpu_mesh = Mesh(jax.local_devices()[:1], ("cpu",))


def slice_devices() -> list:
    """Every host's devices but its last (the attention stand-in's scratch device), in JAX's order."""
    import jax

    last = {}
    for d in jax.devices():
        last[d.process_index] = d
    return [d for d in jax.devices() if d is not last[d.process_index]]


def _reference_ragged_paged_attention(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens,
                                      distribution, *, use_causal_mask=True, update_kv_cache=True,
                                      sm_scale=1.0, sliding_window=None, soft_cap=None, q_scale=None,
                                      k_scale=None, v_scale=None, out_dtype=None, **_kernel_tuning):
    """Same signature and results as the v3 kernel's ``ragged_paged_attention`` (the kernel's tuning
    arguments are ignored); the computation is ``ref_ragged_paged_attention`` from the same module,
    called on concrete arrays from inside the jitted step, on this host's last CPU device, which must
    be outside the runner's mesh (``real_engine`` gives JAX one device more than it uses; on several
    hosts, shim 11 leaves each host's last device out of the mesh)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from tpu_inference.kernels.ragged_paged_attention.v3 import kernel

    if not update_kv_cache:
        raise NotImplementedError("the reference attention always writes the new KV (update_kv_cache=False)")
    if out_dtype is None:  # the kernel's default
        out_dtype = jnp.float32 if queries.dtype == jnp.float32 else jnp.bfloat16
    out_spec = jax.ShapeDtypeStruct(queries.shape, out_dtype)
    cache_spec = jax.ShapeDtypeStruct(kv_cache.shape, kv_cache.dtype)

    def on_host(*args):
        # Owned copies in and out: XLA's argument buffers are only lent for the call, and it reads
        # the results after the call returns, when the arrays they came from may be gone.
        q, k, v, cache, lens, pages, cu, dist = (np.array(a, copy=True) for a in args)
        full = np.zeros(out_spec.shape, out_spec.dtype)  # the kernel leaves padding rows; zeros here
        if int(dist[-1]) == 0:
            return full, cache
        # The reference's eager ops run on a CPU device outside the runner's mesh: queued behind the
        # step program on a mesh device (which waits for this callback), they would never run.
        scratch = jax.local_devices()[-1]
        with jax.default_device(scratch):
            out, new_cache = kernel.ref_ragged_paged_attention(
                jnp.array(q), jnp.array(k), jnp.array(v), jnp.array(cache), jnp.array(lens),
                jnp.array(pages), jnp.array(cu), dist, use_causal_mask=use_causal_mask,
                sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, out_dtype=out_dtype,
                q_scale=q_scale, k_scale=k_scale, v_scale=v_scale)
            full[:out.shape[0]] = np.asarray(out)
            return full, np.array(new_cache, copy=True)

    return jax.pure_callback(on_host, (out_spec, cache_spec), queries, keys, values, kv_cache, kv_lens,
                             page_indices, cu_q_lens, distribution)
