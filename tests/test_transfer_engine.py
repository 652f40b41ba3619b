"""TransferEngine on tpu-inference's real KV cache layouts (``tpuoffload.sim.tpu_layouts``: the
caches its own ``create_kv_caches`` allocates, on 16 CPU devices): byte-exact round trips, blocks
split by data parallelism, the transfer-buffer bound, write-after-write and read-after-write
ordering, failed writes, threading, dispatch counts, input checks, and every injected fault point
(invariant 2: a fault changes what a host reports, never what it dispatches).

The bytes of a slot live in the engine's store and are only ever observed here through loads:
every check of a slot's content is a load compared byte for byte with the block it was saved from.
"""

from __future__ import annotations

import dataclasses
import math
import re
import threading
import time
import types
from collections import Counter
from concurrent import futures
from functools import cache

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from tpuoffload.backend.slot_table import EMPTY_SLOT
from tpuoffload.config import parse_config
from tpuoffload.layout import CacheLayout, UnsupportedCache
from tpuoffload.messages import LoadRequest, OffloadMetadata, StepPlan, SaveBatch
from tpuoffload.sim.tpu_layouts import LAYOUTS, create_caches
from tpuoffload.worker import copy_plan as cp
from tpuoffload.worker import programs as pm
from tpuoffload.worker import transfer_engine as te
from tpuoffload.worker.faults import FaultInjector, FaultPoint
from tpuoffload.worker.offload_worker import OffloadWorker
from tpuoffload.worker.transfer_engine import SaveResult, TransferEngine

BF16, FP8, INT8 = "bf16-8kv-tp4", "fp8-8kv-tp4", "int8-8kv-tp4"
MIXED = "bf16-mixed-hd256-512-tp4"  # two layer groups
DP = ("bf16-dp2-tp4", "bf16-attndp4-tp2")  # blocks split over 2 / 4 batch shards
NUM_SLOTS = 32


# ---------------------------------------------------------------- helpers
@cache
def template(name: str) -> tuple[jax.Array, ...]:
    return tuple(create_caches(LAYOUTS[name])[0])


# Bit patterns no float op may touch: NaNs with payloads (quiet, signalling, negative), infinity,
# -0, the smallest denormal; for 8-bit types the e4m3fn NaNs.
SPECIAL = {1: [0x7F, 0xFF, 0x80, 0x01, 0x00], 2: [0x7FC1, 0xFFFF, 0x7F81, 0xFF81, 0x7F80, 0x8000, 0x0001]}


@cache
def _random_host(name: str, seed: int) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    out = []
    for c in template(name):
        wire = np.dtype(f"uint{8 * c.dtype.itemsize}")
        raw = np.frombuffer(rng.bytes(c.size * c.dtype.itemsize), wire).reshape(c.shape[0], -1).copy()
        raw[:, :len(SPECIAL[wire.itemsize])] = SPECIAL[wire.itemsize]
        raw.flags.writeable = False
        out.append(raw.view(c.dtype).reshape(c.shape))
    return tuple(out)


def random_caches(name: str, seed: int) -> list[jax.Array]:
    """``name``'s caches (shape, dtype, sharding from tpu-inference) filled with random bytes,
    every block of every layer starting with the SPECIAL bit patterns. Fresh arrays every call
    (a load donates the ones it is given)."""
    return [jax.device_put(h, c.sharding) for h, c in zip(_random_host(name, seed), template(name))]


def host(caches) -> list[np.ndarray]:
    """Each layer's bytes, one row per block."""
    return [np.asarray(c).view(np.uint8).reshape(c.shape[0], -1) for c in caches]


def chunk(host_caches, block: int) -> np.ndarray:
    """A block's bytes in every layer, layers back to back (they may differ in size)."""
    return np.concatenate([h[block] for h in host_caches])


@pytest.fixture
def engines():
    made = []

    def make(caches, *, slots=NUM_SLOTS, **kw):
        eng = TransferEngine(caches, slots * CacheLayout.from_caches(caches).device_bytes_per_chunk, **kw)
        made.append(eng)
        return eng

    yield make
    for eng in made:
        eng.wait_idle(10)
        eng.close()


def save_ok(eng, caches, blocks, slots, ids):
    eng.save(caches, blocks, slots, ids)
    assert eng.wait_idle(30)
    assert sorted(eng.drain_results(), key=lambda r: r.save_id) == [SaveResult(i, True) for i in sorted(ids)]


def op_names(ops) -> list[str]:
    return [op.split()[0] for op in ops]


def small_load_ops(groups: int) -> list[str]:
    """What a load moved in one part logs: its reads per group, then its scatters per group."""
    return ["load.read"] * groups + ["load"] * groups


def op_shape(op: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.search(r"shape=\(([^)]*)\)", op).group(1).split(",") if x.strip())


def logged_blocks(op: str) -> list[int]:
    return [int(x) for x in re.search(r"blocks=\[([^]]*)\]", op).group(1).split(",") if x.strip()]


def same_step(a: TransferEngine, b: TransferEngine):
    """Close the step on two engines; they must have dispatched the same thing."""
    da, db = a.finish_step(), b.finish_step()
    assert da.digest == db.digest and da.ops == db.ops, (da.ops, db.ops)
    return da


class Counting:
    """Counts what an engine runs: its per-group save and load programs, and any transfer it
    starts itself."""

    def __init__(self, monkeypatch, eng: TransferEngine) -> None:
        self.calls: Counter[str] = Counter()
        monkeypatch.setattr(te.jax, "device_put", self._wrap("device_put", jax.device_put))
        monkeypatch.setattr(te.jax, "make_array_from_callback",
                            self._wrap("from_callback", jax.make_array_from_callback))
        for prog in eng._programs:
            monkeypatch.setattr(prog, "save", self._wrap("save", prog.save))
            for name in ("load", "read", "scatter"):
                monkeypatch.setattr(prog, name, self._wrap(name, getattr(prog, name)))

    def _wrap(self, name, fn):
        def counted(*a, **k):
            self.calls[name] += 1
            return fn(*a, **k)
        return counted

    def programs(self) -> Counter[str]:
        return Counter({k: v for k, v in self.calls.items() if k in ("save", "load", "read", "scatter")})


class Injected(FaultInjector):
    """One fault at one point, acting only while armed: ``raise`` (the whole operation fails),
    ``positions`` (positions 1 and 3 fail alone) or ``block`` (a slow host: waits until
    ``release``). Records every call."""

    def __init__(self, point: FaultPoint, mode: str, positions=(1, 3)) -> None:
        assert mode in ("raise", "positions", "block")
        self.point, self.mode, self.positions = point, mode, frozenset(positions)
        self._lock = threading.Lock()  # guards calls, _armed, _gate
        self.calls: list[tuple[FaultPoint, int]] = []
        self._armed = False
        self._gate = threading.Event()

    def arm(self) -> None:
        with self._lock:
            self._armed, self._gate = True, threading.Event()

    def release(self) -> None:
        with self._lock:
            self._gate.set()

    def disarm(self) -> None:
        with self._lock:
            self._armed = False
            self._gate.set()

    def hit(self, point: FaultPoint, n: int) -> set[int]:
        with self._lock:
            self.calls.append((point, n))
            active, gate = self._armed and point is self.point, self._gate
        if not active:
            return set()
        if self.mode == "raise":
            raise OSError(f"injected failure at {point.name}")
        if self.mode == "positions":
            return {p for p in self.positions if p < n}
        if not gate.wait(20):  # safety net only: every test releases
            raise TimeoutError("injected slow host never released")
        return set()


# ---------------------------------------------------------------- round trips
# MLA: the latent cache is replicated over the model axis (each tile held by 4 devices, moved once).
@pytest.mark.parametrize("name", [BF16, FP8, INT8, "mla-tp4"])
def test_round_trip_byte_exact(name, engines):
    caches = random_caches(name, 0)
    eng = engines(caches)
    assert eng.backend.num_slots == NUM_SLOTS
    src = host(caches)
    if name != INT8:  # the planted patterns really are NaNs of the cache dtype
        assert np.isnan(np.asarray(caches[0])[3].astype(np.float32)).any()
    blocks, slots, ids = [3, 17, 40, 63, 0], [5, 0, 9, 31, 2], [100, 101, 102, 103, 104]
    save_ok(eng, caches, blocks, slots, ids)
    for b, s, i in zip(blocks, slots, ids):
        assert eng.backend.tag(s) == i

    # Overwrite the whole cache, then load into other block ids.
    caches = random_caches(name, 1)
    before = host(caches)
    targets = [10, 11, 12, 50, 1]
    caches, failed = eng.load(caches, targets, slots, ids)
    assert failed == []
    after = host(caches)
    for b, t in zip(blocks, targets):
        assert np.array_equal(chunk(after, t), chunk(src, b)), (b, t)
    untouched = [x for x in range(LAYOUTS[name].num_blocks) if x not in targets]
    for layer, (c, t) in enumerate(zip(caches, template(name))):
        assert np.array_equal(after[layer][untouched], before[layer][untouched])
        assert c.sharding == t.sharding and c.dtype == t.dtype and c.shape == t.shape
    counters = eng.take_counters()
    slot_bytes = eng.backend.slot_bytes
    assert (counters["chunks_saved"], counters["bytes_saved"], counters["chunks_loaded"],
            counters["bytes_loaded"]) == (5, 5 * slot_bytes, 5, 5 * slot_bytes)
    assert counters["load_errors"] == counters["save_failures"] == 0


