#!/usr/bin/env python
"""Save/load throughput of tpuoffload's TransferEngine against the raw JAX path, on the platform JAX has.

For each step size, on one device, in one process, on the same blocks (median of --iters after a
warm-up; raw and engine iterations interleaved so drift hits both alike):

  raw        save: one jitted gather of the step's blocks + one ``jax.device_put`` to a
             ``pinned_host`` sharding; load: one ``device_put`` of that pinned array back + one
             jitted scatter that donates the cache. The ceiling the engine is measured against.
  engine     the public API: ``TransferEngine(kv_caches, cpu_bytes_to_use)``;
             save = ``engine.save(kv_caches, block_ids, slots, save_ids)`` + ``engine.wait_idle()``
             (the bytes are in host slots); load = ``engine.load(kv_caches, block_ids, slots,
             save_ids)`` until the returned caches are ready. ``main ms`` is the time until
             ``save()`` / ``load()`` returned on the calling thread, each dispatched right after
             the previous byte check, which streamed the checked blocks (128 MiB by default)
             through the CPU caches: cold-cache figures, the engine's and JAX's code and data
             fetched from memory. A scratch probe on two H200 machines timed a 512 MiB save's
             dispatch at 0.39 / 0.63 ms with warm caches, 0.60 / 0.76 right after such a check,
             0.54 / 0.76 after a plain numpy pass over 256 MiB instead (no ids-buffer fallback,
             the layout check of new cache arrays +0.03 ms, garbage collection off no change);
             docs/performance.md splits that time and compares it with the raw path's own
             dispatches in the same state.
             ``(warm)``: a second save of the same blocks into the same slots, dispatched right
             after the first one finished (its bytes are what the load then reads). Measured for
             two slot patterns on one engine of 2n slots: ``contiguous`` (slots n..2n-1 in order,
             one ascending run ending at the store's last slot, as a fresh scheduler hands them
             out) and ``scattered`` (n of the 2n slots drawn at random, in random order: one copy
             per slot). ``run`` is
             the slot-group width the engine dispatched (worker/programs.py); ``rows`` the rows its
             save programs moved, padding included, against the blocks asked for.
  raw_unique load only: the raw load with the scatter told its indices are unique (they are), as
             the engine's scatter is (worker/programs.py): the same transfer with XLA's faster
             scatter, the stricter ceiling for loads.
  per-block  the same moves one block at a time (one gather + one device_put per block; one
             device_put + one scatter per block): the floor batching has to beat.

Every sample is in the JSON (``samples_ms``): at 64 MiB single samples of every path, raw included,
spread by 9-14% (H200, 41 iterations), so a ratio of two medians of 9 moves by several points from
run to run.

Bytes are verified in the same run: before every timed load the destination blocks are zeroed,
and after it a sample of them (``--verify-blocks``) must equal the source blocks byte for byte, for
every path; the engine must report no failed block. After each check one tiny host-to-device
transfer, untimed, absorbs what the check's large copy into numpy leaves the runtime to do (its time
is printed), so that neither path's timing pays for the benchmark's own checks. Exit status: 0 all
verified, 1 a check failed, 2 wrong platform or arguments.

The default cache is tpu-inference's ragged-paged-attention layout: per layer
``(num_blocks, block_size, 2*kv_heads/packing, packing, head_dim)`` (packing = 32 // dtype bits),
bf16, sharded ``P("data", None, "model")`` on a 1x1 mesh. ``--layout 4d`` uses
``(num_blocks, block_size, 2*kv_heads, head_dim)`` sharded ``P(None, None, "model")`` (same bytes).

    python tools/bench_transfer.py --expect-platform gpu                     # 64 MiB, 512 MiB, 2 GiB
    python tools/bench_transfer.py --expect-platform gpu --sizes-mib 512 --json out.json
    JAX_PLATFORMS=cpu python tools/bench_transfer.py --expect-platform cpu --sizes-mib 8 --layers 4
    python tools/bench_transfer.py --expect-platform gpu --deployments llama-70b-tp8 --devices 2   # TP over 2 devices

JAX is never pointed at a platform here: the run uses whatever JAX picks (the GPU when present), and
refuses to measure anything unless that is ``--expect-platform``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from functools import partial

# Importable from a plain checkout (the device machine has no install); an installed tpuoffload or
# PYTHONPATH still comes first.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MIB = 1 << 20
DEFAULT_BUFFER = 256 * MIB  # TransferEngine's transfer_buffer_bytes default
DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn", "int8")


def _align(x: int, a: int) -> int:
    return -(-x // a) * a


def per_device_block_shape(*, tp: int, num_kv_heads: int, head_dim: int, dtype: str, block_size: int,
                           use_mla: bool = False, mla_packing: int = 32) -> tuple[int, ...]:
    """One device's shape of one block of one layer, by tpu-inference 0.32's rules (read from its
    source; tests/test_bench_transfer.py checks this against its own functions on CPU):

    * runner: ``utils.get_padded_num_heads(num_kv_heads, tp)`` (fewer KV heads than model shards
      are replicated up to ``tp``) and ``utils.get_padded_head_dim`` (up to a multiple of 128; 64
      stays) before ``kv_cache.create_kv_caches``;
    * ``kv_cache.get_kv_cache_shape_with_mesh``: RPA shape of ``heads // tp`` heads per shard,
      axis 2 multiplied by ``tp`` (so one device holds ``align(2*heads/tp, packing)/packing``);
      ``kernels/ragged_paged_attention/v3/kernel.py get_kv_cache_shape``: ``(block_size,
      align(2*heads, packing)/packing, packing, align(head_dim, 128))``, packing = 32 // bits;
    * head_dim 64 (``kernel_hd64.py``): ``(block_size, align(heads, packing)/packing, packing, 128)``;
    * MLA (``kernels/mla/v2/kernel.py get_kv_cache_shape`` with ``envs.MLA_KV_PACKING_SIZE``,
      default 32): ``(align(block_size, packing)/packing, packing, align(kv_dim, 128))``, not
      sharded by heads (every device of a model shard holds the whole latent).
    """
    import numpy as np  # noqa: F401 (ml_dtypes' names through jax below)
    import jax.numpy as jnp

    bits = jnp.dtype(dtype).itemsize * 8
    if use_mla:
        return (_align(block_size, mla_packing) // mla_packing, mla_packing, _align(head_dim, 128))
    heads = num_kv_heads if num_kv_heads >= tp else tp
    if heads % tp:
        raise ValueError(f"{num_kv_heads} KV heads do not shard over {tp} devices")
    packing = 32 // bits
    if head_dim == 64:  # kernel_hd64.py: K and V share the 128 lanes of one head
        return (block_size, _align(heads // tp, packing) // packing, packing, 128)
    return (block_size, _align(2 * (heads // tp), packing) // packing, packing, _align(head_dim, 128))


# Real deployments, as tpu-inference lays out one device's share of their KV cache (the per-device
# shapes follow from per_device_block_shape; the model dimensions are the models' own configs).
DEPLOYMENTS = {
    # gpt-oss-120b: 36 layers, 8 KV heads, head_dim 64, bf16, TP 8, block 16. tpu-inference enables
    # HMA by default and then shares one array between a sliding-window and a full-attention layer
    # (DESIGN.md, Integration facts): 18 arrays. ~144 KiB per device per chunk.
    "gpt-oss-120b-tp8": dict(layers=18, tp=8, num_kv_heads=8, head_dim=64, dtype="bfloat16", block_size=16),
    # Qwen3-Coder-480B-A35B fp8 KV, TP 16 (configs/qwen3-coder-480b-multihost): 62 layers, 8 KV
    # heads (replicated to 16), head_dim 128, block 16. ~496 KiB.
    "qwen3-coder-480b-fp8-tp16": dict(layers=62, tp=16, num_kv_heads=8, head_dim=128, dtype="float8_e4m3fn",
                                      block_size=16),
    # Llama-3.3-70B bf16, TP 8: 80 layers, 8 KV heads, head_dim 128, block 32. 1.25 MiB.
    "llama-70b-tp8": dict(layers=80, tp=8, num_kv_heads=8, head_dim=128, dtype="bfloat16", block_size=32),
    # DeepSeek-V3 (MLA) fp8 KV, block 64: 61 layers, latent 512 + rope 64 = 576, padded to 640. ~2.4 MiB.
    "deepseek-v3-mla-fp8": dict(layers=61, tp=8, num_kv_heads=1, head_dim=576, dtype="float8_e4m3fn",
                                block_size=64, use_mla=True),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--expect-platform", choices=("gpu", "cpu", "tpu"), required=True,
                   help="fail (exit 2) unless JAX's default backend is this platform")
    p.add_argument("--sizes-mib", type=float, nargs="+", default=[64, 512, 2048], help="bytes moved per step")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--block-size", type=int, default=64, help="tokens per block")
    p.add_argument("--kv-heads", type=int, default=8, help="KV heads on this device (K and V: 2x)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    p.add_argument("--layout", choices=("rpa", "4d"), default="rpa",
                   help="rpa: tpu-inference 5-D ragged-paged-attention cache; 4d: (blocks, block_size, heads, head_dim)")
    p.add_argument("--iters", type=int, default=7, help="timed iterations after one warm-up (>= 7)")
    p.add_argument("--verify-blocks", type=int, default=16, help="blocks compared after every load (0: all)")
    p.add_argument("--no-per-block", action="store_true", help="skip the per-block floor")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--devices", type=int, default=1,
                   help="tensor parallelism over this many devices of the host, as on a TPU host: a (1, N) mesh, "
                        "each device holding the layout's per-device share (KV heads sharded over 'model', an MLA "
                        "latent replicated); sizes, slots and GiB/s stay per device, every path moves N shares")
    p.add_argument("--transfer-buffer-mib", type=float, default=None,
                   help="the engine's transfer_buffer_bytes (default: the engine's default or the step "
                        "rounded up to a power of two of blocks, whichever is larger: no step is split "
                        "by the buffer, only by the engine's own piecing)")
    p.add_argument("--deployments", nargs="+", choices=sorted(DEPLOYMENTS), default=None,
                   help="measure these deployments' per-device layouts (tpu-inference's rules) instead of "
                        "--layers/--block-size/--kv-heads/--head-dim/--dtype/--layout")
    p.add_argument("--patterns", nargs="+", choices=("contiguous", "churned", "scattered"),
                   default=["contiguous", "churned"],
                   help="slot patterns: contiguous (a fresh store's one ascending run), churned (the real "
                        "scheduler's slots in steady state after LRU churn: tools/churn_slots.py), scattered "
                        "(random distinct slots)")
    p.add_argument("--pool-steps", type=int, default=8, help="host slots = this many steps' chunks")
    p.add_argument("--churn-file", metavar="[NAME=]PATH", nargs="+", default=None,
                   help="churned slot patterns written by tools/churn_slots.py (else simulated here, which "
                        "needs the scheduler's dependencies: numba, vLLM); several NAME=PATH files measure "
                        "each store's churned slots side by side in one run, as patterns churned-NAME")
    p.add_argument("--churn-seed", type=int, default=0)
    p.add_argument("--structure-steps", type=int, default=0, metavar="K",
                   help="also replay K steady-state churned steps (saves and loads, from --churn-file or "
                        "--write-churn-file): the distinct copy structures they meet and what a first call of "
                        "a new one costs")
    p.add_argument("--write-churn-file", metavar="PATH", default=None,
                   help="only simulate the churned patterns of these configs and steps (with the scheduler, "
                        "on the machine that has it) and write them for --churn-file; measures nothing")
    a = p.parse_args(argv)
    if a.pool_steps < 2:
        p.error("--pool-steps must be >= 2")
    for name in ("layers", "block_size", "kv_heads", "head_dim"):
        if getattr(a, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if a.devices < 1:
        p.error("--devices must be >= 1")
    if a.iters < 7:
        p.error("--iters must be >= 7 (medians of at least 7)")
    if a.verify_blocks < 0:
        p.error("--verify-blocks must be >= 0")
    if any(s <= 0 for s in a.sizes_mib):
        p.error("--sizes-mib must be positive")
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from tpuoffload.worker.transfer_engine import TransferEngine

    if args.write_churn_file:
        return write_churn_file(args)
    platform = jax.default_backend()
    dev = jax.devices()[0]
    print(f"platform {platform} | device {dev.device_kind} | jax {jax.__version__} | "
          f"{len(jax.devices())} device(s), using {args.devices}", flush=True)
    if platform != args.expect_platform:
        print(f"refusing to measure: JAX's platform is {platform!r}, --expect-platform is {args.expect_platform!r}",
              file=sys.stderr)
        return 2
    if args.devices > len(jax.devices()):
        print(f"--devices {args.devices}: this host has {len(jax.devices())}", file=sys.stderr)
        return 2

    configs = []  # (name, block shape of one device, dtype, layers, mla)
    if args.deployments:
        for name in args.deployments:
            d = dict(DEPLOYMENTS[name])
            layers = d.pop("layers")
            configs.append((name, per_device_block_shape(**d), d["dtype"], layers, d.get("use_mla", False)))
    else:
        dtype0 = jnp.dtype(args.dtype)
        packing = max(1, 4 // dtype0.itemsize)
        if args.layout == "rpa":
            if (2 * args.kv_heads) % packing:
                print(f"2*kv_heads ({2 * args.kv_heads}) must be a multiple of packing ({packing})", file=sys.stderr)
                return 2
            shape = (args.block_size, 2 * args.kv_heads // packing, packing, args.head_dim)
        else:
            shape = (args.block_size, 2 * args.kv_heads, args.head_dim)
        configs.append((f"{args.layout}-{args.layers}x{args.kv_heads}kv", shape, args.dtype, args.layers,
                        args.layout == "4d"))

    churn_data = {}  # pattern name (churned, churned-NAME) -> the churn file's patterns
    if "churned" in args.patterns:
        for spec in args.churn_file or [""]:
            name, _, path = spec.rpartition("=") if "=" in spec else ("", "", spec)
            data = {}
            if path and os.path.exists(path):
                with open(path) as f:
                    data = json.load(f)
            churn_data[f"churned-{name}" if name else "churned"] = data

    results = []
    failures = []
    t_start = time.perf_counter()
    for cfg_name, block_shape, dtype_name, num_layers, no_head_axis in configs:
        dtype = jnp.dtype(dtype_name)
        mesh = Mesh(np.array(jax.devices()[:args.devices]).reshape(1, args.devices), ("data", "model"))
        # tpu-inference's specs: P(BATCH, KV_CONTEXT, KV_HEAD); MLA P(BATCH, KV_CONTEXT).
        cache_spec = P("data", None) if no_head_axis else P("data", None, "model")
        cache_sharding = NamedSharding(mesh, cache_spec)
        # The whole cache's block: heads times the devices (each holds block_shape); an MLA latent whole.
        global_shape = tuple(block_shape) if no_head_axis else (
            block_shape[0], block_shape[1] * args.devices, *block_shape[2:])
        # Rows (n, layers, *block) sharded as the cache's blocks: each device moves its own share.
        rows_spec = P() if no_head_axis else P(None, None, None, "model")
        dev_sharding = NamedSharding(mesh, rows_spec)
        host_sharding = NamedSharding(mesh, rows_spec, memory_kind="pinned_host")
        layer_block_bytes = int(np.prod(block_shape)) * dtype.itemsize
        chunk_bytes = num_layers * layer_block_bytes  # one block, every layer
        out_shardings = tuple(cache_sharding for _ in range(num_layers))

        def gather(caches, ids):
            return jnp.stack([c[ids] for c in caches], axis=1)  # (n, layers, *block_shape)

        def scatter(caches, ids, rows, unique=False):
            return tuple(c.at[ids].set(rows[:, i], mode="drop", unique_indices=unique) for i, c in enumerate(caches))

        gather_jit = jax.jit(gather, out_shardings=dev_sharding)
        scatter_jit = jax.jit(scatter, donate_argnums=0, out_shardings=out_shardings)
        scatter_unique_jit = jax.jit(partial(scatter, unique=True), donate_argnums=0, out_shardings=out_shardings)
        zero_jit = jax.jit(lambda cs, ids: tuple(c.at[ids].set(jnp.zeros((), c.dtype)) for c in cs),
                           donate_argnums=0, out_shardings=out_shardings)
        pick_jit = jax.jit(lambda cs, ids: jnp.stack([c[ids] for c in cs], axis=1))

        def make_caches(num_blocks: int) -> list:
            shape = (num_blocks, *global_shape)
            caches = []
            for key in jax.random.split(jax.random.key(0), num_layers):
                if jnp.issubdtype(dtype, jnp.integer):
                    x = jax.random.randint(key, shape, -128, 128, jnp.int32).astype(dtype)
                else:  # finite values: a scatter may canonicalize NaN payloads, which is no transfer error
                    x = (jax.random.normal(key, shape, jnp.float32) * 4).astype(dtype)
                caches.append(jax.device_put(x, cache_sharding))
            return caches

        for size_mib in args.sizes_mib:
            n = int(size_mib * MIB) // chunk_bytes
            if n < 1:
                print(f"{size_mib} MiB holds no whole block of {chunk_bytes} bytes", file=sys.stderr)
                return 2
            row = run_config(args, cfg_name, block_shape, dtype, num_layers, n, chunk_bytes, size_mib, churn_data,
                             failures, jax=jax, jnp=jnp, np=np, dev_sharding=dev_sharding,
                             host_sharding=host_sharding, gather_jit=gather_jit, scatter_jit=scatter_jit,
                             scatter_unique_jit=scatter_unique_jit, zero_jit=zero_jit, pick_jit=pick_jit,
                             make_caches=make_caches, TransferEngine=TransferEngine, global_shape=global_shape)
            if row is None:
                return 2
            results.append(row)

    print(f"\nmedian of {args.iters} after warm-up; bytes verified on {args.verify_blocks or 'all'} blocks after "
          f"every load; {time.perf_counter() - t_start:.1f} s in all")
    print_details(results)
    print_summary(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"platform": platform, "device_kind": dev.device_kind, "jax": jax.__version__,
                       "devices": args.devices,
                       "argv": sys.argv if argv is None else list(argv), "iters": args.iters,
                       "verified": not failures, "failures": failures, "results": results}, f, indent=1)
    if failures:
        print(f"{len(failures)} check(s) FAILED", file=sys.stderr)
        return 1
    print("all bytes verified")
    return 0


def replay_structures(args, engine, caches, src, dst, churn: dict, jax, np) -> dict:
    """Replay the churn simulation's steady-state steps (``steps``, tools/churn_slots.py) through
    the engine: each step's save of its slots, then its load (at most a step's blocks), timed to
    completion. Counts the distinct copy structures the programs take (worker/copy_plan.py, with
    the engine's own costs and cap) and times the calls that met a structure not seen before (a
    compile) against those that did not. Bytes are not checked here (the loads name save ids the
    slots need not hold: placeholders, the same programs)."""
    steps = churn.get("steps", [])[:args.structure_steps]
    if len(steps) < args.structure_steps:
        print(f"churn record has {len(steps)} steps, fewer than --structure-steps {args.structure_steps}: "
              f"rewrite the churn file with --write-churn-file ... --structure-steps", file=sys.stderr)
    n = len(src)
    seen = {"save": set(), "load": set()}
    times = {"save_new": [], "save_seen": [], "load_new": [], "load_seen": []}
    ids = iter(range(1 << 40, 1 << 62))
    for st in steps:
        save_slots = np.asarray(st["save"][:n], np.int64)
        load_slots = np.asarray(st["load"][:n], np.int64)
        for op, slots in (("save", save_slots), ("load", load_slots)):
            if not len(slots):
                continue
            copies = engine.copy_plan(op, slots).copies
            new = copies not in seen[op]
            seen[op].add(copies)
            t0 = time.perf_counter()
            if op == "save":
                engine.save(caches, src[:len(slots)].tolist(), slots.tolist(), [next(ids) for _ in slots])
                engine.wait_idle(300)
            else:
                caches, _ = engine.load(caches, dst[:len(slots)].tolist(), slots.tolist(), [next(ids) for _ in slots])
                jax.block_until_ready(caches)
            times[f"{op}_{'new' if new else 'seen'}"].append(time.perf_counter() - t0)
        engine.finish_step()
        engine.drain_results()
    out = {"steps": len(steps), "caches": caches}
    for op in ("save", "load"):
        new, old = times[f"{op}_new"], times[f"{op}_seen"]
        out[op] = {"structures": len(seen[op]), "calls": len(new) + len(old),
                   "new_call_ms": [round(x * 1e3, 2) for x in new],
                   "seen_call_median_ms": round(statistics.median(old) * 1e3, 3) if old else None,
                   "structure_list": sorted("+".join(f"{w}x{c}" for w, c in s) for s in seen[op])}
        print(f"    structures over {len(steps)} churned steps: {op} {len(seen[op])} distinct in {out[op]['calls']} "
              f"calls; first call of a new one median {statistics.median(new) * 1e3 if new else 0:.1f} ms, max "
              f"{max(new, default=0) * 1e3:.1f}; a call of a structure seen before median "
              f"{out[op]['seen_call_median_ms']} ms", flush=True)
    return out


def config_chunks(args) -> list[tuple[str, int, int]]:
    """(config, chunk bytes, chunks per step) of every config and step the run would measure."""
    import numpy as np
    import jax.numpy as jnp

    out = []
    if args.deployments:
        for name in args.deployments:
            d = dict(DEPLOYMENTS[name])
            layers = d.pop("layers")
            chunk = layers * int(np.prod(per_device_block_shape(**d))) * jnp.dtype(d["dtype"]).itemsize
            out += [(name, chunk, int(s * MIB) // chunk) for s in args.sizes_mib]
    else:
        dt = jnp.dtype(args.dtype)
        chunk = args.layers * args.block_size * 2 * args.kv_heads * args.head_dim * dt.itemsize
        out += [("legacy", chunk, int(s * MIB) // chunk) for s in args.sizes_mib]
    return out


def write_churn_file(args) -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    import churn_slots  # noqa: E402

    data = {}
    if os.path.exists(args.write_churn_file):
        with open(args.write_churn_file) as f:
            data = json.load(f)
    for name, chunk, n in config_chunks(args):
        key = churn_slots.key(args.pool_steps * n, n, args.churn_seed)
        if key not in data or len(data[key].get("steps", ())) < args.structure_steps:
            data[key] = churn_slots.simulate(args.pool_steps * n, n, args.churn_seed, record_steps=args.structure_steps)
        r = data[key]
        print(f"{name}: {n} chunks of {chunk / 1024:g} KiB per step, {args.pool_steps * n} slots: steady after "
              f"{r['warmup_steps']} steps ({r['evicted_per_slot']:.1f} evictions per slot), mean run save "
              f"{r['save_mean_run']:.2f} load {r['load_mean_run']:.2f}", flush=True)
    with open(args.write_churn_file, "w") as f:
        json.dump(data, f)
    return 0


def churn_pattern(args, num_slots: int, n: int, churn_data: dict, label: str) -> dict | None:
    """The churned store's save and load slots for a step of ``n`` chunks in a store of
    ``num_slots`` (tools/churn_slots.py): from ``--churn-file`` when it holds them, else simulated
    here with the scheduler's own ChunkIndex (needs the scheduler's dependencies)."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    import churn_slots  # noqa: E402 (tools/ sibling)
    key = churn_slots.key(num_slots, n, args.churn_seed)
    if key in churn_data:
        return churn_data[key]
    try:
        r = churn_slots.simulate(num_slots, n, args.churn_seed)
    except ImportError as exc:
        print(f"{label}: no churned slots for {key} in --churn-file and no scheduler to simulate them ({exc}); "
              f"run tools/churn_slots.py first", file=sys.stderr)
        return None
    churn_data[key] = r
    return r


