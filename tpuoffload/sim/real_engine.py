"""tpuoffload inside the real engine: vLLM's ``LLM`` on tpu-inference's platform, worker and model
runner, on CPU JAX, with a tiny model whose random weights are written here (nothing downloaded):
``QWEN3`` (tpu-inference's JAX Qwen3, one KV cache group) or ``HYBRID`` (``--model hybrid``:
sliding-window and full-attention layers on tpu-inference's vLLM-model path, two KV cache groups
with vLLM's hybrid KV cache manager on, which tpu-inference's platform enables).

One engine per process (the platform and vLLM's parallel state are process-wide), so
``compare()`` starts one child process per configuration (``python -m tpuoffload.sim.real_engine``)
under an outside timeout and compares what they report. Each child runs the same passes over the
same prompts, greedy:

    pass 1  cold: computes every prompt (the connector saves the full blocks)
            llm.reset_prefix_cache()                      (drops vLLM's HBM prefix cache only)
    pass 2  the prefixes come back from host RAM (connector) / are recomputed (baseline)
            llm.reset_prefix_cache(reset_connector=True)  (what a weight update does)
    pass 3  nothing saved before the reset may load: everything is computed and saved again
            llm.reset_prefix_cache()
    pass 4  served from host RAM again, from the chunks saved in pass 3

and reports the generated token ids of every pass and, with the connector, the counters of both
connector halves per pass (deltas of their totals, read in this process: the ``uni`` executor
runs the worker here).

What is real and what is shimmed: ``tpuoffload.sim.engine_shims`` (the one module that holds every
shim). Used by ``tests/test_real_engine.py`` and ``python -m tpuoffload.demo --engine``.

Data parallelism: ``--dp 2`` builds the engine with ``data_parallel_size=2``, as offline serving
does on TPU: tpu-inference's platform then installs its ``DPScheduler`` (one vLLM ``Scheduler`` per
rank, each in a forked process, each with its own scheduler-half connector), and one runner holds
both ranks' KV caches (sharded over the mesh's ``data`` axis). The scheduler halves live in the
rank processes, so their counters are read from the snapshots they write (``stats_dir``, every
step: ``scheduler-dp<rank>.json``).

    python -m tpuoffload.sim.real_engine [--model hybrid] [--only connector] [--tp 1 2] [--dp 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from tpuoffload.sim.byte_audit import ByteAudit
from tpuoffload.sim.engine_shims import OPTIONAL as OPTIONAL_SHIMS

BLOCK_SIZE = 16
NUM_BLOCKS = 160  # KV cache blocks (num_gpu_blocks_override): small, so the CPU attention stays cheap
MAX_TOKENS = 6
PROMPT_BLOCKS = 4
VOCAB = 512
CPU_BYTES = 8 << 20  # host RAM for offloaded KV (cpu_bytes_to_use)
# float32: bit-for-bit equal KV still leaves the batch shapes different with and without hits, and
# bf16 rounding of those differences can flip a near-tie argmax; in float32 it does not.
DTYPE = "float32"
_COMMON_CONFIG = dict(
    vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
    head_dim=128, max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
    torch_dtype="float32", hidden_act="silu", attention_bias=False, bos_token_id=0, eos_token_id=1)


@dataclass(frozen=True)
class TinyModel:
    """A tiny model tpu-inference runs, as the HF config and random weights written at run time.
    ``impl``: tpu-inference's ``MODEL_IMPL_TYPE`` (``flax_nnx``: its own JAX model; ``vllm``: vLLM's
    PyTorch model through torchax)."""

    name: str
    config: dict[str, Any]
    impl: str
    qk_norm: bool  # Qwen3's per-head q/k RMSNorm weights
    about: str

    @property
    def num_layers(self) -> int:
        return self.config["num_hidden_layers"]


#: Qwen3, 2 layers, tpu-inference's JAX model: one KV cache group.
QWEN3 = TinyModel("qwen3", dict(
    _COMMON_CONFIG, architectures=["Qwen3ForCausalLM"], model_type="qwen3", num_hidden_layers=2,
    max_window_layers=2, attention_dropout=0.0, use_sliding_window=False), impl="flax_nnx", qk_norm=True,
    about="tiny Qwen3 (2 layers, 4 query / 2 KV heads of 128), tpu-inference's JAX model")
#: Hybrid: Llama with vLLM's per-layer ``layer_types``, sliding window 32 tokens (2 blocks, half the
#: prompt) and full attention alternating over 4 layers, on tpu-inference's vLLM-model path (its JAX
#: path declares every layer full attention to vLLM, kv_cache_manager.get_kv_cache_spec). vLLM's
#: hybrid KV cache manager makes two groups of 2 layers; tpu-inference shares 2 arrays between them.
HYBRID = TinyModel("hybrid", dict(
    _COMMON_CONFIG, architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=4, mlp_bias=False,
    layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=2 * BLOCK_SIZE), impl="vllm",
    qk_norm=False, about="tiny hybrid Llama (4 layers alternating sliding window 32 and full attention, 4 query / "
    "2 KV heads of 128), vLLM's PyTorch model on tpu-inference's vLLM-model path")
MODELS = {m.name: m for m in (QWEN3, HYBRID)}


def write_tiny_model(path: str, model: TinyModel = QWEN3, seed: int = 0) -> str:
    """config.json + model.safetensors with random float32 weights, HF names."""
    import torch
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    cfg = model.config
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    gen = torch.Generator().manual_seed(seed)
    hidden, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    nq, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def rand(*shape, scale=0.05):
        return (torch.randn(*shape, generator=gen) * scale).to(torch.float32)

    def ones(n):
        return torch.ones(n, dtype=torch.float32)

    weights = {"model.embed_tokens.weight": rand(VOCAB, hidden, scale=1.0), "model.norm.weight": ones(hidden),
               "lm_head.weight": rand(VOCAB, hidden, scale=0.2)}
    for layer in range(model.num_layers):
        p = f"model.layers.{layer}."
        weights.update({
            p + "self_attn.q_proj.weight": rand(nq * hd, hidden), p + "self_attn.k_proj.weight": rand(nkv * hd, hidden),
            p + "self_attn.v_proj.weight": rand(nkv * hd, hidden), p + "self_attn.o_proj.weight": rand(hidden, nq * hd),
            p + "mlp.gate_proj.weight": rand(inter, hidden), p + "mlp.up_proj.weight": rand(inter, hidden),
            p + "mlp.down_proj.weight": rand(hidden, inter),
            p + "input_layernorm.weight": ones(hidden), p + "post_attention_layernorm.weight": ones(hidden),
        })
        if model.qk_norm:
            weights.update({p + "self_attn.q_norm.weight": ones(hd), p + "self_attn.k_norm.weight": ones(hd)})
    save_file(weights, os.path.join(path, "model.safetensors"))
    return path


def make_prompts(seed: int = 0) -> list[list[int]]:
    """Four prompts of PROMPT_BLOCKS full blocks: two share all but their last block, two are their
    own. One length for all keeps the reference attention's shapes (and so its compiles) few."""
    import random

    rng = random.Random(seed)

    def toks(n):
        return [rng.randrange(2, VOCAB) for _ in range(n)]

    shared = toks((PROMPT_BLOCKS - 1) * BLOCK_SIZE)
    return [shared + toks(BLOCK_SIZE), shared + toks(BLOCK_SIZE), toks(PROMPT_BLOCKS * BLOCK_SIZE),
            toks(PROMPT_BLOCKS * BLOCK_SIZE)]


