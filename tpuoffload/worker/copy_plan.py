"""How a program moves a plan's rows: copies of consecutive slots (``copy_plan``).

A save or load program moves its rows as slices of consecutive slots of the store, one dynamic
slice, one transfer and one update per copy (worker/programs.py). Each copy costs a fixed time on
top of its bytes, so a plan wants few copies; the copy structure ``((width, count), ...)`` is a
static argument of the program, so it also wants few distinct structures. ``copy_plan`` trades
the two against each other with one number, what a copy costs in rows (``copy_cost``, from the
layout: programs.SAVE_COPY_BYTES / LOAD_COPY_BYTES over the bytes of one row), and is a pure
function of the slots and that number: every host dispatches the same programs (invariant 1).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

Copies = tuple[tuple[int, int], ...]


class CopyPlan(NamedTuple):
    """``order[i]``: the plan row that program row ``i`` moves (None: the identity, no row
    repeated). ``copies``: the program's static structure. ``repeats``: program rows whose plan
    row an earlier-covered row of the same slot already moves (None: none): a save writes the
    same bytes into the same slot again; a load must drop them (the engine points them at no
    block), so each block is scattered once."""

    order: np.ndarray | None
    copies: Copies
    repeats: np.ndarray | None


def copy_rows(copies) -> int:
    """Rows a program of this structure moves (repeated rows included)."""
    return sum(w * c for w, c in copies)


@functools.lru_cache(maxsize=4096)
def _run_copies(length: int, copy_cost: float) -> tuple[tuple[int, int, int], ...]:
    """The copies of one run of ``length`` consecutive slots: ``(offset, width, skip)`` each,
    widest first, ``skip`` leading rows that an earlier copy of the run moves already.

    The set bits of ``length``, widest first (26 -> 16 + 8 + 2); or the bits below some set bit,
    ``rest``, in one copy of the next power of two placed at the run's end, reaching back over
    slots already moved (23 -> 16 + 8, moving one slot twice): chosen where it saves the most,
    ``copy_cost`` per copy saved against one per row moved twice. Never past the run, so a save
    writes only its own slots."""
    top = length.bit_length() - 1
    best_gain, cut = 0.0, 0
    for b in range(top):
        rest = length & ((2 << b) - 1)
        if length >> b & 1 and rest & (rest - 1):
            gain = copy_cost * (bin(rest).count("1") - 1) - ((2 << b) - rest)
            if gain > best_gain:
                best_gain, cut = gain, rest
    kept = length - cut
    out, at = [], 0
    for b in range(top, -1, -1):
        if kept >> b & 1:
            out.append((at, 1 << b, 0))
            at += 1 << b
    if cut:
        width = 1 << cut.bit_length()
        out.append((length - width, width, width - cut))
    return tuple(out)


def _sorted_runs(s: np.ndarray) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
    """``(order, starts, lens)``: rows in ascending slot order (``order`` into ``s``, None when
    that is the listed order; listed runs of consecutive slots stay whole, sorted by their first
    slot), and the maximal runs of consecutive slots in that order (positions into it). A slot
    listed twice breaks a run."""
    n = len(s)
    brk = np.flatnonzero(s[1:] != s[:-1] + 1) + 1
    lstart = np.concatenate(([0], brk))
    ro = np.argsort(s[lstart], kind="stable")
    if (ro[1:] > ro[:-1]).all():
        return None, lstart, np.diff(np.concatenate((lstart, [n])))
    llen = np.diff(np.concatenate((lstart, [n])))[ro]
    lstart = lstart[ro]
    order = np.arange(n) + np.repeat(lstart - (np.cumsum(llen) - llen), llen)
    ss = s[order]
    starts = np.flatnonzero(np.concatenate(([True], ss[1:] != ss[:-1] + 1)))
    return order, starts, np.diff(np.concatenate((starts, [n])))


def copy_plan(slots, copy_cost: float = 0.0) -> CopyPlan:
    """How a program moves the rows of a plan with these ``slots``.

    The rows are taken in ascending slot order (a descending run becomes an ascending one, runs
    listed apart that adjoin merge) and cut into maximal runs of consecutive slots (a slot listed
    twice, as a load may read one slot into two blocks, breaks a run); each run into the copies
    of ``_run_copies`` (``copy_cost`` 0: its set bits, no slot moved twice). ``copies`` has
    widths descending and power-of-two counts (few structures compile): a width whose count is no
    power of two either splits its copies past the largest power of two into two of half the
    width each, or repeats its last copy up to the next power of two, whichever costs less (width
    1 always repeats; ``_power_of_two_counts``). ``copy_cost`` 0 moves every plan row once but
    width-1 repeats at the end. Costs Python work per copy: a plan of scattered slots (a run per
    slot, which the allocator does not hand out) is the slow case."""
    s = np.asarray(slots, np.int64).ravel()
    n = len(s)
    if not n:
        return CopyPlan(None, (), None)
    if s[-1] - s[0] == n - 1 and (n == 1 or (np.diff(s) == 1).all()):  # one ascending run: the fresh store
        return _one_run(n, copy_cost)
    order, starts, lens = _sorted_runs(s)
    copies, program = _power_of_two_counts(_copies_by_width(starts.tolist(), lens.tolist(), copy_cost), copy_cost)
    pos, width, skip = np.array(program, np.int64).T
    first = np.cumsum(width) - width  # program row of each copy's first row
    within = np.arange(int(first[-1] + width[-1])) - np.repeat(first, width)
    rows = np.repeat(pos, width) + within
    repeats = within < np.repeat(skip, width)
    if order is not None:
        rows = order[rows]
    if not repeats.any():
        if len(rows) == n and (rows == np.arange(n)).all():
            return CopyPlan(None, copies, None)
        repeats = None
    return CopyPlan(rows, copies, repeats)


def _one_run(n: int, copy_cost: float) -> CopyPlan:
    """The plan of one ascending run listed in order: its copies in ``_run_copies`` order, which
    is already program order (a covering copy is no wider than the narrowest other, and at most
    one other has its width), so every count is 1 or 2."""
    pattern = _run_copies(n, copy_cost)
    copies: list[tuple[int, int]] = []
    for _, w, _ in pattern:
        if copies and copies[-1][0] == w:
            copies[-1] = (w, 2)
        else:
            copies.append((w, 1))
    _, width, skip = pattern[-1]
    if not skip:
        return CopyPlan(None, tuple(copies), None)
    kept = n - width + skip  # rows before the covering copy, which reaches back over ``skip`` of them
    rows = np.concatenate((np.arange(kept), np.arange(n - width, n)))
    repeats = np.zeros(len(rows), bool)
    repeats[kept:kept + skip] = True
    return CopyPlan(rows, tuple(copies), repeats)


def _copies_by_width(starts: list[int], lens: list[int], copy_cost: float) -> dict[int, list[tuple[int, int]]]:
    """Every run's copies (``_run_copies``) by width: ``(position in the sorted rows, skip)``, in
    ascending position (runs come in slot order, and a run has at most two copies of one width,
    in order)."""
    by_width: dict[int, list[tuple[int, int]]] = {}
    for start, length in zip(starts, lens):
        for offset, w, skip in _run_copies(length, copy_cost):
            by_width.setdefault(w, []).append((start + offset, skip))
    return by_width


def _power_of_two_counts(by_width: dict[int, list[tuple[int, int]]], copy_cost: float):
    """Widest first: a count that is no power of two splits its last copies (past the largest
    power of two) into halves, carried to the next width, or repeats its last copy, whichever
    costs less (width 1 always repeats). Returns the structure and every copy's ``(position,
    width, skip)`` in program order (widths descending; within a width, its own copies in
    ascending slot order, then the halves carried in)."""
    copies: list[tuple[int, int]] = []
    program: list[tuple[int, int, int]] = []
    carry: list[tuple[int, int]] = []
    for b in range(max(by_width).bit_length() - 1, -1, -1):
        w = 1 << b
        todo = by_width.get(w, []) + carry
        carry = []
        c = len(todo)
        if not c:
            continue
        low = 1 << (c.bit_length() - 1)
        high = low if low == c else 2 * low
        if high != c and (w == 1 or (high - c) * (copy_cost + w) <= (c - low) * copy_cost):
            todo += [(todo[-1][0], w)] * (high - c)
        elif high != c:
            h = w // 2
            rest, todo = todo[low:], todo[:low]
            carry = [(p, min(k, h)) for p, k in rest] + [(p + h, max(k - h, 0)) for p, k in rest]
        copies.append((w, len(todo)))
        program += [(p, w, k) for p, k in todo]
    return tuple(copies), program
