"""Benchmark: the shared tier's store path against the backend's raw read/write of the same bytes.

For each backend (a tmpfs directory, a disk directory, a local redis-server started here), the same
N chunks of S bytes are written and read back twice, side by side in one run:

* raw: the backend's plain operations on the bytes (file: write a temporary file, fsync as the tier
  does, rename into place; read: open and read the whole file. redis: SET and GET);
* tier: what worker/shared_stage.py does per chunk on its background threads: encode the header
  (crc32 of the payload), exists-many for the batch (deduplication), put-if-absent (file: link(2);
  redis: SET NX); read: get, then verify header and checksum (``decode_object``).

It reports GiB/s of each and the tier's ratio to raw, and states the platform. No accelerator is
involved: the host-RAM side of a publish or fetch (one read or install program per layer group) is
measured by tools/bench_transfer.py. Run: ``python tools/bench_shared_tier.py [--chunk-bytes N]
[--chunks N] [--disk-dir DIR]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tpuoffload.backend.shared_store import (FileStore, ObjectId, decode_object,  # noqa: E402
                                             encode_header)


def platform_line() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{platform.node()}: {cpu}, {os.cpu_count()} cores, Linux {platform.release()}, Python "
            f"{platform.python_version()}, numpy {np.__version__}; host side only (no accelerator)")


def fs_of(path: str) -> str:
    best = ("", "?")
    with open("/proc/mounts") as f:
        for line in f:
            dev, mnt, fstype = line.split()[:3]
            if path.startswith(mnt) and len(mnt) > len(best[0]):
                best = (mnt, fstype)
    return best[1]


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_file(root: str, payloads: list[np.ndarray], fsync: bool) -> dict[str, float]:
    ns = bytes(16)
    raw_dir = os.path.join(root, "raw")
    os.makedirs(raw_dir, exist_ok=True)

    def raw_write():
        for i, p in enumerate(payloads):
            tmp, final = os.path.join(raw_dir, f".t{i}"), os.path.join(raw_dir, f"{i}.bin")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.write(fd, p)
            if fsync:
                os.fsync(fd)
            os.close(fd)
            os.rename(tmp, final)

    def raw_read():
        for i, p in enumerate(payloads):
            with open(os.path.join(raw_dir, f"{i}.bin"), "rb", buffering=0) as f:
                data = f.read()
            assert len(data) == len(p)

    store = FileStore(os.path.join(root, "tier"), fsync=fsync)
    oids = [ObjectId(ns, i.to_bytes(16, "little"), 0, 0, 1) for i in range(len(payloads))]
    return _run(raw_write, raw_read, store, oids, payloads)


def bench_redis(payloads: list[np.ndarray]) -> dict[str, float]:
    from tpuoffload.backend.shared_store_redis import RedisStore
    from tpuoffload.sim.redis_server import RedisServer

    ns = bytes(16)
    with RedisServer() as server:
        store = RedisStore(server.url, timeout_s=30)
        client = store._client

        def raw_write():
            for i, p in enumerate(payloads):
                client.set(f"raw:{i}", p.tobytes())

        def raw_read():
            for i, p in enumerate(payloads):
                assert len(client.get(f"raw:{i}")) == len(p)

        oids = [ObjectId(ns, i.to_bytes(16, "little"), 0, 0, 1) for i in range(len(payloads))]
        out = _run(raw_write, raw_read, store, oids, payloads)
        store.close()
        return out


def _run(raw_write, raw_read, store, oids, payloads) -> dict[str, float]:
    size = len(payloads[0])

    def tier_write():
        present = store.exists_many([o.name for o in oids])
        for o, p, there in zip(oids, payloads, present):
            if not there:
                store.put_if_absent(o.name, encode_header(o, p), p)

    def tier_read():
        for o in oids:
            got, err, _ = decode_object(o, store.get(o.name), size)
            assert err is None

    nbytes = size * len(payloads)
    gib = 1 << 30
    times = {"raw_write": timed(raw_write), "tier_write": timed(tier_write), "raw_read": timed(raw_read),
             "tier_read": timed(tier_read)}
    return {k: nbytes / gib / t for k, t in times.items()} | {
        "write_ratio": times["raw_write"] / times["tier_write"], "read_ratio": times["raw_read"] / times["tier_read"],
        "tier_write_ms_per_chunk": times["tier_write"] / len(payloads) * 1e3,
        "tier_read_ms_per_chunk": times["tier_read"] / len(payloads) * 1e3,
        "raw_write_ms_per_chunk": times["raw_write"] / len(payloads) * 1e3,
        "raw_read_ms_per_chunk": times["raw_read"] / len(payloads) * 1e3}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunk-bytes", type=int, default=1 << 20)
    ap.add_argument("--chunks", type=int, default=128)
    ap.add_argument("--disk-dir", default="/var/tmp")
    ap.add_argument("--no-redis", action="store_true")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    payloads = [rng.integers(0, 256, args.chunk_bytes, dtype=np.uint8) for _ in range(args.chunks)]
    print(platform_line())
    print(f"{args.chunks} chunks of {args.chunk_bytes} bytes; GiB/s, and tier/raw as a ratio of throughputs")
    runs = []
    if os.path.isdir("/dev/shm"):
        runs.append(("tmpfs dir", "/dev/shm", True))
    runs.append(("disk dir", os.path.abspath(args.disk_dir), True))
    rows = []
    for label, base, fsync in runs:
        os.makedirs(base, exist_ok=True)
        root = tempfile.mkdtemp(prefix="tpuoffload-shared-bench-", dir=base)
        try:
            rows.append((f"{label} ({fs_of(root)}, fsync={int(fsync)})", bench_file(root, payloads, fsync)))
        finally:
            shutil.rmtree(root, ignore_errors=True)
    if not args.no_redis:
        rows.append(("local redis-server (loopback)", bench_redis(payloads)))
    print(f"{'backend':44s} {'raw w':>7s} {'tier w':>7s} {'ratio':>6s} {'raw r':>7s} {'tier r':>7s} {'ratio':>6s} "
          f"{'ms/chunk w (raw/tier)':>22s} {'ms/chunk r (raw/tier)':>22s}")
    for label, r in rows:
        print(f"{label:44s} {r['raw_write']:7.2f} {r['tier_write']:7.2f} {r['write_ratio']:6.2f} {r['raw_read']:7.2f} "
              f"{r['tier_read']:7.2f} {r['read_ratio']:6.2f} "
              f"{r['raw_write_ms_per_chunk']:10.2f}/{r['tier_write_ms_per_chunk']:<10.2f} "
              f"{r['raw_read_ms_per_chunk']:10.2f}/{r['tier_read_ms_per_chunk']:<10.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