def kv_transfer_config(cpu_bytes: int = CPU_BYTES, **extra: Any) -> dict[str, Any]:
    return {"kv_connector": "TPUOffloadConnector", "kv_connector_module_path": "tpuoffload.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"cpu_bytes_to_use": cpu_bytes, **extra}}


# ---------------------------------------------------------------- engines, in this process
def run_engine(model_dir: str, connector: bool, tp: int = 1, dp: int = 1, seed: int = 0,
               hazard: bool = False, without_shims: tuple[str, ...] = (), num_passes: int = 4) -> dict[str, Any]:
    """Build vLLM's LLM on tpu-inference (shims installed first, but ``without_shims``), run the four
    passes, shut it down. ``hazard``: the runner's host input buffers forced onto 64-byte boundaries
    and its device queue held (``_force_aliasing_hazard``)."""
    from tpuoffload.sim import engine_shims

    shims = list(engine_shims.install(without=without_shims))
    import jax
    from vllm import LLM, SamplingParams

    devices = dp * tp
    if len(jax.devices()) < devices + 1:  # the mesh's devices and the reference attention's scratch device
        raise RuntimeError(f"DP {dp} x TP {tp} needs {devices + 1} CPU devices, JAX has {len(jax.devices())} "
                           "(XLA_FLAGS=--xla_force_host_platform_device_count=N)")
    kwargs: dict[str, Any] = {}
    stats_dir = None
    if connector:
        if dp > 1:  # the rank schedulers' counters come back through their snapshots
            stats_dir = os.path.join(os.path.dirname(os.path.abspath(model_dir)), f"stats-{config_name(tp, True, dp)}")
            kwargs["kv_transfer_config"] = kv_transfer_config(stats_dir=stats_dir, stats_interval_s=0)
        else:
            kwargs["kv_transfer_config"] = kv_transfer_config()
    t0 = time.monotonic()
    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype=DTYPE, seed=seed, max_model_len=256,
              max_num_seqs=8, max_num_batched_tokens=512, block_size=BLOCK_SIZE, enable_prefix_caching=True,
              num_gpu_blocks_override=NUM_BLOCKS, gpu_memory_utilization=0.5, enforce_eager=True,
              tensor_parallel_size=tp, data_parallel_size=dp,
              # the runner's own explicit device order (CPU devices have no TPU coordinates to sort by)
              additional_config={"sharding": {"sharding_strategy": {"device_indexes": list(range(devices))}}},
              **kwargs)
    init_s = time.monotonic() - t0
    try:
        halves = _connector_halves(llm, dp, stats_dir) if connector else None
        audit = ByteAudit(halves["worker"]) if connector else None
        runner = _check_real_path(llm, halves, dp)
        hazard_counts = _force_aliasing_hazard(runner) if hazard else None
        trace = _trace_steps(llm) if dp == 1 else []
        allocated = _kv_cache_report(runner, halves)  # before the first step replaces the arrays
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)
        prompts = make_prompts(seed)
        passes = []
        resets = {2: "reset_prefix_cache()", 3: "reset_prefix_cache(reset_connector=True)",
                  4: "reset_prefix_cache()"}
        for n in range(1, num_passes + 1):
            before = _totals(halves) if connector else None
            if n in resets:
                assert llm.reset_prefix_cache(reset_connector=(n == 3)), f"vLLM refused {resets[n]} before pass {n}"
            t = time.monotonic()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            wall = time.monotonic() - t
            entry = {"pass": n, "after": resets.get(n, "start"), "seconds": round(wall, 2),
                     "tokens": [list(o.outputs[0].token_ids) for o in outs],
                     "num_cached_tokens": [o.num_cached_tokens for o in outs]}
            if connector:
                assert halves["worker"].wait_idle(30.0), "saves still in flight 30 s after the pass"
                entry["counters"] = _delta(before, _totals(halves))
                entry["byte_audit"] = audit.report()
            entry["steps"], trace[:] = list(trace), []
            passes.append(entry)
        result = {"connector": connector, "tp": tp, "dp": dp, "dtype": DTYPE, "init_seconds": round(init_s, 2),
                  "devices": [str(d) for d in runner.devices], "mesh": dict(runner.mesh.shape), **allocated,
                  "prompts": prompts, "passes": passes, "shims": shims,
                  "platform": type(_current_platform()).__module__ + "." + type(_current_platform()).__name__}
        if hazard_counts is not None:
            result["hazard"] = dict(hazard_counts)
        if connector:
            result["worker_idle"] = halves["worker"].idle_report()
            result["moves"] = audit.steps
            result["digests"] = audit.digests()
    finally:
        _shutdown(llm)
    if connector:  # after the shutdown: DP ranks' halves write their last snapshot as they close
        result["scheduler_leaks"] = _scheduler_leaks(halves)
    return result


