"""TransferEngine on a KV cache sharded on heads over 4 CPU devices: round trips, missing data,
write-after-write and read-after-write ordering, failures, threading and input checks."""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tpuoffload.backend.host_backend import EMPTY
from tpuoffload.worker import transfer_engine as te
from tpuoffload.worker.transfer_engine import Faults, SaveResult, TransferEngine

L, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 3, 64, 16, 8, 32
SHAPE = (NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM)
NUM_SLOTS = 32


def chunk_bytes(dtype=np.float32) -> int:
    return L * BLOCK_SIZE * HEADS * HEAD_DIM * np.dtype(dtype).itemsize


@pytest.fixture(scope="module")
def mesh():
    devices = jax.devices()
    assert len(devices) >= 4, "tests/conftest.py must set --xla_force_host_platform_device_count=4"
    return Mesh(np.array(devices[:4]), ("model",))


@pytest.fixture(scope="module")
def sharding(mesh):
    return NamedSharding(mesh, PartitionSpec(None, None, "model", None))


@pytest.fixture
def engines():
    made = []

    def make(caches, *, slots=NUM_SLOTS, **kw):
        eng = TransferEngine(caches, slots * chunk_bytes(caches[0].dtype), **kw)
        made.append(eng)
        return eng

    yield make
    for eng in made:
        eng.wait_idle(10)
        eng.close()


def random_caches(sharding, seed, dtype=jnp.float32, layers=L):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(layers):
        host = rng.standard_normal(SHAPE, dtype=np.float32) + 1.0  # no exact zeros in practice
        out.append(jax.device_put(jnp.asarray(host, dtype=dtype), sharding))
    return out


def host(caches) -> list[np.ndarray]:
    return [np.asarray(c) for c in caches]


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def chunk_of(host_caches, block) -> np.ndarray:
    """The bytes a slot holds for ``block``: (layers, block_size, heads, head_dim)."""
    return np.stack([c[block] for c in host_caches])


def loaded_chunk(caches, block) -> np.ndarray:
    return np.stack([np.asarray(c[block]) for c in caches])


def save_ok(eng, caches, blocks, slots, ids):
    eng.save(caches, blocks, slots, ids)
    assert eng.wait_idle(30)
    results = eng.drain_results()
    assert sorted(results, key=lambda r: r.save_id) == [SaveResult(i, True) for i in sorted(ids)]


# ---------------------------------------------------------------- round trip
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_roundtrip_exact_bytes(sharding, engines, dtype):
    caches = random_caches(sharding, 0, dtype)
    eng = engines(caches)
    assert eng.backend.num_slots == NUM_SLOTS
    src = host(caches)
    blocks, slots, ids = [3, 17, 40, 63, 0], [5, 0, 9, 31, 2], [100, 101, 102, 103, 104]
    save_ok(eng, caches, blocks, slots, ids)
    for b, s, i in zip(blocks, slots, ids):
        assert eng.backend.tag(s) == i

    # Overwrite the whole cache, then load into other block ids.
    caches = random_caches(sharding, 1, dtype)
    before = host(caches)
    targets = [10, 11, 12, 50, 1]
    caches, failed = eng.load(caches, targets, slots, ids)
    assert failed == []
    after = host(caches)
    for b, t in zip(blocks, targets):
        assert same_bytes(np.stack([a[t] for a in after]), chunk_of(src, b)), (b, t)
    untouched = [x for x in range(NUM_BLOCKS) if x not in targets]
    for layer in range(L):
        assert same_bytes(after[layer][untouched], before[layer][untouched])
        assert caches[layer].sharding == sharding
        assert caches[layer].dtype == dtype


def test_roundtrip_more_blocks_than_bucket_and_partial_order(sharding, engines):
    caches = random_caches(sharding, 2)
    eng = engines(caches)
    src = host(caches)
    blocks = list(range(5, 5 + 20))  # 20 blocks: padded to a bucket of 32
    slots = list(range(31, 11, -1))
    ids = list(range(1000, 1020))
    save_ok(eng, caches, blocks, slots, ids)
    caches = random_caches(sharding, 3)
    # Load a permuted subset.
    pick = [7, 0, 19, 3]
    caches, failed = eng.load(caches, [40 + k for k in range(4)], [slots[p] for p in pick], [ids[p] for p in pick])
    assert failed == []
    for k, p in enumerate(pick):
        assert same_bytes(loaded_chunk(caches, 40 + k), chunk_of(src, blocks[p]))


