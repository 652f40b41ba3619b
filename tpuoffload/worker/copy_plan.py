"""How a program moves a plan's rows: copies of consecutive slots (``save_plan``, ``load_plan``).

A save or load program moves its rows as slices of consecutive slots of the store, one dynamic
slice, one transfer and one update per copy (worker/programs.py). Each copy costs a fixed time on
top of its bytes, so a plan wants few copies. The copy structure ``((width, count), ...)`` is a
static argument of the program: every structure not seen before compiles a program (seconds for
a load of a few hundred copies: docs/performance.md), so the set of structures must not grow with the store's
history. It is bounded here by construction:

* a width is a power of two up to the plan's cap (``widths``), and a program has at most one width
  besides single-row copies: a load is ``((W, E),)``, a save ``((W, E), (1, S))``;
* a count is rounded up to the count ladder ``k * 2**j``, ``COUNT_STEPS <= k < 2 * COUNT_STEPS``
  (``count_bucket``), the extra copies repeating the last real one.

So the structures of a cap of ``C`` rows are a fixed set whatever the slots (``structure_bound``:
for 1024 rows, 183 for loads and a few thousand for saves), and a churned store's steady state
meets a few dozen of them (tests/test_copy_plan.py, tools/bench_transfer.py --structure-steps).

Each run of consecutive slots (rows sorted by slot; a slot listed twice, as a load may read one
slot into two blocks, starts a run of its own) is cut into copies of the width ``W``: ``ceil(L /
W)`` of them, the last one ending at the run's end and reaching back over rows already moved, or,
for a run shorter than ``W``, reaching past the run. A load may read slots outside the plan (their
rows are dropped: they scatter nowhere); a save never writes a slot outside the plan, so a save's
run shorter than ``W``, or a remainder where that is cheaper, moves as single-row copies. ``W`` is
the one of ``widths`` that costs least over the model ``copy_cost`` (what a copy costs, in rows of
the layout) per copy plus one per row moved. Everything is a pure function of the slots, the cost,
the cap and the store's size: every host dispatches the same programs (invariant 1).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numba
import numpy as np

Copies = tuple[tuple[int, int], ...]

# Counts are rounded up to k * 2**j with COUNT_STEPS <= k < 2 * COUNT_STEPS (every count up to
# 2 * COUNT_STEPS kept): at most 1 / COUNT_STEPS of a width's copies are padding.
COUNT_STEPS = 4
COUNT_STEPS_BITS = COUNT_STEPS.bit_length()


class CopyPlan(NamedTuple):
    """``rows[i]``: the plan row that program row ``i`` moves, -1 for none (a load's row read
    only because its copy covers it: a slot outside the plan, a row another copy moves, or a
    repeated copy; the engine points it at no block, so each block is scattered once). A save's
    rows are never -1: a repeated row rewrites its slot with the same bytes. ``slots[i]``: the slot
    program row ``i`` reads or writes (each copy's first row gives the copy's start).
    ``copies``: the program's static structure, widths descending."""

    rows: np.ndarray
    slots: np.ndarray
    copies: Copies


def copy_rows(copies) -> int:
    """Rows a program of this structure moves (repeated rows included)."""
    return sum(w * c for w, c in copies)


def count_bucket(count):
    """``count`` (an int, or an array of them) rounded up to the count ladder (0 stays 0)."""
    c = np.asarray(count, np.int64)
    shift = np.where(c <= 2 * COUNT_STEPS, 0, np.frexp(c)[1] - COUNT_STEPS.bit_length())  # frexp: bit_length
    out = -(-c >> shift) << shift
    return int(out) if out.ndim == 0 else out


def widths(cap: int) -> list[int]:
    """The copy widths of a plan of at most ``cap`` rows: the powers of two up to ``cap``."""
    return [1 << b for b in range(max(cap, 1).bit_length())]