#: How long a held step waits for the next step's inputs before it runs anyway (the last step of a
#: pass has no successor).
HOLD_S = 1.0


def _aligned_like(array, align: int = 64):
    """A copy of ``array`` whose data starts on an ``align``-byte boundary."""
    import numpy as np

    raw = np.zeros(array.nbytes + align, np.uint8)
    start = (-raw.ctypes.data) % align
    out = raw[start:start + array.nbytes].view(array.dtype).reshape(array.shape)
    out[...] = array
    return out


def _force_aliasing_hazard(runner) -> dict[str, int]:
    """Test harness for the copy shim (engine_shims.py, 10): make the hazard it removes happen on
    every step that has a successor. (1) The runner's reused host input buffers (``positions_cpu``,
    the ``DeviceBuffer`` blob) start on a 64-byte boundary, where CPU JAX's put aliases them
    instead of copying. (2) The device queue is held: before each step, the runner's KV caches are
    tied (a donated no-op update) to a gate, a host callback behind a slow computation (so that
    both run asynchronously) that opens only once the runner has prepared the next step's inputs
    (or after ``HOLD_S``). The step's program takes the caches, so it runs after the gate, and
    reads its inputs after the runner rewrote them: what async scheduling's batch queue does by
    chance when the device is behind. Returns live counts: steps ``released_by_next_step`` (the
    hazard was set up) and ``released_by_timeout``."""
    import threading

    import jax
    import jax.numpy as jnp
    import numpy as np

    if len(runner.devices) != 1:
        raise NotImplementedError("the aliasing hazard harness holds one device")
    device = runner.devices[0]
    runner.positions_cpu = _aligned_like(runner.positions_cpu)
    runner.device_buffer.buffer = _aligned_like(runner.device_buffer.buffer)  # sized for every step: never regrown

    gates: dict[int, threading.Event] = {}  # step -> its gate (the engine thread adds, callbacks read)
    counts = {"released_by_next_step": 0, "released_by_timeout": 0}

    def wait(step, _):
        if not gates[int(step)].wait(HOLD_S):
            counts["released_by_timeout"] += 1
        return np.asarray(step)

    slow = jax.jit(lambda x: jnp.sum(x @ x @ x))  # long enough that the gate behind it is queued
    x = jax.device_put(np.ones((400, 400), np.float32), device)
    gate = jax.jit(lambda step, busy: jax.pure_callback(wait, jax.ShapeDtypeStruct((), np.int32), step, busy))
    tie = jax.jit(lambda caches, token: [c.at[(0,) * c.ndim].add((token * 0).astype(c.dtype)) for c in caches],
                  donate_argnums=0)
    prepare = runner._prepare_inputs

    def prepare_held(scheduler_output):
        step = len(gates)
        gates[step] = threading.Event()
        token = gate(jax.device_put(np.int32(step), device), slow(x))
        runner.kv_caches = tie(runner.kv_caches, token)
        out = prepare(scheduler_output)
        if step and not gates[step - 1].is_set():  # the previous step's inputs are rewritten now: let it run
            counts["released_by_next_step"] += 1
            gates[step - 1].set()
        return out

    runner._prepare_inputs = prepare_held
    return counts


