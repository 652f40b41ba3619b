#!/usr/bin/env python
"""Where a save's time goes, main thread and after (developer tool for issue 9).

On the platform JAX has (--expect-platform, never a silent fallback), 32 layers of (64, 8, 2, 128)
bf16 blocks (8 MiB chunks), slots in one ascending run, per step size (--blocks), medians of
--iters, interleaved so that drift hits every path alike:

  raw        the raw save: jitted gather (dispatch), device_put to pinned_host (dispatch), until ready.
  program    the engine's save program alone (ids already in the ring): dispatch, until its token is ready.
  trivial    a jit taking the same arguments (32 caches, the store, the ids) that only reads the ids:
             JAX's per-call cost for these arguments plus one tiny launch.
  engine     ``save()`` split into its steps (each wrapped with a timer; ``other`` is what the wrappers
             do not cover), then: main thread blocks on the save's tokens (``token``), then
             ``wait_idle()`` (``idle``: the background completion's handoff), and the background
             thread's own finish time (``bg done``); and a plain ``save()`` + ``wait_idle()``.
  cold       the same engine save right after a numpy pass over --cold-mib (CPU caches cold).
  (That is --only split, the default.)

  --only programs: the save program alone against variants (ids already on the device; rows moved
             to a fresh host array instead of into the store) and the raw path, until ready.
  --only compare: this tree's engine against an earlier one, imported as --baseline-package (a copy
             of its ``tpuoffload`` directory under another name, its ``tpuoffload`` imports renamed),
             interleaved with raw saves, cold and warm (``compare``).
  --only jit: JAX's own cost of one jitted call against the number of cache arrays it takes.

    python tools/probe_save_latency.py --expect-platform gpu --blocks 8 64 --iters 15
    python tools/probe_save_latency.py --expect-platform gpu --only jit
    git archive <commit> tpuoffload | tar x -C base && mv base/tpuoffload base/tpuoffload_base && \
      sed -i -E 's/(from|import) tpuoffload([. ])/\1 tpuoffload_base\2/g' $(find base -name '*.py')
    PYTHONPATH=.:base python tools/probe_save_latency.py --expect-platform gpu --only compare \
      --baseline-package tpuoffload_base --iters 41
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

BLOCK = (64, 8, 2, 128)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--expect-platform", required=True)
    ap.add_argument("--blocks", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--cold-mib", type=int, default=128)
    ap.add_argument("--only", choices=("split", "programs", "compare", "jit"), default="split")
    ap.add_argument("--baseline-package", default=None,
                    help="compare: a copy of an earlier tpuoffload under this name (imports renamed)")
    a = ap.parse_args()
    if jax.default_backend() != a.expect_platform:
        print(f"platform is {jax.default_backend()}, expected {a.expect_platform}", file=sys.stderr)
        return 2
    from tpuoffload.worker import transfer_engine as te

    dev = jax.devices()[0]
    print(f"platform {jax.default_backend()} | device {dev.device_kind} | jax {jax.__version__}", flush=True)
    mesh = Mesh(np.array([dev]).reshape(1, 1), ("data", "model"))
    sh = NamedSharding(mesh, P("data", None, "model"))
    host = NamedSharding(mesh, P(), memory_kind="pinned_host")
    devsh = NamedSharding(mesh, P())
    gather = jax.jit(lambda cs, ids: jnp.stack([c[ids] for c in cs], axis=1), out_shardings=devsh)
    scratch = np.ones(a.cold_mib << 18, np.float32)
    if a.only == "jit":
        probe_jit(a, sh, scratch)
        return 0
    for n in a.blocks:
        caches = [jax.jit(lambda: jnp.ones((2 * n, *BLOCK), jnp.bfloat16), out_shardings=sh)()
                  for _ in range(a.layers)]
        chunk = a.layers * int(np.prod(BLOCK)) * 2
        eng = te.TransferEngine(caches, 2 * n * chunk, transfer_buffer_bytes=1 << 40)
        src, slots = list(range(n)), list(range(n, 2 * n))
        src_dev = jax.device_put(np.array(src, np.int32), devsh)
        prog = eng._programs[0]
        trivial = jax.jit(lambda cs, store, ids: ids[0, 0] + 0)
        t: dict[str, list[float]] = defaultdict(list)
        if a.only != "compare":
            wrap_engine(eng, te, t)
        next_id = iter(range(1, 1 << 62))

        def ids_for():
            return [next(next_id) for _ in range(n)]

        def raw():
            t0 = time.perf_counter()
            g = gather(tuple(caches), src_dev)
            t1 = time.perf_counter()
            p = jax.device_put(g, host)
            t2 = time.perf_counter()
            p.block_until_ready()
            t3 = time.perf_counter()
            return {"raw gather dispatch": t1 - t0, "raw put dispatch": t2 - t1, "raw total": t3 - t0}

        def program():
            cap = eng.max_chunks_per_transfer
            run = te.slot_run(slots, te.bucket(n, cap))
            ids, entry = eng._ids.put(te.save_plan_ids(src, slots, cap, run))
            r = min(run, prog.part_rows("save", ids.shape[1]))
            t0 = time.perf_counter()
            eng._stores[0], tok = prog.save(tuple(caches), eng._stores[0], ids, run=r)
            t1 = time.perf_counter()
            tok.block_until_ready()
            t2 = time.perf_counter()
            eng._ids.read_by(entry, [tok])
            t0b = time.perf_counter()
            out = trivial(tuple(caches), eng._stores[0], ids)
            t1b = time.perf_counter()
            out.block_until_ready()
            return {"program dispatch": t1 - t0, "program total": t2 - t0, "trivial dispatch": t1b - t0b}

        def engine_split():
            t["_tokens"] = []
            t0 = time.perf_counter()
            eng.save(caches, src, slots, ids_for())
            t1 = time.perf_counter()
            jax.block_until_ready(t["_tokens"])
            t2 = time.perf_counter()
            eng.wait_idle()
            t3 = time.perf_counter()
            return {"_split": t["_split"][0], "engine save()": t1 - t0, "engine token ready": t2 - t0, "engine idle": t3 - t0,
                    "engine bg done": t["_bg_done"][-1] - t0}

        def engine_plain(cold=False):
            if cold:
                scratch.sum()
            t0 = time.perf_counter()
            eng.save(caches, src, slots, ids_for())
            t1 = time.perf_counter()
            eng.wait_idle()
            t2 = time.perf_counter()
            key = "cold" if cold else "plain"
            return {f"{key} save()": t1 - t0, f"{key} total": t2 - t0}

        res: dict[str, list[float]] = defaultdict(list)
        if a.only == "compare":
            compare(a, n, chunk, caches, src, slots, raw, scratch, res)
        if a.only == "programs":
            probe_programs(eng, te, caches, src, slots, raw, a.iters, res)
        for it in range(a.iters + 2 if a.only == "split" else 0):
            rows = {}
            for fn in (raw, program, engine_split, engine_plain, lambda: engine_plain(True)):
                jax.block_until_ready(eng._stores)
                rows.update(fn())
            # the split engine call's steps (the last engine_split call's wrappers)
            if it >= 2:
                for k, v in rows.items():
                    if k != "_split":
                        res[k].append(v)
                for k, v in rows["_split"].items():
                    res["  " + k].append(v)
        eng.close()
        print(f"--- {n} chunks ({n * chunk >> 20} MiB), median of {a.iters} (ms)")
        for k, v in res.items():
            if k.endswith("per iteration"):
                print(f"  {k:28s} {statistics.median(v):8.1%}   (min {min(v):.1%}, max {max(v):.1%})")
            else:
                print(f"  {k:28s} {statistics.median(v) * 1e3:8.3f}   (min {min(v) * 1e3:.3f}, max {max(v) * 1e3:.3f})")
    return 0


def probe_jit(a, sh, scratch) -> None:
    """JAX's own cost of calling a jitted function that only reads a small ids array, against how
    many cache arrays it also takes (as a save program takes every layer): warm (called in a tight
    loop) and cold (right after a numpy pass over --cold-mib), as ``jax.jit`` and as the compiled
    executable ``.lower(...).compile()`` returns."""
    ids = jax.device_put(np.ones((3, 64), np.int32), jax.sharding.NamedSharding(sh.mesh, P()))
    for k in (1, 2, 8, 32, 64):
        cs = tuple(jax.jit(lambda: jnp.ones((16, *BLOCK), jnp.bfloat16), out_shardings=sh)() for _ in range(k))
        f = jax.jit(lambda cs, ids, run=1: ids[0, 0] + run, static_argnames="run")
        compiled = f.lower(cs, ids, run=2).compile()
        for name, call in (("jit", lambda: f(cs, ids, run=2)), ("compiled", lambda: compiled(cs, ids))):
            warm, cold = [], []
            for it in range(a.iters * 4 + 5):
                if it % 4 == 0:
                    scratch.sum()
                t0 = time.perf_counter()
                out = call()
                dt = time.perf_counter() - t0
                out.block_until_ready()
                if it >= 5:
                    (cold if it % 4 == 0 else warm).append(dt)
            print(f"  {k:3d} arrays, {name:8s}: warm {statistics.median(warm) * 1e3:.3f} ms, "
                  f"cold {statistics.median(cold) * 1e3:.3f} ms", flush=True)


def compare(a, n, chunk, caches, src, slots, raw, scratch, res) -> None:
    """Saves of this tree's engine against --baseline-package's, interleaved with raw saves (their
    order rotating every iteration): each right after a numpy pass over --cold-mib (cold CPU caches,
    as the benchmark's byte check leaves them), then once more right after (warm)."""
    import importlib
    from tpuoffload.worker import transfer_engine as te

    engines = {"new": te.TransferEngine(caches, 2 * n * chunk, transfer_buffer_bytes=1 << 40)}
    if a.baseline_package:
        base = importlib.import_module(a.baseline_package + ".worker.transfer_engine")
        engines["base"] = base.TransferEngine(caches, 2 * n * chunk, transfer_buffer_bytes=1 << 40)
    next_id = iter(range(1, 1 << 62))

    def engine_save(eng):
        t0 = time.perf_counter()
        eng.save(caches, src, slots, [next(next_id) for _ in range(n)])
        t1 = time.perf_counter()
        eng.wait_idle()
        return t1 - t0, time.perf_counter() - t0

    def raw_save():
        r = raw()
        return r["raw gather dispatch"] + r["raw put dispatch"], r["raw total"]

    paths = {"raw": raw_save, **{name: (lambda e=e: engine_save(e)) for name, e in engines.items()}}
    names = list(paths)
    for it in range(a.iters + 2):
        order = names[it % len(names):] + names[:it % len(names)]
        for name in order:
            for e in engines.values():
                jax.block_until_ready(e._stores)
            scratch.sum()
            cold = paths[name]()
            warm = paths[name]()
            if it >= 2:
                for label, (main, total) in (("cold", cold), ("warm", warm)):
                    res[f"{name} {label}: main"].append(main)
                    res[f"{name} {label}: total"].append(total)
        for e in engines.values():
            e.finish_step()
            e.drain_results()
    for e in engines.values():
        e.close()
    for label in ("cold", "warm"):
        for name in names[1:]:
            ratio = [r / e for r, e in zip(res[f"raw {label}: total"], res[f"{name} {label}: total"])]
            res[f"{name} {label}: raw/engine per iteration"] = ratio


def probe_programs(eng, te, caches, src, slots, raw, iters, res) -> None:
    """The save program against variants of it, each until ready (dispatch included)."""
    from tpuoffload.worker.programs import DEVICE, HOST, _token
    prog = eng._programs[0]
    n = len(slots)
    cap = eng.max_chunks_per_transfer
    run = te.slot_run(slots, te.bucket(n, cap))
    plan = te.save_plan_ids(src, slots, cap, run)
    r = min(run, prog.part_rows("save", plan.shape[1]))
    devsh = jax.sharding.NamedSharding(prog.device_sharding.mesh, P())
    ids_dev = jax.device_put(plan, devsh)

    def save_dev_ids(cs, store, ids, run=1):  # the ids already on the device: no copy at the start
        step = prog.part_rows("save", ids.shape[1])
        for lo in range(0, ids.shape[1], step):
            store = prog._write_rows(store, prog._gather(ids[0, lo:lo + step], cs), ids, lo, run)
        return store, _token(ids)

    def to_new_host(cs, ids):  # gather + move to a fresh host array (no update of the store)
        ids = jax.device_put(ids, DEVICE)
        return jax.device_put(prog._gather(ids[0], cs), HOST), _token(ids)

    tok_sh = jax.sharding.NamedSharding(prog.device_sharding.mesh, P())
    v_dev = jax.jit(save_dev_ids, donate_argnums=1, static_argnames="run", out_shardings=(prog.store_sharding, tok_sh))
    v_new = jax.jit(to_new_host, out_shardings=(prog.store_sharding, tok_sh))
    gather_only = jax.jit(lambda cs, ids: prog._gather(ids[0], cs), out_shardings=prog.device_sharding)
    host_sh = prog.store_sharding

    def timed(fn):
        t0 = time.perf_counter()
        out = fn()
        t1 = time.perf_counter()
        jax.block_until_ready(out)
        return t1 - t0, time.perf_counter() - t0

    def program():
        ids, entry = eng._ids.put(plan)
        out = [None]

        def go():
            eng._stores[0], tok = prog.save(tuple(caches), eng._stores[0], ids, run=r)
            out[0] = tok
            return tok
        d, tot = timed(go)
        eng._ids.read_by(entry, [out[0]])
        return d, tot

    def dev_ids():
        def go():
            eng._stores[0], tok = v_dev(tuple(caches), eng._stores[0], ids_dev, run=r)
            return tok
        return timed(go)

    def new_host():
        ids, entry = eng._ids.put(plan)
        d, tot = timed(lambda: v_new(tuple(caches), ids))
        return d, tot

    def engine_gather_put():
        return timed(lambda: jax.device_put(gather_only(tuple(caches), ids_dev), host_sh))

    variants = {"save program": program, "save program, ids on device": dev_ids,
                "gather + to new host array (1 jit)": new_host, "engine gather jit + device_put": engine_gather_put}
    for it in range(iters + 2):
        row = {"raw total": raw()["raw total"]}
        for name, fn in variants.items():
            jax.block_until_ready(eng._stores)
            d, tot = fn()
            row[name + ": dispatch"], row[name + ": total"] = d, tot
        if it >= 2:
            for k, v in row.items():
                res[k].append(v)


def wrap_engine(eng, te, t) -> None:
    """Time each step of ``save`` on the main thread; keep the tokens and the background finish time."""
    split: dict[str, float] = {}
    t["_split"] = []
    t["_bg_done"] = [0.0]

    def timer(name, fn):
        def inner(*args, **kw):
            t0 = time.perf_counter()
            out = fn(*args, **kw)
            split[name] = split.get(name, 0.0) + time.perf_counter() - t0
            return out
        return inner

    for name in ("_check_owner", "_check_caches", "_check_plan", "_pieces", "_complete_in_background"):
        setattr(eng, name, timer(name, getattr(eng, name)))
    for name in ("slot_run", "save_plan_ids"):
        setattr(te, name, timer(name, getattr(te, name)))
    eng._ids.put = timer("ids.put", eng._ids.put)
    eng._ids.read_by = timer("ids.read_by", eng._ids.read_by)
    eng.log.record = timer("log.record", eng.log.record)
    for p in eng._programs:
        p.save = timer("program dispatch (in save)", p.save)
    save, complete = eng.save, eng._complete_in_background
    finish = eng._complete_save

    def timed_save(*args, **kw):
        split.clear()
        t0 = time.perf_counter()
        save(*args, **kw)
        total = time.perf_counter() - t0
        out = dict(split)
        out["other"] = total - sum(v for k, v in split.items())
        t["_split"] = [out]

    def keep_tokens(tokens, *args, **kw):
        t["_tokens"] = tokens
        return complete(tokens, *args, **kw)

    def timed_finish(*args, **kw):
        finish(*args, **kw)
        t["_bg_done"].append(time.perf_counter())

    eng.save, eng._complete_in_background, eng._complete_save = timed_save, keep_tokens, timed_finish


if __name__ == "__main__":
    sys.exit(main())
