"""Compiled loops of the scheduler half's per-chunk work (``HashKeys``, ``HashTable``,
``ChunkIndex``, ``SlotPool``, ``RecencyLog``, the save planner's slot runs).

Why compiled: a prefill step saves about 512 chunks, and every numpy call costs about a
microsecond whatever its size, several when vLLM's own step has just evicted numpy's code and data
from the caches (the usual case: the scheduler runs between two of vLLM's steps). A batch
operation written as numpy calls costs tens of microseconds in call overhead alone, and a lookup
that probes past a full bucket needs another round of calls. A plain loop compiled by numba (a
vLLM dependency, declared in pyproject.toml) does one batch in one call: under a microsecond of
call overhead plus one cache line per key, and the loops that probe the table read every key's
bucket first, so that their cache misses overlap.

Compiled once per process, at the first ``kernels()`` call (the first ``HashTable``; worker
processes import this module but never build one), with fixed signatures so that no argument can
trigger a recompilation mid-run. numba caches the machine code on disk (``cache=True``), so a later
process loads it in a fraction of a second instead of compiling (about 2 s).

Table layout (``HashTable`` documents it): ``tab[bucket] = [k1 x 4 | value x 4]`` as uint64, k1
words 0 (EMPTY_CELL) and 1 (DELETED) mark free cells, a bucket with an EMPTY_CELL cell never overflowed. Keys
are confirmed with ``key2[slot] == k2`` where a value is a slot. Every integer below is kept uint64
or intp explicitly: numba turns a uint64/int64 mix into a float.
"""

from __future__ import annotations

import functools
import sys

import numba
import numpy as np

W = 4  # cells per bucket
EMPTY_CELL = np.uint64(0)
DELETED = np.uint64(1)
SAVING, READY = np.uint8(1), np.uint8(2)  # ChunkIndex's slot states (index.py: FREE, SAVING, READY, REVOKED)


@numba.njit(inline="always")  # compiled with its caller (decorating is cheap: nothing compiles here)
def _probe(tab, key):
    """The value stored under ``key`` (-1 if none): from its home bucket on, up to a bucket that
    still has an EMPTY_CELL cell (no key ever overflowed past it)."""
    nb = tab.shape[0]
    b = np.intp((key >> np.uint64(8)) & np.uint64(nb - 1))
    for _ in range(nb):
        open_ = False
        for c in range(W):
            w = tab[b, c]
            if w == key:
                return np.int64(tab[b, W + c])
            if w == EMPTY_CELL:
                open_ = True
        if open_:
            return np.int64(-1)
        b = (b + 1) & (nb - 1)
    return np.int64(-1)


@numba.njit(inline="always")
def _touch_homes(tab, k1):
    """Read the first word of every key's home bucket, all loads independent of each other, so
    the CPU overlaps their cache misses (a cold table costs one miss per key; one at a time they
    add up to tens of microseconds per batch, overlapped to a few). Returns a value the caller
    must use, so the compiler keeps the loads."""
    mask = np.uint64(tab.shape[0] - 1)
    acc = np.uint64(0)
    for i in range(k1.shape[0]):
        acc ^= tab[np.intp((k1[i] >> np.uint64(8)) & mask), 0]
    return acc


def _find(tab, k1, out):
    """``out[i]``: the value under ``k1[i]``, -1 if none."""
    for i in range(k1.shape[0]):
        out[i] = _probe(tab, k1[i])


def _find_confirmed(tab, key2, k1, k2, out):
    """``out[i]``: the slot named by key ``(k1[i], k2[i])``, -1 if none (a k1 match whose slot
    holds another k2 is another hash: absent)."""
    if k1.shape[0]:
        out[0] = np.int64(_touch_homes(tab, k1) >> np.uint64(1))  # prefetch (overwritten below)
    for i in range(k1.shape[0]):
        s = _probe(tab, k1[i])
        out[i] = s if s >= 0 and key2[s] == k2[i] else -1


@numba.njit
def _insert(tab, k1, values, cells):
    """Each key into the first free (EMPTY_CELL or DELETED) cell from its home bucket on; ``cells[i]``
    = ``bucket * 4 + column``. Returns how many DELETED cells were reused."""
    nb = tab.shape[0]
    reused = 0
    for i in range(k1.shape[0]):
        b = np.intp((k1[i] >> np.uint64(8)) & np.uint64(nb - 1))
        done = False
        for _ in range(nb):
            for c in range(W):
                if tab[b, c] <= DELETED:
                    if tab[b, c] == DELETED:
                        reused += 1
                    tab[b, c] = k1[i]
                    tab[b, W + c] = np.uint64(values[i])
                    cells[i] = b * W + c
                    done = True
                    break
            if done:
                break
            b = (b + 1) & (nb - 1)
    return reused