def run_config(args, cfg_name, block_shape, dtype, num_layers, n, chunk_bytes, size_mib, churn_data, failures, *,
               jax, jnp, np, dev_sharding, host_sharding, gather_jit, scatter_jit, scatter_unique_jit, zero_jit,
               pick_jit, make_caches, TransferEngine, global_shape) -> dict | None:
    """One layout and step size: raw, floor, the engine on each slot pattern, per-block; a row."""
    def median_ms(xs):
        return statistics.median(xs) * 1e3

    step_bytes = n * chunk_bytes
    gib = step_bytes / (1 << 30)
    label = f"{cfg_name} {step_bytes / MIB:g} MiB"
    rng = np.random.default_rng(int(size_mib * 1000))
    src = rng.permutation(n).astype(np.int32)  # saved from blocks 0..n-1, in shuffled order
    dst = (n + rng.permutation(n)).astype(np.int32)  # loaded into blocks n..2n-1
    num_slots = args.pool_steps * n
    # pattern -> (save slots, load slots): the load reads back what the save wrote when they are equal;
    # otherwise the load slots are first written (untimed) with the same source blocks.
    patterns = {}
    stats = {}
    for pat in args.patterns:
        if pat == "contiguous":  # a fresh store: SlotPool hands out 0, 1, 2, ... in one ascending run
            sl = np.arange(n, dtype=np.int32)
            patterns[pat] = (sl, sl)
        elif pat == "scattered":
            sl = rng.choice(num_slots, n, replace=False).astype(np.int32)
            patterns[pat] = (sl, sl)
        elif pat == "churned":
            for name, data in churn_data.items():  # one pattern per churn file (per store)
                r = churn_pattern(args, num_slots, n, data, label)
                if r is None:
                    return None
                patterns[name] = (np.asarray(r["save_slots"], np.int32), np.asarray(r["load_slots"], np.int32))
                stats[name] = {k: r[k] for k in ("warmup_steps", "evicted_per_slot", "save_mean_run",
                                                 "load_mean_run", "steady")}
    pos = np.arange(n) if args.verify_blocks == 0 or args.verify_blocks >= n else \
        np.unique(np.linspace(0, n - 1, args.verify_blocks).astype(np.int64))
    src_s, dst_s = src[pos], dst[pos]
    caches = make_caches(2 * n)
    expect = np.asarray(pick_jit(caches, src_s)).view(np.uint8)  # source blocks: never written
    settle_probe = np.zeros(8, np.int32)
    probe_sharding = jax.sharding.NamedSharding(dev_sharding.mesh, jax.sharding.PartitionSpec())
    # The floor: one device_put of a contiguous array of the step's bytes each way.
    flat_dev = jax.device_put(jnp.zeros((n, num_layers, *global_shape), dtype), dev_sharding)
    flat_dev.block_until_ready()

    times = {k: [] for k in ("raw_save", "raw_save_main", "raw_load", "raw_unique_load", "floor_save", "floor_load",
                             "pb_save", "pb_load", "settle")}
    for pat in patterns:
        for k in ("save", "load", "save_main", "save_main_warm", "load_main"):
            times[f"{pat}_{k}"] = []
    runs, moved, copies = {}, {}, {}

    def verify(path: str, cs) -> None:
        got = np.asarray(pick_jit(cs, dst_s)).view(np.uint8)
        if not np.array_equal(got, expect):
            bad = sorted({int(dst_s[i]) for i in range(len(pos)) if not np.array_equal(got[i], expect[i])})
            failures.append(f"{label} {path}: loaded blocks differ from the saved ones: {bad[:8]}")
            print(f"VERIFY FAILED: {failures[-1]}", file=sys.stderr, flush=True)
        # The check's device-to-host copy into numpy leaves the runtime work that the next small
        # host-to-device transfer pays for (measured on the H200: 4 ms after a 128 MiB check, 12
        # after 512 MiB, landing in whichever path is timed next, raw or engine). One tiny
        # transfer here takes it, outside every timed region; its time is reported.
        t0 = time.perf_counter()
        jax.device_put(settle_probe, probe_sharding).block_until_ready()
        times["settle"].append(time.perf_counter() - t0)

    def fresh_dst(cs):
        cs = zero_jit(tuple(cs), dst)
        jax.block_until_ready(cs)
        return cs

    print(f"--- {label}: {n} blocks x {num_layers} layers of {tuple(block_shape)} {dtype.name} "
          f"({chunk_bytes / 1024:g} KiB per block), {num_slots} slots, patterns {', '.join(patterns)}", flush=True)
    for pat, st in stats.items():
        print(f"    {pat}: steady state after {st['warmup_steps']} steps ({st['evicted_per_slot']:.1f} evictions "
              f"per slot); mean slot run save {st['save_mean_run']:.2f} load {st['load_mean_run']:.2f}", flush=True)

    buffer = int(args.transfer_buffer_mib * 2**20) if args.transfer_buffer_mib else \
        max(DEFAULT_BUFFER, (1 << (n - 1).bit_length()) * chunk_bytes)
    # The store and the transfer buffer hold every device's share (layout.device_bytes_per_chunk).
    engine = TransferEngine(caches, num_slots * chunk_bytes * args.devices, transfer_buffer_bytes=buffer * args.devices)
    next_id = iter(range(1, 1 << 62))

    def timed_save(pat: str, slots) -> tuple[list[int], float, float] | None:
        """One save of the step's blocks into ``slots``: (its save ids, main-thread seconds,
        seconds until every host slot was written); None if it never finished."""
        ids = [next(next_id) for _ in range(n)]
        t0 = time.perf_counter()
        engine.save(caches, src.tolist(), slots.tolist(), ids)
        t_main = time.perf_counter() - t0
        if not engine.wait_idle(300):
            failures.append(f"{label} engine {pat}: save did not finish in 300 s")
            return None
        return ids, t_main, time.perf_counter() - t0

    def engine_round(pat: str, record: bool) -> bool:
        """One save and one load through the public API with the slots of ``pat``; False if a
        save never finished."""
        nonlocal caches
        save_slots, load_slots = patterns[pat]
        first = timed_save(pat, save_slots)
        if first is None:
            return False
        _, t_main, t_save = first
        # The same save again, right after the first finished: its main-thread time with the CPU
        # caches warm (the first one's follows the previous byte check, which streamed the checked
        # blocks through them). Untimed otherwise; the load reads these saves.
        second = timed_save(pat, save_slots)
        if second is None:
            return False
        ids, t_main_warm, _ = second
        save_ops = engine.finish_step().ops  # the two timed saves' programs
        if load_slots is not save_slots:  # the load's slots hold the same source blocks (untimed)
            third = timed_save(pat, load_slots)
            if third is None:
                return False
            ids = third[0]
        bad_saves = [r for r in engine.drain_results() if not r.ok]
        if bad_saves:
            failures.append(f"{label} engine {pat}: {len(bad_saves)} saves failed")
        caches = fresh_dst(caches)
        t0 = time.perf_counter()
        caches, failed = engine.load(caches, dst.tolist(), load_slots.tolist(), ids)
        t_load_main = time.perf_counter() - t0
        jax.block_until_ready(caches)
        t_load = time.perf_counter() - t0
        if failed:
            failures.append(f"{label} engine {pat}: load reported {len(failed)} failed blocks")
        verify(f"engine {pat}", caches)
        saves = [op for op in save_ops if op.startswith("save ")]
        loads = [op for op in engine.finish_step().ops if op.startswith("load")]
        runs[pat] = {"save": sorted({int(m) for op in saves for m in re.findall(r"\brun=(\d+)", op)}),
                     "load": sorted({int(m) for op in loads for m in re.findall(r"\brun=(\d+)", op)})}
        # Copies one save's / one load's programs issued (logged per program), summed over groups.
        copies[pat] = {"save": sum(int(m) for op in saves for m in re.findall(r"\bcopies=(\d+)", op)) // 2,
                       "load": sum(int(m) for op in loads for m in re.findall(r"\bcopies=(\d+)", op)),
                       "save_structure": sorted({m for op in saves for m in re.findall(r"\bstructure=(\S+)", op)}),
                       "load_structure": sorted({m for op in loads for m in re.findall(r"\bstructure=(\S+)", op)})}
        # Rows one save's programs moved (padding included), from the logged ids shapes; two saves.
        moved[pat] = sum(int(m) for op in saves for m in re.findall(r"shape=\(3, (\d+)\)", op)) // (
            2 * len(engine.layout.groups))
        if record:
            times[f"{pat}_save"].append(t_save)
            times[f"{pat}_load"].append(t_load)
            times[f"{pat}_save_main"].append(t_main)
            times[f"{pat}_save_main_warm"].append(t_main_warm)
            times[f"{pat}_load_main"].append(t_load_main)
        return True

    structures = None
    try:
        for it in range(args.iters + 1):
            record = it > 0  # iteration 0 is the warm-up (compiles)
            # raw save / load
            t0 = time.perf_counter()
            pinned = jax.device_put(gather_jit(tuple(caches), src), host_sharding)
            t_main = time.perf_counter() - t0
            pinned.block_until_ready()
            t_save = time.perf_counter() - t0
            caches = fresh_dst(caches)
            t0 = time.perf_counter()
            caches = scatter_jit(tuple(caches), dst, jax.device_put(pinned, dev_sharding))
            jax.block_until_ready(caches)
            t_load = time.perf_counter() - t0
            verify("raw", caches)
            caches = fresh_dst(caches)
            t0 = time.perf_counter()
            caches = scatter_unique_jit(tuple(caches), dst, jax.device_put(pinned, dev_sharding))
            jax.block_until_ready(caches)
            t_load_unique = time.perf_counter() - t0
            del pinned
            verify("raw unique", caches)
            # floor: one contiguous device_put each way, same bytes
            t0 = time.perf_counter()
            flat_host = jax.device_put(flat_dev, host_sharding)
            flat_host.block_until_ready()
            t_fsave = time.perf_counter() - t0
            t0 = time.perf_counter()
            back = jax.device_put(flat_host, dev_sharding)
            back.block_until_ready()
            t_fload = time.perf_counter() - t0
            del back, flat_host
            if record:
                times["raw_save"].append(t_save)
                times["raw_save_main"].append(t_main)
                times["raw_load"].append(t_load)
                times["raw_unique_load"].append(t_load_unique)
                times["floor_save"].append(t_fsave)
                times["floor_load"].append(t_fload)

            # engine save / load through the public API, each slot pattern
            if not all(engine_round(pat, record) for pat in patterns):
                break
        if args.structure_steps and churn_data:
            first = next(iter(churn_data.values()))  # the first churn file's recorded steps
            structures = replay_structures(args, engine, caches, src, dst, churn_pattern(args, num_slots, n, first,
                                                                                      label), jax, np)
            caches = structures.pop("caches")
    finally:
        engine.close()

    if not args.no_per_block:
        one = np.zeros(1, np.int32)
        for it in range(args.iters + 1):
            t0 = time.perf_counter()
            pinned = [jax.device_put(gather_jit(tuple(caches), src[i:i + 1]), host_sharding) for i in range(n)]
            jax.block_until_ready(pinned)
            t_save = time.perf_counter() - t0
            caches = fresh_dst(caches)
            t0 = time.perf_counter()
            cs = tuple(caches)
            for i in range(n):
                one[0] = dst[i]
                cs = scatter_jit(cs, one.copy(), jax.device_put(pinned[i], dev_sharding))
            caches = list(cs)
            jax.block_until_ready(caches)
            t_load = time.perf_counter() - t0
            del pinned
            verify("per-block", caches)
            if it:
                times["pb_save"].append(t_save)
                times["pb_load"].append(t_load)

    med = {k: median_ms(v) if v else None for k, v in times.items()}
    row = {"config": cfg_name, "block_shape": list(block_shape), "dtype": dtype.name, "layers": num_layers,
           "step_mib": step_bytes / MIB, "blocks": n, "block_kib": chunk_bytes / 1024, "num_slots": num_slots,
           "churn": stats}
    paths = (("raw", "raw"), ("floor", "floor"), *((f"engine_{pat}", pat) for pat in patterns), ("per_block", "pb"))
    for path, key in paths:
        for op in ("save", "load"):
            ms = med[f"{key}_{op}"]
            row[f"{path}_{op}_ms"] = ms
            row[f"{path}_{op}_gibps"] = gib / (ms / 1e3) if ms else None
    row["raw_save_main_ms"] = med["raw_save_main"]
    row["raw_unique_load_ms"] = med["raw_unique_load"]
    row["raw_unique_load_gibps"] = gib / (med["raw_unique_load"] / 1e3) if med["raw_unique_load"] else None
    row["patterns"] = list(patterns)
    for pat in patterns:
        if med[f"{pat}_load"]:
            row[f"engine_{pat}_raw_unique_load_ratio"] = med["raw_unique_load"] / med[f"{pat}_load"]
        for op in ("save", "load"):
            if med[f"{pat}_{op}"]:
                row[f"engine_{pat}_raw_{op}_ratio"] = med[f"raw_{op}"] / med[f"{pat}_{op}"]
                row[f"engine_{pat}_floor_{op}_ratio"] = med[f"floor_{op}"] / med[f"{pat}_{op}"]
            row[f"engine_{pat}_{op}_main_ms"] = med[f"{pat}_{op}_main"]
        row[f"engine_{pat}_save_main_warm_ms"] = med[f"{pat}_save_main_warm"]
        row[f"engine_{pat}_runs"] = runs.get(pat, {})
        row[f"engine_{pat}_rows_moved"] = moved.get(pat)
        row[f"engine_{pat}_copies"] = copies.get(pat)
    row["structures"] = structures
    row["settle_after_check_ms"] = med["settle"]
    row["ids_ring_fallbacks"] = engine._ids.fallbacks
    row["samples_ms"] = {k: [round(x * 1e3, 4) for x in v] for k, v in times.items()}
    del caches, flat_dev
    return row


