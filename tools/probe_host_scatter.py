#!/usr/bin/env python
"""Probe: can one XLA program write rows into scattered slots of a pinned_host store (and read
them back) as ONE op, instead of one dynamic-update-slice per slot? Times, per variant, a step of
``n`` rows of ``row_kib`` KiB into random slots of a store of ``8n`` slots, against one contiguous
device_put (the floor). Prints what compiles and what it costs; a variant that fails says why."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

HOST, DEVICE = jax.memory.Space.Host, jax.memory.Space.Device


def timeit(fn, iters=7):
    fn()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def main() -> int:
    dev = jax.devices()[0]
    mesh = Mesh(np.array([dev]), ("x",))
    d_sh = NamedSharding(mesh, P())
    h_sh = NamedSharding(mesh, P(), memory_kind="pinned_host")
    out = []
    for row_kib, n in ((128, 512), (512, 128), (512, 1024)):
        w = row_kib * 1024 // 4
        rng = np.random.default_rng(0)
        slots = np.sort(rng.choice(8 * n, n, replace=False)).astype(np.int32)
        rows = jax.device_put(jnp.arange(n * w, dtype=jnp.uint32).reshape(n, w), d_sh)
        store = jax.device_put(jnp.zeros((8 * n, w), jnp.uint32), h_sh)
        res = {"row_kib": row_kib, "n": n}
        res["floor_d2h_ms"] = timeit(lambda: jax.device_put(rows, h_sh).block_until_ready())
        pinned = jax.device_put(rows, h_sh)
        res["floor_h2d_ms"] = timeit(lambda: jax.device_put(pinned, d_sh).block_until_ready())

        def scatter_host(st, r, ids):  # one scatter whose operand lives in host memory
            return st.at[ids].set(jax.device_put(r, HOST), unique_indices=True, mode="drop")

        def gather_host(st, ids):  # one gather computed where the store lives, then one transfer
            return jax.device_put(jnp.take(st, jax.device_put(ids, HOST), axis=0, mode="clip"), DEVICE)

        def dus_loop(st, r, ids):
            def body(i, s):
                return jax.lax.dynamic_update_slice_in_dim(s, jax.device_put(
                    jax.lax.dynamic_slice_in_dim(r, i, 1, 0), HOST), ids[i], 0)
            return jax.lax.fori_loop(0, r.shape[0], body, st, unroll=4)

        for name, fn, donate in (("scatter_into_host", scatter_host, 0), ("dus_loop", dus_loop, 0),
                                 ("gather_from_host", gather_host, None)):
            try:
                if donate is None:
                    f = jax.jit(fn, out_shardings=d_sh)
                    ids = jax.device_put(slots, d_sh)
                    got = f(store, ids)
                    res[name + "_ms"] = timeit(lambda: f(store, ids).block_until_ready())
                    res[name + "_bytes_ok"] = bool(np.array_equal(np.asarray(got), np.asarray(store)[slots]))
                else:
                    f = jax.jit(fn, donate_argnums=0, out_shardings=h_sh)
                    ids = jax.device_put(slots, d_sh)
                    holder = [store]

                    def step():
                        holder[0] = f(holder[0], rows, ids)
                        holder[0].block_until_ready()
                    res[name + "_ms"] = timeit(step)
                    store = holder[0]
                    ok = np.array_equal(np.asarray(store)[slots], np.asarray(rows))
                    res[name + "_bytes_ok"] = bool(ok)
                    store = jax.device_put(jnp.zeros((8 * n, w), jnp.uint32), h_sh)
            except Exception as exc:  # noqa: BLE001
                res[name + "_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        print(json.dumps(res), flush=True)
        out.append(res)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "probe_host_scatter.json"), "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