def test_round_trip_more_blocks_than_bucket_permuted_subset(engines):
    caches = random_caches(BF16, 2)
    eng = engines(caches)
    src = host(caches)
    blocks = list(range(5, 25))  # 20 blocks in one descending run: copies of 16 + 4, no padding
    slots = list(range(31, 11, -1))
    ids = list(range(1000, 1020))
    save_ok(eng, caches, blocks, slots, ids)
    ops = eng.finish_step().ops
    assert op_names(ops) == ["save"] and op_shape(ops[0])[1] == 20 and logged_copies(ops[0]) == 2
    caches = random_caches(BF16, 3)
    pick = [7, 0, 19, 3]
    caches, failed = eng.load(caches, [40, 41, 42, 43], [slots[p] for p in pick], [ids[p] for p in pick])
    assert failed == []
    after = host(caches)
    for k, p in enumerate(pick):
        assert np.array_equal(chunk(after, 40 + k), chunk(src, blocks[p]))


@pytest.mark.parametrize("name", DP)
def test_blocks_split_by_data_parallelism(name, engines):
    """Sources in every batch shard: every device saves and loads only its shard's blocks.
    Loaded into a block of the same batch shard, a chunk arrives byte-exact; loaded into another
    batch shard (the store keeps a chunk in its source block's batch shard), it is a load error
    with zeros in place, never another shard's bytes or garbage."""
    caches = random_caches(name, 4)
    eng = engines(caches)
    g = eng.layout.groups[0]
    shards, per = g.num_shards, g.blocks_per_shard
    assert shards == {"bf16-dp2-tp4": 2, "bf16-attndp4-tp2": 4}[name]
    src = host(caches)
    blocks = [s * per + k for s in range(shards) for k in (0, per - 1)]
    same = [s * per + k for s in range(shards) for k in (2, 3)]  # same shard as the source
    other = [((s + 1) % shards) * per + k for s in range(shards) for k in (4, 5)]  # the next shard
    slots = list(range(len(blocks)))
    ids = [500 + i for i in slots]
    save_ok(eng, caches, blocks, slots, ids)
    ops = eng.finish_step().ops
    assert op_names(ops) == ["save"] and op_shape(ops[0])[1] == len(blocks)  # 4 or 8: no padding

    caches = random_caches(name, 5)
    before = host(caches)
    # Even positions into their own shard, odd ones into the next shard.
    targets = [same[i] if i % 2 == 0 else other[i] for i in range(len(blocks))]
    caches, failed = eng.load(caches, targets, slots, ids)
    assert failed == targets[1::2]
    after = host(caches)
    for i, (b, t) in enumerate(zip(blocks, targets)):
        if i % 2 == 0:
            assert np.array_equal(chunk(after, t), chunk(src, b)), (b, t)
        else:
            assert g.shard_of(b) != g.shard_of(t) and not chunk(after, t).any(), (b, t)
    rest = [x for x in range(g.num_blocks) if x not in targets]
    for layer in range(len(caches)):
        assert np.array_equal(after[layer][rest], before[layer][rest])
        assert caches[layer].sharding == template(name)[layer].sharding
    # Every chunk, loaded into its own shard, is whole.
    caches, failed = eng.load(caches, same, slots, ids)
    assert failed == []
    after = host(caches)
    for b, t in zip(blocks, same):
        assert np.array_equal(chunk(after, t), chunk(src, b)), (b, t)


@pytest.fixture
def load_program_shape(monkeypatch):
    """Rebuild the programs with the load split into parts / read by loops (module constants)."""
    from tpuoffload.worker import programs

    def set_(**consts):
        for k, v in consts.items():
            monkeypatch.setattr(programs, k, v)
        programs.programs_for.cache_clear()

    yield set_
    monkeypatch.undo()
    programs.programs_for.cache_clear()  # no program built with patched constants outlives the test


@pytest.mark.parametrize("slots", [[7, 3, 11, 0, 30, 12, 5, 9], [8, 9, 20, 21, 4, 5, 14, 15]],
                         ids=["scattered", "runs of 2"])
@pytest.mark.parametrize("parts,static_max", [(1, 256), (4, 256), (2, 0), (4, 0), (1, 0)])
def test_parts_and_loop_reads_byte_exact(engines, load_program_shape, parts, static_max, slots):
    """The programs' variants (one part or several: saves gathered and loads scattered part by
    part; reads and writes written out per copy or in fori_loops; one copy per slot or per run of
    slots) move the same bytes: valid rows exact, placeholders zero, every other block untouched,
    across batch shards."""
    from tpuoffload.worker import programs

    load_program_shape(LOAD_PART_BYTES=1, SAVE_PART_BYTES=1, MAX_PARTS=parts, LOAD_STATIC_MAX=static_max,
                       SAVE_STATIC_MAX=256 - static_max)
    name = "bf16-dp2-tp4"
    caches = random_caches(name, 20)
    eng = engines(caches)
    g = eng.layout.groups[0]
    assert programs.num_parts(8, eng._programs[0].row_bytes, 1) == parts
    src = host(caches)
    per = g.blocks_per_shard
    blocks = [0, 1, 2, 3, per, per + 1, per + 2, per + 3]
    ids = list(range(700, 708))
    save_ok(eng, caches, blocks, slots, ids)
    caches = random_caches(name, 21)
    before = host(caches)
    targets = [4, 5, per + 6, 7, per + 4, 9, per + 5, per + 7]  # positions 2 and 5 cross shards: zeros
    caches, failed = eng.load(caches, targets, slots, ids)
    assert failed == [per + 6, 9]
    # One part, or one copy per part: reads, then the scatter (two programs); otherwise one load
    # program overlapping them.
    copies = cp.copy_plan(slots, eng._copy_cost["load"]).copies
    reads_first = eng._reads_first(copies)
    assert reads_first == (parts == 1 or eng._programs[0].num_copies("load", copies) <= te.READS_FIRST_COPIES)
    assert op_names(eng.finish_step().ops) == ["save"] + (small_load_ops(1) if reads_first else ["load"])
    after = host(caches)
    for b, t in zip(blocks, targets):
        if t in failed:
            assert not chunk(after, t).any(), t
        else:
            assert np.array_equal(chunk(after, t), chunk(src, b)), (b, t)
    rest = [x for x in range(g.num_blocks) if x not in targets]
    for layer in range(len(caches)):
        assert np.array_equal(after[layer][rest], before[layer][rest])


@pytest.mark.parametrize("buffer_chunks,per_piece", [(0.5, 1), (5, 4)])
def test_transfer_buffer_bounds_each_piece(engines, monkeypatch, buffer_chunks, per_piece):
    """A plan larger than the transfer buffer moves in pieces of at most the buffer, each with one
    save (gather + device-to-host) / one load (host-to-device + scatter) program per layer group;
    the bytes stay exact."""
    caches = random_caches(MIXED, 6)
    src = host(caches)
    layout = CacheLayout.from_caches(caches)
    buffer = int(buffer_chunks * layout.device_bytes_per_chunk)
    eng = engines(caches, transfer_buffer_bytes=buffer)
    assert eng.max_chunks_per_transfer == per_piece
    n = 10
    pieces = math.ceil(n / per_piece)
    groups = len(layout.groups)
    blocks, slots, ids = list(range(20, 20 + n)), list(range(n - 1, -1, -1)), list(range(300, 300 + n))
    fresh = random_caches(MIXED, 7)
    before = host(fresh)
    count = Counting(monkeypatch, eng)
    save_ok(eng, caches, blocks, slots, ids)
    ops = eng.finish_step().ops
    assert op_names(ops) == ["save"] * groups * pieces
    assert count.programs() == Counter(save=groups * pieces)
    moved = []
    for op in ops:
        assert op_shape(op)[1] <= per_piece  # the device-side batch never exceeds the buffer
        assert op_shape(op)[1] * layout.device_bytes_per_chunk <= max(buffer, layout.device_bytes_per_chunk)
        moved.append(logged_blocks(op))
    # every block once, in ascending slot order (a plan of several pieces is sorted by slot first)
    assert [b for blk in moved[::groups] for b in blk] == blocks[::-1]

    count.calls.clear()
    targets = list(range(40, 40 + n))
    out, failed = eng.load(fresh, targets, slots, ids)
    assert failed == []
    ops = eng.finish_step().ops
    assert op_names(ops) == small_load_ops(groups) * pieces
    assert count.programs() == Counter(read=groups * pieces, scatter=groups * pieces)
    assert all(op_shape(op)[1] <= per_piece for op in ops)
    scatters = [op for op in ops if op_names([op]) == ["load"]]
    assert [b for op in scatters[::groups] for b in logged_blocks(op)] == targets[::-1]
    after = host(out)
    for b, t in zip(blocks, targets):
        assert np.array_equal(chunk(after, t), chunk(src, b)), (b, t)
    rest = [x for x in range(layout.num_blocks) if x not in targets]
    for layer in range(len(out)):
        assert np.array_equal(after[layer][rest], before[layer][rest])


# ---------------------------------------------------------------- slot runs
def _groups_are_runs(slots: np.ndarray, run: int) -> bool:
    groups = slots.reshape(-1, run)
    return bool((groups == groups[:, :1] + np.arange(run)).all())


