"""The per-host disk tier: byte-exact round trips, every broken-file case is a read error, the byte
budget holds under concurrent writes with random delays, slow disks and injected failures.

``python tools/bench_storage.py disk [DIR]`` measures the checksum candidates and the tier's
write/read GiB/s (see the module docstring of tpuoffload.backend.disk_tier)."""

from __future__ import annotations

import os
import random
import threading
import time

import numpy as np
import pytest

from tpuoffload.backend.disk_tier import (
    HEADER_BYTES,
    TMP_SUFFIX,
    ChunkKey,
    DiskFaults,
    DiskTier,
    DiskTierError,
    ReadError,
    file_name,
)

SLOT = 12_288  # bytes per chunk in these tests (not a multiple of the header size on purpose)
FILE = HEADER_BYTES + SLOT


def row(seed: int, n: int = SLOT) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def key(i: int, save_id: int | None = None) -> ChunkKey:
    return ChunkKey(i if save_id is None else save_id, i.to_bytes(4, "little") * 8)  # a 32-byte "hash"


def dir_bytes(path: str) -> int:
    """Bytes of every file in the directory now (files may vanish while we look)."""
    total = 0
    for name in os.listdir(path):
        try:
            total += os.stat(os.path.join(path, name)).st_size
        except FileNotFoundError:
            pass
    return total


def write_ok(tier: DiskTier, k: ChunkKey, data: np.ndarray):
    w = tier.write(k, data)
    res = w.future.result(timeout=30)
    assert res.ok, res
    return w


def read(tier: DiskTier, k: ChunkKey):
    return tier.read(k).result(timeout=30)


@pytest.fixture
def tier(tmp_path):
    t = DiskTier(str(tmp_path / "disk"), 8 * FILE, SLOT, threads=2)
    yield t
    t.close()


def test_round_trip_byte_exact_and_restart(tmp_path):
    path = str(tmp_path / "disk")
    with DiskTier(path, 8 * FILE + FILE - 1, SLOT) as t:  # budget: 8 whole files, never a 9th
        assert t.capacity_chunks == 8
        datas = {i: row(i) for i in range(5)}
        for i, d in datas.items():
            write_ok(t, key(i), d)
        long_key = ChunkKey(99, bytes(range(256)) * 3)  # a long hash: the header holds it whole
        write_ok(t, long_key, row(99))
        for i, d in datas.items():
            res = read(t, key(i))
            assert res.ok and res.data.dtype == np.uint8 and np.array_equal(res.data, d)
        out = np.full(SLOT, 7, np.uint8)
        res = t.read(long_key, out=out).result(timeout=30)
        assert res.ok and res.data is out and np.array_equal(out, row(99))
        assert t.used_bytes == 6 * FILE == dir_bytes(path)  # the lock file is empty
        # another dtype/shape with the same bytes is the same opaque row
        write_ok(t, key(50), row(50).view(np.int32).reshape(4, -1))
        assert np.array_equal(read(t, key(50)).data, row(50))
    with DiskTier(path, 8 * FILE, SLOT) as t:  # restart: every file adopted, bytes intact
        assert t.scan_report.adopted == 7 and len(t) == 7
        for i, d in datas.items():
            assert np.array_equal(read(t, key(i)).data, d)
        assert np.array_equal(read(t, long_key).data, row(99))


def test_absent_keys(tier):
    write_ok(tier, key(1), row(1))
    assert read(tier, key(2)).error is ReadError.ABSENT  # never written
    res = read(tier, key(1, save_id=77))  # same hash, another save id
    assert res.error is ReadError.ABSENT and res.data is None
    out = np.full(SLOT, 9, np.uint8)
    assert tier.read(key(2), out=out).result().error is ReadError.ABSENT and not out.any()


