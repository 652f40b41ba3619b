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
             tools/probe_save_latency.py splits that time and compares it with the raw path's own
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
    p.add_argument("--transfer-buffer-mib", type=float, default=None,
                   help="the engine's transfer_buffer_bytes (default: the engine's default or the step "
                        "rounded up to a power of two of blocks, whichever is larger: no step is split "
                        "by the buffer, only by the engine's own piecing)")
    a = p.parse_args(argv)
    for name in ("layers", "block_size", "kv_heads", "head_dim"):
        if getattr(a, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
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

    platform = jax.default_backend()
    dev = jax.devices()[0]
    print(f"platform {platform} | device {dev.device_kind} | jax {jax.__version__} | "
          f"{len(jax.devices())} device(s), using 1", flush=True)
    if platform != args.expect_platform:
        print(f"refusing to measure: JAX's platform is {platform!r}, --expect-platform is {args.expect_platform!r}",
              file=sys.stderr)
        return 2

    dtype = jnp.dtype(args.dtype)
    packing = max(1, 4 // dtype.itemsize)
    if args.layout == "rpa":
        if (2 * args.kv_heads) % packing:
            print(f"2*kv_heads ({2 * args.kv_heads}) must be a multiple of packing ({packing})", file=sys.stderr)
            return 2
        block_shape = (args.block_size, 2 * args.kv_heads // packing, packing, args.head_dim)
        mesh = Mesh(np.array([dev]).reshape(1, 1), ("data", "model"))
        cache_spec = P("data", None, "model")
    else:
        block_shape = (args.block_size, 2 * args.kv_heads, args.head_dim)
        mesh = Mesh(np.array([dev]), ("model",))
        cache_spec = P(None, None, "model")
    cache_sharding = NamedSharding(mesh, cache_spec)
    dev_sharding = NamedSharding(mesh, P())
    host_sharding = NamedSharding(mesh, P(), memory_kind="pinned_host")
    layer_block_bytes = int(np.prod(block_shape)) * dtype.itemsize
    chunk_bytes = args.layers * layer_block_bytes  # one block, every layer
    out_shardings = tuple(cache_sharding for _ in range(args.layers))

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
        shape = (num_blocks, *block_shape)
        caches = []
        for key in jax.random.split(jax.random.key(0), args.layers):
            if jnp.issubdtype(dtype, jnp.integer):
                x = jax.random.randint(key, shape, -128, 128, jnp.int32).astype(dtype)
            else:  # finite values: a scatter may canonicalize NaN payloads, which is no transfer error
                x = (jax.random.normal(key, shape, jnp.float32) * 4).astype(dtype)
            caches.append(jax.device_put(x, cache_sharding))
        return caches

    def median_ms(xs):
        return statistics.median(xs) * 1e3

    results = []
    failures = []
    t_start = time.perf_counter()
    for size_mib in args.sizes_mib:
        n = int(size_mib * MIB) // chunk_bytes
        if n < 1:
            print(f"{size_mib} MiB holds no whole block of {chunk_bytes} bytes", file=sys.stderr)
            return 2
        step_bytes = n * chunk_bytes
        gib = step_bytes / (1 << 30)
        label = f"{step_bytes / MIB:g} MiB"
        rng = np.random.default_rng(int(size_mib * 1000))
        src = rng.permutation(n).astype(np.int32)  # saved from blocks 0..n-1, in shuffled order
        dst = (n + rng.permutation(n)).astype(np.int32)  # loaded into blocks n..2n-1
        patterns = {"contiguous": np.arange(n, 2 * n, dtype=np.int32),
                    "scattered": rng.choice(2 * n, n, replace=False).astype(np.int32)}
        pos = np.arange(n) if args.verify_blocks == 0 or args.verify_blocks >= n else \
            np.unique(np.linspace(0, n - 1, args.verify_blocks).astype(np.int64))
        src_s, dst_s = src[pos], dst[pos]
        caches = make_caches(2 * n)
        expect = np.asarray(pick_jit(caches, src_s)).view(np.uint8)  # source blocks: never written

        settle_probe = np.zeros(8, np.int32)

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
            jax.device_put(settle_probe, dev_sharding).block_until_ready()
            times["settle"].append(time.perf_counter() - t0)

        def fresh_dst(cs):
            cs = zero_jit(tuple(cs), dst)
            jax.block_until_ready(cs)
            return cs

        times = {k: [] for k in ("raw_save", "raw_load", "raw_unique_load", "pb_save", "pb_load", "settle")}
        for pat in patterns:
            for k in ("save", "load", "save_main", "save_main_warm", "load_main"):
                times[f"{pat}_{k}"] = []
        runs, moved = {}, {}
        print(f"--- {label}: {n} blocks x {args.layers} layers of {block_shape} {args.dtype} "
              f"({chunk_bytes / MIB:g} MiB per block), layout {args.layout}", flush=True)

        buffer = int(args.transfer_buffer_mib * 2**20) if args.transfer_buffer_mib else \
            max(DEFAULT_BUFFER, (1 << (n - 1).bit_length()) * chunk_bytes)
        engine = TransferEngine(caches, 2 * n * chunk_bytes, transfer_buffer_bytes=buffer)
        next_id = iter(range(1, 1 << 62))

        def timed_save(pat: str) -> tuple[list[int], float, float] | None:
            """One save of the step's blocks into the slots of ``pat``: (its save ids, main-thread
            seconds, seconds until every host slot was written); None if it never finished."""
            ids = [next(next_id) for _ in range(n)]
            t0 = time.perf_counter()
            engine.save(caches, src.tolist(), patterns[pat].tolist(), ids)
            t_main = time.perf_counter() - t0
            if not engine.wait_idle(300):
                failures.append(f"{label} engine {pat}: save did not finish in 300 s")
                return None
            return ids, t_main, time.perf_counter() - t0

        def engine_round(pat: str, record: bool) -> bool:
            """One save and one load through the public API with the slots of ``pat``; False if the
            save never finished."""
            nonlocal caches
            slots = patterns[pat]
            first = timed_save(pat)
            if first is None:
                return False
            _, t_main, t_save = first
            # The same save again, right after the first finished: its main-thread time with the
            # CPU caches warm (the first one's follows the previous byte check, which streamed the
            # checked blocks through them). Untimed otherwise; the load reads these saves.
            second = timed_save(pat)
            if second is None:
                return False
            ids, t_main_warm, _ = second
            drain = getattr(engine, "drain_results", None)
            if drain is not None:
                bad_saves = [r for r in drain() if not r.ok]
                if bad_saves:
                    failures.append(f"{label} engine {pat}: {len(bad_saves)} saves failed")
            caches = fresh_dst(caches)
            t0 = time.perf_counter()
            caches, failed = engine.load(caches, dst.tolist(), slots.tolist(), ids)
            t_load_main = time.perf_counter() - t0
            jax.block_until_ready(caches)
            t_load = time.perf_counter() - t0
            if failed:
                failures.append(f"{label} engine {pat}: load reported {len(failed)} failed blocks")
            verify(f"engine {pat}", caches)
            if hasattr(engine, "finish_step"):
                ops = engine.finish_step().ops
                runs[pat] = sorted({int(m) for op in ops for m in re.findall(r"\brun=(\d+)", op)})
                # Rows one save's programs moved (padding included), from the logged ids shapes;
                # the round dispatched two saves of the plan.
                moved[pat] = sum(int(m) for op in ops if op.startswith("save ")
                                 for m in re.findall(r"shape=\(3, (\d+)\)", op)) // (2 * len(engine.layout.groups))
            if record:
                times[f"{pat}_save"].append(t_save)
                times[f"{pat}_load"].append(t_load)
                times[f"{pat}_save_main"].append(t_main)
                times[f"{pat}_save_main_warm"].append(t_main_warm)
                times[f"{pat}_load_main"].append(t_load_main)
            return True

        try:
            for it in range(args.iters + 1):
                record = it > 0  # iteration 0 is the warm-up (compiles)
                # raw save / load
                t0 = time.perf_counter()
                pinned = jax.device_put(gather_jit(tuple(caches), src), host_sharding)
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
                if record:
                    times["raw_save"].append(t_save)
                    times["raw_load"].append(t_load)
                    times["raw_unique_load"].append(t_load_unique)

                # engine save / load through the public API, each slot pattern
                if not all(engine_round(pat, record) for pat in patterns):
                    break
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
        row = {"step_mib": step_bytes / MIB, "blocks": n, "block_mib": chunk_bytes / MIB}
        paths = (("raw", "raw"), *((f"engine_{pat}", pat) for pat in patterns), ("per_block", "pb"))
        for path, key in paths:
            for op in ("save", "load"):
                ms = med[f"{key}_{op}"]
                row[f"{path}_{op}_ms"] = ms
                row[f"{path}_{op}_gibps"] = gib / (ms / 1e3) if ms else None
        row["raw_unique_load_ms"] = med["raw_unique_load"]
        row["raw_unique_load_gibps"] = gib / (med["raw_unique_load"] / 1e3)
        for pat in patterns:
            if med[f"{pat}_load"]:
                row[f"engine_{pat}_raw_unique_load_ratio"] = med["raw_unique_load"] / med[f"{pat}_load"]
            for op in ("save", "load"):
                if med[f"{pat}_{op}"]:
                    row[f"engine_{pat}_raw_{op}_ratio"] = med[f"raw_{op}"] / med[f"{pat}_{op}"]
                row[f"engine_{pat}_{op}_main_ms"] = med[f"{pat}_{op}_main"]
            row[f"engine_{pat}_save_main_warm_ms"] = med[f"{pat}_save_main_warm"]
            row[f"engine_{pat}_runs"] = runs.get(pat, [])
            row[f"engine_{pat}_rows_moved"] = moved.get(pat)
        row["settle_after_check_ms"] = med["settle"]
        row["ids_ring_fallbacks"] = engine._ids.fallbacks
        row["samples_ms"] = {k: [round(x * 1e3, 4) for x in v] for k, v in times.items()}
        results.append(row)
        del caches

    def fmt(x, spec):
        return format(x, spec) if x is not None else "-"

    print(f"\nmedian of {args.iters} after warm-up; bytes verified on {args.verify_blocks or 'all'} blocks after "
          f"every load; {time.perf_counter() - t_start:.1f} s in all")
    header = (f"{'step':>9} {'path':<17} {'save ms':>9} {'save GiB/s':>10} {'load ms':>9} {'load GiB/s':>10} "
              f"{'save main ms':>12} {'(warm)':>7} {'load main ms':>12}  run  rows")
    print(header)
    for r in results:
        step = f"{r['step_mib']:g} MiB"
        for path in ("raw", "engine_contiguous", "engine_scattered", "per_block"):
            if r[f"{path}_save_ms"] is None:
                continue
            eng = path.startswith("engine")
            main_s = fmt(r[f"{path}_save_main_ms"], ".3f") if eng else ""
            main_l = fmt(r[f"{path}_load_main_ms"], ".3f") if eng else ""
            main_w = fmt(r[f"{path}_save_main_warm_ms"], ".3f") if eng else ""
            run = ",".join(map(str, r[f"{path}_runs"])) if eng else ""
            if eng and r[f"{path}_rows_moved"] is not None:
                run += f"  {r[f'{path}_rows_moved']}/{r['blocks']}"
            print(f"{step:>9} {path:<17} {fmt(r[f'{path}_save_ms'], '.2f'):>9} {fmt(r[f'{path}_save_gibps'], '.2f'):>10} "
                  f"{fmt(r[f'{path}_load_ms'], '.2f'):>9} {fmt(r[f'{path}_load_gibps'], '.2f'):>10} {main_s:>12} "
                  f"{main_w:>7} {main_l:>12}  {run}")
        print(f"{step:>9} {'raw_unique':<17} {'':>9} {'':>10} {fmt(r['raw_unique_load_ms'], '.2f'):>9} "
              f"{fmt(r['raw_unique_load_gibps'], '.2f'):>10}")
        for pat in ("contiguous", "scattered"):
            print(f"{step:>9} {pat[:10] + '/raw':<17} {'':>9} {fmt(r.get(f'engine_{pat}_raw_save_ratio'), '.1%'):>10} "
                  f"{'':>9} {fmt(r.get(f'engine_{pat}_raw_load_ratio'), '.1%'):>10}  "
                  f"(load / raw_unique {fmt(r.get(f'engine_{pat}_raw_unique_load_ratio'), '.1%')})")
    print("settle after each byte check (untimed): " +
          ", ".join(f"{r['step_mib']:g} MiB {fmt(r['settle_after_check_ms'], '.3f')} ms" for r in results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"platform": platform, "device_kind": dev.device_kind, "jax": jax.__version__,
                       "layout": args.layout, "dtype": args.dtype, "layers": args.layers,
                       "block_shape": list(block_shape), "iters": args.iters, "verified": not failures,
                       "failures": failures, "results": results}, f, indent=1)
    if failures:
        print(f"{len(failures)} check(s) FAILED", file=sys.stderr)
        return 1
    print("all bytes verified")
    return 0


if __name__ == "__main__":
    sys.exit(main())
