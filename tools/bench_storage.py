#!/usr/bin/env python
"""Write and read speed of the storage below host RAM, on this machine (one process, 4 MiB chunks).

  checkpoint GIB [DIR] [--stores]  a warm-restart checkpoint (tpuoffload.persist.Persister) of GIB
                                   GiB: write and restore GiB/s on this machine's JAX backend; the
                                   slots as a numpy array, or with --stores as one global store
                                   array in host memory (the engine's form)
  disk [DIR]                       the checksum candidates (crc32, blake2b) on 1, 4 and 8 threads,
                                   then the disk tier (tpuoffload.backend.disk_tier) writing and
                                   reading 1 GiB on 1 and 4 threads

DIR is where the temporary files go (default: the system's temporary directory). With
DROP_CACHES=1 (and root on a real kernel) the page cache is dropped before every read, so reads
come from the disk. Figures: docs/performance.md.

    DROP_CACHES=1 JAX_PLATFORMS=cpu python tools/bench_storage.py checkpoint 4 /tmp
    DROP_CACHES=1 python tools/bench_storage.py checkpoint 4 /tmp --stores
    DROP_CACHES=1 python tools/bench_storage.py disk /tmp
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import numpy as np


def drop_caches() -> str:
    """With DROP_CACHES=1 (and root on a real kernel), empty the page cache so that reads come
    from the disk. Off by default: it slows down everything else on a shared machine."""
    if os.environ.get("DROP_CACHES") != "1":
        return "warm"
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "dropped"
    except OSError:
        return "warm"


def bench_checkpoint(gib: float, path: str, form: str) -> None:
    """One process: write and restore ``gib`` GiB of 4 MiB slots, as a numpy array ("rows") or as
    one global store array in host memory ("stores", the engine's form)."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from tpuoffload.persist import Fingerprint, Persister

    slot = 4 << 20
    n = int(gib * 2**30) // slot
    buf = np.empty(n * slot + 4096, np.uint8)  # 4096-aligned, as a host backend should allocate it
    off = (-buf.ctypes.data) % 4096
    storage = buf[off:off + n * slot].reshape(n, slot)
    storage[...] = np.random.default_rng(0).integers(0, 256, slot, dtype=np.uint8)
    tags = np.arange(n, dtype=np.int64)
    fp = Fingerprint("bench", "bench", "uint8", 16, 1, slot)
    p = Persister(path, fp)
    if form == "stores":
        device = jax.devices()[0]
        kind = "pinned_host" if device.platform != "cpu" else None
        sharding = NamedSharding(Mesh(np.array([device]), ("d",)), PartitionSpec(), memory_kind=kind)
        data = {"group0": jax.device_put(storage[None], sharding)}
        data["group0"].block_until_ready()
        into = {"group0": jax.ShapeDtypeStruct(data["group0"].shape, np.uint8, sharding=sharding)}
    else:
        data, into = storage, np.zeros_like(storage)
    assert p.restore(into)[0] is None  # start-up: nothing there yet
    t0 = time.perf_counter()
    r = p.save(data, tags, {}).result()
    w = time.perf_counter() - t0
    assert r.ok, r.reason
    cache = drop_caches()
    t0 = time.perf_counter()
    restored, reason = p.restore(into)
    rs = time.perf_counter() - t0
    assert restored is not None, reason
    got = into if form == "rows" else np.asarray(restored.stores["group0"])[0]
    assert np.array_equal(got, storage)
    size = n * slot / 2**30
    print(f"{jax.devices()[0].platform} {form}: {n} x 4 MiB = {size:.2f} GiB: write {size / w:.2f} GiB/s "
          f"(blocking {r.blocking_s:.2f} s of {w:.2f} s), restore {size / rs:.2f} GiB/s ({rs:.2f} s, "
          f"page cache {cache})")
    p.close()


def bench_disk(path: str, gib: float = 1.0, slot_mib: int = 4) -> None:
    import hashlib
    import zlib

    from concurrent.futures import ThreadPoolExecutor

    from tpuoffload.backend.disk_tier import HEADER_BYTES, ChunkKey, DiskTier

    buf = np.random.default_rng(0).integers(0, 256, 256 << 20, dtype=np.uint8)
    pieces = [memoryview(buf)[i:i + (4 << 20)] for i in range(0, buf.nbytes, 4 << 20)]
    for name, fn in (("zlib.crc32", zlib.crc32),
                     ("hashlib.blake2b", lambda m: hashlib.blake2b(m, digest_size=16).digest())):
        for threads in (1, 4, 8):
            with ThreadPoolExecutor(threads) as ex:
                t0 = time.perf_counter()
                list(ex.map(fn, pieces))
                dt = time.perf_counter() - t0
            print(f"{name:16s} {buf.nbytes / dt / 2**30:6.2f} GiB/s ({threads} threads, 4 MiB pieces)")
    slot = slot_mib << 20
    n = int(gib * 2**30) // slot
    data = buf[:slot]
    for threads in (1, 4):
        with DiskTier(os.path.join(path, f"bench{threads}"), (n + 1) * (slot + HEADER_BYTES), slot,
                      threads=threads) as t:
            t0 = time.perf_counter()
            futs = [t.write(ChunkKey(i, i.to_bytes(8, "little")), data).future for i in range(n)]
            assert all(f.result().ok for f in futs)
            w = n * slot / (time.perf_counter() - t0) / 2**30
            cache = drop_caches()
            t0 = time.perf_counter()
            futs = [t.read(ChunkKey(i, i.to_bytes(8, "little"))) for i in range(n)]
            assert all(f.result().ok for f in futs)
            r = n * slot / (time.perf_counter() - t0) / 2**30
            print(f"disk tier, {threads} threads, {n} x {slot_mib} MiB: write {w:.2f} GiB/s, "
                  f"read+verify {r:.2f} GiB/s (page cache {cache})")
            for k in t.keys():
                t.delete(k.hash)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = [a for a in argv if not a.startswith("--")]
    if args[:1] == ["checkpoint"] and len(args) in (2, 3):
        with tempfile.TemporaryDirectory(dir=args[2] if len(args) > 2 else None) as d:
            bench_checkpoint(float(args[1]), d, "stores" if "--stores" in argv else "rows")
        return 0
    if args[:1] == ["disk"] and len(args) in (1, 2):
        with tempfile.TemporaryDirectory(dir=args[1] if len(args) > 1 else None) as d:
            bench_disk(d)
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