@pytest.mark.parametrize("slots,padded,run", [
    (list(range(8)), 8, 8),
    (list(range(24, 32)), 8, 8),  # ends at the store's last slot
    (list(range(5, 17)), 16, 4),  # 12 rows padded to 16: padding repeats the last group of 4
    ([30, 31, 0, 1, 2, 3, 4, 5], 8, 2),  # wraps past the last slot: a break at row 2
    ([1, 2, 3, 4, 9, 10, 11, 12], 8, 4),  # two runs, each an aligned group
    ([1, 2, 3, 9, 10, 11, 12, 13], 8, 1),  # a break at row 3
    (list(range(7, -1, -1)), 8, 1),  # descending
    ([3, 3, 4, 5], 4, 1),  # a slot read twice (a load may): a break at row 1
    ([3, 4, 4, 5], 4, 2),  # ... or at row 2: two groups of 2
    ([3, 4, 5, 6, 3, 4, 5, 6], 8, 4),  # one run read into two sets of blocks
    ([6], 8, 1), ([6, 7], 2, 2), ([], 8, 1),
])
def test_slot_run_examples(slots, padded, run):
    assert pm.slot_run(slots, padded) == run


def test_slot_run_of_one_ascending_run_is_the_widest_the_padding_allows():
    """The fast path (a list that is one ascending run) against the general one, on every length
    and a few starts, and its negative: a run with one slot changed is not taken for a run."""
    for n in range(1, 70):
        for start in (0, 5, 1000 - n):
            run = list(range(start, start + n))
            for padded in {pm.bucket(n, 64), pm.bucket(n, 8) if n <= 8 else pm.bucket(n, 64)}:
                assert pm.slot_run(run, padded) == pm.slot_run(np.array(run), padded)
            if n > 1:  # a break before the last row: a group width must divide n - 1
                broken = run[:-1] + [run[-1] + 1]
                assert pm.slot_run(broken, pm.bucket(n, 64)) <= (n - 1) & -(n - 1)


def test_slot_run_is_the_widest_width_whose_padded_plan_is_runs():
    """Against brute force, on random plans made of ascending and descending runs and repeats: the
    padded plan (both ``save_plan_ids`` and ``load_plan_ids``) keeps the real rows, holds
    consecutive slots in every aligned group of ``run`` rows, and no wider width allowed by the
    padding does; save padding rewrites real (block, slot) pairs; load padding targets no block."""
    rng = np.random.default_rng(7)
    for _ in range(400):
        slots: list[int] = []
        n = int(rng.integers(1, 40))
        while len(slots) < n:
            start, length = int(rng.integers(0, 200)), int(rng.choice([1, 2, 3, 4, 8, 16]))
            step = -1 if rng.random() < 0.2 else 1
            slots += [max(0, start + step * i) for i in range(length)]
        slots = slots[:n]
        padded = pm.bucket(n, 64)
        blocks = [1000 + 3 * i for i in range(n)]
        widest = max(w for w in (1 << k for k in range(padded.bit_length())) if w <= padded and n % w == 0
                     and _groups_are_runs(pm.save_plan_ids(blocks, slots, 64, w)[1], w))
        run = pm.slot_run(slots, padded)
        assert run == widest, (slots, run, widest)
        assert pm.slot_run(np.array(slots), padded) == run  # the numpy path agrees
        save = pm.save_plan_ids(blocks, slots, 64, run)
        load = pm.load_plan_ids(blocks, slots, [1] * n, 99, 64, run)
        for ids in (save, load):
            assert ids.shape == (3, padded) and _groups_are_runs(ids[1], run)
            assert ids[0, :n].tolist() == blocks and ids[1, :n].tolist() == slots
        pairs = set(zip(blocks, slots))
        assert all((int(b), int(s)) in pairs for b, s in zip(save[0, n:], save[1, n:])) and (save[2] == 1).all()
        assert (load[0, n:] == 99).all() and (load[2, n:] == 0).all() and (load[2, :n] == 1).all()


# slots of one save, the width its programs use, and four sentinel slots saved just before it
# (neighbours a wrong width would overwrite).
SLOT_PATTERNS = {
    "run to the last slot": (list(range(NUM_SLOTS - 8, NUM_SLOTS)), 8, [20, 21, 22, 23]),
    "wraps": ([30, 31, 0, 1, 2, 3, 4, 5], 2, [6, 7, 28, 29]),
    "12 ascending": (list(range(3, 15)), 4, [15, 16, 17, 18]),
    "descending": (list(range(NUM_SLOTS - 1, NUM_SLOTS - 9, -1)), 1, [20, 21, 22, 23]),
    "two runs": ([1, 2, 3, 4, 9, 10, 11, 12], 4, [5, 6, 7, 8]),
    "scattered": ([7, 3, 11, 0, 30, 12, 5, 9], 1, [1, 2, 4, 6]),
}


def logged_run(op: str) -> int:
    return int(re.search(r"\brun=(\d+)", op).group(1))


def logged_copies(op: str) -> int:
    return int(re.search(r"\bcopies=(\d+)", op).group(1))


def widest(slots) -> int:
    return cp.copy_plan(list(slots)).copies[0][0]


def slot_pattern_round_trip(engines, pattern: str) -> tuple[list[str], list[int]]:
    """Save sentinels, then the pattern's chunks (from both batch shards); load them back in the
    saved order, then in ascending slot order (another width), then the sentinels. Returns the
    mismatches and the widths logged by the save, the first load's read, the second's."""
    slots, _, sentinels = SLOT_PATTERNS[pattern]
    name = "bf16-dp2-tp4"
    caches = random_caches(name, 30)
    eng = engines(caches)
    per = eng.layout.groups[0].blocks_per_shard
    n = len(slots)
    src = host(caches)
    blocks = [(i % 2) * per + i for i in range(n)]
    ids = list(range(900, 900 + n))
    save_ok(eng, caches, [12, 13, per + 12, per + 13], sentinels, [800, 801, 802, 803])
    save_ok(eng, caches, blocks, slots, ids)
    runs = [logged_run(eng.finish_step().ops[-1])]
    bad = []
    order = sorted(range(n), key=lambda i: slots[i])
    for k, (pos, first) in enumerate(((list(range(n)), 16), (order, 20))):
        caches = random_caches(name, 31 + k)
        targets = [(i % 2) * per + first + j for j, i in enumerate(pos)]
        caches, failed = eng.load(caches, targets, [slots[i] for i in pos], [ids[i] for i in pos])
        ops = eng.finish_step().ops
        assert failed == [] and op_names(ops) == small_load_ops(1)
        runs.append(logged_run(ops[0]))
        after = host(caches)
        bad += [f"load {k} slot {slots[i]}" for i, t in zip(pos, targets)
                if not np.array_equal(chunk(after, t), chunk(src, blocks[i]))]
    caches, failed = eng.load(random_caches(name, 33), [14, 15, per + 14, per + 15], sentinels, [800, 801, 802, 803])
    after = host(caches)
    bad += [f"sentinel slot {s}" for s, b, t in zip(sentinels, [12, 13, per + 12, per + 13], [14, 15, per + 14, per + 15])
            if not np.array_equal(chunk(after, t), chunk(src, b))]
    return bad, runs


@pytest.mark.parametrize("pattern", SLOT_PATTERNS)
def test_slot_runs_round_trip_byte_exact(engines, pattern):
    """Whatever the slots (one run, a run that ends at the store's last slot or wraps past it, a
    run that is padded, descending slots, scattered ones), each chunk comes back byte-exact, loaded
    in the saved order or in another, and no neighbouring slot is touched; the save moves its slots
    in the copies ``copy_plan`` gives (rows sorted by slot: a descending run is one copy)."""
    slots, _, _ = SLOT_PATTERNS[pattern]
    bad, runs = slot_pattern_round_trip(engines, pattern)
    assert bad == []
    assert runs == [widest(slots)] * 3  # rows sorted by slot: the load in another order copies alike


@pytest.mark.parametrize("src_slots,dst_slots", [
    ([0, 1, 2, 3, 4, 5], [20, 21, 22, 23, 24, 25]),  # runs of 2, padded to 8
    ([9, 3, 7, 1, 5], [30, 31, 0, 1, 2]),  # wraps; 5 rows: one copy per slot
    (list(range(8)), list(range(NUM_SLOTS - 8, NUM_SLOTS))),  # one run to the last slot
])
def test_disk_tier_read_and_install_with_slot_runs(engines, src_slots, dst_slots):
    """The disk tier's two programs use the widths too: chunks read out of slots (``read_slots``)
    and written back into other slots (``install``, padding rewriting the last group with its own
    bytes) load byte-exact, and the slots around them keep their chunks."""
    caches = random_caches(BF16, 40)
    src = host(caches)
    eng = engines(caches)
    n = len(src_slots)
    keep = [s for s in range(NUM_SLOTS) if s not in src_slots and s not in dst_slots][:4]
    save_ok(eng, caches, list(range(n)), src_slots, list(range(100, 100 + n)))
    save_ok(eng, caches, [40, 41, 42, 43], keep, [200, 201, 202, 203])
    rows, ok = eng.read_slots(src_slots, list(range(100, 100 + n)))
    assert ok == [True] * n
    eng.install(eng.rows_to_payloads(rows, n), dst_slots, list(range(300, 300 + n)))
    assert eng.wait_idle(30) and all(r.ok for r in eng.drain_results())
    ops = eng.finish_step().ops
    assert [logged_run(op) for op in ops[-2:]] == [pm.slot_run(src_slots, pm.bucket(n, 8)),
                                                   pm.slot_run(dst_slots, pm.bucket(n, 8))]
    out, failed = eng.load(random_caches(BF16, 41), list(range(50, 50 + n)) + [60, 61, 62, 63], dst_slots + keep,
                           list(range(300, 300 + n)) + [200, 201, 202, 203])
    assert failed == []
    after = host(out)
    for i in range(n):
        assert np.array_equal(chunk(after, 50 + i), chunk(src, i)), i
    for k, b in enumerate([40, 41, 42, 43]):
        assert np.array_equal(chunk(after, 60 + k), chunk(src, b)), keep[k]


