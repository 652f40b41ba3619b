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

import numpy as np

Copies = tuple[tuple[int, int], ...]

# Counts are rounded up to k * 2**j with COUNT_STEPS <= k < 2 * COUNT_STEPS (every count up to
# 2 * COUNT_STEPS kept): at most 1 / COUNT_STEPS of a width's copies are padding.
COUNT_STEPS = 4


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


def _runs(slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(order, starts, lens, first)``: the plan rows in ascending slot order (stable), and the
    maximal runs of consecutive slots in that order: their positions, lengths and first slots."""
    order = np.argsort(slots, kind="stable")
    ss = slots[order]
    starts = np.flatnonzero(np.concatenate(([True], ss[1:] != ss[:-1] + 1)))
    lens = np.diff(np.concatenate((starts, [len(ss)])))
    return order, starts, lens, ss[starts]


def _one_run(s: np.ndarray) -> bool:
    """Whether ``s`` is one ascending run listed in order (a fresh store's plan)."""
    return bool(s[-1] - s[0] == len(s) - 1 and (len(s) == 1 or (np.diff(s) == 1).all()))


def _shifted(plan: CopyPlan, first: int) -> CopyPlan:
    """A plan of slots ``0..n-1`` moved to start at slot ``first`` (rows are plan rows: alike)."""
    return plan._replace(slots=plan.slots + first)


def load_plan(slots, copy_cost: float, cap: int, num_slots: int) -> CopyPlan:
    """A load's copies: one width ``W`` for every run (``ceil(L / W)`` copies each, reading past a
    run shorter than ``W``, kept within the store's ``num_slots``), ``W`` the cheapest of
    ``widths(min(cap, num_slots))`` with counts rounded up to the ladder. One ascending run whose
    copies cannot reach the store's end (a fresh store) takes its cached plan, shifted."""
    s = np.asarray(slots, np.int64).ravel()
    if not len(s):
        return CopyPlan(np.zeros(0, np.int64), np.zeros(0, np.int64), ())
    if _one_run(s) and s[0] + max(len(s), min(cap, num_slots)) <= num_slots:
        return _shifted(_load_run(len(s), copy_cost, cap, num_slots), int(s[0]))
    return _load_plan(s, copy_cost, cap, num_slots)


@functools.lru_cache(maxsize=256)
def _load_run(n: int, copy_cost: float, cap: int, num_slots: int) -> CopyPlan:
    return _frozen(_load_plan(np.arange(n, dtype=np.int64), copy_cost, cap, num_slots))


def _load_plan(s: np.ndarray, copy_cost: float, cap: int, num_slots: int) -> CopyPlan:
    order, starts, lens, first = _runs(s)
    ladder = np.array(widths(min(cap, num_slots)), np.int64)
    need = count_bucket((-(-lens[None, :] // ladder[:, None])).sum(axis=1))  # copies per width, on the ladder
    # Width 1 always fits the cap (a plan has at most ``cap`` rows, a power of two on the ladder).
    k = int(np.argmin(np.where(need * ladder <= cap, need * (copy_cost + ladder), np.inf)))
    w = int(ladder[k])
    return _plan(s, order, starts, lens, first, -(-lens // w), w, int(need[k]), num_slots)


def save_plan(slots, copy_cost: float, cap: int) -> CopyPlan:
    """A save's copies: copies of one width ``W`` within the runs (``ceil(L / W)`` per run, the
    last reaching back, or ``L // W`` and the rest as single rows, whichever costs less), single
    rows for runs shorter than ``W``; ``W`` the cheapest of ``widths(cap)``, counts rounded up to
    the ladder. The slots must be distinct (the engine checks). One ascending run (a fresh
    store) takes its cached plan, shifted."""
    s = np.asarray(slots, np.int64).ravel()
    if not len(s):
        return CopyPlan(np.zeros(0, np.int64), np.zeros(0, np.int64), ())
    if _one_run(s):
        return _shifted(_save_run(len(s), copy_cost, cap), int(s[0]))
    return _save_plan(s, copy_cost, cap)


@functools.lru_cache(maxsize=256)
def _save_run(n: int, copy_cost: float, cap: int) -> CopyPlan:
    return _frozen(_save_plan(np.arange(n, dtype=np.int64), copy_cost, cap))


def _frozen(plan: CopyPlan) -> CopyPlan:
    """A plan whose arrays are read-only (a cached plan, shared by every caller)."""
    plan.rows.flags.writeable = plan.slots.flags.writeable = False
    return plan


def _save_plan(s: np.ndarray, copy_cost: float, cap: int) -> CopyPlan:
    order, starts, lens, first = _runs(s)
    ladder = np.array(widths(cap), np.int64)[:, None]
    wide, single = _save_split(lens[None, :], ladder, copy_cost)  # (widths, runs)
    nw, ns = count_bucket(wide.sum(axis=1)), count_bucket(single.sum(axis=1))
    w_ = ladder[:, 0]
    # Width 1 always fits the cap (no single rows then).
    k = int(np.argmin(np.where(nw * w_ + ns <= cap, nw * (copy_cost + w_) + ns * (copy_cost + 1), np.inf)))
    w, wide, single, ns = int(w_[k]), wide[k], single[k], int(ns[k])
    plan = _plan(s, order, starts, lens, first, wide, w, int(nw[k]), None)
    if not ns:
        return plan
    # Single rows: the rows of each run that its wide copies leave (the run's last ``single``).
    run_of = np.repeat(np.arange(len(lens)), single)
    within = np.arange(int(single.sum())) - np.repeat(np.cumsum(single) - single, single)
    pos = starts[run_of] + lens[run_of] - single[run_of] + within
    pos = np.concatenate((pos, np.full(ns - len(pos), pos[-1])))  # the ladder's padding repeats the last row
    return CopyPlan(np.concatenate((plan.rows, order[pos])), np.concatenate((plan.slots, s[order[pos]])),
                    plan.copies + ((1, ns),))


def _save_split(lens: np.ndarray, w, copy_cost: float) -> tuple[np.ndarray, np.ndarray]:
    """Per run: copies of width ``w`` and single rows. A run of ``q * w + r`` slots (``q >= 1``)
    takes ``q + 1`` copies (the last reaching back) where one copy costs less than ``r`` single
    ones, else ``q`` copies and ``r`` single rows; a shorter run takes single rows only."""
    q, r = lens // w, lens % w
    cover = (q > 0) & (r > 0) & (copy_cost + w < r * (copy_cost + 1))
    return q + cover, np.where(cover, 0, r)


def _plan(s, order, starts, lens, first, per_run, w: int, count: int, num_slots: int | None) -> CopyPlan:
    """Program rows of ``per_run[i]`` copies of width ``w`` for each run ``i`` (its first rows),
    then copies repeating the last one up to ``count``. Copy ``j`` of a run starts ``j * w`` into
    it, the last one ending at the run's end. A load (``num_slots``, the store's size, given) may
    read past a run shorter than ``w`` (moved back to fit the store), and a copy's rows beyond
    those it moves first are -1; a save's copies stay within their runs."""
    n_copies = int(per_run.sum())
    if not n_copies:
        return CopyPlan(np.zeros(0, np.int64), np.zeros(0, np.int64), ())
    run = np.repeat(np.arange(len(per_run)), per_run)
    j = np.arange(n_copies) - np.repeat(np.cumsum(per_run) - per_run, per_run)
    length = lens[run]
    offset = np.minimum(j * w, np.maximum(length - w, 0))  # the run's last copy ends at its end
    start = first[run] + offset
    if num_slots is not None:
        start = np.minimum(start, num_slots - w)  # a load reading past the store's end moves back
    lo, hi = j * w, np.minimum((j + 1) * w, length)  # the run offsets this copy moves first
    pad = count - n_copies
    if pad:
        run, start, lo, hi = (np.concatenate((a, np.full(pad, a[-1]))) for a in (run, start, lo, hi))
        lo[n_copies:] = hi[n_copies:] = 0  # a repeated copy moves no row first
    slot = np.repeat(start, w) + np.tile(np.arange(w), count)
    at = slot - np.repeat(first[run], w)  # offset into the copy's run
    inside = (at >= 0) & (at < np.repeat(lens[run], w))
    pos = np.repeat(starts[run], w) + np.where(inside, at, 0)
    rows = order[pos]
    if num_slots is not None:
        rows = np.where((at >= np.repeat(lo, w)) & (at < np.repeat(hi, w)), rows, -1)
    return CopyPlan(rows, slot, ((w, count),))