def structure_bound(cap: int) -> tuple[int, int]:
    """``(loads, saves)``: how many structures load and save programs of at most ``cap`` rows can
    take, whatever the slots: every ``((W, E),)`` and every ``((W, E), (1, S))`` (a part may be
    absent) with widths and counts on their ladders and ``W * E + S <= cap``."""
    counts = sorted({count_bucket(c) for c in range(1, cap + 1)})
    loads = {(w, e) for w in widths(cap) for e in counts if w * e <= cap}
    saves = {tuple((v, c) for v, c in ((w, e), (1, f)) if c) for w in widths(cap)
             for e in [0, *counts] for f in [0, *counts] if 0 < w * e + f <= cap and (w > 1 or not f)}
    return len(loads), len(saves)


def _one_run(s: np.ndarray) -> bool:
    """Whether ``s`` is one ascending run listed in order (a fresh store's plan)."""
    return bool(_is_one_run(s))


def _shifted(plan: CopyPlan, first: int) -> CopyPlan:
    """A plan of slots ``0..n-1`` moved to start at slot ``first`` (rows are plan rows: alike)."""
    return plan._replace(slots=plan.slots + first)


def _slots(slots) -> np.ndarray:
    """The plan's slots as the compiled planners take them: one contiguous int64 array."""
    return np.ascontiguousarray(slots, np.int64).ravel()


def load_plan(slots, copy_cost: float, cap: int, num_slots: int) -> CopyPlan:
    """A load's copies: one width ``W`` for every run (``ceil(L / W)`` copies each, reading past a
    run shorter than ``W``, kept within the store's ``num_slots``), ``W`` the cheapest of
    ``widths(min(cap, num_slots))`` with counts rounded up to the ladder. One ascending run whose
    copies cannot reach the store's end (a fresh store) takes its cached plan, shifted."""
    s = _slots(slots)
    if not len(s):
        return CopyPlan(np.zeros(0, np.int64), np.zeros(0, np.int64), ())
    if _is_one_run(s) and s[0] + max(len(s), min(cap, num_slots)) <= num_slots:
        return _shifted(_load_run(len(s), copy_cost, cap, num_slots), int(s[0]))
    return _load_plan(s, copy_cost, cap, num_slots)


@functools.lru_cache(maxsize=256)
def _load_run(n: int, copy_cost: float, cap: int, num_slots: int) -> CopyPlan:
    return _frozen(_load_plan(np.arange(n, dtype=np.int64), copy_cost, cap, num_slots))


def _load_plan(s: np.ndarray, copy_cost: float, cap: int, num_slots: int) -> CopyPlan:
    rows, slots, w, count = _load_kernel(s, _order(s), float(copy_cost), int(cap), int(num_slots))
    return CopyPlan(rows, slots, ((int(w), int(count)),))


def save_plan(slots, copy_cost: float, cap: int) -> CopyPlan:
    """A save's copies: copies of one width ``W`` within the runs (``ceil(L / W)`` per run, the
    last reaching back, or ``L // W`` and the rest as single rows, whichever costs less), single
    rows for runs shorter than ``W``; ``W`` the cheapest of ``widths(cap)``, counts rounded up to
    the ladder. Raises ValueError if a slot is listed twice (two chunks in one slot): the check
    rides on the plan's own sort. One ascending run (a fresh store) takes its cached plan,
    shifted."""
    s = _slots(slots)
    if not len(s):
        return CopyPlan(np.zeros(0, np.int64), np.zeros(0, np.int64), ())
    if _is_one_run(s):
        return _shifted(_save_run(len(s), copy_cost, cap), int(s[0]))
    return _save_plan(s, copy_cost, cap)


@functools.lru_cache(maxsize=256)
def _save_run(n: int, copy_cost: float, cap: int) -> CopyPlan:
    return _frozen(_save_plan(np.arange(n, dtype=np.int64), copy_cost, cap))


def _order(s: np.ndarray) -> np.ndarray:
    """The plan rows in ascending slot order (stable: numpy's sort of integers, faster than a
    compiled one)."""
    return np.argsort(s, kind="stable")


def _frozen(plan: CopyPlan) -> CopyPlan:
    """A plan whose arrays are read-only (a cached plan, shared by every caller)."""
    plan.rows.flags.writeable = plan.slots.flags.writeable = False
    return plan