@pytest.mark.parametrize("pattern", ["wraps", "two runs", "descending"])
def test_slot_runs_negative_control_wrong_width(engines, monkeypatch, pattern):
    """The round trip above catches a wrong copy plan: an engine that takes every plan for one
    ascending run in the listed order overwrites neighbouring slots (a run that wraps, two runs)
    or stores a descending run reversed (seen by the load in another order)."""
    n_bits = lambda n: tuple((1 << b, 1) for b in range(n.bit_length() - 1, -1, -1) if n >> b & 1)  # noqa: E731
    monkeypatch.setattr(te, "copy_plan", lambda slots, cost: cp.CopyPlan(None, n_bits(len(slots)), None))
    bad, _ = slot_pattern_round_trip(engines, pattern)
    assert bad


# ---------------------------------------------------------------- copy structures (issue 24)
@pytest.mark.parametrize("slots,save_copies", [
    (list(range(NUM_SLOTS - 1, NUM_SLOTS - 27, -1)), 3),  # 26 descending, to the store's last slot: 16 + 8 + 2
    (list(range(3, 29)), 3),  # 26 ascending: no power of two
    (list(range(20, 32))[::-1] + list(range(0, 12)), 4),  # two descending/ascending runs of 12: 8 + 4 each
])
def test_descending_and_odd_runs_move_in_few_copies_byte_exact(engines, slots, save_copies):
    """Issue 24: a descending run, or a run of no power-of-two length, moves in a few wide copies
    (the count the engine logs), not one per slot; the chunks come back byte-exact, loaded in
    another order (reversed), and the slots around them keep their chunks."""
    name = "bf16-dp2-tp4"
    caches = random_caches(name, 60)
    eng = engines(caches)
    per = eng.layout.groups[0].blocks_per_shard
    src = host(caches)
    n = len(slots)
    blocks = [(i % 2) * per + i for i in range(n)]
    keep = [s for s in range(NUM_SLOTS) if s not in slots][:4]
    sentinels = [26, 27, per + 26, per + 27]  # each loaded back within its batch shard
    save_ok(eng, caches, sentinels, keep, [500, 501, 502, 503])
    ids = list(range(900, 900 + n))
    save_ok(eng, caches, blocks, slots, ids)
    ops = eng.finish_step().ops
    assert logged_copies(ops[-1]) == save_copies and op_shape(ops[-1])[1] == n  # no padding
    pos = list(range(n))[::-1]
    targets = [(i % 2) * per + i // 2 for i in pos]  # the source's batch shard, other blocks
    out, failed = eng.load(random_caches(name, 61), targets + [20, 21, per + 20, per + 21],
                           [slots[i] for i in pos] + keep, [ids[i] for i in pos] + [500, 501, 502, 503])
    assert failed == []
    ops = eng.finish_step().ops
    assert sum(logged_copies(op) for op in ops if op.startswith("load.read") or "copies=" in op) <= save_copies + 4
    after = host(out)
    for i, t in zip(pos, targets):
        assert np.array_equal(chunk(after, t), chunk(src, blocks[i])), (slots[i], t)
    for b, t in zip(sentinels, [20, 21, per + 20, per + 21]):
        assert np.array_equal(chunk(after, t), chunk(src, b))


# Covering copies (copy_plan): in this layout a save's copy costs 6 rows and a load's 12, so a run
# of 23 moves as 16 + 8 (one slot twice), a run of 11 loads as 8 + 4 (one slot twice) and seven
# runs of 2 save as eight copies of 2, the last repeated.
COVERED_RUNS = [list(range(25, 2, -1)), list(range(40, 51))] + [[60 + 4 * k, 61 + 4 * k] for k in range(7)]


def covering_round_trip(engines, monkeypatch=None, mutate=None) -> tuple[list[str], int]:
    """Save the covered runs (listed shuffled, one descending) from both batch shards around
    sentinel slots, load them back in another order into other blocks of their shards, then the
    sentinels. Returns the mismatches and the rows the load moved twice."""
    name = "bf16-dp2-tp4"
    caches = random_caches(name, 70)
    eng = engines(caches, slots=128)
    per = eng.layout.groups[0].blocks_per_shard
    src = host(caches)
    rng = np.random.default_rng(7)
    slots = [s for k in rng.permutation(len(COVERED_RUNS)) for s in COVERED_RUNS[k]]
    n = len(slots)
    assert cp.copy_plan(slots, eng._copy_cost["save"]).repeats is not None
    blocks = [(i % 2) * per + i // 2 for i in range(n)]  # both batch shards
    used = set(slots)
    sentinels = sorted({s + d for run in COVERED_RUNS for s in (min(run), max(run)) for d in (-1, 1)} - used)
    sentinel_blocks = [(k % 2) * per + k // 2 for k in range(len(sentinels))]
    save_ok(eng, caches, sentinel_blocks, sentinels, list(range(500, 500 + len(sentinels))))
    ids = list(range(900, 900 + n))
    save_ok(eng, caches, blocks, slots, ids)
    ops = eng.finish_step().ops
    save_copies = cp.copy_plan(slots, eng._copy_cost["save"]).copies
    assert logged_copies(ops[-1]) == eng._programs[0].num_copies("save", save_copies)
    if pm.SAVE_SINGLE_ROW_BYTES <= eng._programs[0].row_bytes:  # rows this large: one per copy
        assert logged_copies(ops[-1]) == cp.copy_rows(save_copies)
    if mutate is not None:
        monkeypatch.setattr(te, "copy_plan", mutate)
    pos = rng.permutation(n).tolist()
    within = rng.permutation(n // 2)  # another block of the source's own batch shard
    targets = [(i % 2) * per + int(within[i // 2]) for i in pos]
    load_plan = cp.copy_plan([slots[i] for i in pos], eng._copy_cost["load"])
    out, failed = eng.load(random_caches(name, 71), targets, [slots[i] for i in pos], [ids[i] for i in pos])
    assert failed == []
    after = host(out)
    bad = [f"slot {slots[i]}" for i, t in zip(pos, targets)
           if not np.array_equal(chunk(after, t), chunk(src, blocks[i]))]
    if mutate is not None:
        monkeypatch.undo()  # the sentinels load with the real plan
    out, failed = eng.load(out, sentinel_blocks, sentinels, list(range(500, 500 + len(sentinels))))
    after = host(out)
    bad += [f"sentinel {s}" for s, b in zip(sentinels, sentinel_blocks)
            if not np.array_equal(chunk(after, b), chunk(src, b))]
    return bad, int(load_plan.repeats.sum()) if load_plan.repeats is not None else 0


@pytest.mark.parametrize("single_row_bytes", [pm.SAVE_SINGLE_ROW_BYTES, 1], ids=["wide", "one row per copy"])
def test_covering_copies_round_trip_byte_exact(engines, load_program_shape, single_row_bytes):
    """A save writes the slots a covering copy reaches back over twice, with the same bytes, and
    no slot outside its runs (the sentinels around every run keep their chunks); a load reads
    them twice but scatters each block once (the repeated rows target no block): every chunk
    comes back byte-exact in its own batch shard. Alike when the save writes one row per copy
    (rows of at least SAVE_SINGLE_ROW_BYTES)."""
    load_program_shape(SAVE_SINGLE_ROW_BYTES=single_row_bytes)
    bad, twice = covering_round_trip(engines)
    assert bad == [] and twice > 0


def test_covering_copies_negative_control_repeats_misplaced(engines, monkeypatch):
    """With the load's repeated rows marked one row late, one row a covering copy alone moves is
    dropped: the round trip above is sensitive to which rows a load drops."""
    real = te.copy_plan

    def late(slots, cost):
        plan = real(slots, cost)
        return plan if plan.repeats is None else plan._replace(repeats=np.roll(plan.repeats, 1))

    bad, _ = covering_round_trip(engines, monkeypatch, late)
    assert bad and not any(b.startswith("sentinel") for b in bad)


# ---------------------------------------------------------------- power-of-two pieces
@pytest.mark.parametrize("n,cap,step,sizes", [
    (0, 8, 1, []),
    (1, 64, 1, [1]), (1, 64, 8, [1]),
    (7, 64, 1, [4, 2, 1]), (7, 64, 2, [7]), (7, 64, 8, [7]),
    (9, 64, 1, [8, 1]), (9, 64, 2, [8, 1]), (9, 64, 8, [9]),
    (40, 64, 1, [32, 8]), (40, 32, 1, [32, 8]), (40, 16, 8, [16, 16, 8]),
    (100, 128, 1, [64, 32, 4]), (100, 128, 8, [64, 32, 4]), (100, 64, 1, [64, 32, 4]),
    (127, 128, 8, [127]), (300, 128, 8, [128, 128, 32, 12]), (5, 2, 8, [2, 2, 1]),
])
def test_piece_sizes_examples(n, cap, step, sizes):
    assert pm.piece_sizes(n, cap, step) == sizes


def test_piece_sizes_pad_less_than_a_step_in_few_power_of_two_pieces():
    """Every plan: the pieces cover it in order, each a power of two of at most ``cap`` rows but
    maybe the last; padding them to their buckets adds fewer than ``step`` rows; there are at most
    ``n // cap + log2(cap / step) + 1`` of them."""
    for cap in (1, 2, 8, 32, 128):
        for step in (1, 2, 8, 64):
            s = min(step, cap)
            for n in range(0, 3 * cap + 9):
                sizes = pm.piece_sizes(n, cap, step)
                assert sum(sizes) == n and all(0 < p <= cap for p in sizes)
                assert all(p & (p - 1) == 0 for p in sizes[:-1]), sizes
                assert sum(pm.bucket(p, cap) for p in sizes) - n < s, (n, cap, step, sizes)
                assert len(sizes) <= n // cap + (cap // s).bit_length(), (n, cap, step, sizes)


def test_piece_step_comes_from_the_layout(engines, monkeypatch):
    """The step is the power of two of rows whose bytes (per device) reach PIECE_BYTES, at most
    the transfer buffer's rows: the layout alone decides it, the same on every host."""
    caches = random_caches(BF16, 50)
    row = sum(p.row_bytes for p in engines(caches)._programs)
    for piece_bytes, step in ((1, 1), (row, 1), (row + 1, 2), (5 * row, 8), (1 << 40, NUM_SLOTS)):
        monkeypatch.setattr(pm, "PIECE_BYTES", piece_bytes)
        assert engines(caches, transfer_buffer_bytes=NUM_SLOTS * row * 4).piece_step == step, piece_bytes


PIECE_SLOTS = {  # slots of a plan of n chunks in a store of 256 slots
    "one run": lambda n: list(range(100, 100 + n)),  # spans every piece boundary
    "run per piece": lambda n: [i + 2 * k + 1 for k, p in enumerate(pm.piece_sizes(n, 128))  # breaks at each
                                for i in range(sum(pm.piece_sizes(n, 128)[:k]), sum(pm.piece_sizes(n, 128)[:k + 1]))],
    "scattered": lambda n: np.random.default_rng(n).permutation(256)[:n].tolist(),
}


@pytest.mark.parametrize("pattern", PIECE_SLOTS)
@pytest.mark.parametrize("n", [1, 7, 9, 40, 100])
def test_pieces_round_trip_byte_exact(engines, n, pattern):
    """A plan larger than the transfer buffer (32 chunks here) moves in pieces of the buffer and a
    rest, each save and load program one piece, the plan first sorted by slot (runs stay whole);
    each piece's slots give its own copy structure (programs.copy_plan), whether a run of slots
    continues across a piece boundary or a new run starts at one. The chunks come back byte-exact; blocks and slots outside
    the plan keep theirs; a save that overwrites the same slots right away (write-after-write across
    pieces) wins, and the older save's ids no longer load."""
    spec = dataclasses.replace(LAYOUTS[BF16], num_blocks=256)
    rng = np.random.default_rng(n)
    caches = [jax.device_put(rng.integers(0, 1 << 16, c.shape, np.uint16).view(c.dtype), c.sharding)
              for c in create_caches(spec)[0]]  # 256 blocks of random bytes
    src = host(caches)
    eng = engines(caches, slots=256, transfer_buffer_bytes=32 * CacheLayout.from_caches(caches).device_bytes_per_chunk)
    assert eng.max_chunks_per_transfer == 32
    slots = PIECE_SLOTS[pattern](n)
    sizes = [32] * (n // 32) + ([n % 32] if n % 32 else [])
    assert [p.stop - p.start for p in eng.pieces(n)] == sizes
    listed = sorted(slots) if len(sizes) > 1 else slots
    starts = np.cumsum([0] + sizes[:-1])
    plans = {op: [cp.copy_plan(listed[a:a + p], eng._copy_cost[op]).copies for a, p in zip(starts, sizes)]
             for op in ("save", "load")}
    sentinel = [s for s in range(256) if s not in slots][:2]
    save_ok(eng, caches, [250, 251], sentinel, [1, 2])
    older, newer = list(range(1000, 1000 + n)), list(range(2000, 2000 + n))
    eng.save(caches, list(range(n, 2 * n)), slots, older)  # overwritten at once by the next save
    eng.save(caches, list(range(n)), slots, newer)
    assert eng.wait_idle(30)
    assert {r.save_id for r in eng.drain_results() if r.ok} == set(older) | set(newer)
    ops = eng.finish_step().ops
    saves = ops[1:]
    assert [op_shape(op)[1] for op in saves] == [cp.copy_rows(c) for c in plans["save"]] * 2  # one program per piece
    assert [logged_copies(op) for op in saves] == [eng._programs[0].num_copies("save", c) for c in plans["save"]] * 2
    targets = list(range(120, 120 + n))
    fresh = random_caches(BF16, 51)
    fresh = [jax.device_put(np.concatenate([np.asarray(c)] * 4), caches[0].sharding) for c in fresh]
    before = host(fresh)
    out, failed = eng.load(fresh, targets, slots, newer)
    assert failed == []
    loads = eng.finish_step().ops
    assert [op_shape(op)[1] for op in loads if op.startswith("load ")] == [cp.copy_rows(c) for c in plans["load"]]
    after = host(out)
    for i, t in enumerate(targets):
        assert np.array_equal(chunk(after, t), chunk(src, i)), (i, t)
    rest = [x for x in range(256) if x not in targets]
    for layer in range(len(out)):
        assert np.array_equal(after[layer][rest], before[layer][rest])
    out, failed = eng.load(out, [200, 201], sentinel, [1, 2])
    assert failed == [] and all(np.array_equal(chunk(host(out), t), chunk(src, b)) for t, b in ((200, 250), (201, 251)))
    out, failed = eng.load(out, targets[:3], slots[:3], older[:3])  # the tags are the newer save's
    assert failed == targets[:3]


class Recorder(FaultInjector):
    def __init__(self) -> None:
        self.calls: list[tuple[FaultPoint, int]] = []
        self._lock = threading.Lock()

    def hit(self, point: FaultPoint, n: int) -> set[int]:
        with self._lock:
            self.calls.append((point, n))
        return set()


def test_a_call_of_several_pieces_completes_once_and_checks_once(engines):
    """However many pieces a save has, one background completion records all of its slots (one
    future in flight, chained once); a load's checks (late writes, tags, faults) run once for the
    whole plan, before its first scatter."""
    caches = random_caches(BF16, 52)
    faults = Recorder()
    eng = engines(caches, faults=faults, transfer_buffer_bytes=4 * CacheLayout.from_caches(caches).device_bytes_per_chunk)
    n = 13  # 4 + 4 + 4 + 1
    assert len(eng.pieces(n)) == 4
    save_ok(eng, caches, list(range(n)), list(range(n)), list(range(100, 100 + n)))
    assert faults.calls == [(FaultPoint.SAVE_PROGRAM, n), (FaultPoint.SAVE_RECORD, n)]
    assert len(set(eng._write_call[:n].tolist())) == 1
    faults.calls.clear()
    out, failed = eng.load(caches, list(range(20, 20 + n)), list(range(n)), list(range(100, 100 + n)))
    assert failed == [] and faults.calls == [(FaultPoint.LOAD_SLOT_CHECK, n), (FaultPoint.LOAD_PREPARE, n)]
    assert op_names(eng.finish_step().ops) == ["save"] * 4 + small_load_ops(1) * 4


def test_a_completion_that_finishes_at_once_leaves_no_inflight_entry(engines):
    """A save's completion removes its own in-flight entry when done; the engine inserts that
    entry under the lock the completion takes, so even a completion that finishes before the
    entry could be written (here the pool's submit waits for it, up to 0.3 s) cannot run first
    and leave the entry behind for good (inflight() would report it forever)."""
    caches = random_caches(BF16, 53)
    eng = engines(caches)
    pool = eng._pool

    class WaitsForTheWork:
        def submit(self, fn, *args):
            fut = pool.submit(fn, *args)
            futures.wait([fut], timeout=0.3)
            return fut

        def shutdown(self, wait=True):
            pool.shutdown(wait)

    eng._pool = WaitsForTheWork()
    save_ok(eng, caches, [1, 2], [3, 4], [10, 11])
    assert eng.inflight() == (0, 0, None)


# ---------------------------------------------------------------- write-after-write
class SlowOlder(FaultInjector):
    """Sleeps while completing the 1-chunk save (A) only, just before A records what its slot
    holds; records when that sleep ended and when the 2-chunk save (B) started completing (its
    first fault point, after its write chain)."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.times: dict[str, float] = {}

    def hit(self, point: FaultPoint, n: int) -> set[int]:
        if point is FaultPoint.SAVE_RECORD and n == 1:
            time.sleep(self.delay)
            self.times["a_end"] = time.monotonic()
        elif point is FaultPoint.SAVE_PROGRAM and n == 2:
            self.times["b_start"] = time.monotonic()
        return set()


def _waw_run(engines, chain: bool, delay: float):
    caches = random_caches(BF16, 20)
    faults = SlowOlder(delay)
    eng = engines(caches, faults=faults, save_threads=4)
    if not chain:
        eng._earlier_writes = lambda slots: {}  # mutation: no write chains
    eng.save(caches, [5], [7], [1])  # A: older, slow
    eng.save(caches, [9, 10], [7, 8], [2, 3])  # B: newer, another block, same slot 7
    assert eng.wait_idle(30)
    assert {r.save_id: r.ok for r in eng.drain_results()} == {1: True, 2: True, 3: True}
    src = host(caches)
    out, failed_b = eng.load(random_caches(BF16, 21), [30], [7], [2])
    out, failed_a = eng.load(out, [31], [7], [1])
    return eng, faults, src, host(out), failed_b, failed_a


def test_write_after_write_newest_wins(engines):
    eng, faults, src, after, failed_b, failed_a = _waw_run(engines, chain=True, delay=0.5)
    assert eng.backend.tag(7) == 2
    assert failed_b == []
    assert np.array_equal(chunk(after, 30), chunk(src, 9))  # B's bytes
    # B's completion began only after A's had finished.
    assert faults.times["b_start"] >= faults.times["a_end"]
    # A is gone for good: never served, and block 31 holds zeros.
    assert failed_a == [31] and not chunk(after, 31).any()


def test_write_after_write_negative_control_without_chaining(engines):
    """With the chain removed, the same sequence ends with the slot recorded as A's chunk while it
    holds B's bytes: a load asking for A gets B's block as if it were A's. The test above is
    sensitive to the chaining."""
    eng, faults, src, after, failed_b, failed_a = _waw_run(engines, chain=False, delay=1.0)
    assert faults.times["b_start"] < faults.times["a_end"]
    assert eng.backend.tag(7) == 1
    assert failed_b == [30]
    assert failed_a == [] and np.array_equal(chunk(after, 31), chunk(src, 9))  # wrong chunk served
    assert not np.array_equal(chunk(src, 9), chunk(src, 5))


# ---------------------------------------------------------------- read-after-write
def test_read_after_write_waits_for_inflight_write(engines):
    caches = random_caches(BF16, 30)
    faults = Injected(FaultPoint.SAVE_RECORD, "block")
    eng = engines(caches, faults=faults)
    save_ok(eng, caches, [8], [4], [1])  # an older committed chunk in the slot
    out, _ = eng.load(random_caches(BF16, 31), [0], [4], [1])  # compile the load outside the timing
    src = host(out)
    faults.arm()
    eng.save(out, [12], [4], [2])  # slow overwrite
    chunks, _, oldest = eng.inflight()
    assert chunks == 1 and oldest is not None
    timer = threading.Timer(0.5, faults.release)  # the save completes 0.5 s from now
    timer.start()
    t0 = time.monotonic()
    out, failed = eng.load(out, [50], [4], [2])  # immediately
    waited = time.monotonic() - t0
    timer.join()
    assert failed == []
    assert np.array_equal(chunk(host(out), 50), chunk(src, 12))
    assert waited >= 0.4  # it really waited for the write


def test_read_after_write_timeout_fails_with_zeros_not_stale(engines):
    caches = random_caches(BF16, 40)
    src = host(caches)
    faults = Injected(FaultPoint.SAVE_RECORD, "block")
    eng = engines(caches, faults=faults, load_wait_timeout_s=0.1)
    save_ok(eng, caches, [8, 9], [4, 5], [1, 3])  # slot 4: older chunk (block 8), slot 5: healthy
    faults.arm()
    eng.save(caches, [12], [4], [2])  # an overwrite of slot 4 whose completion does not finish
    fresh = random_caches(BF16, 41)
    before = host(fresh)
    t0 = time.monotonic()
    out, failed = eng.load(fresh, [50, 51], [4, 5], [2, 3])
    took = time.monotonic() - t0
    assert took < 10, "the load must not wait for the whole write"
    assert failed == [50]
    after = host(out)
    assert not chunk(after, 50).any()  # zeros: not the old chunk, not the old cache block
    assert chunk(before, 50).any() and chunk(src, 8).any()
    assert np.array_equal(chunk(after, 51), chunk(src, 9))
    # Later, the slow write lands and the chunk becomes loadable.
    faults.disarm()
    assert eng.wait_idle(30)
    assert {r.save_id: r.ok for r in eng.drain_results()} == {2: True}
    out, failed = eng.load(out, [52], [4], [2])
    assert failed == []
    assert np.array_equal(chunk(host(out), 52), chunk(src, 12))


def _stale_slot_run(engines, *, wait: bool):
    """Slot 4 holds chunk 1 (block 8); its overwrite by chunk 2 (block 12) is queued behind another
    slow save (one save thread), so the slot table still says chunk 1 while the store, ordered by
    the runtime, already holds (or will before any later program reads it) block 12's bytes. Then
    a load asks for chunk 1 from slot 4."""
    caches = random_caches(BF16, 50)
    src = host(caches)
    faults = Injected(FaultPoint.SAVE_RECORD, "block")
    eng = engines(caches, faults=faults, save_threads=1, load_wait_timeout_s=0.1)
    if not wait:
        eng._wait_for_writes = lambda slots: set()  # mutation: no read-after-write wait
    save_ok(eng, caches, [8], [4], [1])  # old chunk in slot 4
    faults.arm()
    eng.save(caches, [20], [10], [5])  # occupies the only save thread
    eng.save(caches, [12], [4], [2])  # overwrite of slot 4: queued
    assert eng.backend.tag(4) == 1
    ok, sources = eng.backend.lookup([4], [1])
    assert ok.all() and sources.tolist() == [8]  # the slot table alone: "valid"
    out, failed = eng.load(random_caches(BF16, 51), [60], [4], [1])
    faults.disarm()
    assert eng.wait_idle(30)
    assert eng.backend.tag(4) == 2
    return src, host(out), failed


def test_read_after_write_timeout_never_serves_stale_chunk_backend_would_accept(engines):
    """Only the read-after-write wait protects this load: it times out, so block 60 is a load
    error with zeros, although the slot table alone would have accepted slot 4 as chunk 1."""
    src, after, failed = _stale_slot_run(engines, wait=True)
    assert failed == [60]
    assert not chunk(after, 60).any()


def test_read_after_write_negative_control_without_wait(engines):
    """Without the wait the same load succeeds and serves block 12's bytes as chunk 1 (block 8):
    the test above is sensitive to the wait."""
    src, after, failed = _stale_slot_run(engines, wait=False)
    assert failed == []
    assert np.array_equal(chunk(after, 60), chunk(src, 12)) and not np.array_equal(chunk(src, 12), chunk(src, 8))


# ---------------------------------------------------------------- failed writes
def test_failed_write_reports_not_ok_and_is_not_loadable(engines):
    caches = random_caches(BF16, 60)
    faults = Injected(FaultPoint.SAVE_RECORD, "raise")
    eng = engines(caches, faults=faults)
    save_ok(eng, caches, [8], [4], [1])  # an older committed chunk in slot 4
    faults.arm()
    eng.save(caches, [12, 13], [4, 6], [2, 3])  # this batch fails
    assert eng.wait_idle(30)
    faults.disarm()
    assert sorted(eng.drain_results(), key=lambda r: r.save_id) == [SaveResult(2, False), SaveResult(3, False)]
    assert eng.backend.tag(4) == EMPTY_SLOT and eng.backend.tag(6) == EMPTY_SLOT
    out, failed = eng.load(caches, [50, 51, 52], [4, 6, 5], [2, 3, 1])
    assert failed == [50, 51, 52]  # slot 5 never written
    # The old chunk that used to be in slot 4 is not loadable either: the slot was being overwritten.
    out, failed = eng.load(out, [53], [4], [1])
    assert failed == [53]
    after = host(out)
    for b in (50, 51, 52, 53):
        assert not chunk(after, b).any()
    assert eng.inflight() == (0, 0, None)
    counters = eng.take_counters()
    assert (counters["save_failures"], counters["chunks_saved"], counters["load_errors"]) == (2, 1, 4)


def test_missing_chunks_error_exactly_those_blocks_with_same_digest(engines):
    caches1, caches2 = random_caches(BF16, 10), random_caches(BF16, 10)
    src = host(caches1)
    faults = Injected(FaultPoint.SAVE_RECORD, "raise")
    good = engines(caches1)
    local = engines(caches2, faults=faults)  # its save of id 12 fails; slot 1 is overwritten locally

    plan = [([1, 2], [0, 1], [10, 11]), ([3], [2], [12]), ([4], [3], [13])]
    for blocks, slots, ids in plan:
        if ids == [12]:
            faults.arm()
        for eng, caches in ((good, caches1), (local, caches2)):
            eng.save(caches, blocks, slots, ids)
            assert eng.wait_idle(30)
        faults.disarm()
    assert all(r.ok for r in good.drain_results())
    assert {r.save_id: r.ok for r in local.drain_results()} == {10: True, 11: True, 12: False, 13: True}
    local.backend.commit([1], [999], [7])
    same_step(good, local)

    # Plus one slot neither host ever wrote (slot 9), expected with save id 14.
    load_plan = ([20, 21, 22, 23, 24], [0, 1, 2, 3, 9], [10, 11, 12, 13, 14])
    caches1, caches2 = random_caches(BF16, 11), random_caches(BF16, 11)
    before = host(caches2)
    caches1, failed1 = good.load(caches1, *load_plan)
    caches2, failed2 = local.load(caches2, *load_plan)
    assert failed1 == [24]
    assert failed2 == [21, 22, 24]
    assert op_names(same_step(good, local).ops) == small_load_ops(1)
    after1, after2 = host(caches1), host(caches2)
    assert np.array_equal(chunk(after2, 20), chunk(src, 1))
    assert np.array_equal(chunk(after2, 23), chunk(src, 4))
    for b in (21, 22, 24):
        assert not chunk(after2, b).any(), b
    assert not chunk(after1, 24).any()
    rest = [x for x in range(LAYOUTS[BF16].num_blocks) if x not in load_plan[0]]
    for layer in range(len(caches2)):
        assert np.array_equal(after2[layer][rest], before[layer][rest])


# ---------------------------------------------------------------- invariant 2: every fault point
SAVE_SIDE = (FaultPoint.SAVE_PROGRAM, FaultPoint.SAVE_RECORD)
LOAD_SIDE = (FaultPoint.LOAD_SLOT_CHECK, FaultPoint.LOAD_PREPARE)
FAULT_CASES = ([(p, m) for p in (*LOAD_SIDE, *SAVE_SIDE) for m in ("raise", "positions")]
               + [(p, "block") for p in SAVE_SIDE])
# Every case on one layout; the load side (one program per layer group, blocks per batch shard)
# also with two layer groups and with blocks split over four batch shards.
FAULT_MATRIX = ([(BF16, p, m) for p, m in FAULT_CASES]
                + [(MIXED, FaultPoint.LOAD_SLOT_CHECK, "positions"), (MIXED, FaultPoint.LOAD_PREPARE, "raise"),
                   (DP[1], FaultPoint.LOAD_PREPARE, "positions")])


def test_fault_cases_cover_every_fault_point():
    assert set(FaultPoint) == {p for p, _ in FAULT_CASES}


# Chunk i of every step lives in block range i (of 16 blocks): with blocks split over batch shards
# (up to 4 here) the chunks of one call span every shard and each stays in its own.
SEQ_OLD, SEQ_SAVE1, SEQ_SAVE3 = [2, 18, 34, 50], [3, 19, 35, 51], [4, 20, 36, 52]
SEQ_LOADS = {2: ([6, 22, 38, 54], SEQ_SAVE1), 3: ([8, 24, 40, 56], SEQ_SAVE3),
             4: ([10, 26, 42, 58], SEQ_SAVE1)}  # step -> (destination blocks, source blocks)


def fault_sequence(name: str, faults: Injected | None = None) -> list[dict]:
    """One engine through the plan sequence below, a fault (if any) armed where it applies.

    0. save SEQ_OLD into slots 0..3 (never faulted: what a failed overwrite could leave behind)
    1. save SEQ_SAVE1 into slots 0..3 as ids 10..13 (a save-side fault acts here)
    2. load slots 0..3 (a load-side fault acts here; a slow save makes the load time out)
    3. save SEQ_SAVE3 into slots 4..7 as ids 20..23 and load them in the same step (every fault
       acts here)
    4. load slots 0..3 again, no fault: what the faults left loadable

    Checked here for every load: each destination block either holds its source block's bytes
    exactly or is reported failed and holds zeros; every other block is untouched. Returns per
    step: the dispatch digest and ops, the failed blocks, the save outcomes and the counters."""
    save_side = faults is not None and faults.point in SAVE_SIDE
    block = faults is not None and faults.mode == "block"

    def arm(when: bool) -> None:
        if faults is not None and when:
            faults.arm()

    caches = random_caches(name, 70)
    src = host(caches)
    eng = TransferEngine(caches, NUM_SLOTS * CacheLayout.from_caches(caches).device_bytes_per_chunk, faults=faults,
                         load_wait_timeout_s=0.3 if block else 10.0)
    steps: list[dict] = []

    def load(step: int, slots: list[int], ids: list[int]) -> list[int]:
        nonlocal caches
        dst, srcs = SEQ_LOADS[step]
        before = host(caches)
        caches, failed = eng.load(caches, dst, slots, ids)
        after = host(caches)
        for d, b in zip(dst, srcs):
            if d in failed:
                assert not chunk(after, d).any(), f"step {step}: failed block {d} is not zeros"
            else:
                assert np.array_equal(chunk(after, d), chunk(src, b)), f"step {step}: block {d} differs"
        rest = [x for x in range(LAYOUTS[name].num_blocks) if x not in dst]
        for layer in range(len(after)):
            assert np.array_equal(after[layer][rest], before[layer][rest]), f"step {step}: other blocks changed"
        return failed

    def close_step(failed=()) -> None:
        d = eng.finish_step()
        c = eng.take_counters()
        assert c["bytes_saved"] == c["chunks_saved"] * eng.backend.slot_bytes
        assert c["bytes_loaded"] == c["chunks_loaded"] * eng.backend.slot_bytes
        steps.append({"digest": d.digest, "ops": d.ops, "failed": list(failed),
                      "results": {r.save_id: r.ok for r in eng.drain_results()},
                      "counters": {k: c[k] for k in ("chunks_saved", "save_failures", "chunks_loaded", "load_errors")}})

    try:
        eng.save(caches, SEQ_OLD, [0, 1, 2, 3], [1, 2, 3, 4])
        assert eng.wait_idle(30)
        close_step()

        arm(save_side)
        eng.save(caches, SEQ_SAVE1, [0, 1, 2, 3], [10, 11, 12, 13])
        if not block:
            assert eng.wait_idle(30)
        close_step()

        arm(not save_side)
        failed = load(2, [0, 1, 2, 3], [10, 11, 12, 13])
        if faults is not None:
            faults.disarm()  # also releases a slow save
        assert eng.wait_idle(30)
        close_step(failed)

        arm(True)
        eng.save(caches, SEQ_SAVE3, [4, 5, 6, 7], [20, 21, 22, 23])
        failed = load(3, [4, 5, 6, 7], [20, 21, 22, 23])
        if faults is not None:
            faults.disarm()
        assert eng.wait_idle(30)
        close_step(failed)

        failed = load(4, [0, 1, 2, 3], [10, 11, 12, 13])
        close_step(failed)
    finally:
        if faults is not None:
            faults.disarm()
        eng.wait_idle(10)
        eng.close()
    return steps


@cache
def clean_sequence(name: str) -> tuple[dict, ...]:
    """The sequence without faults (the same for every fault case of a layout: run once)."""
    steps = fault_sequence(name)
    assert [s["failed"] for s in steps] == [[]] * 5
    assert all(all(s["results"].values()) for s in steps)
    assert [s["counters"] for s in steps] == [
        {"chunks_saved": 4, "save_failures": 0, "chunks_loaded": 0, "load_errors": 0},
        {"chunks_saved": 4, "save_failures": 0, "chunks_loaded": 0, "load_errors": 0},
        {"chunks_saved": 0, "save_failures": 0, "chunks_loaded": 4, "load_errors": 0},
        {"chunks_saved": 4, "save_failures": 0, "chunks_loaded": 4, "load_errors": 0},
        {"chunks_saved": 0, "save_failures": 0, "chunks_loaded": 4, "load_errors": 0}]
    return tuple(steps)


@pytest.mark.parametrize("name,point,mode", FAULT_MATRIX, ids=[f"{n}-{p.name}-{m}" for n, p, m in FAULT_MATRIX])
def test_fault_changes_reports_never_dispatch(name, point, mode):
    """The same plans on two engines of one layout, one with a fault at ``point``: identical
    dispatch at every step; exactly the affected blocks are load errors (and the affected saves
    not ok); counters right; unaffected blocks byte-exact, affected blocks zeros, never stale
    (checked inside ``fault_sequence``)."""
    clean = clean_sequence(name)
    faults = Injected(point, mode)
    faulty = fault_sequence(name, faults)
    for step, (c, f) in enumerate(zip(clean, faulty)):
        assert f["digest"] == c["digest"] and f["ops"] == c["ops"], f"step {step}: dispatch diverged"
    assert {p for p, _ in faults.calls} == set(FaultPoint)  # every point was reached

    n = 4
    bad = list(range(n)) if mode in ("raise", "block") else sorted(faults.positions)
    lost = point in SAVE_SIDE and mode != "block"  # the affected saves failed: never loadable
    slow = mode == "block"  # the affected saves landed late: loads timed out, later ones succeed

    def outcomes(ids):
        return {sid: not (lost and i in bad) for i, sid in enumerate(ids)}

    def blocks(step, positions):
        return [SEQ_LOADS[step][0][i] for i in positions]

    # Step 1's save completes during step 2 when it is slow.
    assert faulty[1]["results"] | faulty[2]["results"] == outcomes([10, 11, 12, 13])
    assert faulty[3]["results"] == outcomes([20, 21, 22, 23])
    assert [f["failed"] for f in faulty] == [[], [], blocks(2, bad), blocks(3, bad), blocks(4, bad if lost else [])]
    f = len(bad)
    saved = [4, (n - f if lost else 0 if slow else n), (n if slow else 0), (n - f if lost else n), 0]
    save_failures = [0, f if lost else 0, 0, f if lost else 0, 0]
    load_errors = [0, 0, f, f, f if lost else 0]
    assert [x["counters"] for x in faulty] == [
        {"chunks_saved": saved[s], "save_failures": save_failures[s],
         "chunks_loaded": (n - load_errors[s] if s >= 2 else 0), "load_errors": load_errors[s]} for s in range(5)]


def test_worker_reports_and_counts_load_read_failure():
    """Issue 12's bug at the worker level: reading slots raises on one host; the blocks reach vLLM
    as load errors AND are counted in the host's stats, and the host dispatched what a healthy
    host did."""
    n, slots_total = 18, NUM_SLOTS
    faults = Injected(FaultPoint.LOAD_SLOT_CHECK, "raise")
    runners, workers = {}, {}
    chunk_bytes = CacheLayout.from_caches(template(BF16)).device_bytes_per_chunk
    config = parse_config({"cpu_bytes_to_use": slots_total * chunk_bytes})
    for key, inj in (("clean", None), ("faulty", faults)):
        runners[key] = types.SimpleNamespace(kv_caches=random_caches(BF16, 80))
        workers[key] = OffloadWorker(config, host_id=0, faults=inj)
        workers[key].register_runner(runners[key])
    src = host(runners["clean"].kv_caches)
    blocks, dst = list(range(n)), list(range(30, 30 + n))
    try:
        save = OffloadMetadata([StepPlan(step=0, num_slots=slots_total,
                               save=SaveBatch(tuple(blocks), tuple(range(n)), range(100, 100 + n)))])
        loads = (LoadRequest("a", tuple(dst[:10]), tuple(range(10)), tuple(range(100, 110))),
                 LoadRequest("b", tuple(dst[10:]), tuple(range(10, n)), tuple(range(110, 100 + n))))
        load = OffloadMetadata([StepPlan(step=1, num_slots=slots_total, loads=loads)])
        out = {}
        for step, meta in enumerate((save, load)):
            if step == 1:
                faults.arm()
            for key, w in workers.items():
                w.bind(meta)
                w.start_load()
                w.wait_for_save()
                assert w.engine.wait_idle(30)
                out[key, step] = (w.get_finished(), w.take_load_errors(), w.build_report(), w.take_stats(),
                                  w.clear())
            faults.disarm()
            assert out["clean", step][4].digest == out["faulty", step][4].digest
            assert out["clean", step][4].ops == out["faulty", step][4].ops
        assert out["faulty", 1][0] == out["clean", 1][0] == (None, {"a", "b"})
        assert out["clean", 1][1] == set()
        assert out["faulty", 1][1] == set(dst)
        clean_stats, faulty_stats = out["clean", 1][3].totals(), out["faulty", 1][3].totals()
        assert (clean_stats["chunks_loaded"], clean_stats["load_errors"]) == (n, 0)
        assert (faulty_stats["chunks_loaded"], faulty_stats["load_errors"]) == (0, n)
        assert out["faulty", 0][3].totals()["chunks_saved"] == n
        clean_after, faulty_after = host(runners["clean"].kv_caches), host(runners["faulty"].kv_caches)
        for b, d in zip(blocks, dst):
            assert np.array_equal(chunk(clean_after, d), chunk(src, b))
            assert not chunk(faulty_after, d).any()
        assert workers["faulty"].idle_report() == workers["clean"].idle_report() == {
            "inflight_saves": 0, "staging_bytes": 0, "unreported_save_failures": 0, "pending_load_reports": 0}
    finally:
        faults.disarm()
        for w in workers.values():
            w.close()


# ---------------------------------------------------------------- threading and dispatch counts
def test_other_thread_raises_before_dispatch(engines, monkeypatch):
    caches = random_caches(BF16, 90)
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
    assert sum(count.calls.values()) == 0
    assert eng.finish_step().ops == ()
    assert eng.inflight() == (0, 0, None)
    assert eng.backend.tag(1) == EMPTY_SLOT
    assert not caches[0].is_deleted()  # the refused load donated nothing


@pytest.mark.parametrize("n", [1, 30])
def test_one_program_per_group_per_call(engines, monkeypatch, n):
    """A save is one save program (gather + device-to-host + slot write) per layer group, a load
    moved in one part one read program (slot read + host-to-device) and one scatter program per
    layer group, whatever the count."""
    caches = random_caches(MIXED, 91)
    eng = engines(caches)
    groups = len(eng.layout.groups)
    assert groups == 2
    count = Counting(monkeypatch, eng)
    blocks, slots, ids = list(range(n)), list(range(n)), list(range(100, 100 + n))
    save_ok(eng, caches, blocks, slots, ids)
    assert count.programs() == Counter(save=groups)
    assert op_names(eng.finish_step().ops) == ["save"] * groups
    count.calls.clear()
    out, failed = eng.load(caches, blocks[::-1], slots, ids)
    assert failed == []
    assert count.programs() == Counter(read=groups, scatter=groups)
    assert op_names(eng.finish_step().ops) == small_load_ops(groups)


def test_empty_plan_dispatches_nothing(engines):
    caches = random_caches(BF16, 92)
    eng = engines(caches)
    eng.save(caches, [], [], [])
    out, failed = eng.load(caches, [], [], [])
    assert failed == [] and all(a is b for a, b in zip(out, caches))
    assert eng.finish_step().ops == ()
    assert eng.drain_results() == [] and eng.inflight() == (0, 0, None)


# ---------------------------------------------------------------- bad input
def test_constructor_rejects_bad_caches():
    good = random_caches(BF16, 93)
    layout = CacheLayout.from_caches(good)
    cap = NUM_SLOTS * layout.device_bytes_per_chunk
    mesh = good[0].sharding.mesh
    fewer_blocks = create_caches(dataclasses.replace(LAYOUTS[BF16], num_blocks=32))[0][0]
    single = jax.device_put(np.zeros(good[0].shape, good[0].dtype), jax.devices()[0])
    cases = [
        ([], "empty"),
        ([good[0], (good[1], good[1])], r"kv_caches\[1\].*mamba"),
        ([np.zeros(good[0].shape, np.float32)], r"kv_caches\[0\].*jax.Array"),
        ([good[0], single], r"kv_caches\[1\].*NamedSharding"),
        ([jax.device_put(jnp.zeros(8), NamedSharding(mesh, PartitionSpec()))], r"num_blocks"),
        ([good[0], fewer_blocks], "number of blocks"),
    ]
    for caches, pattern in cases:
        with pytest.raises(UnsupportedCache if caches else ValueError, match=pattern):
            TransferEngine(caches, cap)
    for bad in (layout.device_bytes_per_chunk - 1, 0):
        with pytest.raises(ValueError, match="cpu_bytes_to_use"):
            TransferEngine(good, bad)
    with pytest.raises(ValueError, match="save_threads"):
        TransferEngine(good, cap, save_threads=0)
    with pytest.raises(ValueError, match="load_wait_timeout_s"):
        TransferEngine(good, cap, load_wait_timeout_s=0)


@pytest.mark.parametrize("op", ["save", "load"])
def test_bad_plans_raise_naming_argument(engines, op):
    caches = random_caches(BF16, 94)
    eng = engines(caches)
    nb = LAYOUTS[BF16].num_blocks
    other_dtype = [c.astype(jnp.float32) for c in caches]
    single = jax.device_put(np.zeros(caches[1].shape, caches[1].dtype), jax.devices()[0])
    cases = [
        (caches, [1, 2], [0], [1, 2], "block_ids, slots and save_ids"),
        (caches, [1], [0], [1, 2], "block_ids, slots and save_ids"),
        (caches, [1, nb], [0, 1], [1, 2], "block_ids out of range"),
        (caches, [-1], [0], [1], "block_ids out of range"),
        (caches, [1], [NUM_SLOTS], [1], "slots out of range"),
        (caches, [1], [-1], [1], "slots out of range"),
        # A save must not put two chunks in one slot; a load must not put two chunks in one block
        # (it may read one slot into several blocks: see test_load_one_slot_into_two_blocks).
        (caches, [1, 2], [3, 3], [1, 2], "slots repeat") if op == "save" else
        (caches, [1, 1], [3, 4], [1, 2], "block_ids repeat"),
        (caches[:1], [1], [0], [1], "kv_caches has 1 layers"),
        ([], [1], [0], [1], "kv_caches has 0 layers"),
        (other_dtype, [1], [0], [1], r"kv_caches\[0\]"),
        ([caches[0], single], [1], [0], [1], r"kv_caches\[1\]"),
        ([caches[0], np.zeros(caches[1].shape, np.float32)], [1], [0], [1], r"kv_caches\[1\]"),
    ]
    for kv, blocks, slots, ids, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            getattr(eng, op)(kv, blocks, slots, ids)
    assert eng.finish_step().ops == ()  # nothing dispatched
    assert eng.inflight() == (0, 0, None)
    assert not any(c.is_deleted() for c in caches)


def test_load_one_slot_into_two_blocks(engines):
    caches = random_caches(BF16, 95)
    src = host(caches)
    eng = engines(caches)
    save_ok(eng, caches, [6], [2], [1])
    out, failed = eng.load(caches, [40, 41], [2, 2], [1, 1])
    assert failed == []
    after = host(out)
    assert np.array_equal(chunk(after, 40), chunk(src, 6))
    assert np.array_equal(chunk(after, 41), chunk(src, 6))
