"""A hash table from content hashes to slot numbers, held in numpy arrays and used in batches.

Why not a Python dict: with a million chunks held and every save evicting one, each dict insert,
delete or failed lookup is a cache miss along a probe chain lengthened by deleted entries (a few
hundred nanoseconds to a microsecond each, measured), and a prefill step does one of each per
chunk. Here a batch of keys is looked up, inserted or deleted with a fixed handful of numpy calls,
whatever the table's size.

Keys: the first 16 bytes of vLLM's block hash (sha256 or xxhash128 output, uniformly distributed)
as two uint64 words, compared together (128 bits: a false match is as likely as a collision of
vLLM's own 128-bit hashes). ``k1`` values 0 and 1 mark empty and deleted cells; a real key with
``k1 < 2`` is stored as 2 (``k2`` still tells it apart).

Layout: ``num_buckets`` buckets of 8 cells, at most a quarter of the cells live. A key lives in its
home bucket ``(k1 >> 8) % num_buckets`` unless that bucket was full when it was inserted, then in the
next bucket with a free cell. A bucket that still has an empty cell has never been full, so no key
has overflowed past it: lookups stop there, and deleting from it can empty the cell; only buckets
that have been full keep deleted markers (reused by later inserts; the table is rebuilt if they
ever take an eighth of the cells).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

EMPTY = np.uint64(0)
DELETED = np.uint64(1)
_W = 8  # cells per bucket
_SHIFT = np.uint64(8)


class HashKeys:
    """Keys of a batch of content hashes (two uint64 words each)."""

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
        """Keys of ``hashes`` (bytes of one length, at least 16, a multiple of 8: what vLLM's
        block hashers produce)."""
        n = len(hashes)
        if not n:
            return cls(np.zeros(0, np.uint64), np.zeros(0, np.uint64))
        try:
            buf = b"".join(hashes)
        except TypeError:
            raise TypeError(f"block hashes must be bytes, got {type(hashes[0]).__name__}") from None
        width = len(hashes[0])
        if width < 16 or width % 8 or len(buf) != n * width:  # not what vLLM hashes are: normalise
            return cls.of([bytes(h[:16]).ljust(16, b"\0") for h in hashes])
        words = np.frombuffer(buf, dtype=np.uint64).reshape(n, width // 8)
        k1 = np.maximum(words[:, 0], np.uint64(2))
        return cls(k1, words[:, 1].copy())


class HashTable:
    """Content-hash keys -> int values (slots). Single-threaded."""

    def __init__(self, capacity: int) -> None:
        nb = 1
        while nb * _W < 4 * max(capacity, 1):
            nb *= 2
        self.num_buckets = nb
        self._mask = np.uint64(nb - 1)
        self._k1 = np.zeros((nb, _W), dtype=np.uint64)
        self._k2 = np.zeros((nb, _W), dtype=np.uint64)
        self._val = np.zeros((nb, _W), dtype=np.int64)
        self._claim = np.zeros(nb, dtype=np.int64)  # scratch: which key claims a bucket this round
        self._live = 0
        self._deleted = 0

    def __len__(self) -> int:
        return self._live

    def _home(self, k1: np.ndarray) -> np.ndarray:
        return ((k1 >> _SHIFT) & self._mask).astype(np.intp)

    # ------------------------------------------------------------------ batch operations
    # Each round gathers one bucket (one 64-byte row of k1 words) per key still looked for, and
    # works on the flattened (keys x 8) comparison: np.flatnonzero gives (row, cell) pairs directly
    # and a row's 8 flags read as one uint64 tell whether it has an empty cell, so no per-row
    # reductions. k2 is read only where k1 matched.
    def _match(self, b: np.ndarray, k1: np.ndarray, k2: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows, cells, open): the keys (row numbers into ``b``) found in their bucket ``b``, the
        cell holding each, and for every key whether its bucket has an empty cell."""
        rows = self._k1[b]
        p = np.flatnonzero(rows == k1[:, None])
        r, c = p >> 3, p & 7
        if len(p):
            ok = self._k2[b[r], c] == k2[r]
            if not ok.all():
                r, c = r[ok], c[ok]
        open_ = (rows == EMPTY).view(np.uint64)[:, 0] != 0
        return r, c, open_

    def find(self, keys: HashKeys) -> np.ndarray:
        """The value of each key, -1 where absent."""
        n = len(keys)
        out = np.full(n, -1, dtype=np.int64)
        if not n:
            return out
        k1, k2, b = keys.k1, keys.k2, self._home(keys.k1)
        idx = None  # None: every key is still looked for, in order
        for _ in range(self.num_buckets):
            r, c, open_ = self._match(b, k1, k2)
            if len(r):
                out[r if idx is None else idx[r]] = self._val[b[r], c]
            go_on = ~open_
            go_on[r] = False
            if not go_on.any():
                break
            idx = np.flatnonzero(go_on) if idx is None else idx[go_on]
            k1, k2, b = k1[go_on], k2[go_on], (b[go_on] + 1) & (self.num_buckets - 1)
        return out

    def insert(self, keys: HashKeys, values: np.ndarray) -> None:
        """Add keys that are absent and distinct (the caller checked)."""
        n = len(keys)
        if not n:
            return
        if (self._live + n) * 4 > self.num_buckets * _W + 4 * _W:
            raise ValueError(f"hash table over capacity: {self._live} + {n} keys in {self.num_buckets} buckets")
        k1, k2, v = keys.k1, keys.k2, np.asarray(values, dtype=np.int64)
        b = self._home(k1)
        for _ in range(n + self.num_buckets):
            free = self._k1[b] <= DELETED
            p = np.flatnonzero(free)
            r = p >> 3
            first = np.ones(len(p), dtype=bool)
            first[1:] = r[1:] != r[:-1]
            p, r = p[first], r[first]  # each key's first free cell, for keys whose bucket has one
            # One key per bucket per round: the last writer of _claim wins, the others retry.
            rb = b[r]
            self._claim[rb] = r
            won = self._claim[rb] == r
            r, rb, c = r[won], rb[won], p[won] & 7
            self._deleted -= int(np.count_nonzero(self._k1[rb, c] == DELETED))
            self._k1[rb, c] = k1[r]
            self._k2[rb, c] = k2[r]
            self._val[rb, c] = v[r]
            if len(r) == len(b):
                break
            # Keys whose bucket is full move on to the next one; the losers of a claim stay.
            full = (free.view(np.uint64)[:, 0] == 0)
            b = np.where(full, (b + 1) & (self.num_buckets - 1), b)
            keep = np.ones(len(b), dtype=bool)
            keep[r] = False
            k1, k2, v, b = k1[keep], k2[keep], v[keep], b[keep]
        self._live += n

    def delete(self, keys: HashKeys) -> int:
        """Remove the keys that are present; returns how many were."""
        n = len(keys)
        if not n:
            return 0
        k1, k2, b = keys.k1, keys.k2, self._home(keys.k1)
        removed = 0
        for _ in range(self.num_buckets):
            r, c, open_ = self._match(b, k1, k2)
            if len(r):
                # A bucket with an empty cell has never overflowed: its cell can be emptied.
                mark = np.where(open_[r], EMPTY, DELETED)
                self._k1[b[r], c] = mark
                removed += len(r)
                self._deleted += len(r) - int(np.count_nonzero(open_[r]))
            go_on = ~open_
            go_on[r] = False
            if not go_on.any():
                break
            k1, k2, b = k1[go_on], k2[go_on], (b[go_on] + 1) & (self.num_buckets - 1)
        self._live -= removed
        if self._deleted > self.num_buckets:  # deleted markers in an eighth of the cells
            self._rebuild()
        return removed

    def clear(self) -> None:
        self._k1[:] = EMPTY
        self._live = self._deleted = 0

    # ------------------------------------------------------------------ scalar
    def find_one(self, h: bytes) -> int:
        """The value of one hash, -1 if absent (cheaper than ``find`` for a single key)."""
        k1 = max(int.from_bytes(h[0:8], "little"), 2)
        k2 = int.from_bytes(h[8:16], "little")
        b = (k1 >> 8) & (self.num_buckets - 1)
        for _ in range(self.num_buckets):
            row = self._k1[b].tolist()
            for c, x in enumerate(row):
                if x == k1 and int(self._k2[b, c]) == k2:
                    return int(self._val[b, c])
            if 0 in row:
                return -1
            b = (b + 1) & (self.num_buckets - 1)
        return -1

    # ------------------------------------------------------------------ internals
    def _rebuild(self) -> None:
        live = self._k1 > DELETED
        keys = HashKeys(self._k1[live], self._k2[live])
        vals = self._val[live]
        self._k1[:] = EMPTY
        self._live = self._deleted = 0
        self.insert(keys, vals)