@numba.njit(inline="always")
def _delete_cell(tab, cell):
    """Free one cell: EMPTY_CELL where its bucket still has an EMPTY_CELL cell (lookups stop there anyway),
    else a DELETED marker that lookups go past. Returns 1 for a marker, else 0."""
    b = cell // W
    for j in range(W):
        if tab[b, j] == EMPTY_CELL:
            tab[b, cell % W] = EMPTY_CELL
            return 0
    tab[b, cell % W] = DELETED
    return 1


def _delete(tab, cells):
    """Free the cells; returns how many DELETED markers were left."""
    markers = 0
    for i in range(cells.shape[0]):
        markers += _delete_cell(tab, cells[i])
    return markers


def _evict(tab, cell, state, save_id, victims):
    """The victims' chunks leave the table (by cell) and their slots become FREE with no save id.
    Returns how many DELETED markers were left."""
    if victims.shape[0] == 0:
        return 0
    acc = np.uint64(0)
    for i in range(victims.shape[0]):  # independent loads first: their cache misses overlap
        acc ^= tab[cell[victims[i]] // W, 0]
    save_id[victims[0]] = np.int64(acc >> np.uint64(1))  # keeps the loads (overwritten below)
    markers = 0
    for i in range(victims.shape[0]):
        s = victims[i]
        markers += _delete_cell(tab, cell[s])
        state[s] = 0  # FREE
        save_id[s] = -1
    return markers


@numba.njit(inline="always")
def _dedup(tab, key2, k1, k2):
    """Deduplicate one batch of save candidates. Returns (the positions, ascending, of the
    candidates whose key is neither held nor equal to an earlier candidate's; how many were equal
    to an earlier candidate's); the rest are held already."""
    n = k1.shape[0]
    keep = np.empty(n, dtype=np.int64)
    if n == 0:
        return keep, 0
    m = 1
    while m < 2 * n:
        m *= 2
    seen = np.zeros(m, dtype=np.int64)  # open addressing on k1: 1 + position of a kept or held key
    keep[n - 1] = np.int64(_touch_homes(tab, k1) >> np.uint64(1))  # prefetch (a scratch value: see below)
    n_keep = 0
    n_dup = 0
    for i in range(n):
        h = np.intp(k1[i] & np.uint64(m - 1))
        dup = False
        while seen[h] != 0:
            j = seen[h] - 1
            if k1[j] == k1[i] and k2[j] == k2[i]:
                dup = True
                break
            h = (h + 1) & (m - 1)
        if dup:
            n_dup += 1
            continue
        seen[h] = i + 1
        s = _probe(tab, k1[i])
        if s >= 0 and key2[s] == k2[i]:
            continue  # held (READY or being saved)
        keep[n_keep] = i
        n_keep += 1
    return keep[:n_keep], n_dup


@numba.njit(inline="always")
def _kept(k1, k2, keep):
    """The keys at the positions ``keep`` (ascending), as new arrays."""
    o1 = np.empty(keep.shape[0], dtype=np.uint64)
    o2 = np.empty(keep.shape[0], dtype=np.uint64)
    for j in range(keep.shape[0]):
        o1[j] = k1[keep[j]]
        o2[j] = k2[keep[j]]
    return o1, o2


def _select_new(tab, key2, k1, k2):
    """``_dedup``: (positions kept, their k1, their k2, how many were batch duplicates)."""
    keep, n_dup = _dedup(tab, key2, k1, k2)
    o1, o2 = _kept(k1, k2, keep)
    return keep, o1, o2, n_dup


@numba.njit(inline="always")
def _select_new_packed(tab, key2, buf, width):
    """``_select_new`` of hashes of ``width`` bytes laid end to end in ``buf`` (``_split_keys``
    first, in the same call: each call of a compiled function costs microseconds on a cold cache)."""
    k1, k2 = _split_keys(buf, width)
    keep, n_dup = _dedup(tab, key2, k1, k2)
    if keep.shape[0] == k1.shape[0]:
        return keep, k1, k2, n_dup
    o1, o2 = _kept(k1, k2, keep)
    return keep, o1, o2, n_dup


def _plan_saves(tab, key2, cell, state, save_id, stack, allocated, top, buf, width, limit, first_id):
    """One save batch's index work in one call (the save planner's usual case; each call of a
    compiled function costs microseconds on a cold cache): ``_select_new_packed``, then the first
    ``m = min(kept, limit, top)`` kept keys take slots from the free stack (``_pool_take``) and are
    named SAVING under save ids ``first_id ..`` (``_name``). Returns (keep, kept k1, kept k2, batch
    duplicates, the ``m`` slots, DELETED cells reused, ``_run_step`` of the slots). Kept keys past
    ``m`` are the caller's: ``limit`` means staging, ``top`` means evict for them."""
    keep, k1, k2, n_dup = _select_new_packed(tab, key2, buf, width)
    m = min(keep.shape[0], limit, top)
    slots = _pool_take(stack, allocated, top, m)
    reused, run_step = _name(tab, k1[:m], k2[:m], slots, cell, key2, state, save_id, first_id)
    return keep, k1, k2, n_dup, slots, reused, run_step


@numba.njit(inline="always")
def _name(tab, k1, k2, slots, cell, key2, state, save_id, first_id):
    """Insert ``k1[i] -> slots[i]`` (absent, distinct keys) and make each slot SAVING under save
    id ``first_id + i``, recording its cell and k2. Returns (how many DELETED cells were reused,
    ``_run_step(slots)``: the caller sends slots that are a run as a range)."""
    cells = np.empty(k1.shape[0], dtype=np.int64)
    reused = _insert(tab, k1, slots, cells)
    for i in range(slots.shape[0]):
        s = slots[i]
        cell[s] = cells[i]
        key2[s] = k2[i]
        state[s] = SAVING
        save_id[s] = first_id + i
    return reused, _run_step(slots)


def _mark_ready(state, save_id, slots, ids):
    """If every listed slot is SAVING under its listed save id (the usual case), make them all
    READY and return True; else change nothing and return False."""
    for i in range(slots.shape[0]):
        if state[slots[i]] != SAVING or save_id[slots[i]] != ids[i]:
            return False
    for i in range(slots.shape[0]):
        state[slots[i]] = READY
    return True


def _pin(pins, state, slots):
    """One more pin per listed slot if every one is READY (returns True); else nothing (False)."""
    for i in range(slots.shape[0]):
        if state[slots[i]] != READY:
            return False
    for i in range(slots.shape[0]):
        pins[slots[i]] += 1
    return True


def _unpin(pins, slots, released):
    """One pin less per listed slot; ``released[:k]`` = the listed slots whose last pin went, in
    reverse order (a slot listed twice appears twice). Returns ``k``, or -1 (nothing changed) if
    a slot would go below zero pins."""
    n = slots.shape[0]
    for i in range(n):
        pins[slots[i]] -= 1
    for i in range(n):
        if pins[slots[i]] < 0:
            for j in range(n):
                pins[slots[j]] += 1
            return -1
    k = 0
    for i in range(n - 1, -1, -1):
        if pins[slots[i]] == 0:
            released[k] = slots[i]
            k += 1
    return k


def _ready_prefix(tab, key2, state, save_id, buf, width):
    """The leading hashes (``width`` bytes each, end to end in ``buf``) that name READY chunks,
    stopping at the first that does not, as a load lists them: (their slots, the slots' save ids,
    ``_run_step`` of each). Keys are split here, in the same call (each call of a compiled function
    costs microseconds on a cold cache)."""
    k1, k2 = _split_keys(buf, width)
    out = np.empty(k1.shape[0], dtype=np.int64)
    if k1.shape[0]:
        out[0] = np.int64(_touch_homes(tab, k1) >> np.uint64(1))  # prefetch (overwritten below)
    n = k1.shape[0]
    for i in range(k1.shape[0]):
        s = _probe(tab, k1[i])
        if s < 0 or key2[s] != k2[i] or state[s] != READY:
            n = i
            break
        out[i] = s
    slots = out[:n]
    ids = np.empty(n, dtype=np.int64)
    for i in range(n):
        ids[i] = save_id[slots[i]]
    return slots, ids, _run_step(slots), _run_step(ids)


@numba.njit(inline="always")
def _run_step(values):
    """1 if ``values`` ascend by one, -1 if they descend by one, else 0 (also for fewer than 2)."""
    n = values.shape[0]
    if n < 2:
        return 0
    step = values[1] - values[0]
    if step != 1 and step != -1:
        return 0
    for i in range(2, n):
        if values[i] - values[i - 1] != step:
            return 0
    return step


@numba.njit(inline="always")
def _split_keys(buf, width):
    """The keys of hashes of ``width`` bytes each (a multiple of 8, at least 16), laid end to end
    in ``buf``: k1 (the first little-endian word, at least 2: 0 and 1 mark free cells) and k2 (the
    second). The bytes are read in place as words (``kernels()`` checks the host is little-endian)."""
    words = np.frombuffer(buf, np.uint64)
    step = width // 8
    n = words.shape[0] // step
    k1 = np.empty(n, dtype=np.uint64)
    k2 = np.empty(n, dtype=np.uint64)
    for i in range(n):
        w = words[i * step]
        k1[i] = w if w > DELETED else np.uint64(2)
        k2[i] = words[i * step + 1]
    return k1, k2


@numba.njit(inline="always")
def _pool_take(stack, allocated, top, k):
    """SlotPool: the ``k`` slots below ``top`` of the free stack, top first, marked allocated."""
    out = np.empty(k, dtype=np.int64)
    for i in range(k):
        s = stack[top - 1 - i]
        out[i] = s
        allocated[s] = True
    return out


def _stamp(stamp, slots, first):
    """RecencyLog: stamp ``first + i`` for ``slots[i]`` (a slot listed twice keeps its last);
    returns private copies of (slots, stamps) for the log."""
    n = slots.shape[0]
    own = np.empty(n, dtype=np.int64)
    stamps = np.empty(n, dtype=np.int64)
    for i in range(n):
        own[i] = slots[i]
        stamps[i] = first + i
        stamp[slots[i]] = first + i
    return own, stamps


class Kernels:
    """The compiled functions (attributes named as the Python functions above, without ``_``)."""

    __slots__ = ("find", "find_confirmed", "insert", "delete", "select_new", "name", "mark_ready", "pin", "unpin",
                 "ready_prefix", "run_step", "evict",
                 "split_keys", "plan_saves", "pool_take", "stamp")


@functools.cache
def kernels() -> Kernels:
    if sys.byteorder != "little":  # _split_keys reads hash bytes as native words; keys are little-endian
        raise RuntimeError("tpuoffload's scheduler needs a little-endian host")
    try:
        numba.njit(cache=True)(_delete)  # raises where no cache directory is writable
        cache = True
    except RuntimeError:
        cache = False
    jit = functools.partial(numba.njit, cache=cache, nogil=True)
    tab = numba.uint64[:, ::1]
    i64 = numba.int64[::1]  # outputs: contiguous
    u64out = numba.uint64[::1]
    keys, ints = numba.uint64[:], numba.int64[:]  # inputs: any layout (a reversed view, a column)
    packed = numba.types.Bytes(numba.uint8, 1, "C", readonly=True)  # hashes laid end to end (a bytes object)
    # ChunkIndex's per-slot fields: columns of one record array (strided).
    key2, cell, save_id, pins, state = numba.uint64[:], numba.int64[:], numba.int64[:], numba.int32[:], numba.uint8[:]
    k = Kernels()
    k.find = jit(numba.void(tab, keys, i64))(_find)
    k.find_confirmed = jit(numba.void(tab, key2, keys, keys, i64))(_find_confirmed)
    k.insert = jit(numba.int64(tab, keys, ints, i64))(_insert.py_func)
    k.delete = jit(numba.int64(tab, ints))(_delete)
    selected = numba.types.Tuple((i64, u64out, u64out, numba.int64))  # keep, k1, k2 (kept), batch duplicates
    k.select_new = jit(selected(tab, key2, keys, keys))(_select_new)
    k.name = jit(numba.types.UniTuple(numba.int64, 2)(tab, keys, keys, ints, cell, key2, state, save_id,
                                                       numba.int64))(_name.py_func)
    planned = numba.types.Tuple((i64, u64out, u64out, numba.int64, i64, numba.int64, numba.int64))
    k.plan_saves = jit(planned(tab, key2, cell, state, save_id, i64, numba.boolean[::1], numba.int64, packed,
                               numba.int64, numba.int64, numba.int64))(_plan_saves)
    k.mark_ready = jit(numba.boolean(state, save_id, ints, ints))(_mark_ready)
    k.pin = jit(numba.boolean(pins, state, ints))(_pin)
    k.unpin = jit(numba.int64(pins, ints, i64))(_unpin)
    k.ready_prefix = jit(numba.types.Tuple((i64, i64, numba.int64, numba.int64))(
        tab, key2, state, save_id, packed, numba.int64))(_ready_prefix)
    k.run_step = jit(numba.int64(ints))(_run_step.py_func)
    k.evict = jit(numba.int64(tab, cell, state, save_id, ints))(_evict)
    k.pool_take = jit(i64(i64, numba.boolean[::1], numba.int64, numba.int64))(_pool_take.py_func)
    k.stamp = jit(numba.types.UniTuple(i64, 2)(i64, ints, numba.int64))(_stamp)
    k.split_keys = jit(numba.types.UniTuple(u64out, 2)(packed, numba.int64))(_split_keys.py_func)
    return k
