#!/usr/bin/env python
"""What the data-parallel save's store write costs against the plain one, side by side.

With blocks split over batch shards (DP), a save writes its copies inside ``shard_map``, each
device at its own row or at its spare rows (worker/programs.py ``_write_own``); without, one
global write puts every copy at the same row on every device. This probe times the product's own two
writes on the same copies (16-row copies, ``SHARD_SPARE_ROWS``, into a pinned-host store), plus the
plain write inside ``shard_map`` without the owner test (to tell the two costs apart), and checks
the bytes written.

    python tools/probe_dp_store_write.py --expect-platform gpu

It refuses to run on another platform than ``--expect-platform`` (never a silent CPU fallback).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tpuoffload.backend.slot_table import SHARD_SPARE_ROWS  # noqa: E402
from tpuoffload.worker.programs import GroupPrograms, _write_own  # noqa: E402

WIDTH = SHARD_SPARE_ROWS  # rows per copy: the widest a DP save makes
CASES = ((128, 32), (512, 16), (2048, 8))  # (KiB per row per device, copies)


def writes(mesh, spare_at: int, copies: int, blocks_per_shard: int):
    """The product's two writes of ``copies`` copies of WIDTH rows (worker/programs.py): the plain
    global one (``_write_rows``), the per-device one (``_write_own``), and the per-device one
    without the owner test (``_write_rows`` inside ``shard_map``), to tell the two costs apart."""
    groups = ((0, WIDTH, copies),)
    write = partial(GroupPrograms._write_rows, groups=groups, total=copies)
    layout = SimpleNamespace(batch_axes=("data",), blocks_per_shard=blocks_per_shard)  # what _write_own reads
    hs = NamedSharding(mesh, P("data"), memory_kind="pinned_host")
    specs = dict(mesh=mesh, in_specs=(P("data"), P("data"), P()), out_specs=P("data"), check_vma=False)
    return {"plain": jax.jit(lambda st, r, ids: write(st, r, lambda i: ids[1, i]), donate_argnums=0, out_shardings=hs),
            "own": jax.jit(jax.shard_map(partial(_write_own, group=layout, spare_row=spare_at, write=write), **specs),
                           donate_argnums=0, out_shardings=hs),
            "own, no test": jax.jit(jax.shard_map(lambda st, r, ids: write(st, r, lambda i: ids[1, i]), **specs),
                                    donate_argnums=0, out_shardings=hs)}


def run_case(mesh, row_kib: int, copies: int, rounds: int) -> str:
    n, words = mesh.size, row_kib * 256
    slots_total = 512 if row_kib >= 2048 else 4096 * 256 // row_kib
    hs = NamedSharding(mesh, P("data"), memory_kind="pinned_host")
    store = jax.jit(lambda: jnp.zeros((n, slots_total + WIDTH, words), jnp.uint32), out_shardings=hs)()
    rows = jax.jit(lambda: (jnp.arange(n * WIDTH * copies * words, dtype=jnp.uint32) * 7 + 3).reshape(
        n, WIDTH * copies, words), out_shardings=NamedSharding(mesh, P("data")))()
    starts = np.arange(copies) * (slots_total // copies)
    ids = np.zeros((3, WIDTH * copies), np.int32)  # row 0: blocks (all of shard 0), row 1: slots
    ids[1] = (starts[:, None] + np.arange(WIDTH)).ravel()
    ids = jnp.asarray(ids)
    fns = writes(mesh, slots_total, copies, blocks_per_shard=64)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):  # interleaved rounds, the median of 10 calls each
        for name, fn in fns.items():
            ts = []
            for _ in range(10):
                t0 = time.perf_counter()
                store = fn(store, rows, ids)
                store.block_until_ready()
                ts.append(time.perf_counter() - t0)
            times[name].append(float(np.median(ts)))
    # The byte check, last, of one more per-device write, read through a device copy: a host view
    # of the pinned-host store itself (np.array of it) stays referenced by the array, and the next
    # donating write of that store then fails on several devices ("Donation requested for buffer
    # with external reference").
    store = fns["own"](store, rows, ids)
    got = np.array(jax.device_put(store, NamedSharding(mesh, P("data"), memory_kind="device")))[0]
    want = np.array(rows)[0]
    exact = all(np.array_equal(got[s:s + WIDTH], want[j * WIDTH:(j + 1) * WIDTH])
                for j, s in enumerate(starts.tolist()))
    med = {name: float(np.median(v)) for name, v in times.items()}
    mib = n * WIDTH * copies * words * 4 / 2**20
    return (f"| {row_kib} KiB | {copies} x {WIDTH} rows ({mib:.0f} MiB) | {'exact' if exact else 'WRONG'} | "
            f"{med['plain'] * 1e3:.2f} | {med['own'] * 1e3:.2f} | {med['own, no test'] * 1e3:.2f} | "
            f"{med['own'] / med['plain']:.3f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--expect-platform", required=True, help="gpu, tpu or cpu: refuse to run on another")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    platform = jax.default_backend()
    if platform != args.expect_platform:
        raise SystemExit(f"this run is on {platform}, not {args.expect_platform}")
    devices = jax.devices()
    print(f"{devices[0].device_kind} x {len(devices)}, JAX {jax.__version__}")
    print("| row per device | copies | bytes | plain ms | per-device ms | per-device, no owner test ms | per-device / plain |")
    print("|---|---|---|---|---|---|---|")
    mesh = Mesh(np.array(devices), ("data",))
    for row_kib, copies in CASES:
        print(run_case(mesh, row_kib, copies, args.rounds))


if __name__ == "__main__":
    main()