def _trace_steps(llm) -> list:
    """Per step of vLLM's scheduler: the tokens scheduled per request, the loads reported done
    and the sampled tokens (what tells a wrong batch from a wrong KV)."""
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    trace: list = []
    update = sched.update_from_output

    def traced(scheduler_output, model_runner_output):
        kvo = model_runner_output.kv_connector_output
        trace.append({"scheduled": dict(scheduler_output.num_scheduled_tokens),
                      "new": [r.req_id for r in scheduler_output.scheduled_new_reqs],
                      "recved": sorted(kvo.finished_recving or ()) if kvo else [],
                      "sampled": {r: list(t) for r, t in zip(model_runner_output.req_ids,
                                                             model_runner_output.sampled_token_ids or [])}})
        return update(scheduler_output, model_runner_output)

    sched.update_from_output = traced
    return trace


def _kv_cache_report(runner, halves) -> dict[str, Any]:
    """What the runner allocated (its arrays, vLLM's KV cache groups in its ``kv_cache_config``,
    which array each layer uses) and, with one scheduler, the groups the connector's scheduler
    half plans with (built from the scheduler's own ``kv_cache_config``)."""
    report = {
        "kv_cache_shapes": [list(c.shape) for c in runner.kv_caches],
        "kv_cache_sharding": str(runner.kv_caches[0].sharding.spec),
        "kv_cache_groups": [{"spec": type(g.kv_cache_spec).__name__, "layers": list(g.layer_names),
                             "sliding_window": getattr(g.kv_cache_spec, "sliding_window", None)}
                            for g in runner.kv_cache_config.kv_cache_groups],
        "layer_to_array": dict(runner.layer_name_to_kvcache_index),
    }
    if halves is not None and halves["dp"] == 1:
        groups = halves["scheduler"].kv_groups
        report["connector_groups"] = {"windows": list(groups.windows), "describe": groups.describe()}
    return report