def _damage(tier: DiskTier, k: ChunkKey, how: str) -> None:
    path = os.path.join(tier.path, file_name(k.hash))
    if how == "payload_byte":
        with open(path, "r+b") as f:
            f.seek(HEADER_BYTES + SLOT // 2)
            b = f.read(1)
            f.seek(HEADER_BYTES + SLOT // 2)
            f.write(bytes([b[0] ^ 0x01]))
    elif how == "header_byte":
        with open(path, "r+b") as f:
            f.seek(20)  # inside the save id
            b = f.read(1)
            f.seek(20)
            f.write(bytes([b[0] ^ 0x80]))
    elif how == "truncated":
        os.truncate(path, FILE - 100)
    elif how == "missing":
        os.unlink(path)
    elif how == "other_chunk":  # a valid file of another chunk under this name
        os.replace(os.path.join(tier.path, file_name(key(2).hash)), path)
    else:
        raise AssertionError(how)


@pytest.mark.parametrize("how, error", [
    ("payload_byte", ReadError.CORRUPT), ("header_byte", ReadError.CORRUPT), ("truncated", ReadError.SHORT),
    ("missing", ReadError.MISSING), ("other_chunk", ReadError.MISMATCH),
])
def test_broken_file_is_a_read_error_never_garbage(tier, how, error):
    write_ok(tier, key(1), row(1))
    write_ok(tier, key(2), row(2))
    write_ok(tier, key(3), row(3))
    _damage(tier, key(1), how)
    out = np.full(SLOT, 5, np.uint8)
    res = tier.read(key(1), out=out).result(timeout=30)
    assert res.error is error and res.data is None, res
    assert not out.any()  # the caller's buffer holds zeros, not the damaged bytes
    assert not tier.contains(key(1)) and read(tier, key(1)).error is ReadError.ABSENT
    assert not os.path.exists(os.path.join(tier.path, file_name(key(1).hash)))  # deleted
    assert np.array_equal(read(tier, key(3)).data, row(3))  # the others are untouched
    if how == "other_chunk":  # chunk 2's file was moved away: its own read finds it missing
        assert read(tier, key(2)).error is ReadError.MISSING
    _wait(lambda: tier.used_bytes == dir_bytes(tier.path))
    assert tier.counters[f"disk_read_failed_{error.value}"] == 1


def _wait(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_lru_eviction_contract(tmp_path):
    with DiskTier(str(tmp_path / "d"), 3 * FILE, SLOT) as t:
        for i in range(3):
            assert write_ok(t, key(i), row(i)).evicted == ()
        assert read(t, key(0)).ok  # 0 becomes the most recently used: 1 is the LRU now
        w = write_ok(t, key(3), row(3))
        assert w.evicted == (key(1),)  # decided synchronously, returned with the write
        assert read(t, key(1)).error is ReadError.ABSENT
        assert [k.save_id for k in t.keys()] == [2, 0, 3]
        assert t.used_bytes == 3 * FILE == dir_bytes(t.path)
        for i in (0, 2, 3):
            assert np.array_equal(read(t, key(i)).data, row(i))
        # a new save of a held hash replaces it (reported as evicted); the same key is a no-op
        w = write_ok(t, key(0, save_id=40), row(40))
        assert w.evicted == (key(0),) and read(t, key(0)).error is ReadError.ABSENT
        assert np.array_equal(read(t, key(0, save_id=40)).data, row(40))
        assert write_ok(t, key(0, save_id=40), row(41)).evicted == ()
        assert np.array_equal(read(t, key(0, save_id=40)).data, row(40))
        assert t.used_bytes == 3 * FILE == dir_bytes(t.path)
        assert t.delete(key(2).hash) and not t.delete(key(2).hash)
        _wait(lambda: t.used_bytes == 2 * FILE == dir_bytes(t.path))


class GateReads(DiskFaults):
    """Reads of the gated chunks wait for the gate (a slow disk under a read)."""

    def __init__(self, gated: set[bytes]) -> None:
        self.gate = threading.Event()
        self.gated = gated
        self.entered = threading.Semaphore(0)

    def before_read(self, k: ChunkKey) -> None:
        if k.hash in self.gated:
            self.entered.release()
            assert self.gate.wait(30)


def test_chunks_being_read_are_not_evicted_and_delete_waits_for_readers(tmp_path):
    faults = GateReads({key(0).hash, key(1).hash})
    with DiskTier(str(tmp_path / "d"), 2 * FILE, SLOT, threads=4, faults=faults) as t:
        write_ok(t, key(0), row(0))
        write_ok(t, key(1), row(1))
        f0, f1 = t.read(key(0)), t.read(key(1))
        assert faults.entered.acquire(timeout=10) and faults.entered.acquire(timeout=10)
        w = t.write(key(2), row(2))  # both chunks are pinned by reads: no room, refused
        res = w.future.result(timeout=10)
        assert not res.ok and res.error == "no_space" and w.evicted == ()
        assert t.write(key(0, save_id=9), row(9)).future.result().error == "busy"
        assert t.delete(key(1).hash)  # forgotten now, unlinked after its read
        assert read(t, key(1)).error is ReadError.ABSENT
        faults.gate.set()
        assert np.array_equal(f0.result(timeout=10).data, row(0))
        assert np.array_equal(f1.result(timeout=10).data, row(1))  # read before the delete: whole
        _wait(lambda: t.used_bytes == FILE == dir_bytes(t.path))


class RandomDelays(DiskFaults):
    """Random delays before and while writing; samples the directory's real size while temp files
    exist (the moment a missing guard overshoots)."""

    def __init__(self, path: str, seed: int) -> None:
        self.path = path
        self.rng = random.Random(seed)
        self.lock = threading.Lock()  # guards rng and max_seen
        self.max_seen = 0

    def _delay(self) -> None:
        with self.lock:
            d = self.rng.uniform(0, 0.004)
        time.sleep(d)

    def before_write(self, k):
        self._delay()
        self._sample()

    def before_commit(self, k, tmp_path):
        self._sample()
        self._delay()
        self._sample()

    def before_read(self, k):
        self._delay()

    def _sample(self) -> None:
        size = dir_bytes(self.path)
        with self.lock:
            self.max_seen = max(self.max_seen, size)


def test_budget_never_exceeded_under_concurrent_writes(tmp_path):
    path = str(tmp_path / "d")
    cap_chunks = 6
    faults = RandomDelays(path, seed=1)
    os.makedirs(path)
    t = DiskTier(path, cap_chunks * FILE + 123, SLOT, threads=6, faults=faults)
    stop = threading.Event()

    def sampler():
        while not stop.is_set():
            faults._sample()
            time.sleep(0.0005)

    last: dict[int, int] = {}  # hash id -> seed of the last write that was accepted and succeeded
    last_lock = threading.Lock()  # guards last

    def writer(w: int):
        rng = random.Random(w)
        for n in range(40):
            i = rng.randrange(12)
            seed = w * 1000 + n
            dw = t.write(ChunkKey(seed, key(i).hash), row(seed))
            res = dw.future.result(timeout=30)
            if res.ok:
                with last_lock:
                    last[i] = seed
            if rng.random() < 0.3:
                t.read(ChunkKey(seed, key(i).hash))
            time.sleep(rng.uniform(0, 0.002))

    threads = [threading.Thread(target=sampler)] + [threading.Thread(target=writer, args=(w,)) for w in range(6)]
    for th in threads:
        th.start()
    for th in threads[1:]:
        th.join(60)
    stop.set()
    threads[0].join(10)
    t.close()
    assert t.counters["disk_written_chunks"] > 50 and t.counters["disk_evicted"] > 20  # the guard was exercised
    assert faults.max_seen <= cap_chunks * FILE, (faults.max_seen, cap_chunks * FILE)
    assert dir_bytes(path) == len(t) * FILE == t.used_bytes <= cap_chunks * FILE
    assert not [n for n in os.listdir(path) if n.endswith(TMP_SUFFIX)]
    # whatever is held reads back as exactly the bytes of its own save
    with DiskTier(path, cap_chunks * FILE, SLOT) as t2:
        assert len(t2) == len(t)
        for k in t2.keys():
            assert np.array_equal(read(t2, k).data, row(k.save_id))


class SlowDisk(DiskFaults):
    def __init__(self, delay: float) -> None:
        self.delay = delay

    def before_write(self, k):
        time.sleep(self.delay)

    def before_read(self, k):
        time.sleep(self.delay)


def test_slow_disk_never_blocks_the_caller(tmp_path):
    with DiskTier(str(tmp_path / "d"), 8 * FILE, SLOT, threads=2, faults=SlowDisk(0.3)) as t:
        t0 = time.monotonic()
        writes = [t.write(key(i), row(i)) for i in range(4)]
        assert time.monotonic() - t0 < 0.2  # queued, not done
        assert not any(w.future.done() for w in writes)
        assert read(t, key(0)).error is ReadError.ABSENT  # not committed yet: never a partial file
        assert all(w.future.result(timeout=30).ok for w in writes)
        t0 = time.monotonic()
        futures = [t.read(key(i)) for i in range(4)]
        assert time.monotonic() - t0 < 0.2
        assert [np.array_equal(f.result(timeout=30).data, row(i)) for i, f in enumerate(futures)] == [True] * 4


class FailingDisk(DiskFaults):
    def __init__(self, fail_write: set[int], fail_commit: set[int], fail_read: set[int]) -> None:
        self.fail_write, self.fail_commit, self.fail_read = fail_write, fail_commit, fail_read
        self.tmp_seen: list[str] = []

    def before_write(self, k):
        if k.save_id in self.fail_write:
            raise OSError(28, "No space left on device (injected)")

    def before_commit(self, k, tmp_path):
        self.tmp_seen.append(tmp_path)
        assert os.path.getsize(tmp_path) == FILE
        if k.save_id in self.fail_commit:
            raise OSError(5, "Input/output error (injected)")

    def before_read(self, k):
        if k.save_id in self.fail_read:
            self.fail_read.discard(k.save_id)  # a transient failure: the next read works
            raise OSError(5, "Input/output error (injected)")


def test_failed_writes_and_reads_are_explicit(tmp_path):
    faults = FailingDisk(fail_write={1}, fail_commit={2}, fail_read={3})
    with DiskTier(str(tmp_path / "d"), 4 * FILE, SLOT, faults=faults) as t:
        results = [t.write(key(i), row(i)).future.result(timeout=30) for i in range(4)]
        assert [r.ok for r in results] == [True, False, False, True]
        assert "No space" in results[1].error and "Input/output" in results[2].error
        assert read(t, key(1)).error is ReadError.ABSENT and read(t, key(2)).error is ReadError.ABSENT
        assert faults.tmp_seen and not any(os.path.exists(p) for p in faults.tmp_seen)
        assert t.used_bytes == 2 * FILE == dir_bytes(t.path)
        res = read(t, key(3))
        assert res.error is ReadError.IO and "Input/output" in res.detail
        assert np.array_equal(read(t, key(3)).data, row(3))  # an I/O error does not drop the file
        # a failed replacement of a held hash leaves neither the old nor a partial file
        faults.fail_commit.add(30)
        res = t.write(key(3, save_id=30), row(30)).future.result(timeout=30)
        assert not res.ok and read(t, key(3)).error is ReadError.ABSENT
        _wait(lambda: t.used_bytes == FILE == dir_bytes(t.path))
        assert t.counters["disk_write_failed"] == 3 and t.counters["disk_read_failed_io"] == 1


def test_startup_scan(tmp_path):
    path = str(tmp_path / "d")
    with DiskTier(path, 5 * FILE, SLOT) as t:
        for i in range(5):
            write_ok(t, key(i), row(i))
            os.utime(os.path.join(path, file_name(key(i).hash)), (1000 + i, 1000 + i))  # age order
    # debris of a crash and of other deployments
    with open(os.path.join(path, ".x.kv.0123.tmp"), "wb") as f:
        f.write(b"half a chunk")
    with open(os.path.join(path, file_name(b"bad header")), "wb") as f:
        f.write(bytes(FILE))
    with open(os.path.join(path, file_name(key(0).hash)), "r+b") as f:  # a torn header
        f.write(b"XXXX")
    with open(os.path.join(path, "notes.txt"), "w") as f:
        f.write("operator's file")
    with DiskTier(path, 3 * FILE, SLOT) as t:  # a smaller budget: the newest 3 valid files stay
        r = t.scan_report
        assert (r.adopted, r.removed_tmp, r.removed_invalid, r.removed_over_budget) == (3, 1, 2, 1)
        assert [k.save_id for k in t.keys()] == [2, 3, 4]
        assert sorted(os.listdir(path)) == sorted([".lock", "notes.txt"] + [file_name(key(i).hash) for i in (2, 3, 4)])
        for i in (2, 3, 4):
            assert np.array_equal(read(t, key(i)).data, row(i))
    with DiskTier(path, 10 * FILE, SLOT * 2) as t:  # another chunk size: nothing is adopted
        assert t.scan_report.adopted == 0 and t.scan_report.removed_invalid == 3


def test_chunk_files_of_another_deployment_are_deleted_not_adopted(tmp_path):
    """A start adopts chunk files only if they were written for the same deployment (the warm-restart
    fingerprint); a start that names none adopts nothing, and a later start cannot take its files."""
    path = str(tmp_path / "d")
    with DiskTier(path, 4 * FILE, SLOT, deployment="model A") as t:
        for i in range(3):
            write_ok(t, key(i), row(i))
    with DiskTier(path, 4 * FILE, SLOT, deployment="model A") as t:  # the same deployment: adopted
        assert t.scan_report.adopted == 3 and np.array_equal(read(t, key(1)).data, row(1))
    with DiskTier(path, 4 * FILE, SLOT, deployment="model B") as t:  # another: deleted, never read
        r = t.scan_report
        assert (r.adopted, r.removed_foreign) == (0, 3) and len(t) == 0
        assert read(t, key(1)).error == ReadError.ABSENT
        write_ok(t, key(7), row(7))
    with DiskTier(path, 4 * FILE, SLOT, deployment=None) as t:  # unknown: nothing adopted ...
        assert (t.scan_report.adopted, t.scan_report.removed_foreign) == (0, 1)
        write_ok(t, key(8), row(8))
    with DiskTier(path, 4 * FILE, SLOT) as t:  # ... and what it wrote belongs to no deployment
        assert (t.scan_report.adopted, t.scan_report.removed_foreign) == (0, 1)
    assert sorted(os.listdir(path)) == [".lock", "DEPLOYMENT"]


def test_one_tier_per_directory_and_bad_arguments(tmp_path):
    path = str(tmp_path / "d")
    with DiskTier(path, 2 * FILE, SLOT):
        with pytest.raises(DiskTierError, match="in use"):
            DiskTier(path, 2 * FILE, SLOT)
    with pytest.raises(DiskTierError, match="smaller than one chunk"):
        DiskTier(path, FILE - 1, SLOT)
    with DiskTier(path, 2 * FILE, SLOT) as t:
        with pytest.raises(ValueError, match="12288 bytes"):
            t.write(key(0), np.zeros(SLOT - 1, np.uint8))
        with pytest.raises(ValueError, match="12288 bytes"):
            t.read(key(0), out=np.zeros(SLOT + 1, np.uint8))
