#!/usr/bin/env python
"""Probes for issue 9's fixed per-call costs (developer tool): what a save's dispatch and a small
load pay beyond the raw path, one candidate at a time, in one process on the platform JAX has.

  dispatch  (--save-blocks chunks of 8 MiB): main-thread ms of engine.save; of building and
            transferring the ids; of the save program called through jax.jit, through its AOT
            Compiled object, with the GPU busy; of trivial programs with the same 34 arguments;
            of the save program built with other unroll / part settings (dispatch and total ms).
  load      (--load-blocks chunks): raw load (device_put of a pinned array + donating scatter)
            against engine.load and the load program alone (prebuilt ids), main-thread and total
            ms, interleaved; load program variants (reads in loops, other unrolls).

    python tools/probe_overhead.py --expect-platform gpu
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import weakref

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


def save_stamped(eng, pm, kv, block_ids, slots, save_ids, marks):
    """engine.save's steps (one piece, one group) with a clock reading after each."""
    t = [time.perf_counter()]
    eng._check_owner()
    eng._check_caches(kv)
    eng._check_plan(block_ids, slots, save_ids, unique="slots")
    t.append(time.perf_counter())
    block_ids, slots, save_ids = [int(b) for b in block_ids], [int(s) for s in slots], [int(s) for s in save_ids]
    t.append(time.perf_counter())
    ids_np = pm.save_plan_ids(block_ids, slots, eng.max_chunks_per_transfer)
    t.append(time.perf_counter())
    ids = eng._put_ids(ids_np)
    t.append(time.perf_counter())
    bt, st = str(block_ids), str(slots)
    t.append(time.perf_counter())
    prog = eng._programs[0]
    eng._stores[0], token = prog.save(eng._group_caches(kv, prog.group), eng._stores[0], ids)
    t.append(time.perf_counter())
    eng.log.record("save", shape=ids.shape, group=0, blocks=bt, slots=st)
    t.append(time.perf_counter())
    previous = {eng._last_write[s] for s in slots if s in eng._last_write}
    fut = eng._pool.submit(eng._complete_save, [token], block_ids, slots, save_ids, previous)
    t.append(time.perf_counter())
    with eng._lock:
        eng._inflight[fut] = (time.monotonic(), len(slots), 0)
    fut.add_done_callback(eng._forget_inflight)
    for s in slots:
        eng._last_write[s] = fut
    t.append(time.perf_counter())
    names = ("checks", "int lists", "plan ids", "put ids", "str", "program", "log", "submit", "bookkeeping")
    for name, a, b in zip(names, t, t[1:]):
        marks.setdefault(name, []).append(b - a)