def fmt(x, spec):
    return format(x, spec) if x is not None else "-"


def print_details(results) -> None:
    header = (f"{'config':<26} {'step':>9} {'path':<17} {'save ms':>9} {'save GiB/s':>10} {'load ms':>9} "
              f"{'load GiB/s':>10} {'save main ms':>12} {'(warm)':>7} {'load main ms':>12}  runs (save/load) rows")
    print(header)
    for r in results:
        step = f"{r['step_mib']:g} MiB"
        for path in ("raw", "floor", *(f"engine_{p}" for p in r["patterns"]), "per_block"):
            if r.get(f"{path}_save_ms") is None:
                continue
            eng = path.startswith("engine")
            main_s = fmt(r[f"{path}_save_main_ms"], ".3f") if eng else (
                fmt(r["raw_save_main_ms"], ".3f") if path == "raw" else "")
            main_l = fmt(r[f"{path}_load_main_ms"], ".3f") if eng else ""
            main_w = fmt(r[f"{path}_save_main_warm_ms"], ".3f") if eng else ""
            run = ""
            if eng:
                rs = r[f"{path}_runs"]
                run = ",".join(map(str, rs.get("save", []))) + "/" + ",".join(map(str, rs.get("load", [])))
                if r[f"{path}_rows_moved"] is not None:
                    run += f"  {r[f'{path}_rows_moved']}/{r['blocks']}"
                cp = r.get(f"{path}_copies") or {}
                if cp:
                    run += f"  copies {cp.get('save')}/{cp.get('load')}"
            print(f"{r['config']:<26} {step:>9} {path:<17} {fmt(r[f'{path}_save_ms'], '.2f'):>9} "
                  f"{fmt(r[f'{path}_save_gibps'], '.2f'):>10} {fmt(r[f'{path}_load_ms'], '.2f'):>9} "
                  f"{fmt(r[f'{path}_load_gibps'], '.2f'):>10} {main_s:>12} {main_w:>7} {main_l:>12}  {run}")
        print(f"{r['config']:<26} {step:>9} {'raw_unique':<17} {'':>9} {'':>10} {fmt(r['raw_unique_load_ms'], '.2f'):>9} "
              f"{fmt(r['raw_unique_load_gibps'], '.2f'):>10}")
    print("settle after each byte check (untimed): " +
          ", ".join(f"{r['config']} {r['step_mib']:g} MiB {fmt(r['settle_after_check_ms'], '.3f')} ms" for r in results))