def test_roundtrip_mesh_with_replicated_axis(engines):
    """Heads sharded on one axis of a 2x2 mesh, replicated on the other: each heads range is
    present on two devices and must be written once."""
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    sh = NamedSharding(mesh, PartitionSpec(None, None, "model", None))
    caches = random_caches(sh, 4)
    eng = engines(caches)
    src = host(caches)
    save_ok(eng, caches, [1, 2], [0, 1], [7, 8])
    caches = random_caches(sh, 5)
    caches, failed = eng.load(caches, [30, 31], [1, 0], [8, 7])
    assert failed == []
    assert same_bytes(loaded_chunk(caches, 30), chunk_of(src, 2))
    assert same_bytes(loaded_chunk(caches, 31), chunk_of(src, 1))


# ---------------------------------------------------------------- missing data, same dispatch
class FailIds(Faults):
    def __init__(self, ids):
        self.ids = set(ids)

    def before_write(self, save_ids):
        if self.ids & set(save_ids):
            raise OSError("injected device-to-host failure")


def test_missing_chunks_error_exactly_those_blocks_with_same_digest(sharding, engines):
    caches1 = random_caches(sharding, 10)
    caches2 = random_caches(sharding, 10)
    src = host(caches1)
    good = engines(caches1)
    # Host 2: the save of id 12 fails locally, and slot 1 was overwritten locally by another chunk.
    local = engines(caches2, faults=FailIds({12}))

    plan = [([1, 2], [0, 1], [10, 11]), ([3], [2], [12]), ([4], [3], [13])]
    for eng, caches in ((good, caches1), (local, caches2)):
        for blocks, slots, ids in plan:
            eng.save(caches, blocks, slots, ids)
        assert eng.wait_idle(30)
    assert all(r.ok for r in good.drain_results())
    assert {r.save_id: r.ok for r in local.drain_results()} == {10: True, 11: True, 12: False, 13: True}
    local.backend.commit([1], [999])
    d_good, d_local = good.finish_step(), local.finish_step()
    assert d_good.digest == d_local.digest and d_good.ops == d_local.ops

    # Plus one slot neither host ever wrote (slot 9), expected with save id 14.
    load_plan = ([20, 21, 22, 23, 24], [0, 1, 2, 3, 9], [10, 11, 12, 13, 14])
    caches1 = random_caches(sharding, 11)
    caches2 = random_caches(sharding, 11)
    before = host(caches2)
    caches1, failed1 = good.load(caches1, *load_plan)
    caches2, failed2 = local.load(caches2, *load_plan)
    assert failed1 == [24]
    assert failed2 == [21, 22, 24]
    d_good, d_local = good.finish_step(), local.finish_step()
    assert d_good.digest == d_local.digest and d_good.ops == d_local.ops
    assert [op.split()[0] for op in d_good.ops] == ["h2d", "scatter"]

    zeros = np.zeros((L, BLOCK_SIZE, HEADS, HEAD_DIM), np.float32)
    assert same_bytes(loaded_chunk(caches2, 20), chunk_of(src, 1))
    assert same_bytes(loaded_chunk(caches2, 23), chunk_of(src, 4))
    for b in (21, 22, 24):
        assert same_bytes(loaded_chunk(caches2, b), zeros), b
    assert same_bytes(loaded_chunk(caches1, 24), zeros)
    after = host(caches2)
    rest = [x for x in range(NUM_BLOCKS) if x not in load_plan[0]]
    for layer in range(L):
        assert same_bytes(after[layer][rest], before[layer][rest])


# ---------------------------------------------------------------- write-after-write
class SlowOlder(Faults):
    """Sleeps in the write of ``slow_id`` only; records hook entry/exit times and, when another
    save's write starts, what the slot's storage holds at that moment."""

    def __init__(self, slow_id, slot, delay):
        self.slow_id, self.slot, self.delay = slow_id, slot, delay
        self.engine = None
        self.times: dict[tuple[int, str], float] = {}
        self.seen_at_start: dict[int, np.ndarray] = {}

    def before_write(self, save_ids):
        sid = save_ids[0]
        self.times[(sid, "start")] = time.monotonic()
        with self.engine.backend._lock:
            self.seen_at_start[sid] = self.engine.backend._storage[self.slot].copy()
        if sid == self.slow_id:
            time.sleep(self.delay)
        self.times[(sid, "end")] = time.monotonic()


