#!/usr/bin/env python
"""Probes for issue 9's fixed per-call costs (developer tool), in one process on the platform JAX has
(--expect-platform, never a silent fallback), 32 layers of (64, 8, 2, 128) bf16 blocks (8 MiB chunks).

  dispatch  (--save-blocks): main-thread and total ms of engine.save (tools/profile_dispatch.py
            splits the main-thread time into the engine's own steps).
  load      (--load-blocks): the raw load (device_put of a pinned array + donating scatter) against
            engine.load with other read programs (written out / fori_loops) and with the load as
            one program or as reads-then-scatter, interleaved; main-thread and total ms, % of raw.
            The slots are a random permutation: one copy per slot (see ``runs`` for slot runs).
  runs      (--run-blocks): slot runs (worker/programs.py) with slots 0..n-1: one device_put of a
            pinned array, the engine's read program alone with each width of copy, and engine
            loads and saves with the width capped at each value; main-thread and total ms, GiB/s.

    python tools/probe_overhead.py --expect-platform gpu --save-blocks 64 8 --load-blocks 8 64 256
    python tools/probe_overhead.py --expect-platform gpu --only runs --run-blocks 8 32 64 256 --iters 11
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

BLOCK = (64, 8, 2, 128)


def ms(xs) -> str:
    return f"{statistics.median(xs) * 1e3:8.3f}"


def timed(fn, iters, *, ready=None, before=None, warm=1):
    """(main-thread seconds, seconds until ``ready(result)`` is ready) per call."""
    main, total = [], []
    for _ in range(iters + warm):
        if before:
            before()
        t0 = time.perf_counter()
        out = fn()
        t1 = time.perf_counter()
        jax.block_until_ready(ready(out) if ready else out)
        t2 = time.perf_counter()
        main.append(t1 - t0)
        total.append(t2 - t0)
    return main[warm:], total[warm:]


def make_caches(n, layers, sh):
    shape = (n, *BLOCK)
    return [jax.jit(lambda i=i: (jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape) % 251 + i)
                    .astype(jnp.bfloat16), out_shardings=sh)() for i in range(layers)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--expect-platform", required=True)
    ap.add_argument("--save-blocks", type=int, nargs="+", default=[64])
    ap.add_argument("--load-blocks", type=int, nargs="+", default=[8])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--run-blocks", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--only", nargs="*", default=["dispatch", "load"])
    a = ap.parse_args()
    if jax.default_backend() != a.expect_platform:
        print(f"platform is {jax.default_backend()}, expected {a.expect_platform}", file=sys.stderr)
        return 2
    from tpuoffload.worker import programs as pm
    from tpuoffload.worker.transfer_engine import TransferEngine

    print(f"platform {jax.default_backend()} | {jax.devices()[0].device_kind} | jax {jax.__version__}", flush=True)
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    sh = NamedSharding(mesh, P("data", None, "model"))
    chunk = a.layers * int(np.prod(BLOCK)) * 2

    host = "pinned_host"
    for n in (a.save_blocks if "dispatch" in a.only else ()):
        caches = make_caches(2 * n, a.layers, sh)
        eng = TransferEngine(caches, n * chunk, transfer_buffer_bytes=1 << 40)
        src = list(range(n))
        ids_iter = iter(range(1, 1 << 40))
        print(f"--- save of {n} chunks ({n * chunk >> 20} MiB), ms: main / total")
        m, t = timed(lambda: eng.save(caches, src, src, [next(ids_iter) for _ in src]), a.iters,
                     ready=lambda _: eng.wait_idle())
        print(f"  engine.save                 {ms(m)} {ms(t)}")
        print(f"    ids ring fallbacks: {eng._ids.fallbacks}")
        eng.close()
        del caches, eng

    for n in (a.load_blocks if "load" in a.only else ()):
        caches = make_caches(2 * n, a.layers, sh)
        eng = TransferEngine(caches, n * chunk, transfer_buffer_bytes=1 << 40)
        rng = np.random.default_rng(0)
        src = rng.permutation(n).tolist()
        dst = (n + rng.permutation(n)).tolist()
        slots = rng.permutation(n).tolist()
        eng.save(caches, src, slots, list(range(1, n + 1)))
        eng.wait_idle()
        dev_sh = NamedSharding(mesh, P())
        host_sh = NamedSharding(mesh, P(), memory_kind=host)
        out_sh = tuple(sh for _ in caches)
        gather = jax.jit(lambda cs, ids: jnp.stack([c[ids] for c in cs], axis=1), out_shardings=dev_sh)
        scatter = jax.jit(lambda cs, ids, rows: tuple(c.at[ids].set(rows[:, i], mode="drop") for i, c in enumerate(cs)),
                          donate_argnums=0, out_shardings=out_sh)
        pinned = jax.device_put(gather(tuple(caches), np.array(src, np.int32)), host_sh)
        dst_np = np.array(dst, np.int32)
        state = {"caches": caches}

        def raw():
            state["caches"] = scatter(tuple(state["caches"]), dst_np, jax.device_put(pinned, dev_sh))
            return state["caches"]

        progs = {}
        saved = (pm.LOAD_STATIC_MAX, pm.LOAD_UNROLL)
        for static, unroll in ((256, 16), (0, 4)):
            pm.LOAD_STATIC_MAX, pm.LOAD_UNROLL = static, unroll
            progs[static, unroll] = pm.GroupPrograms(eng._programs[0].group, host, eng.backend.num_slots)
        pm.LOAD_STATIC_MAX, pm.LOAD_UNROLL = saved

        def engine(key, split=False):
            def go():
                eng._programs[0] = progs[key]
                eng._reads_first = lambda *a: split
                state["caches"], failed = eng.load(state["caches"], dst, slots, list(range(1, n + 1)))
                assert not failed
                return state["caches"]
            return go

        variants = {"raw": raw}
        for key in progs:
            variants[f"engine {'static' if key[0] else 'loops'} unroll {key[1]:2d}"] = engine(key)
            variants[f"split {'static' if key[0] else 'loops'} unroll {key[1]:2d}"] = engine(key, True)
        res = {k: ([], []) for k in variants}
        for it in range(a.iters + 2):
            for name, fn in variants.items():
                m, t = timed(fn, 1, warm=0)
                if it > 1:
                    res[name][0].extend(m)
                    res[name][1].extend(t)
        print(f"--- load of {n} chunks ({n * chunk >> 20} MiB), ms: main / total / GiB/s / of raw")
        raw_t = statistics.median(res["raw"][1])
        for name, (m, t) in res.items():
            print(f"  {name:32s} {ms(m)} {ms(t)} {n * chunk / 2**30 / statistics.median(t):6.2f} "
                  f"{raw_t / statistics.median(t):6.1%}")
        eng.close()
        del caches, eng, state

    for n in (a.run_blocks if "runs" in a.only else ()):
        probe_runs(n, a, sh, chunk)
    return 0


def probe_runs(n, a, sh, chunk) -> None:
    """Slot runs at ``n`` chunks: what each width of copy costs (see the module docstring)."""
    from tpuoffload.worker import transfer_engine as te
    from tpuoffload.worker.programs import load_plan_ids

    caches = make_caches(2 * n, a.layers, sh)
    eng = te.TransferEngine(caches, n * chunk, transfer_buffer_bytes=1 << 40)
    src, dst = list(range(n)), list(range(n, 2 * n))
    state = {"caches": caches, "ids": list(range(1, n + 1))}
    eng.save(caches, src, src, state["ids"])
    eng.wait_idle()
    mesh = sh.mesh
    pinned = jax.device_put(jnp.zeros((n, chunk // 2), jnp.bfloat16), NamedSharding(mesh, P(), memory_kind="pinned_host"))
    prog = eng._programs[0]
    ids = eng._ids._transfer(load_plan_ids(dst, src, [1] * n, 2 * n, n))
    widths = [1 << k for k in range(n.bit_length()) if 1 << k <= n]
    exact = te.slot_run
    next_id = iter(range(n + 1, 1 << 40))

    def capped(cap):
        te.slot_run = lambda slots, padded: min(exact(slots, padded), cap)

    def load(cap):
        capped(cap)
        state["caches"], failed = eng.load(state["caches"], dst, src, state["ids"])
        assert not failed
        return state["caches"]

    def save(cap):
        capped(cap)
        state["ids"] = [next(next_id) for _ in src]
        eng.save(state["caches"], src, src, state["ids"])
        eng.wait_idle()
        assert all(r.ok for r in eng.drain_results())

    variants = {"device_put of a pinned array": lambda: jax.device_put(pinned, NamedSharding(mesh, P()))}
    for w in widths:
        variants[f"read program, {w} per copy"] = lambda w=w: prog.read(eng._stores[0], ids, run=w)[0]
    for w in widths:
        variants[f"engine.load, width <= {w}"] = lambda w=w: load(w)
    for w in widths:
        variants[f"engine.save, width <= {w}"] = lambda w=w: save(w)
    res = {k: ([], []) for k in variants}
    try:
        for it in range(a.iters + 2):
            for name, fn in variants.items():
                m, t = timed(fn, 1, warm=0, before=lambda: jax.block_until_ready(state["caches"]))
                if it > 1:
                    res[name][0].extend(m)
                    res[name][1].extend(t)
    finally:
        te.slot_run = exact
        eng.close()
    print(f"--- slot runs, {n} chunks ({n * chunk >> 20} MiB), ms: main / total / GiB/s")
    for name, (m, t) in res.items():
        print(f"  {name:32s} {ms(m)} {ms(t)} {n * chunk / 2**30 / statistics.median(t):6.2f}")


if __name__ == "__main__":
    sys.exit(main())