def summary_rows(results) -> list[dict]:
    """One line per layout, step and slot pattern: the goal's figures."""
    out = []
    for r in results:
        for pat in r["patterns"]:
            e = f"engine_{pat}"
            out.append({"config": r["config"], "chunk_kib": r["block_kib"], "step_mib": r["step_mib"], "slots": pat,
                        "save_raw": r.get(f"{e}_raw_save_ratio"), "load_raw": r.get(f"{e}_raw_load_ratio"),
                        "save_floor": r.get(f"{e}_floor_save_ratio"), "load_floor": r.get(f"{e}_floor_load_ratio"),
                        "save_main_ms": r.get(f"{e}_save_main_ms"), "raw_save_main_ms": r.get("raw_save_main_ms"),
                        "mean_run": (r["churn"][pat]["save_mean_run"], r["churn"][pat]["load_mean_run"])
                        if pat in r["churn"] else None})
    return out


def print_summary(results) -> None:
    print("\nsummary: engine as % of raw (gather + device_put) and of the floor (one contiguous device_put), "
          "save() main-thread ms (cold) against raw's own dispatch")
    print(f"{'config':<26} {'chunk KiB':>9} {'step MiB':>8} {'slots':<16} {'save%raw':>8} {'load%raw':>8} "
          f"{'save%floor':>10} {'load%floor':>10} {'save() ms':>9} {'raw disp':>8}  mean run s/l")
    for s in summary_rows(results):
        pct = lambda x: fmt(x * 100 if x is not None else None, ".1f")  # noqa: E731
        mr = f"{s['mean_run'][0]:.2f}/{s['mean_run'][1]:.2f}" if s["mean_run"] else ""
        print(f"{s['config']:<26} {s['chunk_kib']:>9.0f} {s['step_mib']:>8g} {s['slots']:<16} {pct(s['save_raw']):>8} "
              f"{pct(s['load_raw']):>8} {pct(s['save_floor']):>10} {pct(s['load_floor']):>10} "
              f"{fmt(s['save_main_ms'], '.3f'):>9} {fmt(s['raw_save_main_ms'], '.3f'):>8}  {mr}")


if __name__ == "__main__":
    sys.exit(main())