def _waw_run(sharding, engines, chain: bool, delay: float):
    caches = random_caches(sharding, 20)
    src = host(caches)
    faults = SlowOlder(slow_id=1, slot=7, delay=delay)
    eng = engines(caches, faults=faults, save_threads=4)
    faults.engine = eng
    if not chain:
        class Forgetful(dict):
            def __setitem__(self, key, value):
                pass

        eng._last_write = Forgetful()  # mutation: no write chains
    eng.save(caches, [5], [7], [1])  # A: older, slow
    eng.save(caches, [9], [7], [2])  # B: newer, different content, same slot
    assert eng.wait_idle(30)
    results = {r.save_id: r.ok for r in eng.drain_results()}
    assert results == {1: True, 2: True}
    caches = random_caches(sharding, 21)
    caches, failed = eng.load(caches, [30], [7], [2])
    return eng, faults, src, caches, failed


def test_write_after_write_newest_wins(sharding, engines):
    eng, faults, src, caches, failed = _waw_run(sharding, engines, chain=True, delay=0.5)
    assert failed == []
    assert same_bytes(loaded_chunk(caches, 30), chunk_of(src, 9))  # B's bytes
    assert eng.backend.tag(7) == 2
    # B's write started only after A's write finished: A's hook had returned, and A's bytes were
    # complete in the slot when B began.
    assert faults.times[(2, "start")] >= faults.times[(1, "end")]
    assert same_bytes(faults.seen_at_start[2], chunk_of(src, 5))
    # A is gone for good.
    caches, failed = eng.load(caches, [31], [7], [1])
    assert failed == [31]


def test_write_after_write_negative_control_without_chaining(sharding, engines):
    """With the chain removed the same sequence ends with A's stale chunk in the slot: the test
    above is sensitive to the chaining."""
    eng, faults, src, caches, failed = _waw_run(sharding, engines, chain=False, delay=1.0)
    assert faults.times[(2, "start")] < faults.times[(1, "end")]
    assert eng.backend.tag(7) == 1
    assert failed == [30]


# ---------------------------------------------------------------- read-after-write
class Sleepy(Faults):
    def __init__(self, delays):
        self.delays = delays  # save id -> seconds

    def before_write(self, save_ids):
        for sid in save_ids:
            if sid in self.delays:
                time.sleep(self.delays[sid])


def test_read_after_write_waits_for_inflight_write(sharding, engines):
    caches = random_caches(sharding, 30)
    src = host(caches)
    eng = engines(caches, faults=Sleepy({2: 0.5}))
    save_ok(eng, caches, [8], [4], [1])  # an older committed chunk in the slot
    eng.save(caches, [12], [4], [2])  # slow overwrite
    chunks, _, oldest = eng.inflight()
    assert chunks == 1 and oldest is not None
    t0 = time.monotonic()
    caches, failed = eng.load(caches, [50], [4], [2])  # immediately
    waited = time.monotonic() - t0
    assert failed == []
    assert same_bytes(loaded_chunk(caches, 50), chunk_of(src, 12))
    assert waited >= 0.3  # it really waited for the write


def test_read_after_write_timeout_fails_with_zeros_not_stale(sharding, engines):
    caches = random_caches(sharding, 40)
    src = host(caches)
    eng = engines(caches, faults=Sleepy({2: 2.0}), load_wait_timeout_s=0.1)
    save_ok(eng, caches, [8, 9], [4, 5], [1, 3])  # slot 4: older chunk (block 8), slot 5: healthy
    caches, _ = eng.load(caches, [0], [5], [3])  # compile the scatter outside the timed load
    eng.save(caches, [12], [4], [2])  # 2 s write into slot 4
    caches = random_caches(sharding, 41)
    before = host(caches)
    t0 = time.monotonic()
    caches, failed = eng.load(caches, [50, 51], [4, 5], [2, 3])
    took = time.monotonic() - t0
    assert took < 1.0, "the load must not wait for the whole write"
    assert failed == [50]
    assert not loaded_chunk(caches, 50).any()  # zeros: not the old chunk, not the old cache block
    assert not same_bytes(before[0][50], np.zeros_like(before[0][50]))
    assert same_bytes(loaded_chunk(caches, 51), chunk_of(src, 9))
    # Later, the slow write lands and the chunk becomes loadable.
    assert eng.wait_idle(30)
    assert {r.save_id: r.ok for r in eng.drain_results()} == {2: True}
    caches, failed = eng.load(caches, [52], [4], [2])
    assert failed == []
    assert same_bytes(loaded_chunk(caches, 52), chunk_of(src, 12))


