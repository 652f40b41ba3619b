"""What the engine dispatches and refuses: only the main thread dispatches, one program per layout
group per call, nothing for an empty plan, and clear errors for bad caches and bad plans.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from tpuoffload.backend.slot_table import EMPTY_SLOT
from tpuoffload.layout import CacheLayout, UnsupportedCache
from tpuoffload.sim.tpu_layouts import LAYOUTS, create_caches
from tpuoffload.worker.transfer_engine import TransferEngine

from engine_helpers import (
    BF16, MIXED, NUM_SLOTS, random_caches, host, chunk, save_ok, op_names, small_load_ops, Counting)


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
    assert eng.slot_table.tag(1) == EMPTY_SLOT
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


def test_save_refuses_a_slot_repeated_across_pieces(engines):
    """A save's repeated slot is refused before anything is dispatched also when the plan moves in
    pieces: one piece's plan refuses a repeat on its own sort (copy_plan.save_plan), and a plan in
    pieces checks its slot-sorted rows, where the two rows of a slot may fall in two pieces.
    Negative control: without the pieces' check the save is dispatched, two chunks into slot 5
    (each piece's plan holds one row), and nothing raises."""
    caches = random_caches(BF16, 96)
    eng = engines(caches, transfer_buffer_bytes=CacheLayout.from_caches(caches).device_bytes_per_chunk)
    assert eng.max_chunks_per_transfer == 1  # every row a piece of its own
    with pytest.raises(ValueError, match="slots repeat"):
        eng.save(caches, [1, 2, 3], [5, 7, 5], [1, 2, 3])
    assert eng.finish_step().ops == ()  # nothing dispatched
    assert eng.inflight() == (0, 0, None)


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
