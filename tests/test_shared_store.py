"""The shared tier's backends (backend/shared_store*.py) against their real systems: a local
directory (POSIX semantics) and Debian's redis-server, started here on a free port and killed at
teardown. Contract: put-if-absent never overwrites, reads are whole objects or nothing, every
broken object is a named miss, an unreachable store answers within its timeout, the budget holds
under concurrent writers, and a reader keeps the object the evictor removes."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from tpuoffload.backend.shared_store import (HEADER_BYTES, FileFaults, FileStore, ObjectError, ObjectId,
                                             SharedURL, StoreUnavailable, decode_object, encode_header)

NS = bytes(range(16))
PAYLOAD = 20_000


def oid(i: int, shard: int = 0, ns: bytes = NS, group: int = 0) -> ObjectId:
    return ObjectId(ns, i.to_bytes(16, "little"), group, shard, 2)


def payload(seed: int, n: int = PAYLOAD) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def put(store, o: ObjectId, data: np.ndarray) -> bool:
    return store.put_if_absent(o.name, encode_header(o, data), data)


@pytest.fixture(scope="module")
def redis_server():
    from tpuoffload.sim.redis_server import RedisServer

    server = RedisServer()
    yield server
    server.stop()


@pytest.fixture(params=["file", "redis"])
def store(request, tmp_path):
    if request.param == "file":
        s = FileStore(str(tmp_path / "store"))
    else:
        from tpuoffload.backend.shared_store_redis import RedisStore

        server = request.getfixturevalue("redis_server")
        s = RedisStore(server.url, timeout_s=2.0)
        s._client.flushdb()
    yield s
    s.close()


def test_round_trip_and_put_if_absent_never_overwrites(store):
    a, b = payload(1), payload(2)
    o = oid(7)
    assert store.exists_many([o.name, oid(8).name]) == [False, False]
    assert store.get(o.name) is None
    assert put(store, o, a) is True
    assert put(store, o, b) is False  # the second writer finds it there: the first one's bytes stay
    got, err, _ = decode_object(o, store.get(o.name), PAYLOAD)
    assert err is None and np.array_equal(np.frombuffer(got, np.uint8), a)
    assert store.exists_many([o.name, oid(8).name]) == [True, False]
    assert store.delete(o.name) is True and store.delete(o.name) is False
    assert store.get(o.name) is None


def test_writers_racing_on_one_name_publish_exactly_one_whole_object(store):
    o, n = oid(3), 8
    datas = [payload(100 + i) for i in range(n)]
    won: list[int] = []
    barrier = threading.Barrier(n)

    def write(i):
        barrier.wait()
        if put(store, o, datas[i]):
            won.append(i)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(won) == 1, won
    got, err, _ = decode_object(o, store.get(o.name), PAYLOAD)
    assert err is None and np.array_equal(np.frombuffer(got, np.uint8), datas[won[0]])


def test_negative_control_rename_instead_of_link_lets_a_second_writer_replace_the_object(tmp_path, monkeypatch):
    """Publishing by rename (what a tmp + os.replace scheme does) replaces the first writer's object:
    the link(2) step is what makes put-if-absent hold."""
    store = FileStore(str(tmp_path / "store"))
    monkeypatch.setattr(os, "link", lambda src, dst: os.replace(src, dst) or open(src, "wb").close())
    o = oid(3)
    first, second = payload(1), payload(2)
    store.put_if_absent(o.name, encode_header(o, first), first)
    os.unlink(store.path(o.name))  # so the existence pre-check does not stop the second writer ...
    open(store.path(o.name), "wb").write(encode_header(o, first) + first.tobytes())  # ... racing it
    monkeypatch.setattr(os.path, "exists", lambda p: False)
    assert store.put_if_absent(o.name, encode_header(o, second), second) is True  # replaced
    got, _, _ = decode_object(o, store.get(o.name), PAYLOAD)
    assert np.array_equal(np.frombuffer(got, np.uint8), second)


def test_every_broken_object_is_a_named_miss():
    o, data = oid(5), payload(5)
    whole = encode_header(o, data) + data.tobytes()
    assert decode_object(o, whole, PAYLOAD)[1] is None
    assert decode_object(o, None, PAYLOAD)[1] is ObjectError.ABSENT
    assert decode_object(o, whole[:-1], PAYLOAD)[1] is ObjectError.SHORT  # truncated payload
    assert decode_object(o, whole[:100], PAYLOAD)[1] is ObjectError.SHORT  # torn in the header
    flipped = bytearray(whole)
    flipped[HEADER_BYTES + 1234] ^= 0x10
    assert decode_object(o, flipped, PAYLOAD)[1] is ObjectError.CORRUPT
    head = bytearray(whole)
    head[40] ^= 1
    assert decode_object(o, head, PAYLOAD)[1] is ObjectError.CORRUPT  # the header's own checksum
    for other in (oid(5, ns=bytes(16)), oid(6), oid(5, shard=1), oid(5, group=1)):
        foreign = encode_header(other, data) + data.tobytes()
        assert decode_object(o, foreign, PAYLOAD)[1] is ObjectError.FOREIGN
    assert decode_object(o, whole, PAYLOAD + 1)[1] is ObjectError.FOREIGN  # another chunk size


def test_a_torn_file_under_its_name_reads_short(tmp_path):
    store = FileStore(str(tmp_path / "store"))
    o, data = oid(9), payload(9)
    put(store, o, data)
    with open(store.path(o.name), "r+b") as f:
        f.truncate(HEADER_BYTES + 5000)
    assert decode_object(o, store.get(o.name), PAYLOAD)[1] is ObjectError.SHORT


def test_an_unreachable_redis_answers_within_its_timeout_and_a_restarted_one_is_used_again():
    from tpuoffload.backend.shared_store_redis import RedisStore
    from tpuoffload.sim.redis_server import RedisServer

    server = RedisServer()
    try:
        store = RedisStore(server.url, timeout_s=0.5)
        o, data = oid(1), payload(1)
        assert put(store, o, data)
        server.stop()
        for op in (lambda: store.get(o.name), lambda: store.exists_many([o.name]), lambda: put(store, oid(2), data)):
            t0 = time.monotonic()
            with pytest.raises(StoreUnavailable):
                op()
            assert time.monotonic() - t0 < 2.0
        server.start()  # back, empty (no persistence)
        assert store.exists_many([o.name]) == [False]
        assert put(store, o, data) and store.exists_many([o.name]) == [True]
        store.close()
    finally:
        server.stop()


def test_redis_maxmemory_lru_evicts_and_reads_are_whole_or_nothing():
    from tpuoffload.backend.shared_store_redis import RedisStore
    from tpuoffload.sim.redis_server import RedisServer

    with RedisServer(maxmemory=4 << 20) as server:
        store = RedisStore(server.url)
        objs = [(oid(i), payload(i, 64 << 10)) for i in range(200)]  # 12.8 MB into 4 MB
        for o, d in objs:
            assert put(store, o, d)
        present = store.exists_many([o.name for o, _ in objs])
        assert 0 < sum(present) < len(objs) and present[-1]
        # Redis's LRU is approximate (it evicts the oldest of a few sampled keys), so an old object
        # may survive (the first one did once, in the suite): the oldest are evicted far more often
        # than the newest, which a random eviction would not do.
        assert sum(present[:50]) < sum(present[-50:]) // 2, present
        for o, d in objs:
            got, err, _ = decode_object(o, store.get(o.name), 64 << 10)
            assert err in (None, ObjectError.ABSENT)
            if err is None:
                assert np.array_equal(np.frombuffer(got, np.uint8), d)
        store.close()


def _concurrent_writers(root: str, budget: int, writers: int, per_writer: int, sample) -> list[FileStore]:
    stores = [FileStore(root, budget_bytes=budget, high=0.8, low=0.6, fsync=False, scan_s=0.0)
              for _ in range(writers)]
    barrier = threading.Barrier(writers)

    def write(w: int) -> None:
        barrier.wait()
        for i in range(per_writer):
            o = oid(w * 10_000 + i, shard=w % 2)
            put(stores[w], o, payload(w * 10_000 + i))
            sample()

    threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return stores


@pytest.mark.parametrize("accounting", [True, False])
def test_budget_holds_under_concurrent_writers(tmp_path, monkeypatch, accounting):
    """Four writers (one store object each, as four hosts) publish 3x the budget at once: the
    usage never exceeds the budget (each writer evicts under the shared lock as soon as its own
    count crosses the high watermark) and ends at most at the high watermark; every object reads
    back exact or not at all. Negative control (``accounting=False``): writers that do not count
    what they write never evict, and the store grows past the budget."""
    if not accounting:
        monkeypatch.setattr(FileStore, "_account", lambda self, size: None)
    root = str(tmp_path / "store")
    obj = HEADER_BYTES + PAYLOAD
    budget = 60 * obj
    peak = [0]
    probe = FileStore(root)

    def sample():
        peak[0] = max(peak[0], probe.usage())

    stores = _concurrent_writers(root, budget, writers=4, per_writer=45, sample=sample)
    if not accounting:
        assert peak[0] > budget
        return
    assert peak[0] <= budget, (peak[0], budget)
    assert probe.usage() <= 0.8 * budget
    assert sum(s.evictions for s in stores) > 0
    for w in range(4):
        for i in range(45):
            o = oid(w * 10_000 + i, shard=w % 2)
            got, err, _ = decode_object(o, probe.get(o.name), PAYLOAD)
            assert err in (None, ObjectError.ABSENT), err
            if err is None:
                assert np.array_equal(np.frombuffer(got, np.uint8), payload(w * 10_000 + i))


@pytest.mark.parametrize("eviction", ["unlink", "truncate (negative control)"])
def test_a_reader_keeps_the_object_the_evictor_removes(tmp_path, eviction):
    """Between a reader's open and its read the evictor removes every object (a budget of one
    byte). With unlink (the evictor's way) the reader still reads the whole object, exact, and the
    name is gone for later lookups. Negative control: an evictor that truncates files in place
    would hand the reader a short object; the checksum makes it a miss, never wrong bytes."""
    root = str(tmp_path / "store")
    writer = FileStore(root, budget_bytes=1 << 40, fsync=False)
    o, data = oid(4), payload(4)
    put(writer, o, data)
    evictor = FileStore(root, budget_bytes=1, high=0.9, low=0.5, fsync=False)
    if eviction != "unlink":
        evictor.faults.evict_unlink = lambda path: os.truncate(path, 0)
    reader = FileStore(root, faults=FileFaults(after_open=lambda path: evictor.evict()))
    got, err, _ = decode_object(o, reader.get(o.name), PAYLOAD)
    assert evictor.evictions == 1
    if eviction == "unlink":
        assert err is None and np.array_equal(np.frombuffer(got, np.uint8), data)
        assert reader.exists_many([o.name]) == [False]
    else:
        assert err is ObjectError.SHORT


def test_shared_url_parses_and_names_every_mistake():
    s = SharedURL.parse("file:///mnt/lustre/kv?bytes=1000000&high=0.85&low=0.7&timeout_s=1.5&namespace=w2")
    assert (s.scheme, s.location, s.budget_bytes, s.high, s.low, s.timeout_s, s.namespace) == \
        ("file", "/mnt/lustre/kv", 1000000, 0.85, 0.7, 1.5, "w2")
    r = SharedURL.parse("redis://kv-cache:6379/2?queue_bytes=1048576")
    assert (r.scheme, r.location, r.queue_bytes) == ("redis", "redis://kv-cache:6379/2", 1 << 20)
    for bad, words in [
        ("", "must be a URL"), (42, "must be a URL"), ("s3://bucket/kv", "unknown scheme"),
        ("file://server/kv", "names a path on this host"), ("file:///", "absolute directory"),
        ("file:///kv?bytes=-1", "outside"), ("file:///kv?high=0.5&low=0.7", "must be below"),
        ("file:///kv?colour=red", "unknown parameter"), ("redis://:6379", "needs a host"),
        ("redis://h:99999", "Port"), ("redis://h:6379/x", "database number"), ("redis://h?bytes=5", "unknown parameter"),
        ("file:///kv?timeout_s=abc", "not a float"),
    ]:
        with pytest.raises(ValueError, match=words):
            SharedURL.parse(bad)
