"""Where the engine's main thread spends its time dispatching a save and a load (developer tool).

Runs the engine on the platform JAX has (--expect-platform, never a silent fallback) with the
benchmark's default cache (32 layers of (64, 8, 2, 128) bf16 blocks, 8 MiB per chunk) and prints,
per step size, the median over --iters calls of each part of ``save`` and ``load`` on the calling
thread, and the time until the load's caches are ready. ``--fresh-caches`` hands every call new
cache arrays (as a serving runner does after each model step), so the layout check runs each time.

    python tools/profile_dispatch.py --expect-platform gpu
    python tools/profile_dispatch.py --expect-platform gpu --blocks 8 64 --fresh-caches
    python tools/profile_dispatch.py --expect-platform gpu --blocks 64 --slots scattered

``--slots``: ``contiguous`` (0..n-1 in order: one copy per part) or ``scattered`` (a fixed random
permutation of them: one copy per slot); see worker/programs.py on slot runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

SAVE_PARTS = ("_check_caches", "_check_plan")
LOAD_PARTS = ("_check_caches", "_check_plan", "_wait_for_writes", "_unusable")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--expect-platform", required=True)
    p.add_argument("--blocks", type=int, nargs="+", default=[64], help="chunks per call (8 MiB each by default)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--iters", type=int, default=9)
    p.add_argument("--fresh-caches", action="store_true", help="new cache arrays before every call")
    p.add_argument("--slots", choices=("contiguous", "scattered"), default="contiguous")
    args = p.parse_args()
    if jax.default_backend() != args.expect_platform:
        print(f"platform is {jax.default_backend()}, expected {args.expect_platform}", file=sys.stderr)
        return 2
    from tpuoffload.worker import transfer_engine as te
    from tpuoffload.worker.programs import load_plan_ids, save_plan_ids, slot_run

    print(f"platform {jax.default_backend()} | device {jax.devices()[0].device_kind} | jax {jax.__version__}")
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    sh = NamedSharding(mesh, PartitionSpec("data", None, "model"))
    renew = jax.jit(lambda cs: cs, donate_argnums=0)  # same buffers, new arrays
    for blocks in args.blocks:
        shape = (blocks * 2, 64, 8, 2, 128)
        caches = [jax.jit(lambda: jnp.ones(shape, jnp.bfloat16), out_shardings=sh)() for _ in range(args.layers)]
        eng = te.TransferEngine(caches, blocks * eng_bytes(caches), transfer_buffer_bytes=1 << 40)
        parts: dict[str, list[float]] = {}
        for name in sorted(set(SAVE_PARTS + LOAD_PARTS)):
            fn = getattr(eng, name)

            def timed(*a, _fn=fn, _name=name, **k):
                t0 = time.perf_counter()
                out = _fn(*a, **k)
                parts.setdefault(f"{op[0]} {_name}", []).append(time.perf_counter() - t0)
                return out
            setattr(eng, name, timed)
        prog = eng._programs[0]
        compiled = {kind: getattr(prog, kind) for kind in ("save", "load")}
        for kind in ("save", "load", "read", "scatter"):
            fn = getattr(prog, kind)

            def timed_prog(*a, _fn=fn, _kind=kind, **k):
                t0 = time.perf_counter()
                out = _fn(*a, **k)
                parts.setdefault(f"{_kind} program dispatch", []).append(time.perf_counter() - t0)
                return out
            setattr(prog, kind, timed_prog)
        src, dst = list(range(blocks)), list(range(blocks, 2 * blocks))
        slots = src if args.slots == "contiguous" else np.random.default_rng(0).permutation(blocks).tolist()
        op = ["save"]
        for it in range(args.iters + 1):
            ids = list(range(it * 10 * blocks, it * 10 * blocks + blocks))
            if args.fresh_caches:
                caches = list(renew(caches))
            jax.block_until_ready((eng._stores, caches))
            op[0] = "save"
            t0 = time.perf_counter()
            eng.save(caches, src, slots, ids)
            parts.setdefault("save() total", []).append(time.perf_counter() - t0)
            eng.wait_idle()
            if args.fresh_caches:
                caches = list(renew(caches))
            jax.block_until_ready((eng._stores, caches))
            op[0] = "load"
            t0 = time.perf_counter()
            caches, failed = eng.load(caches, dst, slots, ids)
            parts.setdefault("load() total", []).append(time.perf_counter() - t0)
            jax.block_until_ready(caches)
            parts.setdefault("load() until ready", []).append(time.perf_counter() - t0)
            assert not failed
        mem = []
        run = slot_run(slots, len(slots))
        for kind, plan in (("save", save_plan_ids(src, slots, blocks, run)),
                           ("load", load_plan_ids(dst, slots, [1] * blocks, 2 * blocks, blocks, run))):
            lowered = compiled[kind].lower(tuple(caches), eng._stores[0], eng._ids.put(plan)[0],
                                           run=min(run, prog.part_rows(kind, plan.shape[1])))
            stats = lowered.compile().memory_analysis()
            if stats is not None:
                mem.append(f"{kind}: device temp {stats.temp_size_in_bytes / 2**20:.1f} MiB, "
                           f"host temp {stats.host_temp_size_in_bytes / 2**20:.1f} MiB")
        eng.close()
        print(f"--- {blocks} chunks of {eng_bytes(caches) / 2**20:g} MiB, {args.layers} layers, {args.slots} slots"
              f"{', fresh cache arrays every call' if args.fresh_caches else ''}: median of {args.iters} (ms)")
        for name in sorted(parts, key=lambda k: (k.split()[0].rstrip("()"), "total" in k or "ready" in k, k)):
            print(f"  {name:28s} {statistics.median(parts[name][1:]) * 1e3:8.3f}")
        print("  compiled: " + "; ".join(mem))
    return 0


def eng_bytes(caches) -> int:
    from tpuoffload.layout import CacheLayout

    return CacheLayout.from_caches(caches).device_bytes_per_chunk


if __name__ == "__main__":
    sys.exit(main())