def _save_plan(s: np.ndarray, copy_cost: float, cap: int) -> CopyPlan:
    rows, slots, w, nw, ns = _save_kernel(s, _order(s), float(copy_cost), int(cap))
    if ns < 0:
        raise ValueError("slots repeat within one save")
    copies = tuple((int(v), int(c)) for v, c in ((w, nw), (1, ns)) if c)
    return CopyPlan(rows, slots, copies)


# ---------------------------------------------------------------- compiled planners
# The plans above are computed by the compiled loops below, one call per plan: a plan of a churned
# store has a few hundred runs, and written as numpy calls (a few dozen of them, each costing
# microseconds whatever its size) it cost the dispatching thread more than the program's own
# dispatch (docs/performance.md, "`save()`'s main thread, and loads' planning"). Each loop states the
# rule in the module docstring; every float is computed in the same order as a numpy expression
# of the same rule would, so the choice of width is the same on every host. Compiled at the first
# plan of a process with fixed argument types (int64 slots, float cost, int sizes), machine code
# cached on disk (``cache=True``).

@numba.njit(cache=True)
def _is_one_run(s):
    for i in range(1, len(s)):
        if s[i] != s[i - 1] + 1:
            return False
    return True


@numba.njit(cache=True, inline="always")
def _bucket(c):
    """``count_bucket`` of one count."""
    if c <= 2 * COUNT_STEPS:
        return c
    bits = 0
    x = c
    while x:
        bits += 1
        x >>= 1
    shift = bits - COUNT_STEPS_BITS
    return (-((-c) >> shift)) << shift


@numba.njit(cache=True)
def _runs(s, order):
    """``(starts, lens, first, repeat)``: the maximal runs of consecutive slots in ascending
    slot order (``order``: the plan rows sorted by slot, stable), their positions, lengths and
    first slots, and whether a slot repeats."""
    n = len(s)
    starts = np.empty(n, np.int64)
    lens = np.empty(n, np.int64)
    first = np.empty(n, np.int64)
    runs = 0
    repeat = False
    for i in range(n):
        v = s[order[i]]
        if i and v == s[order[i - 1]] + 1:
            lens[runs - 1] += 1
            continue
        if i and v == s[order[i - 1]]:
            repeat = True
        starts[runs] = i
        lens[runs] = 1
        first[runs] = v
        runs += 1
    return starts[:runs], lens[:runs], first[:runs], repeat


@numba.njit(cache=True)
def _plan_rows(s, order, starts, lens, first, per_run, w, count, num_slots, rows, slots):
    """Fill ``rows`` and ``slots`` (``count * w`` of each) with ``per_run[i]`` copies of width
    ``w`` for each run ``i``, then copies repeating the last one up to ``count``. Copy ``j`` of a
    run starts ``j * w`` into it, the last one ending at the run's end. A load (``num_slots`` >= 0,
    the store's size) may read past a run shorter than ``w`` (moved back to fit the store), and a
    copy's rows beyond those it moves first are -1; a save's (``num_slots`` < 0) copies stay
    within their runs."""
    c = 0
    last_run, last_start = 0, 0
    for r in range(len(per_run)):
        length = lens[r]
        for j in range(per_run[r]):
            offset = min(j * w, max(length - w, 0))  # the run's last copy ends at its end
            start = first[r] + offset
            if num_slots >= 0:
                start = min(start, num_slots - w)  # a load reading past the store's end moves back
            lo, hi = j * w, min((j + 1) * w, length)  # the run offsets this copy moves first
            _copy_rows(s, order, starts, lens, first, r, start, lo, hi, w, c, num_slots, rows, slots)
            last_run, last_start = r, start
            c += 1
    while c < count:  # a repeated copy moves no row first
        _copy_rows(s, order, starts, lens, first, last_run, last_start, 0, 0, w, c, num_slots, rows, slots)
        c += 1


