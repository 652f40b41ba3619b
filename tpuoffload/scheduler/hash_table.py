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

Layout: ``num_buckets`` buckets of 4 cells, at most a quarter of the cells live. A bucket is one
64-byte row (one cache line): its 4 k1 words, then the 4 values, so finding, inserting or deleting a
key touches one cache line. A key goes to its home bucket ``(k1 >> 8) % num_buckets`` unless that bucket has no free cell, then to the next
bucket with one. A bucket that still has an empty cell has never been full, so no key has
overflowed past it: lookups stop there, and a delete in it can empty the cell. Only buckets that
have been full keep deleted markers (reused by later inserts); if those ever take an eighth of the
cells the table is rebuilt (cells move: ``rebuild`` says where). A cell is ``bucket * 4 + column``.
"""

from __future__ import annotations

from collections.abc import Sequence

import struct

import numpy as np

_TWO_WORDS = struct.Struct("<QQ").unpack_from  # the first 16 bytes as two little-endian uint64
EMPTY = np.uint64(0)
DELETED = np.uint64(1)
_W = 4  # cells per bucket; a bucket's row holds their 4 k1 words then their 4 values
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
        k1, k2 = _TWO_WORDS(h)
        return (k1 if k1 > 1 else 2), k2


class HashTable:
    """k1 -> int value (a slot, below 2**63). Single-threaded. ``capacity``: most keys live at once."""

    CELLS_PER_BUCKET = _W

    def __init__(self, capacity: int) -> None:
        nb = 1
        while nb * _W < 4 * max(capacity, 1):
            nb *= 2
        self.num_buckets = nb
        self._mask = np.uint64(nb - 1)
        self._tab = np.zeros((nb, 2 * _W), dtype=np.uint64)  # [k1 x 4 | value x 4] per bucket
        self._flat = self._tab.reshape(-1)
        self._words = memoryview(self._flat)  # the same memory read word by word as Python ints
        self._claim = np.zeros(nb, dtype=np.int64)  # scratch: which key claims a bucket this round
        self._live = 0
        self._deleted = 0

    def __len__(self) -> int:
        return self._live

    def _home(self, k1: np.ndarray) -> np.ndarray:
        return ((k1 >> _SHIFT) & self._mask).astype(np.intp)

    # Each round gathers one bucket row per key still in play and compares the rows, flattened,
    # at once: the positions of the matches give (key, column) pairs directly, and a row's 4
    # flags read as one uint32 say whether it has an empty (or free) cell. No per-row loops, and
    # flat numpy operations (broadcasting and 2-D fancy indexing cost several times more here).
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
            rows = self._tab.take(b, axis=0)
            flat = rows.reshape(-1)  # a view: 4 k1 words then 4 values per row
            p = (flat == np.repeat(k1, 2 * _W)).nonzero()[0]
            if len(p):
                p = p[(p & 7) < _W]  # a match among the values is no match
            r = p >> 3
            if len(p):
                out[r if idx is None else idx[r]] = flat[p + _W].view(np.int64)
            go_on = (rows[:, :_W] == EMPTY).view(np.uint32).reshape(-1) == 0
            if not go_on.any():
                break
            go_on[r] = False
            if not go_on.any():
                break
            idx = go_on.nonzero()[0] if idx is None else idx[go_on]
            k1, b = k1[go_on], (b[go_on] + 1) & (self.num_buckets - 1)
        return out

    def find_one(self, k1: int) -> int:
        """``find`` for one key, in plain Python over a memoryview of the table (no numpy call:
        about a microsecond, for the per-request lookups)."""
        words, mask = self._words, self.num_buckets - 1
        b = (k1 >> 8) & mask
        for _ in range(self.num_buckets):
            base = b << 3
            row = words[base:base + _W].tolist()
            if k1 in row:
                return words[base + _W + row.index(k1)]
            if 0 in row:  # an empty cell anywhere in the row: it never overflowed
                return -1
            b = (b + 1) & mask
        return -1

    def insert(self, k1: np.ndarray, values: np.ndarray) -> np.ndarray:
        """Add distinct keys that are absent (the caller checked); returns the cell of each."""
        n = len(k1)
        cells = np.empty(n, dtype=np.int64)
        if not n:
            return cells
        if (self._live + n) * 4 > self.num_buckets * _W + 4 * _W:
            raise ValueError(f"hash table over capacity: {self._live} + {n} keys in {self.num_buckets} buckets")
        v = np.asarray(values, dtype=np.int64).view(np.uint64)
        b = self._home(k1)
        idx = None  # None: every key still to place, in order
        for _ in range(n + self.num_buckets):
            free = self._tab.take(b, axis=0)[:, :_W] <= DELETED  # (keys, 4), contiguous
            p = free.reshape(-1).nonzero()[0]
            r = p >> 2
            first = np.ones(len(p), dtype=bool)
            first[1:] = r[1:] != r[:-1]
            p, r = p[first], r[first]  # each key's first free cell, for keys whose bucket has one
            # One key per bucket per round. Usually every bucket is distinct (a sort says so without
            # touching memory at random); otherwise the last writer of _claim wins, the rest retry.
            rb = b[r]
            srt = np.sort(rb)
            if len(srt) > 1 and (srt[1:] == srt[:-1]).any():
                self._claim[rb] = r
                won = self._claim[rb] == r
                r, rb, p = r[won], rb[won], p[won]
            col = p & 3
            kpos = (rb << 3) | col  # the k1 word of the cell; its value is 4 words further
            if self._deleted:
                self._deleted -= int(np.count_nonzero(self._flat[kpos] == DELETED))
            self._flat[kpos] = k1[r]
            self._flat[kpos + _W] = v[r]
            cells[r if idx is None else idx[r]] = (rb << 2) | col
            if len(r) == len(b):
                break
            # Keys whose bucket has no free cell move on to the next one; losers of a claim stay.
            full = free.view(np.uint32).reshape(-1) == 0
            b = np.where(full, (b + 1) & (self.num_buckets - 1), b)
            keep = np.ones(len(b), dtype=bool)
            keep[r] = False
            idx = keep.nonzero()[0] if idx is None else idx[keep]
            k1, v, b = k1[keep], v[keep], b[keep]
        self._live += n
        return cells

    def k1_at(self, cells: np.ndarray) -> np.ndarray:
        """The k1 words stored in live ``cells`` (as ``insert`` returned them)."""
        return self._flat[(cells >> 2 << 3) | (cells & 3)]

    def delete_cells(self, cells: np.ndarray) -> bool:
        """Empty the given cells (as ``insert`` returned them for live keys). Returns True when
        deleted markers have piled up and the caller should ``rebuild``."""
        if not len(cells):
            return False
        b = cells >> 2
        open_ = (self._tab.take(b, axis=0)[:, :_W] == EMPTY).view(np.uint32).reshape(-1) != 0
        self._flat[(b << 3) | (cells & 3)] = np.where(open_, EMPTY, DELETED)
        self._live -= len(cells)
        self._deleted += len(cells) - int(np.count_nonzero(open_))
        return self._deleted > self.num_buckets // 2  # deleted markers in an eighth of the cells

    def clear(self) -> None:
        self._tab[:] = EMPTY
        self._live = self._deleted = 0

    def rebuild(self) -> tuple[np.ndarray, np.ndarray]:
        """Reinsert every live key into a clean table; returns (values, their new cells)."""
        keys = self._tab[:, :_W]
        live = keys > DELETED
        k1 = keys[live]
        vals = self._tab[:, _W:][live].view(np.int64)
        self.clear()
        return vals, self.insert(k1, vals)