def load_stamped(eng, pm, kv, block_ids, slots, save_ids, marks):
    t = [time.perf_counter()]
    eng._check_owner()
    eng._check_caches(kv)
    eng._check_plan(block_ids, slots, save_ids, unique="block_ids")
    t.append(time.perf_counter())
    n = len(block_ids)
    block_ids, slots = [int(b) for b in block_ids], [int(s) for s in slots]
    failed = eng._wait_for_writes(slots)
    t.append(time.perf_counter())
    failed |= eng._unusable(block_ids, slots, save_ids)
    t.append(time.perf_counter())
    valid = [0 if i in failed else 1 for i in range(n)]
    ids_np = pm.load_plan_ids(block_ids, slots, valid, eng.num_blocks, eng.max_chunks_per_transfer)
    t.append(time.perf_counter())
    ids = eng._put_ids(ids_np)
    t.append(time.perf_counter())
    bt, st = str(block_ids), str(slots)
    prog = eng._programs[0]
    out = prog.load(eng._group_caches(kv, prog.group), eng._stores[0], ids)
    t.append(time.perf_counter())
    eng.log.record("load", shape=ids.shape, group=0, blocks=bt, slots=st)
    new = list(out)
    eng._known_caches = tuple(map(weakref.ref, new))
    with eng._lock:
        eng.counters["x"] += n
    t.append(time.perf_counter())
    names = ("checks", "wait writes", "unusable", "plan ids", "put ids", "program", "after")
    for name, a, b in zip(names, t, t[1:]):
        marks.setdefault(name, []).append(b - a)
    return new


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--expect-platform", required=True)
    ap.add_argument("--save-blocks", type=int, nargs="+", default=[64])
    ap.add_argument("--load-blocks", type=int, nargs="+", default=[8])
    ap.add_argument("--why-blocks", type=int, nargs="+", default=[64, 8])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--iters", type=int, default=15)
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
        ids_np = pm.save_plan_ids(src, src, n)
        for kind in (None, host):
            eng._ids_sharding = NamedSharding(mesh, P(), memory_kind=kind)
            m, t = timed(lambda: eng.save(caches, src, src, [next(ids_iter) for _ in src]), a.iters,
                         ready=lambda _: eng.wait_idle())
            print(f"  engine.save, ids {str(kind):12s} {ms(m)} {ms(t)}")
            marks = {}
            for _ in range(a.iters):
                save_stamped(eng, pm, caches, src, src, [next(ids_iter) for _ in src], marks)
                eng.wait_idle()
            print("    stamps: " + ", ".join(f"{k} {statistics.median(v) * 1e3:.3f}" for k, v in marks.items()))
            for name, fn in (("callback", lambda: eng._put_ids(ids_np)),
                             ("device_put", lambda: jax.device_put(ids_np, eng._ids_sharding))):
                m, t = timed(fn, a.iters)
                print(f"    put ids by {name:16s} {ms(m)} {ms(t)}")
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
        for static, unroll in ((256, 16), (0, 2), (0, 4), (0, 8)):
            pm.LOAD_STATIC_MAX, pm.LOAD_UNROLL = static, unroll
            progs[static, unroll] = pm.GroupPrograms(eng._programs[0].group, host, eng.backend.num_slots)
        pm.LOAD_STATIC_MAX, pm.LOAD_UNROLL = saved

        def engine(kind, key):
            def go():
                eng._ids_sharding = NamedSharding(mesh, P(), memory_kind=kind)
                eng._programs[0] = progs[key]
                state["caches"], failed = eng.load(state["caches"], dst, slots, list(range(1, n + 1)))
                assert not failed
                return state["caches"]
            return go

        variants = {"raw": raw}
        for kind in (None, host):
            for key in progs:
                variants[f"ids {str(kind):11s} {'static' if key[0] else 'loops'} unroll {key[1]:2d}"] = engine(kind, key)
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
    for n in (a.why_blocks if "why" in a.only else ()):
        caches = make_caches(2 * n, a.layers, sh)
        eng = TransferEngine(caches, n * chunk, transfer_buffer_bytes=1 << 40)
        prog = eng._programs[0]
        src = list(range(n))
        ids_np = pm.save_plan_ids(src, src, n)
        cs = tuple(caches)
        state = {"store": eng._stores[0]}
        keep = []

        def disp(make, pre=None):
            def go():
                ids = make()
                if pre:
                    pre(ids)
                t0 = time.perf_counter()
                state["store"], tok = prog.save(cs, state["store"], ids)
                keep.append(ids)
                return time.perf_counter() - t0, tok
            return go
        print(f"--- why: save program dispatch, {n} chunks, ms (main of the program call alone)")
        fixed = eng._put_ids(ids_np)
        for name, make, pre in (("prebuilt ids", lambda: fixed, None),
                                ("fresh ids, waited ready", lambda: eng._put_ids(ids_np), jax.block_until_ready),
                                ("fresh ids", lambda: eng._put_ids(ids_np), None)):
            d = []
            for _ in range(a.iters + 1):
                dt, tok = disp(make, pre)()
                tok.block_until_ready()
                d.append(dt)
            print(f"  {name:30s} {ms(d[1:])}")
        tok_sh = NamedSharding(mesh, P())
        set_ids = jax.jit(lambda buf, new: new + 0 * buf, donate_argnums=0, out_shardings=tok_sh)
        buf = {"ids": eng._put_ids(ids_np)}
        d, e = [], []
        for _ in range(a.iters + 1):
            fresh = eng._put_ids(ids_np)
            t0 = time.perf_counter()
            buf["ids"] = set_ids(buf["ids"], fresh)
            t1 = time.perf_counter()
            state["store"], tok = prog.save(cs, state["store"], buf["ids"])
            t2 = time.perf_counter()
            tok.block_until_ready()
            d.append(t1 - t0)
            e.append(t2 - t1)
        print(f"  stable ids buffer: set {ms(d[1:])}, program {ms(e[1:])}")
        eng._stores[0] = state["store"]
        # GPU time of a load: queue known busy work first, so the dispatch ends before the load's GPU work starts.
        x = jnp.ones((8192, 8192) if a.expect_platform == "gpu" else (64, 64), jnp.bfloat16)
        busy = jax.jit(lambda x: jax.lax.fori_loop(0, 10, lambda i, y: (y @ x) * 0.001, x))
        busy(x).block_until_ready()
        _, b = timed(lambda: busy(x), a.iters)
        eng.save(caches, src, src, list(range(1, n + 1)))
        eng.wait_idle()
        dst = list(range(n, 2 * n))
        dev_sh = NamedSharding(mesh, P())
        host_sh = NamedSharding(mesh, P(), memory_kind="pinned_host")
        gather = jax.jit(lambda cs, ids: jnp.stack([c[ids] for c in cs], axis=1), out_shardings=dev_sh)
        scatter = jax.jit(lambda cs, ids, rows: tuple(c.at[ids].set(rows[:, i], mode="drop") for i, c in enumerate(cs)),
                          donate_argnums=0, out_shardings=tuple(sh for _ in caches))
        pinned = jax.device_put(gather(cs, np.array(src, np.int32)), host_sh)
        dst_np = np.array(dst, np.int32)
        st = {"caches": caches}
        del cs

        def raw():
            st["caches"] = scatter(tuple(st["caches"]), dst_np, jax.device_put(pinned, dev_sh))
            return st["caches"]

        def engine():
            st["caches"], failed = eng.load(st["caches"], dst, src, list(range(1, n + 1)))
            return st["caches"]
        print(f"--- why: load of {n} chunks, ms: main / total alone; total after {statistics.median(b) * 1e3:.2f} ms "
              f"of queued GPU work, minus it")
        for name, fn in (("raw", raw), ("engine", engine)):
            m, t = timed(fn, a.iters)
            _, tb = timed(fn, a.iters, before=lambda: busy(x))
            print(f"  {name:10s} {ms(m)} {ms(t)} {statistics.median(tb) * 1e3 - statistics.median(b) * 1e3:8.3f}")
        eng.close()
        del caches, eng, st
    return 0


if __name__ == "__main__":
    sys.exit(main())