@numba.njit(cache=True, inline="always")
def _copy_rows(s, order, starts, lens, first, r, start, lo, hi, w, c, num_slots, rows, slots):
    for t in range(w):
        slot = start + t
        at = slot - first[r]  # offset into the copy's run
        pos = starts[r] + (at if 0 <= at < lens[r] else 0)
        row = order[pos]
        if num_slots >= 0 and not (lo <= at < hi):
            row = -1
        rows[c * w + t] = row
        slots[c * w + t] = slot


@numba.njit(cache=True)
def _load_kernel(s, order, copy_cost, cap, num_slots):
    starts, lens, first, _ = _runs(s, order)
    top = max(min(cap, num_slots), 1)
    best_w, best_count, best = 1, 0, np.inf
    w = 1
    while w <= top:  # the widths of ``widths(top)``, narrowest first: the first cheapest wins
        need = 0
        for r in range(len(lens)):
            need += -(-lens[r] // w)
        need = _bucket(need)
        # Width 1 always fits the cap (a plan has at most ``cap`` rows, a power of two on the ladder).
        cost = need * (copy_cost + w) if need * w <= cap else np.inf
        if w == 1 or cost < best:
            best_w, best_count, best = w, need, cost
        w *= 2
    w = best_w
    per_run = np.empty(len(lens), np.int64)
    for r in range(len(lens)):
        per_run[r] = -(-lens[r] // w)
    rows = np.empty(best_count * w, np.int64)
    slots = np.empty(best_count * w, np.int64)
    _plan_rows(s, order, starts, lens, first, per_run, w, best_count, num_slots, rows, slots)
    return rows, slots, w, best_count


@numba.njit(cache=True, inline="always")
def _save_split(length, w, copy_cost):
    """Copies of width ``w`` and single rows of a run of ``length`` slots: ``q * w + r`` slots
    (``q >= 1``) take ``q + 1`` copies (the last reaching back) where one copy costs less than
    ``r`` single ones, else ``q`` copies and ``r`` single rows; a shorter run takes single rows
    only."""
    q, r = length // w, length % w
    if q > 0 and r > 0 and copy_cost + w < r * (copy_cost + 1):
        return q + 1, 0
    return q, r


@numba.njit(cache=True)
def _save_kernel(s, order, copy_cost, cap):
    """``(rows, slots, W, wide copies, single rows)``; single rows -1: a slot repeats."""
    starts, lens, first, repeat = _runs(s, order)
    if repeat:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), 1, 0, -1
    best_w, best_nw, best_ns, best = 1, 0, 0, np.inf
    w = 1
    while w <= max(cap, 1):  # the widths of ``widths(cap)``, narrowest first: the first cheapest wins
        nw, ns = 0, 0
        for r in range(len(lens)):
            a, b = _save_split(lens[r], w, copy_cost)
            nw += a
            ns += b
        nw, ns = _bucket(nw), _bucket(ns)
        # Width 1 always fits the cap (no single rows then).
        cost = nw * (copy_cost + w) + ns * (copy_cost + 1) if nw * w + ns <= cap else np.inf
        if w == 1 or cost < best:
            best_w, best_nw, best_ns, best = w, nw, ns, cost
        w *= 2
    w, nw, ns = best_w, best_nw, best_ns
    per_run = np.empty(len(lens), np.int64)
    single = np.empty(len(lens), np.int64)
    for r in range(len(lens)):
        per_run[r], single[r] = _save_split(lens[r], w, copy_cost)
    wide = 0
    for r in range(len(lens)):
        wide += per_run[r]
    rows = np.empty((nw * w if wide else 0) + ns, np.int64)
    slots = np.empty(len(rows), np.int64)
    if wide:
        _plan_rows(s, order, starts, lens, first, per_run, w, nw, -1, rows, slots)
    else:
        nw = 0
    # Single rows: the rows of each run that its wide copies leave (the run's last ``single``), the
    # ladder's padding repeating the last one.
    k = nw * w
    for r in range(len(lens)):
        for t in range(single[r]):
            pos = starts[r] + lens[r] - single[r] + t
            rows[k] = order[pos]
            slots[k] = s[order[pos]]
            k += 1
    while k < len(rows):
        rows[k] = rows[k - 1]
        slots[k] = slots[k - 1]
        k += 1
    return rows, slots, w, nw, ns