def _current_platform():
    from vllm.platforms import current_platform

    return current_platform


def _shutdown(llm) -> None:
    """Tear the engine down so that the next one can start in this process."""
    import gc

    from vllm.distributed import cleanup_dist_env_and_memory
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    llm.llm_engine.engine_core.shutdown()
    ensure_kv_transfer_shutdown()  # the worker's connector shutdown() (tpu-inference's worker does not call it)
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


def _connector_halves(llm, dp: int, stats_dir: str | None) -> dict[str, Any]:
    """The TPUOffloadConnector instances vLLM built: the worker's (the uni executor's worker, in this
    process) and the scheduler's (in EngineCore's Scheduler; under DPScheduler one per rank, in the
    rank processes, seen through their snapshots in ``stats_dir``)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    core = llm.llm_engine.engine_core.engine_core  # InprocClient -> EngineCore
    worker_conn = get_kv_transfer_group()
    halves = {"worker": worker_conn.worker, "worker_connector": worker_conn, "core": core, "dp": dp,
              "stats_dir": stats_dir}
    if dp == 1:
        halves.update(scheduler=core.scheduler.connector.scheduler, scheduler_connector=core.scheduler.connector)
    return halves


def _rank_snapshots(halves, every_rank: bool = True) -> list[dict[str, Any]]:
    """Each DP rank's scheduler-half snapshot (written at its last step; none before its first)."""
    from tpuoffload.snapshot import read_rank_snapshots

    snaps = read_rank_snapshots(halves["stats_dir"])
    if every_rank and len(snaps) != halves["dp"]:
        raise RuntimeError(f"expected {halves['dp']} rank scheduler snapshots in {halves['stats_dir']}, "
                           f"found {list(snaps)}")
    return list(snaps.values())


def _check_real_path(llm, halves, dp: int):
    """The pieces around the connector are vLLM's and tpu-inference's own classes."""
    from tpu_inference.core.sched.dp_scheduler import DPScheduler
    from tpu_inference.runner.tpu_runner import TPUModelRunner
    from tpu_inference.worker.tpu_worker import TPUWorker
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    from tpuoffload.connector import TPUOffloadConnector

    core = llm.llm_engine.engine_core.engine_core
    worker = core.model_executor.driver_worker.worker
    assert isinstance(core.model_executor, UniProcExecutor), type(core.model_executor)
    # DP > 1: tpu-inference's platform swapped vLLM's scheduler for its DPScheduler
    assert isinstance(core.scheduler, DPScheduler if dp > 1 else Scheduler), type(core.scheduler)
    if dp > 1:
        assert core.scheduler.dp_size == dp, core.scheduler.dp_size
    assert isinstance(worker, TPUWorker), type(worker)
    assert isinstance(worker.model_runner, TPUModelRunner), type(worker.model_runner)
    if halves is not None:
        if dp == 1:
            assert isinstance(halves["scheduler_connector"], TPUOffloadConnector)
        assert isinstance(halves["worker_connector"], TPUOffloadConnector)
        # register_runner ran (tpu-inference's initialize_kv_cache calls it) on the runner's own caches
        assert halves["worker"].engine is not None, "register_runner was never called"
    return worker.model_runner


