#!/usr/bin/env python
"""Save/load throughput of the TransferEngine against the naive per-block path, on CPU JAX.

The batched path is the engine: one jitted gather + one device-to-host transfer per save, one
host-to-device transfer + one jitted scatter per load. The naive path is the one the seed PR
replaced: per block, ``np.asarray(cache[l][b])`` for every layer on save, and one
``device_put`` (plus a per-block update) per block on load.

    python tools/bench_roundtrip.py                      # defaults: runs in well under a minute
    python tools/bench_roundtrip.py --dtype bfloat16 --blocks 256 --devices 8

On CPU both "device" and "host" are host RAM, so the numbers measure dispatch overhead and
copies, not PCIe; the ratio is the interesting part.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--blocks", type=int, default=64, help="blocks moved per save/load call")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block")
    p.add_argument("--heads", type=int, default=8, help="KV heads (sharded over --devices)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--devices", type=int, default=4, help="CPU devices (heads are sharded over them)")
    p.add_argument("--iters", type=int, default=5, help="timed iterations (after one warm-up)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = p.parse_args(argv)
    for name in ("layers", "blocks", "block_size", "heads", "head_dim", "devices", "iters"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.heads % args.devices:
        p.error(f"--heads ({args.heads}) must be divisible by --devices ({args.devices})")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    # Before jax is imported: the CPU device count.
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={args.devices}"])
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from tpuoffload.worker.transfer_engine import TransferEngine

    if len(jax.devices()) < args.devices:
        print(f"only {len(jax.devices())} devices available, asked for {args.devices}", file=sys.stderr)
        return 2
    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    mesh = Mesh(np.array(jax.devices()[: args.devices]), ("model",))
    sharding = NamedSharding(mesh, PartitionSpec(None, None, "model", None))
    chunk_sharding = NamedSharding(mesh, PartitionSpec(None, None, "model", None))  # (L, bs, heads, hd)
    n = args.blocks
    num_blocks = 2 * n  # save from the first half, load into the second half
    shape = (num_blocks, args.block_size, args.heads, args.head_dim)
    rng = np.random.default_rng(0)
    t_start = time.perf_counter()

    def make_caches(seed):
        r = np.random.default_rng(seed)
        return [jax.device_put(jnp.asarray(r.standard_normal(shape, dtype=np.float32), dtype), sharding)
                for _ in range(args.layers)]

    caches = make_caches(1)
    chunk_bytes = args.layers * args.block_size * args.heads * args.head_dim * jnp.dtype(dtype).itemsize
    total_bytes = n * chunk_bytes
    engine = TransferEngine(caches, 2 * n * chunk_bytes)
    src_blocks = list(rng.permutation(n)[:n].astype(int))
    dst_blocks = [n + b for b in range(n)]
    slots = list(range(n))
    next_id = iter(range(1 << 62))

    def same(a, b):
        return a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))

    # ---------------- batched path (the engine) ----------------
    def engine_save():
        ids = [next(next_id) for _ in range(n)]
        engine.save(caches, src_blocks, slots, ids)
        assert engine.wait_idle(120), "save did not finish"
        results = engine.drain_results()
        assert all(r.ok for r in results) and len(results) == n, results
        engine.finish_step()
        return ids

    def engine_load(ids):
        nonlocal caches
        caches, failed = engine.load(caches, dst_blocks, slots, ids)
        jax.block_until_ready(caches)
        assert failed == [], failed
        engine.finish_step()

    # ---------------- naive path (per block) ----------------
    def naive_save(out):
        for i, b in enumerate(src_blocks):
            for layer in range(args.layers):
                out[i, layer] = np.asarray(caches[layer][b])

    def _set_block(cs, rows, b):
        return tuple(c.at[b].set(rows[layer]) for layer, c in enumerate(cs))

    set_block = jax.jit(_set_block, donate_argnums=0, out_shardings=tuple(c.sharding for c in caches))

    def naive_load(buf):
        nonlocal caches
        cs = tuple(caches)
        for i, b in enumerate(dst_blocks):
            rows = jax.device_put(buf[i], chunk_sharding)  # one device_put per block
            cs = set_block(cs, rows, np.int32(b))
        caches = list(cs)
        jax.block_until_ready(caches)

    def timed(fn, *a):
        t0 = time.perf_counter()
        r = fn(*a)
        return time.perf_counter() - t0, r

    # Warm-up (compiles) and a one-time byte check of both paths.
    before = [np.asarray(c) for c in caches]
    ids = engine_save()
    engine_load(ids)
    after = [np.asarray(c) for c in caches]
    for layer in range(args.layers):
        if not same(after[layer][dst_blocks], before[layer][src_blocks]):
            print("VERIFY FAILED: engine round trip changed bytes", file=sys.stderr)
            return 1
    caches = make_caches(2)
    before = [np.asarray(c) for c in caches]
    buf = np.empty((n, args.layers, args.block_size, args.heads, args.head_dim), before[0].dtype)
    naive_save(buf)
    naive_load(buf)
    after = [np.asarray(c) for c in caches]
    for layer in range(args.layers):
        if not same(after[layer][dst_blocks], before[layer][src_blocks]):
            print("VERIFY FAILED: naive round trip changed bytes", file=sys.stderr)
            return 1

    times = {k: [] for k in ("engine_save", "engine_load", "naive_save", "naive_load")}
    for _ in range(args.iters):
        dt, ids = timed(engine_save)
        times["engine_save"].append(dt)
        dt, _ = timed(engine_load, ids)
        times["engine_load"].append(dt)
        dt, _ = timed(naive_save, buf)
        times["naive_save"].append(dt)
        dt, _ = timed(naive_load, buf)
        times["naive_load"].append(dt)
    engine.close()

    gib = total_bytes / (1 << 30)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"jax {jax.__version__} on {args.devices} CPU devices; {args.layers} layers x {n} blocks of "
          f"({args.block_size}, {args.heads}, {args.head_dim}) {args.dtype}: "
          f"{total_bytes / (1 << 20):.1f} MiB per call, median of {args.iters} after warm-up; bytes verified "
          f"({time.perf_counter() - t_start:.1f} s in all)")
    print(f"{'op':<6} {'path':<28} {'ms/call':>9} {'GiB/s':>8}")
    for op in ("save", "load"):
        for path, label in (("engine", "engine (one batched call)"), ("naive", "naive (per block)")):
            t = med[f"{path}_{op}"]
            print(f"{op:<6} {label:<28} {t * 1e3:9.2f} {gib / t:8.2f}")
        print(f"{op:<6} {'speed-up engine/naive':<28} {'':>9} {med[f'naive_{op}'] / med[f'engine_{op}']:7.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
