"""Transfer engine round trips, byte for byte, on tpu-inference's real layouts: every dtype and MLA,
blocks split by data parallelism, loads read in parts and loops, the transfer buffer bounding each
piece, and pieces of power-of-two sizes.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections import Counter
from concurrent import futures

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tpuoffload.layout import CacheLayout
from tpuoffload.sim.tpu_layouts import LAYOUTS, create_caches
from tpuoffload.worker import copy_plan as cp
from tpuoffload.worker import programs as pm
from tpuoffload.worker import transfer_engine as te
from tpuoffload.worker.faults import FaultInjector, FaultPoint

from engine_helpers import (
    logged_copies, BF16, FP8, INT8, MIXED, DP, NUM_SLOTS, template, random_caches, host, chunk, save_ok, op_names, small_load_ops, op_shape, logged_blocks, Counting)


# ---------------------------------------------------------------- round trips
# MLA: the latent cache is replicated over the model axis (each tile held by 4 devices, moved once).
@pytest.mark.parametrize("name", [BF16, FP8, INT8, "mla-tp4"])
def test_round_trip_byte_exact(name, engines):
    caches = random_caches(name, 0)
    eng = engines(caches)
    assert eng.slot_table.num_slots == NUM_SLOTS
    src = host(caches)
    if name != INT8:  # the planted patterns really are NaNs of the cache dtype
        assert np.isnan(np.asarray(caches[0])[3].astype(np.float32)).any()
    blocks, slots, ids = [3, 17, 40, 63, 0], [5, 0, 9, 31, 2], [100, 101, 102, 103, 104]
    save_ok(eng, caches, blocks, slots, ids)
    for b, s, i in zip(blocks, slots, ids):
        assert eng.slot_table.tag(s) == i

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
    slot_bytes = eng.slot_table.slot_bytes
    assert (counters["chunks_saved"], counters["bytes_saved"], counters["chunks_loaded"],
            counters["bytes_loaded"]) == (5, 5 * slot_bytes, 5, 5 * slot_bytes)
    assert counters["load_errors"] == counters["save_failures"] == 0


def test_caches_of_an_equivalent_sharding_round_trip(engines):
    """A step may hand back caches whose sharding is equivalent, not equal, to the one they were
    allocated with (tpu-inference's vLLM-model path returns what XLA propagated: on one device P()
    for P('data', None, 'model')). Every shard sits where it did, so saves and loads take them, byte
    for byte; caches placed otherwise are refused."""
    caches = random_caches(BF16, 0)
    eng = engines(caches)
    mesh = caches[0].sharding.mesh
    assert mesh.shape["data"] == 1  # so P(None, None, 'model') places every shard as P('data', None, 'model')

    def placed(cs, spec):
        return [jax.device_put(c, NamedSharding(mesh, spec)) for c in cs]

    src_caches = placed(caches, P(None, None, "model"))
    assert src_caches[0].sharding != caches[0].sharding
    src = host(src_caches)
    save_ok(eng, src_caches, [3, 17], [0, 1], [1, 2])
    loaded, failed = eng.load(placed(random_caches(BF16, 1), P(None, None, "model")), [10, 11], [0, 1], [1, 2])
    assert failed == []
    after = host(loaded)
    assert np.array_equal(chunk(after, 10), chunk(src, 3)) and np.array_equal(chunk(after, 11), chunk(src, 17))
    with pytest.raises(ValueError, match="same sharding"):  # replicated over the 4 devices: not the layout's
        eng.save(placed(random_caches(BF16, 2), P()), [3], [2], [3])


def test_round_trip_more_blocks_than_bucket_permuted_subset(engines):
    caches = random_caches(BF16, 2)
    eng = engines(caches)
    src = host(caches)
    blocks = list(range(5, 25))  # 20 blocks in one descending run: five copies of 4, no padding
    slots = list(range(31, 11, -1))
    ids = list(range(1000, 1020))
    save_ok(eng, caches, blocks, slots, ids)
    ops = eng.finish_step().ops
    assert eng.copy_plan("save", np.array(slots)).copies == ((4, 5),)
    assert op_names(ops) == ["save"] and op_shape(ops[0])[1] == 20 and logged_copies(ops[0]) == 5
    caches = random_caches(BF16, 3)
    pick = [7, 0, 19, 3]
    caches, failed = eng.load(caches, [40, 41, 42, 43], [slots[p] for p in pick], [ids[p] for p in pick])
    assert failed == []
    after = host(caches)
    for k, p in enumerate(pick):
        assert np.array_equal(chunk(after, 40 + k), chunk(src, blocks[p]))


@pytest.mark.parametrize("name", DP)
def test_blocks_split_by_data_parallelism(name, engines):
    """Sources in every batch shard: every device saves and loads only its shard's blocks, and
    keeps only its shard's slots. Every shard saves into the same two rows of its own in one
    program: each chunk arrives whole, none written over by another shard's save. Loaded into a
    block of the same batch shard, a chunk arrives byte-exact; loaded into another batch shard (the
    store keeps a chunk in its source block's batch shard), it is a load error with zeros in place,
    never another shard's bytes or garbage. A slot outside its block's shard is refused."""
    caches = random_caches(name, 4)
    eng = engines(caches)
    g = eng.layout.groups[0]
    shards, per, rows = g.num_shards, g.blocks_per_shard, eng.slot_table.shard_slots
    assert shards == {"bf16-dp2-tp4": 2, "bf16-attndp4-tp2": 4}[name]
    assert eng.slot_table.num_slots == shards * rows and rows == NUM_SLOTS  # every shard keeps its own NUM_SLOTS
    src = host(caches)
    blocks = [s * per + k for s in range(shards) for k in (0, per - 1)]
    same = [s * per + k for s in range(shards) for k in (2, 3)]  # same shard as the source
    other = [((s + 1) % shards) * per + k for s in range(shards) for k in (4, 5)]  # the next shard
    slots = [s * rows + k for s in range(shards) for k in (0, 1)]  # rows 0 and 1 of every shard
    ids = [500 + i for i in range(len(slots))]
    with pytest.raises(ValueError, match="not in the batch shard"):
        eng.save(caches, blocks[-1:], [0], [499])
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


def test_shards_saving_into_the_same_rows_negative_control(engines, monkeypatch):
    """Each device writes only its own shard's copies (programs._write_own): without that, every
    device writing each copy at its slot's row, two shards saving into their row 0 leave the
    first shard's row holding the other save's gather of a block it does not have."""
    name = "bf16-dp2-tp4"
    monkeypatch.setattr(pm, "_write_own", lambda store, rows, ids, *, group, spare_row, write:
                        write(store, rows, lambda r: ids[1, r]))
    pm.programs_for.cache_clear()  # programs traced with the stand-in are never reused
    try:
        caches = random_caches(name, 4)
        eng = engines(caches)
        per, rows = eng.layout.groups[0].blocks_per_shard, eng.slot_table.shard_slots
        src = host(caches)
        save_ok(eng, caches, [0, per], [0, rows], [1, 2])
        out, failed = eng.load(random_caches(name, 5), [2, per + 2], [0, rows], [1, 2])
        after = host(out)
        assert failed == [] and not np.array_equal(chunk(after, 2), chunk(src, 0))
    finally:
        pm.programs_for.cache_clear()


@pytest.mark.parametrize("slots", [[7, 3, 11, 0, 30, 12, 5, 9], [8, 9, 20, 21, 4, 5, 14, 15]],
                         ids=["scattered", "runs of 2"])
@pytest.mark.parametrize("parts,static_max", [(1, 256), (4, 256), (2, 0), (4, 0), (1, 0)])
def test_parts_and_loop_reads_byte_exact(engines, load_program_shape, parts, static_max, slots):
    """The programs' variants (one part or several: saves gathered and loads scattered part by
    part; reads and writes written out per copy or in fori_loops; one copy per slot or per run of
    slots) move the same bytes: valid rows exact, placeholders zero, every other block untouched,
    across batch shards."""
    load_program_shape(LOAD_PART_BYTES=1, SAVE_PART_BYTES=1, MAX_PARTS=parts, LOAD_STATIC_MAX=static_max,
                       SAVE_STATIC_MAX=256 - static_max)
    name = "bf16-dp2-tp4"
    caches = random_caches(name, 20)
    eng = engines(caches)
    g = eng.layout.groups[0]
    assert eng._programs[0].op_parts("load", 8) == eng._programs[0].op_parts("save", 8) == parts
    src = host(caches)
    per = g.blocks_per_shard
    blocks = [0, 1, 2, 3, per, per + 1, per + 2, per + 3]
    slots = [s + (i >= 4) * eng.slot_table.shard_slots for i, s in enumerate(slots)]  # each in its block's shard
    ids = list(range(700, 708))
    save_ok(eng, caches, blocks, slots, ids)
    caches = random_caches(name, 21)
    before = host(caches)
    targets = [4, 5, per + 6, 7, per + 4, 9, per + 5, per + 7]  # positions 2 and 5 cross shards: zeros
    caches, failed = eng.load(caches, targets, slots, ids)
    assert failed == [per + 6, 9]
    # One part, or one copy per part: reads, then the scatter (two programs); otherwise one load
    # program overlapping them.
    copies = eng.copy_plan("load", slots).copies
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


# ---------------------------------------------------------------- pieces of the transfer buffer
PIECE_SLOTS = {  # slots of a plan of n chunks in a store of 256 slots
    "one run": lambda n: list(range(100, 100 + n)),  # spans every piece boundary
    "run per piece": lambda n: [i + 2 * (i // 32) + 1 for i in range(n)],  # breaks at each piece boundary
    "scattered": lambda n: np.random.default_rng(n).permutation(256)[:n].tolist(),
}


@pytest.mark.parametrize("pattern", PIECE_SLOTS)
@pytest.mark.parametrize("n", [1, 7, 9, 40, 100])
def test_pieces_round_trip_byte_exact(engines, n, pattern):
    """A plan larger than the transfer buffer (32 chunks here) moves in pieces of the buffer and a
    rest, each save and load program one piece, the plan first sorted by slot (runs stay whole);
    each piece's slots give its own copy structure (TransferEngine.copy_plan), whether a run of slots
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
    plans = {op: [eng.copy_plan(op, np.array(listed[a:a + p])).copies for a, p in zip(starts, sizes)]
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


