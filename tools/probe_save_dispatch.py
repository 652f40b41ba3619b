#!/usr/bin/env python
"""Where ``TransferEngine.save()`` spends the calling thread's time, against the raw path's dispatch.

For each deployment layout (tools/bench_transfer.py ``DEPLOYMENTS``), step size and slot pattern
(a fresh store's one run, ``contiguous``; the churned store's slots from ``--churn-file``), on one
device, in one process, interleaved (medians of ``--iters`` after one warm-up):

  raw        the raw save's two dispatches: one jitted gather of the step's blocks, one
             ``device_put`` to ``pinned_host`` (time until each call returned);
  noop       a jitted call that takes the cache arrays and returns one scalar: what JAX charges
             for dispatching any program over them;
  save()     the engine's public call, until it returned; ``jit`` is the part spent inside the
             save programs' calls (JAX's dispatch, the copies' launch included), ``engine`` the
             rest (the engine's own Python: conversions, checks, copy plan, ids, the completion's
             handoff), ``copies`` what the programs issue. ``--phases`` splits ``engine`` by the
             engine's helpers (each timed where this tree has it: ``_check_caches``,
             ``_plan_arrays``, ``copy_plan``, ``_plan_ids``, the ids ring's ``put``, the dispatch
             log's ``record``, ``_complete_in_background``); ``rest`` is what none of them took.

Each save is dispatched right after the previous one finished (``wait_idle``), with the caches
warm. ``--profile`` adds a cProfile of the engine's saves (top functions by own time) per row.
The bytes are not checked here (tools/bench_transfer.py checks them).

    python tools/probe_save_dispatch.py --expect-platform gpu --deployments gpt-oss-120b-tp8 \\
        --sizes-mib 64 512 --churn-file tools/churn_h200.json

It refuses to run on another platform than ``--expect-platform`` (never a silent CPU fallback).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MIB = 1 << 20


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--expect-platform", choices=("gpu", "cpu", "tpu"), required=True)
    p.add_argument("--deployments", nargs="+", required=True)
    p.add_argument("--sizes-mib", type=float, nargs="+", default=[64, 512])
    p.add_argument("--churn-file", default=None, help="tools/churn_slots.py patterns (else contiguous only)")
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--pool-steps", type=int, default=8)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--phases", action="store_true", help="split the engine's part by its helpers")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import bench_transfer as bt
    from tpuoffload.worker import transfer_engine as te
    from tpuoffload.worker.transfer_engine import TransferEngine

    platform = jax.default_backend()
    dev = jax.devices()[0]
    print(f"platform {platform} | device {dev.device_kind} | jax {jax.__version__}", flush=True)
    if platform != args.expect_platform:
        print(f"refusing to measure: JAX's platform is {platform!r}, not {args.expect_platform!r}", file=sys.stderr)
        return 2
    churn = {}
    if args.churn_file:
        with open(args.churn_file) as f:
            churn = json.load(f)
    mesh = Mesh(np.array([dev]).reshape(1, 1), ("data", "model"))
    host_sharding = NamedSharding(mesh, P(), memory_kind="pinned_host")
    dev_sharding = NamedSharding(mesh, P())
    rows = []
    print(f"{'config':<26} {'MiB':>4} {'slots':<10} {'save()':>7} {'jit':>6} {'engine':>7} {'copies':>6} "
          f"{'raw gather':>10} {'raw put':>8} {'raw sum':>8} {'noop':>6}   (ms, medians)", flush=True)
    for name in args.deployments:
        d = dict(bt.DEPLOYMENTS[name])
        layers = d.pop("layers")
        shape = bt.per_device_block_shape(**d)
        dtype = jnp.dtype(d["dtype"])
        spec = P("data", None) if d.get("use_mla") else P("data", None, "model")
        cache_sharding = NamedSharding(mesh, spec)
        chunk = layers * int(np.prod(shape)) * dtype.itemsize
        gather = jax.jit(lambda cs, ids: jnp.stack([c[ids] for c in cs], axis=1), out_shardings=dev_sharding)
        noop = jax.jit(lambda cs: cs[0].reshape(-1)[0])
        for size in args.sizes_mib:
            n = int(size * MIB) // chunk
            caches = [jax.device_put(jnp.zeros((2 * n, *shape), dtype), cache_sharding) for _ in range(layers)]
            buffer = max(bt.DEFAULT_BUFFER, (1 << (n - 1).bit_length()) * chunk)
            engine = TransferEngine(caches, args.pool_steps * n * chunk, transfer_buffer_bytes=buffer)
            src = np.random.default_rng(0).permutation(n).astype(np.int32)
            patterns = {"contiguous": np.arange(n)}
            key = f"{args.pool_steps * n}/{n}/0"
            if key in churn:
                patterns["churned"] = np.asarray(churn[key]["save_slots"])
            jit_time = [0.0]
            saved = [prog.save for prog in engine._programs]

            def timed(fn):
                def call(*a, **k):
                    t0 = time.perf_counter()
                    out = fn(*a, **k)
                    jit_time[0] += time.perf_counter() - t0
                    return out
                return call

            for prog, fn in zip(engine._programs, saved):
                prog.save = timed(fn)
            phase = {}  # helper -> seconds in the current save
            undo = []

            def wrap(obj, attr, label):
                fn = getattr(obj, attr, None)
                if fn is None:
                    return
                phase[label] = 0.0

                def call(*a, **k):
                    t0 = time.perf_counter()
                    try:
                        return fn(*a, **k)
                    finally:
                        phase[label] += time.perf_counter() - t0
                setattr(obj, attr, call)
                undo.append((obj, attr, fn))

            if args.phases:
                for attr in ("_check_caches", "_plan_arrays", "copy_plan", "_complete_in_background"):
                    wrap(engine, attr, attr)
                wrap(engine._ids, "put", "ids.put")
                wrap(engine.log, "record", "log.record")
                wrap(te, "_plan_ids", "_plan_ids")
            ids = iter(range(1, 1 << 62))
            times = {k: [] for k in ("gather", "put", "noop")}
            for pat in patterns:
                times.update({f"{pat}_save": [], f"{pat}_jit": []})
                times.update({f"{pat}_phase_{k}": [] for k in [*phase, "rest"]})
            prof = {pat: cProfile.Profile() for pat in patterns}
            copies_of = {}
            try:
                for it in range(args.iters + 1):
                    t0 = time.perf_counter()
                    g = gather(tuple(caches), src)
                    t1 = time.perf_counter()
                    h = jax.device_put(g, host_sharding)
                    t2 = time.perf_counter()
                    h.block_until_ready()
                    del g, h
                    t3 = time.perf_counter()
                    noop(tuple(caches)).block_until_ready()
                    t4 = time.perf_counter()
                    if it:
                        times["gather"].append(t1 - t0)
                        times["put"].append(t2 - t1)
                        times["noop"].append(t4 - t3)
                    for pat, slots in patterns.items():
                        blocks, sl, sid = src.tolist(), slots.tolist(), [next(ids) for _ in range(n)]
                        jit_time[0] = 0.0
                        for k in phase:
                            phase[k] = 0.0
                        if it and args.profile:
                            prof[pat].enable()
                        t0 = time.perf_counter()
                        engine.save(caches, blocks, sl, sid)
                        t1 = time.perf_counter()
                        if it and args.profile:
                            prof[pat].disable()
                        if not engine.wait_idle(300):
                            print(f"{name} {pat}: save did not finish", file=sys.stderr)
                            return 1
                        engine.drain_results()
                        if it:
                            times[f"{pat}_save"].append(t1 - t0)
                            times[f"{pat}_jit"].append(jit_time[0])
                            if phase:
                                for k, v in phase.items():
                                    times[f"{pat}_phase_{k}"].append(v)
                                times[f"{pat}_phase_rest"].append(t1 - t0 - jit_time[0] - sum(phase.values()))
                        ops = engine.finish_step().ops
                        copies_of[pat] = sum(int(op.split("copies=")[1].split()[0]) for op in ops if "copies=" in op)
            finally:
                for prog, fn in zip(engine._programs, saved):
                    prog.save = fn
                for obj, attr, fn in undo:
                    setattr(obj, attr, fn)
                engine.close()
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            for pat in patterns:
                row = {"config": name, "step_mib": n * chunk / MIB, "chunks": n, "slots": pat,
                       "save_ms": med[f"{pat}_save"], "jit_ms": med[f"{pat}_jit"],
                       "engine_ms": statistics.median(a - b for a, b in zip(times[f"{pat}_save"], times[f"{pat}_jit"])) * 1e3,
                       "copies": copies_of.get(pat),
                       "raw_gather_ms": med["gather"], "raw_put_ms": med["put"],
                       "raw_dispatch_ms": statistics.median(a + b for a, b in zip(times["gather"], times["put"])) * 1e3,
                       "noop_ms": med["noop"]}
                if phase:
                    row["phases_ms"] = {k: med[f"{pat}_phase_{k}"] for k in [*phase, "rest"]}
                rows.append(row)
                print(f"{name:<26} {row['step_mib']:>4.0f} {pat:<10} {row['save_ms']:>7.3f} {row['jit_ms']:>6.3f} "
                      f"{row['engine_ms']:>7.3f} {str(row['copies'] or ''):>6} {row['raw_gather_ms']:>10.3f} "
                      f"{row['raw_put_ms']:>8.3f} {row['raw_dispatch_ms']:>8.3f} {row['noop_ms']:>6.3f}", flush=True)
                if phase:
                    print("    engine's part: " + ", ".join(f"{k} {v:.3f}" for k, v in row["phases_ms"].items()), flush=True)
                if args.profile:
                    out = io.StringIO()
                    pstats.Stats(prof[pat], stream=out).sort_stats("tottime").print_stats(12)
                    row["profile"] = out.getvalue()
                    print("\n".join(line for line in out.getvalue().splitlines()[6:] if line.strip()), flush=True)
            del caches
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"platform": platform, "device_kind": dev.device_kind, "jax": jax.__version__,
                       "argv": sys.argv if argv is None else list(argv), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