def test_read_after_write_timeout_never_serves_stale_chunk_backend_would_accept(sharding, engines):
    """The case where only the wait protects the load: the overwrite of slot 4 is queued behind
    another slow save (one save thread), so it has not even invalidated the slot, and the backend
    still tags slot 4 with the old chunk's id. A load issued after the overwrite must not read the
    old bytes as valid, although the backend's tag check alone would accept them."""
    caches = random_caches(sharding, 50)
    src = host(caches)
    eng = engines(caches, faults=Sleepy({5: 1.5}), save_threads=1, load_wait_timeout_s=0.1)
    save_ok(eng, caches, [8], [4], [1])  # old chunk in slot 4
    eng.save(caches, [20], [10], [5])  # occupies the only save thread for 1.5 s
    eng.save(caches, [12], [4], [2])  # overwrite of slot 4: queued
    assert eng.backend.tag(4) == 1
    direct, bad = eng.backend.read([4], [1])
    assert bad == [] and same_bytes(direct[0], chunk_of(src, 8))  # the backend alone: "valid"
    caches, failed = eng.load(caches, [60], [4], [1])
    assert failed == [60]
    assert not loaded_chunk(caches, 60).any()
    assert eng.wait_idle(30)
    assert eng.backend.tag(4) == 2


# ---------------------------------------------------------------- failed writes
def test_failed_write_reports_not_ok_and_is_not_loadable(sharding, engines):
    caches = random_caches(sharding, 60)
    eng = engines(caches, faults=FailIds({2}))
    save_ok(eng, caches, [8], [4], [1])  # an older committed chunk in slot 4
    eng.save(caches, [12, 13], [4, 6], [2, 3])  # this batch fails
    assert eng.wait_idle(30)
    assert sorted(eng.drain_results(), key=lambda r: r.save_id) == [SaveResult(2, False), SaveResult(3, False)]
    assert eng.backend.tag(4) == EMPTY and eng.backend.tag(6) == EMPTY
    caches, failed = eng.load(caches, [50, 51, 52], [4, 4 + 2, 5], [2, 3, 1])
    assert failed == [50, 51, 52]
    # The old chunk that used to be in slot 4 is not loadable either: the slot was being overwritten.
    caches, failed = eng.load(caches, [53], [4], [1])
    assert failed == [53]
    for b in (50, 51, 52, 53):
        assert not loaded_chunk(caches, b).any()
    assert eng.inflight() == (0, 0, None)


# ---------------------------------------------------------------- threading
class Counting:
    def __init__(self, monkeypatch, eng):
        self.device_put = 0
        self.gather = 0
        self.scatter = 0
        self.from_callback = 0
        real_put, real_cb = jax.device_put, jax.make_array_from_callback
        real_gather, real_scatter = eng._gather, eng._scatter

        def put(*a, **k):
            self.device_put += 1
            return real_put(*a, **k)

        def cb(*a, **k):
            self.from_callback += 1
            return real_cb(*a, **k)

        def gather(*a, **k):
            self.gather += 1
            return real_gather(*a, **k)

        def scatter(*a, **k):
            self.scatter += 1
            return real_scatter(*a, **k)

        monkeypatch.setattr(te.jax, "device_put", put)
        monkeypatch.setattr(te.jax, "make_array_from_callback", cb)
        monkeypatch.setattr(eng, "_gather", gather)
        monkeypatch.setattr(eng, "_scatter", scatter)

    def total(self):
        return self.device_put + self.gather + self.scatter + self.from_callback


def test_other_thread_raises_before_dispatch(sharding, engines, monkeypatch):
    caches = random_caches(sharding, 70)
    eng = engines(caches)
    save_ok(eng, caches, [1], [0], [1])
    eng.finish_step()
    count = Counting(monkeypatch, eng)
    errors = []

    def other():
        for call in (lambda: eng.save(caches, [2], [1], [2]), lambda: eng.load(caches, [3], [0], [1])):
            try:
                call()
            except RuntimeError as e:
                errors.append(str(e))

    t = threading.Thread(target=other, name="not-main")
    t.start()
    t.join(30)
    assert len(errors) == 2 and all("thread" in e for e in errors)
    assert count.total() == 0
    assert eng.finish_step().ops == ()
    assert eng.inflight() == (0, 0, None)
    assert eng.backend.tag(1) == EMPTY


# ---------------------------------------------------------------- one transfer per call
@pytest.mark.parametrize("n", [1, 7, 9, 30])
def test_one_gather_one_transfer_per_call(sharding, engines, monkeypatch, n):
    caches = random_caches(sharding, 80)
    eng = engines(caches)
    count = Counting(monkeypatch, eng)
    blocks, slots, ids = list(range(n)), list(range(n)), list(range(100, 100 + n))
    save_ok(eng, caches, blocks, slots, ids)
    assert (count.gather, count.device_put) == (1, 1)
    ops = eng.finish_step().ops
    assert [op.split()[0] for op in ops] == ["gather", "d2h"]
    caches, failed = eng.load(caches, blocks[::-1], slots, ids)
    assert failed == []
    assert (count.from_callback, count.scatter, count.device_put, count.gather) == (1, 1, 1, 1)
    assert [op.split()[0] for op in eng.finish_step().ops] == ["h2d", "scatter"]