def _totals(halves) -> Counter:
    totals = Counter()
    if halves["dp"] == 1:
        totals.update(halves["scheduler"].snapshot()["totals"])
    else:
        for snap in _rank_snapshots(halves, every_rank=False):  # before the first step: none yet
            totals.update(snap["totals"])
    totals.update(halves["worker"].snapshot()["totals"])
    return totals


def _scheduler_leaks(halves) -> list[dict[str, Any]]:
    """Each scheduler half's leak gauges (zero when idle)."""
    if halves["dp"] == 1:
        return [halves["scheduler"].leak_report()]
    from tpuoffload.manager.offload_scheduler import leaks_in

    return [leaks_in(snap) for snap in _rank_snapshots(halves)]


def _delta(before: Counter, after: Counter) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0) for k in sorted(after) if after[k] != before.get(k, 0)}


# ---------------------------------------------------------------- the child process
def config_name(tp: int, connector: bool, dp: int = 1) -> str:
    return f"{f'dp{dp}-' if dp > 1 else ''}tp{tp}-{'connector' if connector else 'baseline'}"


def engine_shapes(tps: tuple[int, ...], dps: tuple[int, ...]) -> list[tuple[int, int]]:
    """(dp, tp) of each engine: every tensor-parallel size at DP 1, then every DP size at TP 1."""
    return [(1, tp) for tp in tps] + [(dp, 1) for dp in dps]


#: What the attention stand-in says when a batch's sequence has no query (what a step that reads
#: the next step's metadata gives: see ``_force_aliasing_hazard``).
STAND_IN_REFUSAL = "Require 0 < q_len=Array(0"


def _run_logged(cmd: list[str], env: dict, timeout_s: float, log_path: str) -> tuple[int, str]:
    """Run ``cmd`` in its own session under an outside timeout (its group killed past it), output
    to ``log_path``; returns the exit code and the log."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            raise RuntimeError(f"{' '.join(cmd)} ran past {timeout_s} s (killed); log: {log_path}")
    with open(log_path) as f:
        return rc, f.read()


def run_child(workdir: str, tps: tuple[int, ...] = (1,), timeout_s: float = 300.0,
              dps: tuple[int, ...] = (), model: TinyModel = QWEN3,
              extra_args: tuple[str, ...] = ()) -> dict[str, Any]:
    """One child process (``python -m tpuoffload.sim.real_engine``) under an outside timeout (its
    process group is killed when it runs past it) runs, one after another, the engine without and
    with the connector for each tensor-parallel size, then each data-parallel size, all on one tiny
    model (tpu-inference reads its model implementation once per process); returns its report."""
    model_dir = write_tiny_model(os.path.join(workdir, "model"), model)
    out_json, log_path = os.path.join(workdir, "report.json"), os.path.join(workdir, "engine.log")
    env = dict(os.environ)
    env.update(JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               # One CPU thread per op: multi-threaded reductions may sum in another order from run to
               # run, and a random model's near-tie argmax then flips a greedy token (seen at TP 1 and 2).
               XLA_FLAGS=f"--xla_force_host_platform_device_count={max(d * t for d, t in engine_shapes(tps, dps)) + 1} "
                         "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
               VLLM_XLA_CACHE_PATH=os.path.join(workdir, "xla_cache"),  # tpu-inference's compile cache: not ~/.cache
               MODEL_IMPL_TYPE=model.impl)
    env.pop("VLLM_TARGET_DEVICE", None)  # the scheduler-only sims set cpu; this engine's platform is tpu-inference's
    cmd = [sys.executable, "-m", "tpuoffload.sim.real_engine", "--model", model.name, "--model-dir", model_dir,
           "--json", out_json, "--tp", *map(str, tps), "--dp", *map(str, dps)]
    rc, log = _run_logged(cmd + list(extra_args), env, timeout_s, log_path)
    if rc != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {rc}; log {log_path}:\n{log[-6000:]}")
    with open(out_json) as f:
        return json.load(f)


def summarize(conn: dict[str, Any], base: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the test asserts and the demo prints, from a connector report and, for engines on one
    device, the baseline's (``tokens_equal``: pass -> tokens equal, absent without a baseline)."""
    p = {e["pass"]: e for e in conn["passes"]}
    c = {n: Counter(p[n].get("counters", {})) for n in p}
    audit = conn["passes"][-1]["byte_audit"]
    out = {
        "chunks_loaded": {n: c[n]["chunks_loaded"] for n in p},
        "hit_tokens": {n: c[n]["hit_tokens"] for n in p},
        "chunks_saved": {n: c[n]["chunks_saved"] for n in p},
        "saves_issued": {n: c[n]["saves_issued"] for n in p},
        "dedup_index": {n: c[n]["dedup_index"] for n in p},
        "load_errors": sum(c[n]["load_errors"] for n in p),
        "save_failures": sum(c[n]["save_failures"] for n in p),
        "revoked_at_reset": c[3]["revoked"],
        "resets": c[3]["resets"],
        "blocks_checked": audit["loads_checked"],
        "blocks_differing": audit["num_mismatches"],
    }
    if base is not None:
        b = {e["pass"]: e for e in base["passes"]}
        out["tokens_equal"] = {n: p[n]["tokens"] == b[n]["tokens"] for n in p}
        out["baseline_passes_agree"] = all(b[n]["tokens"] == b[1]["tokens"] for n in b)
    return out


