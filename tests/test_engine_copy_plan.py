"""How the engine moves slots: maximal runs of consecutive slots, the copy structures
(``TransferEngine.copy_plan``, worker/copy_plan.py) and their byte-exact round trips.
"""

from __future__ import annotations

import json
from collections import Counter
import re
from pathlib import Path

import numpy as np
import pytest

from tpuoffload.worker import copy_plan as cp
from tpuoffload.worker import programs as pm
from tpuoffload.worker import transfer_engine as te

from engine_helpers import (
    logged_copies, BF16, FP8, MIXED, NUM_SLOTS, random_caches, host, chunk, save_ok, op_names, small_load_ops, op_shape)


# ---------------------------------------------------------------- slot patterns
# slots of one save, and four sentinel slots saved just before it (neighbours a wrong copy would
# overwrite, or a load reading past a run would read: it must drop them).
SLOT_PATTERNS = {
    "run to the last slot": (list(range(NUM_SLOTS - 8, NUM_SLOTS)), [20, 21, 22, 23]),
    "wraps": ([30, 31, 0, 1, 2, 3, 4, 5], [6, 7, 28, 29]),
    "12 ascending": (list(range(3, 15)), [15, 16, 17, 18]),
    "descending": (list(range(NUM_SLOTS - 1, NUM_SLOTS - 9, -1)), [20, 21, 22, 23]),
    "two runs": ([1, 2, 3, 4, 9, 10, 11, 12], [5, 6, 7, 8]),
    "scattered": ([7, 3, 11, 0, 30, 12, 5, 9], [1, 2, 4, 6]),
}


def logged_structure(op: str) -> str:
    return re.search(r"\bstructure=(\S*)", op).group(1)


def structure(copies) -> str:
    return "+".join(f"{w}x{c}" for w, c in copies)