def test_empty_plan_dispatches_nothing(sharding, engines):
    caches = random_caches(sharding, 81)
    eng = engines(caches)
    eng.save(caches, [], [], [])
    out, failed = eng.load(caches, [], [], [])
    assert failed == [] and all(a is b for a, b in zip(out, caches))
    assert eng.finish_step().ops == ()


# ---------------------------------------------------------------- bad input
def test_constructor_rejects_bad_caches(sharding, mesh):
    good = random_caches(sharding, 90)
    cap = NUM_SLOTS * chunk_bytes()
    other_shape = jax.device_put(jnp.zeros((NUM_BLOCKS, BLOCK_SIZE, HEADS, 2 * HEAD_DIM)), sharding)
    other_dtype = jax.device_put(jnp.zeros(SHAPE, jnp.bfloat16), sharding)
    single = jax.device_put(jnp.zeros(SHAPE), jax.devices()[0])
    blocks_sharded = jax.device_put(jnp.zeros(SHAPE), NamedSharding(mesh, PartitionSpec("model")))
    cases = [
        ([], "kv_caches"),
        ([good[0], other_shape], r"kv_caches\[1\]"),
        ([good[0], good[1], other_dtype], r"kv_caches\[2\]"),
        ([single], r"kv_caches\[0\].*NamedSharding"),
        ([np.zeros(SHAPE, np.float32)], r"kv_caches\[0\]"),
        ([jax.device_put(jnp.zeros((4, 4)), NamedSharding(mesh, PartitionSpec()))], "KV cache layer"),
        ([blocks_sharded], "blocks axis"),
    ]
    for caches, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            TransferEngine(caches, cap)
    with pytest.raises(ValueError, match="cpu_bytes_to_use"):
        TransferEngine(good, chunk_bytes() - 1)
    with pytest.raises(ValueError, match="cpu_bytes_to_use"):
        TransferEngine(good, 0)
    with pytest.raises(ValueError, match="save_threads"):
        TransferEngine(good, cap, save_threads=0)
    with pytest.raises(ValueError, match="load_wait_timeout_s"):
        TransferEngine(good, cap, load_wait_timeout_s=0)


@pytest.mark.parametrize("op", ["save", "load"])
def test_bad_plans_raise_naming_argument(sharding, engines, op):
    caches = random_caches(sharding, 91)
    eng = engines(caches)
    bf16 = [c.astype(jnp.bfloat16) for c in caches]
    cases = [
        (caches, [1, 2], [0], [1, 2], "block_ids, slots and save_ids"),
        (caches, [1], [0], [1, 2], "block_ids, slots and save_ids"),
        (caches, [1, NUM_BLOCKS], [0, 1], [1, 2], "block_ids out of range"),
        (caches, [-1], [0], [1], "block_ids out of range"),
        (caches, [1], [NUM_SLOTS], [1], "slots out of range"),
        (caches, [1], [-1], [1], "slots out of range"),
        # A save must not put two chunks in one slot; a load must not put two chunks in one block
        # (it may read one slot into several blocks: see test_load_one_slot_into_two_blocks).
        (caches, [1, 2], [3, 3], [1, 2], "slots repeat") if op == "save" else
        (caches, [1, 1], [3, 4], [1, 2], "block_ids repeat"),
        (caches[:2], [1], [0], [1], "kv_caches"),
        (bf16, [1], [0], [1], "kv_caches"),
        ([], [1], [0], [1], "kv_caches"),
        ([caches[0], jax.device_put(np.zeros(SHAPE, np.float32), jax.devices()[0]), caches[2]], [1], [0], [1],
         r"kv_caches\[1\]"),
    ]
    for kv, blocks, slots, ids, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            getattr(eng, op)(kv, blocks, slots, ids)
    assert eng.finish_step().ops == ()  # nothing dispatched
    assert eng.inflight() == (0, 0, None)


def test_load_one_slot_into_two_blocks(sharding, engines):
    caches = random_caches(sharding, 92)
    src = host(caches)
    eng = engines(caches)
    save_ok(eng, caches, [6], [2], [1])
    caches, failed = eng.load(caches, [40, 41], [2, 2], [1, 1])
    assert failed == []
    assert same_bytes(loaded_chunk(caches, 40), chunk_of(src, 6))
    assert same_bytes(loaded_chunk(caches, 41), chunk_of(src, 6))