def demo(argv: list[str] | None = None) -> int:
    """``python -m tpuoffload.demo --engine [--tp 1 2] [--dp 2]``: run the engines in a child
    process and print what happened, pass by pass."""
    ap = argparse.ArgumentParser(prog="python -m tpuoffload.demo --engine", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, nargs="*", default=[1, 2], help="tensor-parallel sizes (default: 1 2)")
    ap.add_argument("--dp", type=int, nargs="*", default=[2], help="data-parallel sizes at TP 1, through "
                    "tpu-inference's DPScheduler (default: 2)")
    ap.add_argument("--model", choices=sorted(MODELS), default=QWEN3.name, help="the tiny model (default: qwen3; "
                    "hybrid: sliding-window and full-attention layers, two KV cache groups)")
    ap.add_argument("--workdir", default=None, help="model, report and engine log (default: a temp dir)")
    ap.add_argument("--timeout", type=float, default=900.0, help="outside timeout for the child, seconds")
    args = ap.parse_args(argv)
    workdir = args.workdir or tempfile.mkdtemp(prefix="tpuoffload-engine-")
    model = MODELS[args.model]
    print(f"tpuoffload inside the real engine: vLLM {_version('vllm')} LLM on tpu-inference {_version('tpu-inference')}"
          f" (TpuPlatform, TPUWorker, TPUModelRunner, uni executor) on CPU JAX {_version('jax')}; {model.about}, "
          f"{DTYPE}, written to {workdir}/model; tensor parallel {args.tp}, data parallel {args.dp}")
    print(f"log: {workdir}/engine.log", flush=True)
    t0 = time.monotonic()
    report = run_child(workdir, tuple(args.tp), args.timeout, tuple(args.dp), model)
    wall = time.monotonic() - t0
    first = next(iter(report["runs"].values()))
    print("\nshims (tpuoffload/sim/engine_shims.py, the only ones):")
    for line in first["shims"]:
        print(f"  - {line}")
    ok = True
    for dp, tp in engine_shapes(tuple(args.tp), tuple(args.dp)):
        conn = report["runs"][config_name(tp, True, dp)]
        s = summarize(conn, report["runs"].get(config_name(tp, False, dp)))
        tokens = s.get("tokens_equal", {})
        scheduler = "DPScheduler, one vLLM scheduler per rank" if dp > 1 else "vLLM's Scheduler"
        print(f"\ndata parallel {dp} x tensor parallel {tp} ({scheduler}): mesh {conn['mesh']} on {conn['devices']}; KV cache: "
              f"{len(conn['kv_cache_shapes'])} arrays of {conn['kv_cache_shapes'][0]} sharded {conn['kv_cache_sharding']}")
        if len(conn["kv_cache_groups"]) > 1:
            print(f"  vLLM's KV cache groups (hybrid KV cache manager on): {conn['connector_groups']['describe']}; "
                  f"array of each layer {conn['layer_to_array']}; blocks moved per group, passes 1-4 together: "
                  f"{conn['passes'][-1]['byte_audit']['by_group']}")
        print(f"  {'pass':<46} {'tokens = baseline':>17} {'HBM-cached':>10} {'hit tokens':>10} {'loaded':>7} "
              f"{'saved':>6}")
        for e in conn["passes"]:
            n = e["pass"]
            label = f"{n} (after {e['after']})" if n > 1 else "1 (cold)"
            print(f"  {label:<46} {str(tokens.get(n, 'not run')):>17} {sum(e['num_cached_tokens']):>10} "
                  f"{s['hit_tokens'][n]:>10} {s['chunks_loaded'][n]:>7} {s['chunks_saved'][n]:>6}")
        print(f"  reset_connector revoked {s['revoked_at_reset']} chunks; load errors {s['load_errors']}, save "
              f"failures {s['save_failures']}; loaded blocks differing from the saved bytes: "
              f"{s['blocks_differing']} of {s['blocks_checked']}; worker idle {conn['worker_idle']}")
        ok &= (all(tokens.values()) and s["blocks_differing"] == 0 and s["chunks_loaded"][2] > 0
               and s["chunks_loaded"][3] == 0)
    print(f"\n{'OK' if ok else 'MISMATCH'}: {wall:.0f} s in all (report: {workdir}/report.json)")
    return 0 if ok else 1


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tpuoffload.sim.real_engine", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, nargs="*", default=[1], help="tensor-parallel sizes over CPU devices "
                    "(XLA_FLAGS=--xla_force_host_platform_device_count must offer the largest + 1)")
    ap.add_argument("--dp", type=int, nargs="*", default=[], help="data-parallel sizes, each at TP 1, through "
                    "tpu-inference's DPScheduler (devices as for --tp)")
    ap.add_argument("--only", choices=("baseline", "connector"), default=None, help="run just one of the two")
    ap.add_argument("--model", choices=sorted(MODELS), default=QWEN3.name, help="the tiny model")
    ap.add_argument("--model-dir", default=None, help="where the tiny model is (written there if absent)")
    ap.add_argument("--json", default=None, help="write the report here (default: stdout)")
    ap.add_argument("--hazard", action="store_true", help="force the host-input aliasing hazard (64-byte "
                    "aligned input buffers, device queue held until the next step's inputs are written)")
    ap.add_argument("--without-shim", action="append", default=[], choices=OPTIONAL_SHIMS,
                    help="leave this shim out (the copy shim's negative control)")
    ap.add_argument("--passes", type=int, default=4, choices=(1, 2, 3, 4), help="run the first N passes")
    ap.add_argument("--baseline-runs", type=int, default=1, help="run each baseline engine this many times "
                    "(its determinism, shown)")
    args = ap.parse_args(argv)
    model_dir = args.model_dir or os.path.join(tempfile.mkdtemp(prefix="tpuoffload-engine-"), "model")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        write_tiny_model(model_dir, MODELS[args.model])
    t0 = time.monotonic()
    report: dict[str, Any] = {"model": args.model, "runs": {}}
    report["hazard"], report["without_shims"] = args.hazard, args.without_shim
    for dp, tp in engine_shapes(tuple(args.tp), tuple(args.dp)):
        for connector in (False, True):
            if args.only and args.only != ("connector" if connector else "baseline"):
                continue
            for run in range(1 if connector else args.baseline_runs):
                name = config_name(tp, connector, dp) + (f"-run{run + 1}" if run else "")
                report["runs"][name] = run_engine(model_dir, connector, tp, dp, hazard=args.hazard,
                                                  without_shims=tuple(args.without_shim), num_passes=args.passes)
    report["seconds"] = round(time.monotonic() - t0, 1)
    text = json.dumps(report, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    else:
        print(text)
    sys.stdout.flush()
    # vLLM's exit-time finalizer (LLMEngine._cleanup_instance_caches) walks model.modules(), a torch
    # model's method that tpu-inference's JAX model lacks, and prints a traceback: the report is
    # written and every engine was shut down, so leave without running finalizers.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