def slot_pattern_round_trip(engines, pattern: str) -> tuple[list[str], list[str], list[str]]:
    """Save sentinels, then the pattern's chunks in both batch shards at once (each shard's slots
    are its own store rows, so both write the same rows); load them back in the saved order, then
    in ascending slot order, then the sentinels. Returns the mismatches, the structures logged by
    the save, the first load's read and the second's, and the structures the engine's plans give
    the save and the two loads."""
    pattern_slots, sentinels = SLOT_PATTERNS[pattern]
    name = "bf16-dp2-tp4"
    caches = random_caches(name, 30)
    eng = engines(caches)
    per, rows = eng.layout.groups[0].blocks_per_shard, eng.slot_table.shard_slots
    n = 2 * len(pattern_slots)
    shard = [i * 2 // n for i in range(n)]
    slots = [pattern_slots[i % (n // 2)] + shard[i] * rows for i in range(n)]
    blocks = [shard[i] * per + i % (n // 2) for i in range(n)]
    src = host(caches)
    ids = list(range(900, 900 + n))
    sentinel_blocks = [12, 13, per + 12, per + 13]
    sentinel_slots = [x + (b // per) * rows for x, b in zip(sentinels, sentinel_blocks)]
    save_ok(eng, caches, sentinel_blocks, sentinel_slots, [800, 801, 802, 803])
    save_ok(eng, caches, blocks, slots, ids)
    logged = [logged_structure(eng.finish_step().ops[-1])]
    planned = [structure(eng.copy_plan("save", np.array(slots)).copies)]
    bad = []
    order = sorted(range(n), key=lambda i: slots[i])
    for k, (pos, first) in enumerate(((list(range(n)), 16), (order, 20))):
        caches = random_caches(name, 31 + k)
        targets = [shard[i] * per + first + i % (n // 2) for i in pos]
        load_slots = [slots[i] for i in pos]
        caches, failed = eng.load(caches, targets, load_slots, [ids[i] for i in pos])
        ops = eng.finish_step().ops
        assert failed == [] and op_names(ops) == small_load_ops(1)
        logged.append(logged_structure(ops[0]))
        planned.append(structure(eng.copy_plan("load", np.array(load_slots)).copies))
        after = host(caches)
        bad += [f"load {k} slot {slots[i]}" for i, t in zip(pos, targets)
                if not np.array_equal(chunk(after, t), chunk(src, blocks[i]))]
    sentinel_targets = [14, 15, per + 14, per + 15]
    caches, failed = eng.load(random_caches(name, 33), sentinel_targets, sentinel_slots, [800, 801, 802, 803])
    after = host(caches)
    bad += [f"sentinel slot {s}" for s, b, t in zip(sentinel_slots, sentinel_blocks, sentinel_targets)
            if not np.array_equal(chunk(after, t), chunk(src, b))]
    return bad, logged, planned


@pytest.mark.parametrize("pattern", SLOT_PATTERNS)
def test_slot_runs_round_trip_byte_exact(engines, pattern):
    """Whatever the slots (one run, a run that ends at the store's last slot or wraps past it, a
    run whose load reads past it, descending slots, scattered ones), each chunk comes back
    byte-exact, loaded in the saved order or in another, and no neighbouring slot is touched; the
    programs run the structures of the engine's plans, and a load in another order has the
    same (rows sorted by slot: a descending run is one copy)."""
    bad, logged, planned = slot_pattern_round_trip(engines, pattern)
    assert bad == []
    assert logged == planned and planned[1] == planned[2]


@pytest.mark.parametrize("pattern", ["wraps", "two runs", "descending"])
def test_slot_runs_negative_control_wrong_width(engines, monkeypatch, pattern):
    """The round trip above catches a wrong copy plan: an engine that takes every plan for one
    ascending run in the listed order overwrites neighbouring slots (a run that wraps, two runs)
    or stores a descending run reversed (seen by the load in another order)."""
    n_bits = lambda n: tuple((1 << b, 1) for b in range(n.bit_length() - 1, -1, -1) if n >> b & 1)  # noqa: E731
    monkeypatch.setattr(te.TransferEngine, "copy_plan",
                        lambda self, op, slots: cp.CopyPlan(np.arange(len(slots)), np.asarray(slots), n_bits(len(slots))))
    bad, _, _ = slot_pattern_round_trip(engines, pattern)
    assert bad


@pytest.mark.parametrize("src_slots,dst_slots", [
    ([0, 1, 2, 3, 4, 5], [20, 21, 22, 23, 24, 25]),  # one run each
    ([9, 3, 7, 1, 5], [30, 31, 0, 1, 2]),  # scattered; a run that wraps
    (list(range(8)), list(range(NUM_SLOTS - 8, NUM_SLOTS))),  # one run to the last slot
    ([12, 11, 10, 2, 20, 21, 22], [3, 9, 10, 11, 26, 27, 5]),  # descending, runs and singles
])
def test_disk_tier_read_and_install_with_copy_plans(engines, src_slots, dst_slots):
    """The disk tier's two programs move slots by the engine's copy plans too: chunks read out of
    slots (``read_slots``, a load's plan) and written back into other slots (``install``, a save's
    plan, repeated rows rewriting their slots with their own bytes) load byte-exact in the listed
    order, and the slots around them keep their chunks."""
    caches = random_caches(BF16, 40)
    src = host(caches)
    eng = engines(caches)
    n = len(src_slots)
    keep = [s for s in range(NUM_SLOTS) if s not in src_slots and s not in dst_slots][:4]
    save_ok(eng, caches, list(range(n)), src_slots, list(range(100, 100 + n)))
    save_ok(eng, caches, [40, 41, 42, 43], keep, [200, 201, 202, 203])
    rows, ok = eng.read_slots(src_slots, list(range(100, 100 + n)))
    assert ok == [True] * n
    eng.install(eng.rows_to_payloads(rows), dst_slots, list(range(300, 300 + n)))
    assert eng.wait_idle(30) and all(r.ok for r in eng.drain_results())
    ops = eng.finish_step().ops
    assert [logged_structure(op) for op in ops[-2:]] == [
        structure(eng.copy_plan("load", np.array(src_slots)).copies),
        structure(eng.copy_plan("save", np.array(dst_slots)).copies)]
    out, failed = eng.load(random_caches(BF16, 41), list(range(50, 50 + n)) + [60, 61, 62, 63], dst_slots + keep,
                           list(range(300, 300 + n)) + [200, 201, 202, 203])
    assert failed == []
    after = host(out)
    for i in range(n):
        assert np.array_equal(chunk(after, 50 + i), chunk(src, i)), i
    for k, b in enumerate([40, 41, 42, 43]):
        assert np.array_equal(chunk(after, 60 + k), chunk(src, b)), keep[k]


def test_disk_tier_read_out_of_order_negative_control(engines, monkeypatch):
    """The test above catches a read that hands the rows back in the copy plan's order (sorted by
    slot) rather than the listed one: the chunks are installed into the wrong slots."""
    caches = random_caches(BF16, 42)
    src = host(caches)
    eng = engines(caches)
    src_slots, dst_slots = [9, 3, 7, 1, 5], [30, 31, 0, 1, 2]
    save_ok(eng, caches, list(range(5)), src_slots, list(range(100, 105)))
    real = te.TransferEngine.read_slots
    monkeypatch.setattr(te.TransferEngine, "read_slots",
                        lambda self, s, i: (lambda r: (r[0]._replace(order=np.arange(len(s))), r[1]))(real(self, s, i)))
    rows, _ = eng.read_slots(src_slots, list(range(100, 105)))
    eng.install(eng.rows_to_payloads(rows), dst_slots, list(range(300, 305)))
    assert eng.wait_idle(30)
    out, failed = eng.load(random_caches(BF16, 43), list(range(50, 55)), dst_slots, list(range(300, 305)))
    after = host(out)
    assert failed == [] and not all(np.array_equal(chunk(after, 50 + i), chunk(src, i)) for i in range(5))


# ---------------------------------------------------------------- copy structures (issue 24)
@pytest.mark.parametrize("slots,save_copies", [
    (list(range(NUM_SLOTS - 1, NUM_SLOTS - 27, -1)), 5),  # 26 descending, to the store's last slot: 3 x 8 + 2 x 1
    (list(range(3, 29)), 5),  # 26 ascending: no power of two
    (list(range(20, 32))[::-1] + list(range(0, 12)), 6),  # two descending/ascending runs of 12: 3 x 4 each
])
def test_descending_and_odd_runs_move_in_few_copies_byte_exact(engines, slots, save_copies):
    """Issue 24: a descending run, or a run of no power-of-two length, moves in a few wide copies
    (the count the engine logs), not one per slot, and a save writes no slot twice here; the
    chunks come back byte-exact, loaded in another order (reversed), and the slots around them
    keep their chunks."""
    name = "bf16-dp2-tp4"
    caches = random_caches(name, 60)
    eng = engines(caches)
    per, rows = eng.layout.groups[0].blocks_per_shard, eng.slot_table.shard_slots
    src = host(caches)
    n = len(slots)
    blocks = [per + i for i in range(n)]  # the second batch shard's blocks, into its slots
    keep = [s for s in range(NUM_SLOTS) if s not in slots][:4]
    sentinels = [26, 27, per + 26, per + 27]  # each loaded back within its batch shard
    keep = [k + (b // per) * rows for k, b in zip(keep, sentinels)]
    slots = [s + rows for s in slots]
    save_ok(eng, caches, sentinels, keep, [500, 501, 502, 503])
    ids = list(range(900, 900 + n))
    save_ok(eng, caches, blocks, slots, ids)
    ops = eng.finish_step().ops
    assert logged_copies(ops[-1]) == save_copies and op_shape(ops[-1])[1] == n  # no row twice
    pos = list(range(n))[::-1]
    targets = [per + i for i in pos]  # into a fresh cache: the bytes come from the load alone
    sentinel_targets = [20, 21, per + 28, per + 29]
    out, failed = eng.load(random_caches(name, 61), targets + sentinel_targets,
                           [slots[i] for i in pos] + keep, [ids[i] for i in pos] + [500, 501, 502, 503])
    assert failed == []
    ops = eng.finish_step().ops
    assert sum(logged_copies(op) for op in ops if op.startswith("load.read") or "copies=" in op) <= save_copies + 4
    after = host(out)
    for i, t in zip(pos, targets):
        assert np.array_equal(chunk(after, t), chunk(src, blocks[i])), (slots[i], t)
    for b, t in zip(sentinels, sentinel_targets):
        assert np.array_equal(chunk(after, t), chunk(src, b))


# Copies that move a row twice or read a slot outside the plan. In this layout a save's copy costs
# 2 rows and a load's 7: the save moves the runs in copies of 8 (the run of 23 in three, the last
# reaching back over one slot) and single rows (the rest of the run of 11, the runs of 2, padded
# to the count ladder by repeating the last one), the load in copies of 4 that read past each run
# of 2 into its sentinels and reach back in the runs of 23 and 11: those rows scatter nowhere.
COVERED_RUNS = [list(range(25, 2, -1)), list(range(40, 51))] + [[60 + 4 * k, 61 + 4 * k] for k in range(7)]


def _numbered(shards: list[int], per: int) -> list[int]:
    """A distinct block of each listed batch shard, in order (``per`` blocks a shard)."""
    seen: Counter = Counter()
    out = []
    for shard in shards:
        out.append(shard * per + seen[shard])
        seen[shard] += 1
    assert max(seen.values()) <= per
    return out


def covering_round_trip(engines, monkeypatch=None, mutate=None) -> tuple[list[str], int, int]:
    """Save the covered runs (listed shuffled, one descending), each in one batch shard (the runs
    alternate shards), around sentinel slots, load them back in another order into other blocks of
    their shards, then the sentinels. Returns the mismatches, the rows the save wrote twice and the
    rows the load read but scattered nowhere (``mutate``: a function of the engine's load plan, for
    that load only)."""
    name = "bf16-dp2-tp4"
    caches = random_caches(name, 70)
    eng = engines(caches, slots=128)
    per, rows = eng.layout.groups[0].blocks_per_shard, eng.slot_table.shard_slots
    src = host(caches)
    rng = np.random.default_rng(7)
    runs = [(k % 2, COVERED_RUNS[k]) for k in rng.permutation(len(COVERED_RUNS))]
    slots = [x + shard * rows for shard, run in runs for x in run]
    n = len(slots)
    save_plan = eng.copy_plan("save", np.array(slots))
    blocks = _numbered([shard for shard, run in runs for _ in run], per)
    used = set(slots)
    sentinels = sorted({x + d + shard * rows for shard, run in runs for x in (min(run), max(run)) for d in (-1, 1)}
                       - used)
    sentinel_blocks = _numbered([x // rows for x in sentinels], per)
    save_ok(eng, caches, sentinel_blocks, sentinels, list(range(500, 500 + len(sentinels))))
    ids = list(range(900, 900 + n))
    save_ok(eng, caches, blocks, slots, ids)
    ops = eng.finish_step().ops
    assert logged_copies(ops[-1]) == eng._programs[0].num_copies("save", save_plan.copies)
    if pm.SAVE_SINGLE_ROW_BYTES <= eng._programs[0].row_bytes:  # rows this large: one per copy
        assert logged_copies(ops[-1]) == cp.copy_rows(save_plan.copies)
    pos = rng.permutation(n).tolist()
    targets = [per * (blocks[i] // per) + (blocks[i] + 13) % per for i in pos]  # another block of its own shard
    load_plan = eng.copy_plan("load", np.array([slots[i] for i in pos]))
    if mutate is not None:
        real = te.TransferEngine.copy_plan
        monkeypatch.setattr(te.TransferEngine, "copy_plan", lambda self, op, s: mutate(real(self, op, s)))
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
    return bad, len(save_plan.rows) - n, int((load_plan.rows < 0).sum())


@pytest.mark.parametrize("single_row_bytes", [pm.SAVE_SINGLE_ROW_BYTES, 1], ids=["wide", "one row per copy"])
def test_covering_copies_round_trip_byte_exact(engines, load_program_shape, single_row_bytes):
    """A save writes the slots a covering copy reaches back over (and its padding) twice, with the
    same bytes, and no slot outside its runs (the sentinels around every run keep their chunks); a
    load reads them twice, and the sentinels its copies read past short runs, but scatters each
    block once (those rows target no block): every chunk comes back byte-exact in its own batch
    shard. Alike when the save writes one row per copy (rows of at least SAVE_SINGLE_ROW_BYTES)."""
    load_program_shape(SAVE_SINGLE_ROW_BYTES=single_row_bytes)
    bad, twice, dropped = covering_round_trip(engines)
    assert bad == [] and twice > 0 and dropped > 0


def test_covering_copies_negative_control_dropped_rows_misplaced(engines, monkeypatch):
    """With each run of the load's dropped rows ending one row late, a row only that copy moves
    is dropped: the round trip above is sensitive to which rows a load drops."""
    def late(plan):
        none = plan.rows < 0
        return plan._replace(rows=np.where(none | np.roll(none, 1), -1, plan.rows))

    bad, _, _ = covering_round_trip(engines, monkeypatch, late)
    assert bad and not any(b.startswith("sentinel") for b in bad)


# ---------------------------------------------------------------- churned steady state (issue 24)
# Steady-state steps of a churned store, recorded by tools/churn_slots.py from the manager's real
# ChunkIndex (408 slots, 51 chunks a step): each step's saved slots and loaded slots.
CHURN_FILE = Path(__file__).resolve().parents[1] / "tools" / "churn_h200.json"
CHURN_KEY, CHURN_STEPS = "408/51/0", 8


def churned_round_trip(engines, name: str) -> tuple[list[str], dict[str, set], int]:
    """Replay the recorded steps (``test_churned_steps_round_trip_byte_exact``); returns the rows
    loaded wrong, the copy structures met and the rows the loads read but scattered nowhere."""
    steps = json.loads(CHURN_FILE.read_text())[CHURN_KEY]["steps"][:CHURN_STEPS]
    num_slots = int(CHURN_KEY.split("/")[0])
    eng = engines(random_caches(name, 0), slots=num_slots)
    rows = eng.slot_table.shard_slots  # each batch shard's slots (the steps' slots take turns by shard)
    assert rows == num_slots
    group = eng.layout.groups[0]
    per = group.blocks_per_shard if group.batch_axes else eng.num_blocks
    ids = iter(range(1, 1 << 40))
    saved: dict[int, tuple[np.ndarray, int, int]] = {}  # slot -> (bytes saved there, save id, source block)
    seen: dict[str, set] = {"save": set(), "load": set()}  # copy structures met
    dropped = 0  # rows loads read but scattered nowhere

    def save(seed: int, slots: list[int]) -> None:
        caches = random_caches(name, seed)
        src = host(caches)
        blocks = [(s // rows) * per + i % per for i, s in enumerate(slots)]  # from the slot's shard
        step_ids = [next(ids) for _ in slots]
        save_ok(eng, caches, blocks, slots, step_ids)
        saved.update((s, (chunk(src, b), i, b)) for s, b, i in zip(slots, blocks, step_ids))
        seen["save"].add(eng.copy_plan("save", np.array(slots)).copies)

    def load(seed: int, slots: list[int], label: str) -> list[str]:
        """Load ``slots`` into distinct blocks of each source block's batch shard (rows past a
        full shard in a further load); the rows whose bytes are not what their slot last saved."""
        nonlocal dropped
        bad = []
        while slots:
            used: dict[int, int] = {}
            now, later, targets = [], [], []
            for s in slots:
                shard = saved[s][2] // per
                if used.get(shard, 0) == per:
                    later.append(s)
                    continue
                targets.append(shard * per + used.get(shard, 0))
                used[shard] = used.get(shard, 0) + 1
                now.append(s)
            plan = eng.copy_plan("load", np.array(now))
            seen["load"].add(plan.copies)
            dropped += int((plan.rows < 0).sum())
            out, failed = eng.load(random_caches(name, seed), targets, now, [saved[s][1] for s in now])
            after = host(out)
            bad += [f"{label}: slot {s} into block {t}" for s, t in zip(now, targets)
                    if t in failed or not np.array_equal(chunk(after, t), saved[s][0])]
            slots = later
        return bad

    total = eng.slot_table.num_slots
    save(1, list(range(total)))  # every slot holds a chunk
    bad = []
    for k, st in enumerate(steps):
        shift = k % (total // rows) * rows
        save(100 + k, [x + shift for x in st["save"]])
        bad += load(200 + k, [x + shift for x in st["load"]], f"step {k}")
    for a in range(0, total, eng.num_blocks):
        bad += load(300 + a, list(range(a, min(total, a + eng.num_blocks))), "audit")
    return bad, seen, dropped


@pytest.mark.parametrize("name", [BF16, FP8, MIXED, "bf16-dp2-tp4"])
def test_churned_steps_round_trip_byte_exact(engines, name):
    """The recorded churned steps through the engine, every copy structure their plans take
    (copies reaching back over a run, reading past short runs into slots outside the plan,
    padding to the count ladder): the store is first filled, then each step saves its slots from
    fresh caches and loads its load slots into distinct blocks of the source's batch shard. Every
    loaded block equals what was last saved to its slot, and at the end every slot of the store
    does (a save that wrote outside its slots, or a load that scattered a row read past a run,
    breaks one of them)."""
    bad, seen, dropped = churned_round_trip(engines, name)
    assert bad == []
    assert len(seen["save"]) > 2 and len(seen["load"]) > 2 and dropped > 0  # the plans were churned ones


def test_churned_steps_negative_control_save_past_runs(engines, monkeypatch):
    """With saves planned as loads (copies reaching past short runs, the rows beyond them written
    with another plan row's bytes), the replay above finds slots outside a save overwritten."""
    real = te.TransferEngine.copy_plan
    monkeypatch.setattr(te.TransferEngine, "copy_plan", lambda self, op, slots: real(self, "load", slots))
    bad, _, _ = churned_round_trip(engines, BF16)
    assert bad
