"""Least-recently-used order of host slots, kept as a log of touches with vectorized operations.

Every ``touch`` appends ``(slot, stamp)`` pairs, stamps strictly increasing; ``_stamp[slot]`` is
the slot's latest stamp (-1: not in the order). A logged pair whose stamp is no longer the slot's
latest is stale and skipped when met. The oldest live pair is therefore the least recently used
slot. Each pair is appended once and removed once, so every operation costs amortized O(1) per
slot touched, whatever the number of slots held, and runs as a few numpy calls per batch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import numpy as np

from tpuoffload.manager.kernels import kernels

_EMPTY = np.zeros(0, dtype=np.int64)
_I64 = np.dtype(np.int64)


def _i64(a) -> np.ndarray:
    return a if type(a) is np.ndarray and a.dtype is _I64 else np.asarray(a, dtype=np.int64)


class RecencyLog:
    """Single-threaded (the scheduler thread)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._stamp = np.full(num_slots, -1, dtype=np.int64)
        self._segments: deque[tuple[np.ndarray, np.ndarray]] = deque()  # (slots, stamps), oldest first
        self._head = 0  # pairs of _segments[0] before this offset are consumed
        self._clock = 0
        self._logged = 0  # pairs in the log from the head on, live or stale
        self._compact_at = 2 * num_slots + 4096

    def __len__(self) -> int:
        """Slots in the order (O(num_slots): for reports, not the hot path)."""
        return int(np.count_nonzero(self._stamp >= 0))

    def contains(self, slots: np.ndarray) -> np.ndarray:
        return self._stamp[slots] >= 0

    def order(self) -> np.ndarray:
        """The slots in the order, least recently used first. O(log length): for reports and tests."""
        live = np.flatnonzero(self._stamp >= 0)
        return live[np.argsort(self._stamp[live], kind="stable")]

    def touch(self, slots: np.ndarray) -> None:
        """Make ``slots`` the most recently used, the last one most of all. A slot listed twice
        ends where it is listed last."""
        n = len(slots)
        if not n:
            return
        # One compiled pass: stamps, and private copies for the log (it outlives the caller's array).
        slots, stamps = kernels().stamp(self._stamp, _i64(slots), self._clock)
        self._clock += n
        self._segments.append((slots, stamps))
        self._logged += n
        if self._logged > self._compact_at:
            self._compact()

    def forget(self, slots: np.ndarray) -> None:
        """Take ``slots`` out of the order (their logged pairs become stale)."""
        if len(slots):
            self._stamp[slots] = -1

    def pop_oldest(self, k: int, usable: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """Remove and return up to ``k`` least recently used slots for which ``usable`` (a
        vectorized predicate) holds, oldest first. Slots in the order that are met but not usable
        leave the order too: whoever made them unusable must ``touch`` them when they are usable
        again (a pin is released with a touch). Looks at a window of the log proportional to
        ``k`` (widened while it holds too few usable slots), never at the whole log."""
        out: list[np.ndarray] = []
        need = k
        window = max(2 * k, 256)
        while need > 0 and self._segments:
            seg_slots, seg_stamps = self._segments[0]
            end = min(self._head + window, len(seg_slots))
            s = seg_slots[self._head:end]
            live = self._stamp[s] == seg_stamps[self._head:end]
            pos = np.flatnonzero(live)
            ok = pos[usable(s[pos])] if len(pos) else pos
            if len(ok) >= need:
                last = int(ok[need - 1])
                self._stamp[s[pos[pos < last]]] = -1  # live but unusable, met before the last one taken
                out.append(s[ok[:need]])
                consumed = last + 1
                need = 0
            else:
                out.append(s[ok])
                self._stamp[s[pos]] = -1
                consumed = len(s)
                need -= len(ok)
                window *= 2
            self._head += consumed
            self._logged -= consumed
            if self._head == len(seg_slots):
                self._segments.popleft()
                self._head = 0
        if not out:
            return _EMPTY
        victims = np.concatenate(out) if len(out) > 1 else out[0]
        self._stamp[victims] = -1
        return victims

    def _compact(self) -> None:
        """Drop stale pairs: rebuild the log as one segment of the live pairs, in order."""
        if not self._segments:
            return
        first_slots, first_stamps = self._segments[0]
        parts_s = [first_slots[self._head:]] + [s for s, _ in list(self._segments)[1:]]
        parts_t = [first_stamps[self._head:]] + [t for _, t in list(self._segments)[1:]]
        s = np.concatenate(parts_s)
        t = np.concatenate(parts_t)
        live = self._stamp[s] == t
        self._segments = deque([(s[live], t[live])]) if live.any() else deque()
        self._head = 0
        self._logged = int(live.sum())
        self._compact_at = max(2 * self.num_slots + 4096, 2 * self._logged)


class ExtentLru:
    """Least-recently-used order of a slot pool's *extents*, and eviction by extent: the order the
    host store evicts in (manager/index.py).

    An extent is ``extent`` consecutive slots of the pool, aligned to the pool's first slot
    (extent ``e`` holds slots ``first + e * extent ..``, the last one possibly shorter). A touch of
    a slot makes its extent the most recently used (a ``RecencyLog`` over extents); eviction
    takes the least recently used extent and hands out its evictable slots in slot order, then
    the next one's, so a step's new chunks land in runs of consecutive slots, extent after extent,
    whatever the store's history. An extent taken for eviction stays *open* while it still holds
    evictable slots: the next eviction continues in it (nothing is evicted that a caller did not
    ask for), unless a touch made it recently used again.

    Contract of ``victims(need, evictable)``: up to ``need`` slots for which the vectorized
    predicate ``evictable`` holds, ascending, fewer only when no extent in the order or open holds
    more. An extent met holding none leaves the order (``RecencyLog.pop_oldest``): whoever made its
    slots unevictable touches them when they are evictable again (a save's confirmation, an
    unpin). Single-threaded (the scheduler thread).
    """

    def __init__(self, first: int, num_slots: int, extent: int) -> None:
        if extent < 1:
            raise ValueError(f"extent must be >= 1, got {extent}")
        self.first, self.num_slots, self.extent = first, num_slots, extent
        self.num_extents = -(-num_slots // extent)
        self._log = RecencyLog(self.num_extents)
        self._open = _EMPTY  # extents taken from the order, possibly not emptied yet, oldest first
        self._span = np.arange(extent, dtype=np.int64)

    def touch(self, slots: np.ndarray) -> None:
        """Make the extents of ``slots`` the most recently used, the last listed most of all."""
        if not len(slots):
            return
        ext = (_i64(slots) - self.first) // self.extent if self.extent > 1 else _i64(slots) - self.first
        if self.extent > 1 and len(ext) > 1:  # a repeat in a row changes nothing: one touch each
            ext = ext[np.concatenate(([True], ext[1:] != ext[:-1]))]
        self._log.touch(ext)

    def forget_all(self) -> None:
        """Nothing is evictable any more (a reset freed or revoked every chunk)."""
        self._log.forget(np.arange(self.num_extents, dtype=np.int64))
        self._open = _EMPTY

    def _slots(self, ext: np.ndarray) -> np.ndarray:
        """The slots of extents ``ext``, extent by extent, in slot order; past the pool's end -1."""
        s = (self.first + ext[:, None] * self.extent + self._span).ravel()
        return np.where(s < self.first + self.num_slots, s, -1) if self.num_slots % self.extent else s

    def victims(self, need: int, evictable: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        out: list[np.ndarray] = []
        e = self.extent

        def usable(ext: np.ndarray) -> np.ndarray:
            s = self._slots(ext)
            ok = evictable(np.maximum(s, 0)) & (s >= 0)
            return ok.reshape(len(ext), e).any(axis=1) if e > 1 else ok

        while need > 0:
            if len(self._open):
                stale = self._log.contains(self._open)  # touched since: recently used again
                if stale.any():
                    self._open = self._open[~stale]
            if not len(self._open):
                self._open = self._log.pop_oldest(-(-need // e), usable)
                if not len(self._open):
                    break
            s = self._slots(self._open)
            ok = evictable(np.maximum(s, 0)) & (s >= 0)
            pos = np.flatnonzero(ok)[:need]
            out.append(s[pos])
            need -= len(pos)
            # The extent of the last slot taken may hold more: it stays open; those before it are empty.
            self._open = self._open[int(pos[-1]) // e:] if need == 0 and len(pos) else _EMPTY
        if not out:
            return _EMPTY
        v = np.concatenate(out) if len(out) > 1 else out[0]
        return np.sort(v)

    def order(self) -> np.ndarray:
        """Slots of the open extents, then of the extents in the order, least recently used first
        (every slot of each: the caller keeps those it can evict). For reports and tests."""
        still_open = self._open[~self._log.contains(self._open)]  # those touched since are in the order
        ext = np.concatenate((still_open, self._log.order()))
        s = self._slots(ext)
        return s[s >= 0]
