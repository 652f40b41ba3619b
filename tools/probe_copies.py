#!/usr/bin/env python
"""Developer probe (H200): what a save or load program's copies cost, apart from the engine's Python.

For one deployment layout and step (tools/bench_transfer.py's DEPLOYMENTS), on one device:

  structures  the save program and the load program (worker/programs.py) alone, dispatched on
              ids already in pinned host memory, timed until their token is ready, for copy
              structures of the same rows in copies of several widths (``--widths``): the time
              per copy, apart from the bytes. The first call of each is its compile time.
  save path   (``--save-path``) a step's save of a fresh store's contiguous slots: the raw path
              (jitted gather + one device_put), the save program alone, the engine's save() until
              its store is ready, and until ``wait_idle`` returns (the background completion).
  load phases (``--load-phases CHURN_FILE``) the engine's load() of the churned step's load slots
              (tools/churn_slots.py): main-thread time in copy_plan, the reads dispatched first,
              the checks, the load or scatter dispatch, against the whole call and until the
              caches are ready.

    python tools/probe_copies.py --deployment gpt-oss-120b-tp8 --size-mib 64 --widths 512 64 8 1
    python tools/probe_copies.py --deployment deepseek-v3-mla-fp8 --size-mib 64 --save-path
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_transfer as bt  # noqa: E402  (tools/ sibling)

MIB = 1 << 20


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--deployment", choices=sorted(bt.DEPLOYMENTS), required=True)
    p.add_argument("--size-mib", type=float, default=64)
    p.add_argument("--widths", type=int, nargs="*", default=[], help="copy widths of the structures timed")
    p.add_argument("--save-path", action="store_true")
    p.add_argument("--load-phases", metavar="CHURN_FILE", default=None,
                   help="time the phases of the engine's load() of the churned step in this churn file")
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--json", default=None)
    p.add_argument("--set", nargs="*", default=[], metavar="NAME=INT",
                   help="worker/programs.py constants to patch first (WIRE_WORD, LOAD_STATIC_MAX, LOAD_UNROLL, ...)")
    a = p.parse_args(argv)
    from tpuoffload.worker import programs
    for kv in a.set:
        k, v = kv.split("=")
        setattr(programs, k, int(v))

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from tpuoffload.worker.copy_plan import CopyPlan
    from tpuoffload.worker.transfer_engine import TransferEngine, _plan_ids

    d = dict(bt.DEPLOYMENTS[a.deployment])
    layers = d.pop("layers")
    shape = bt.per_device_block_shape(**d)
    dtype = jnp.dtype(d["dtype"])
    chunk = layers * int(np.prod(shape)) * dtype.itemsize
    n = int(a.size_mib * MIB) // chunk
    dev = jax.devices()[0]
    mesh = Mesh(np.array([dev]).reshape(1, 1), ("data", "model"))
    spec = P("data", None) if d.get("use_mla") else P("data", None, "model")
    cs = NamedSharding(mesh, spec)
    caches = [jax.device_put(jnp.zeros((2 * n, *shape), dtype), cs) for _ in range(layers)]
    buffer = max(256 * MIB, (1 << (n - 1).bit_length()) * chunk)
    eng = TransferEngine(caches, 8 * n * chunk, transfer_buffer_bytes=buffer)
    prog = eng._programs[0]
    out = {"deployment": a.deployment, "n": n, "chunk_kib": chunk / 1024, "device": dev.device_kind, "set": a.set,
           "wire": str(prog.wire)}
    print(f"{a.deployment}: {n} chunks of {chunk / 1024:g} KiB ({n * chunk / MIB:.1f} MiB), {layers} layers, "
          f"{prog.wire}, {' '.join(a.set)}", flush=True)

    dispatched = []  # set by the functions timed: when their last dispatch returned

    def timed(fn, iters):
        first_t0 = time.perf_counter()
        fn()
        first = time.perf_counter() - first_t0
        ts, ds = [], []
        for _ in range(iters):
            dispatched.clear()
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
            ds.append(dispatched[-1] - t0 if dispatched else 0.0)
        timed.dispatch_ms = statistics.median(ds) * 1e3
        return first * 1e3, statistics.median(ts) * 1e3, [round(t * 1e3, 4) for t in ts]

    # ---- copy structures: rows 0..R-1 in copies of one width (slots 0..R-1, blocks 0..R-1)
    rows = 1 << (n.bit_length() - 1)
    structures = {}
    blocks = np.arange(rows, dtype=np.int64)
    for w in a.widths:
        if w > rows:
            continue
        copies = ((w, rows // w),)
        plan = CopyPlan(np.arange(rows), np.arange(rows), copies)
        ids_np = _plan_ids(plan, blocks, 1, eng.num_blocks)
        ids = jax.device_put(ids_np, NamedSharding(mesh, P(), memory_kind="pinned_host"))

        def save():
            eng._stores[0], tok = prog.save(tuple(caches), eng._stores[0], ids, copies=copies)
            dispatched.append(time.perf_counter())
            tok.block_until_ready()

        def load():
            nonlocal caches
            new, tok = prog.load(tuple(caches), eng._stores[0], ids, copies=copies)
            dispatched.append(time.perf_counter())
            caches = list(new)
            tok.block_until_ready()

        for name, fn in (("save", save), ("load", load)):
            c, med, samples = timed(fn, a.iters)
            structures[f"{name} {w}x{rows // w}"] = {"compile_ms": c, "median_ms": med, "samples_ms": samples,
                                                     "dispatch_ms": timed.dispatch_ms,
                                                     "copies": prog.num_copies(name, copies)}
            print(f"  {name} {rows} rows as {w}x{rows // w} ({prog.num_copies(name, copies)} copies): "
                  f"{med:.3f} ms, dispatch {timed.dispatch_ms:.3f} (first call {c:.0f} ms)", flush=True)
    out["rows"] = rows
    out["structures"] = structures

    if a.save_path:
        src = np.arange(n)
        gather = jax.jit(lambda cs_, ids_: jnp.stack([c[ids_] for c in cs_], axis=1),
                         out_shardings=NamedSharding(mesh, P()))
        host = NamedSharding(mesh, P(), memory_kind="pinned_host")
        res = {}

        def raw():
            jax.device_put(gather(tuple(caches), src), host).block_until_ready()

        slots = np.arange(n, dtype=np.int64)
        plan = eng.copy_plan("save", slots)
        ids_np = _plan_ids(plan, src.astype(np.int64), 1)
        ids = jax.device_put(ids_np, host)

        def program():
            eng._stores[0], tok = prog.save(tuple(caches), eng._stores[0], ids, copies=plan.copies)
            tok.block_until_ready()

        counter = iter(range(1, 1 << 40))

        def engine_store():
            eng.save(caches, src, slots, [next(counter) for _ in range(n)])
            eng._stores[0].block_until_ready()
            eng.wait_idle(60)

        def engine_idle():
            eng.save(caches, src, slots, [next(counter) for _ in range(n)])
            eng.wait_idle(60)

        whole = ((n, 1),)
        pad = 1 << (n - 1).bit_length()
        ids_pad = jax.device_put(_plan_ids(CopyPlan(np.arange(pad), np.arange(pad), ((pad, 1),)),
                                           np.minimum(np.arange(pad), n - 1), 1), host)

        ids_one = jax.device_put(_plan_ids(CopyPlan(np.arange(n), slots, whole), src.astype(np.int64), 1), host)

        def program_one_copy():  # one copy of the whole step (not a power of two: a probe only)
            eng._stores[0], tok = prog.save(tuple(caches), eng._stores[0], ids_one, copies=whole)
            tok.block_until_ready()

        def program_padded():  # one power-of-two copy, padding rows repeating the last block
            eng._stores[0], tok = prog.save(tuple(caches), eng._stores[0], ids_pad, copies=((pad, 1),))
            tok.block_until_ready()

        for name, fn in (("raw", raw), ("program", program), ("program one copy", program_one_copy),
                         ("program padded", program_padded), ("engine store ready", engine_store),
                         ("engine wait_idle", engine_idle), ("raw again", raw), ("program again", program)):
            c, med, samples = timed(fn, a.iters)
            res[name] = {"first_ms": c, "median_ms": med, "samples_ms": samples}
            print(f"  save path {name}: {med:.3f} ms", flush=True)
        res["structure"] = "+".join(f"{w}x{c}" for w, c in plan.copies)
        out["save_path"] = res
    if a.load_phases:

        with open(a.load_phases) as f:
            churn = json.load(f)[f"{8 * n}/{n}/0"]
        slots = np.asarray(churn["load_slots"], np.int64)
        src, dst = np.arange(n), n + np.arange(n)
        save_ids = list(range(10**6, 10**6 + n))
        eng.save(caches, src, slots, save_ids)
        eng.wait_idle(60)
        spent: dict[str, float] = {}

        def timing(name, fn):
            def wrapped(*args, **kw):
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kw)
                finally:
                    spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
            return wrapped

        eng.copy_plan = timing("copy_plan", eng.copy_plan)
        for name in ("_maybe_read_first", "_load_failures", "_dispatch_load", "_plan_arrays"):
            setattr(eng, name, timing(name, getattr(eng, name)))
        phases = []
        for it in range(a.iters + 1):
            spent.clear()
            t0 = time.perf_counter()
            caches, failed = eng.load(caches, dst, slots, save_ids)
            t_main = time.perf_counter() - t0
            jax.block_until_ready(caches)
            t_all = time.perf_counter() - t0
            assert not failed
            if it:
                phases.append({**{k: v * 1e3 for k, v in spent.items()}, "main": t_main * 1e3, "total": t_all * 1e3})
        med = {k: statistics.median(p_[k] for p_ in phases) for k in phases[0]}
        structure = eng.copy_plan("load", slots).copies
        out["load_phases"] = {"median_ms": med, "samples": phases,
                              "structure": "+".join(f"{w}x{c}" for w, c in structure)}
        print("  load phases (ms, median): " + ", ".join(f"{k} {v:.3f}" for k, v in med.items()), flush=True)
    eng.close()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
