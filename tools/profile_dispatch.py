"""Where the engine's main thread spends its time dispatching a save (developer tool).

Runs the engine on the platform JAX has (--expect-platform, never a silent fallback) with the
benchmark's default cache and prints the median of each part of ``save`` over 9 calls.
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


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--expect-platform", required=True)
    p.add_argument("--blocks", type=int, default=64)
    p.add_argument("--layers", type=int, default=32)
    args = p.parse_args()
    if jax.default_backend() != args.expect_platform:
        print(f"platform is {jax.default_backend()}, expected {args.expect_platform}", file=sys.stderr)
        return 2
    from tpuoffload.worker import transfer_engine as te

    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    sh = NamedSharding(mesh, PartitionSpec("data", None, "model"))
    shape = (args.blocks * 2, 64, 8, 2, 128)
    caches = [jax.jit(lambda: jnp.ones(shape, jnp.bfloat16), out_shardings=sh)() for _ in range(args.layers)]
    eng = te.TransferEngine(caches, args.blocks * eng_bytes(caches), transfer_buffer_bytes=1 << 34)
    parts: dict[str, list[float]] = {}
    orig = {name: getattr(eng, name) for name in ("_check_caches", "_put_ids", "_check_plan")}
    for name, fn in orig.items():
        def timed(*a, _fn=fn, _name=name, **k):
            t0 = time.perf_counter()
            out = _fn(*a, **k)
            parts.setdefault(_name, []).append(time.perf_counter() - t0)
            return out
        setattr(eng, name, timed)
    prog = eng._programs[0]
    save = prog.save

    def timed_save(*a):
        t0 = time.perf_counter()
        out = save(*a)
        parts.setdefault("program dispatch", []).append(time.perf_counter() - t0)
        return out
    prog.save = timed_save
    blocks = list(range(args.blocks))
    for it in range(10):
        jax.block_until_ready(eng._stores)
        t0 = time.perf_counter()
        eng.save(caches, blocks, blocks, list(range(it * 1000, it * 1000 + args.blocks)))
        parts.setdefault("save() total", []).append(time.perf_counter() - t0)
        eng.wait_idle()
    for name, ts in parts.items():
        print(f"{name:20s} {statistics.median(ts[1:]) * 1e3:8.3f} ms")
    return 0


def eng_bytes(caches) -> int:
    from tpuoffload.layout import CacheLayout

    return CacheLayout.from_caches(caches).device_bytes_per_chunk


if __name__ == "__main__":
    sys.exit(main())
