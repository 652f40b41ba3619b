"""A hash table from content-hash keys to slot numbers, in numpy arrays, used in batches.

Why not a Python dict: at a million chunks every dict operation is two or three cache misses (the
index, the entry, and the hash object itself to read its cached hash), and a prefill step that
evicts does a lookup, an insert and a delete per chunk. Here the key lives inside the table (no
object to follow), a batch of keys is looked up or inserted with a fixed handful of numpy calls,
and a delete does not look anything up: the caller passes the cell each value was stored in (which
``insert`` returned), one cache line per key.

Keys: the first 8 bytes of vLLM's block hash (sha256 or xxhash128 output, uniformly distributed)
as a uint64 (``k1``); the table stores only ``k1`` and the value, and the caller confirms a match
with the next 8 bytes (``k2``), which it keeps per value. Values 0 and 1 of ``k1`` mark empty and
deleted cells; a real ``k1`` below 2 is stored as 2.

Layout: ``num_buckets`` buckets of 8 cells, at most a quarter of the cells live. A key goes to its
home bucket ``(k1 >> 8) % num_buckets`` unless that bucket has no free cell, then to the next
bucket with one. A bucket that still has an empty cell has never been full, so no key has
overflowed past it: lookups stop there, and a delete in it can empty the cell. Only buckets that
have been full keep deleted markers (reused by later inserts); if those ever take an eighth of the
cells the table is rebuilt (cells move: ``rebuild`` says where).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

EMPTY = np.uint64(0)
DELETED = np.uint64(1)
_W = 8  # cells per bucket: one 64-byte cache line of k1 words
_SHIFT = np.uint64(8)


class HashKeys:
    """Keys of a batch of content hashes: ``k1`` (looked up in the table) and ``k2`` (confirms)."""

    __slots__ = ("k1", "k2")

    def __init__(self, k1: np.ndarray, k2: np.ndarray) -> None:
        self.k1 = k1
        self.k2 = k2

    def __len__(self) -> int:
        return len(self.k1)

    def take(self, idx) -> "HashKeys":
        return HashKeys(self.k1[idx], self.k2[idx])

    @classmethod
    def of(cls, hashes: Sequence[bytes]) -> "HashKeys":
        """Keys of ``hashes`` (bytes of one length, at least 16 and a multiple of 8, as vLLM's
        block hashers produce; anything else bytes-like is normalised to that first)."""
        n = len(hashes)
        if not n:
            return cls(np.zeros(0, np.uint64), np.zeros(0, np.uint64))
        try:
            buf = b"".join(hashes)
        except TypeError:
            raise TypeError(f"block hashes must be bytes, got {type(hashes[0]).__name__}") from None
        width = len(hashes[0])
        if width < 16 or width % 8 or len(buf) != n * width:
            return cls.of([bytes(h[:16]).ljust(16, b"\0") for h in hashes])
        words = np.frombuffer(buf, dtype=np.uint64).reshape(n, width // 8)
        return cls(np.maximum(words[:, 0], np.uint64(2)), words[:, 1].copy())

    @staticmethod
    def one(h: bytes) -> tuple[int, int]:
        """(k1, k2) of one hash, as Python ints."""
        if len(h) < 16:
            h = bytes(h).ljust(16, b"\0")
        return max(int.from_bytes(h[0:8], "little"), 2), int.from_bytes(h[8:16], "little")


class HashTable:
    """k1 -> int value (a slot). Single-threaded. ``capacity``: most keys live at once."""

    def __init__(self, capacity: int) -> None:
        nb = 1
        while nb * _W < 4 * max(capacity, 1):
            nb *= 2
        self.num_buckets = nb
        self._mask = np.uint64(nb - 1)
        self._k1 = np.zeros((nb, _W), dtype=np.uint64)
        self._val = np.zeros((nb, _W), dtype=np.int64)
        self._k1_flat = self._k1.reshape(-1)  # views: cell c is bucket c >> 3, column c & 7
        self._val_flat = self._val.reshape(-1)
        self._claim = np.zeros(nb, dtype=np.int64)  # scratch: which key claims a bucket this round
        self._live = 0
        self._deleted = 0

    def __len__(self) -> int:
        return self._live

    def _home(self, k1: np.ndarray) -> np.ndarray:
        return ((k1 >> _SHIFT) & self._mask).astype(np.intp)

    # Each round gathers one bucket (a row of 8 k1 words) per key still in play into a flat array
    # of keys x 8 cells: the positions of the matches give (key, column) pairs directly, and a row's
    # 8 flags read as one uint64 say whether it has an empty (or free) cell. No per-row loops, and
    # only flat, contiguous numpy operations (broadcasting and 2-D fancy indexing cost several times
    # more at this size).
    def _rows(self, b: np.ndarray) -> np.ndarray:
        return self._k1.take(b, axis=0).reshape(-1)

    def find(self, k1: np.ndarray) -> np.ndarray:
        """For each key, the value of a cell holding it (-1 if none). Equal k1 words from two
        different hashes (a 2**-64 event per pair) give one of their values: the caller confirms
        with k2 and treats a mismatch as absent."""
        n = len(k1)
        out = np.full(n, -1, dtype=np.int64)
        if not n:
            return out
        b = self._home(k1)
        idx = None  # None: every key still looked for, in order
        for _ in range(self.num_buckets):
            rows = self._rows(b)
            p = (rows == np.repeat(k1, _W)).nonzero()[0]
            r = p >> 3
            if len(p):
                out[r if idx is None else idx[r]] = self._val_flat[(b[r] << 3) | (p & 7)]
            go_on = (rows == EMPTY).view(np.uint64) == 0
            if not go_on.any():
                break
            go_on[r] = False
            if not go_on.any():
                break
            idx = go_on.nonzero()[0] if idx is None else idx[go_on]
            k1, b = k1[go_on], (b[go_on] + 1) & (self.num_buckets - 1)
        return out

    def find_one(self, k1: int) -> int:
        """``find`` for one key, without numpy's per-call overhead on small arrays."""
        b = (k1 >> 8) & (self.num_buckets - 1)
        for _ in range(self.num_buckets):
            row = self._k1[b].tolist()
            if k1 in row:
                return int(self._val[b, row.index(k1)])
            if 0 in row:
                return -1
            b = (b + 1) & (self.num_buckets - 1)
        return -1

    def insert(self, k1: np.ndarray, values: np.ndarray) -> np.ndarray:
        """Add distinct keys that are absent (the caller checked); returns the cell of each."""
        n = len(k1)
        cells = np.empty(n, dtype=np.int64)
        if not n:
            return cells
        if (self._live + n) * 4 > self.num_buckets * _W + 4 * _W:
            raise ValueError(f"hash table over capacity: {self._live} + {n} keys in {self.num_buckets} buckets")
        v = np.asarray(values, dtype=np.int64)
        b = self._home(k1)
        idx = np.arange(n)
        for _ in range(n + self.num_buckets):
            free = self._rows(b) <= DELETED
            p = free.nonzero()[0]
            r = p >> 3
            first = np.ones(len(p), dtype=bool)
            first[1:] = r[1:] != r[:-1]
            p, r = p[first], r[first]  # each key's first free cell, for keys whose bucket has one
            # One key per bucket per round: the last writer of _claim wins, the others retry.
            rb = b[r]
            self._claim[rb] = r
            won = self._claim[rb] == r
            if not won.all():
                r, rb, p = r[won], rb[won], p[won]
            cell = (rb << 3) | (p & 7)
            if self._deleted:
                self._deleted -= int(np.count_nonzero(self._k1_flat[cell] == DELETED))
            self._k1_flat[cell] = k1[r]
            self._val_flat[cell] = v[r]
            cells[idx[r]] = cell
            if len(r) == len(b):
                break
            # Keys whose bucket has no free cell move on to the next one; losers of a claim stay.
            full = free.view(np.uint64) == 0
            b = np.where(full, (b + 1) & (self.num_buckets - 1), b)
            keep = np.ones(len(b), dtype=bool)
            keep[r] = False
            idx, k1, v, b = idx[keep], k1[keep], v[keep], b[keep]
        self._live += n
        return cells

    def delete_cells(self, cells: np.ndarray) -> bool:
        """Empty the given cells (as ``insert`` returned them for live keys). Returns True when
        deleted markers have piled up and the caller should ``rebuild``."""
        if not len(cells):
            return False
        open_ = (self._rows(cells >> 3) == EMPTY).view(np.uint64) != 0
        self._k1_flat[cells] = np.where(open_, EMPTY, DELETED)
        self._live -= len(cells)
        self._deleted += len(cells) - int(np.count_nonzero(open_))
        return self._deleted > self.num_buckets  # deleted markers in an eighth of the cells

    def clear(self) -> None:
        self._k1[:] = EMPTY
        self._live = self._deleted = 0

    def rebuild(self) -> tuple[np.ndarray, np.ndarray]:
        """Reinsert every live key into a clean table; returns (values, their new cells)."""
        live = np.flatnonzero(self._k1_flat > DELETED)
        k1, vals = self._k1_flat[live].copy(), self._val_flat[live].copy()
        self.clear()
        return vals, self.insert(k1, vals)
