"""A hash table from content-hash keys to slot numbers, in numpy arrays, used in batches.

Why not a Python dict: at a million chunks every dict operation is two or three cache misses (the
index, the entry, and the hash object itself to read its cached hash), and a prefill step that
evicts does a lookup, an insert and a delete per chunk. Here the key lives inside the table (no
object to follow), a batch of keys is looked up or inserted in one call of a compiled loop
(kernels.py), and a delete does not look anything up: the caller passes the cell each value was stored in (which
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

import struct
from collections.abc import Sequence

import numpy as np

from tpuoffload.manager.kernels import DELETED, EMPTY_CELL, kernels
from tpuoffload.manager.kernels import W as _W  # cells per bucket: a row holds 4 k1 words then 4 values

_TWO_WORDS = struct.Struct("<QQ").unpack_from  # the first 16 bytes as two little-endian uint64


class PackedHashes:
    """A batch of content hashes as the compiled loops read them: ``width`` bytes each (a multiple
    of 8, at least 16), laid end to end in one bytes object. Packing reads each hash object once;
    the keys are split from the bytes inside the compiled loop that uses them (``HashKeys.of``, or
    ``ChunkIndex.select_new`` directly), with no numpy call in between."""

    __slots__ = ("buf", "width")

    def __init__(self, buf: bytes, width: int) -> None:
        self.buf = buf
        self.width = width

    def __len__(self) -> int:
        return len(self.buf) // self.width

    @classmethod
    def of(cls, hashes: Sequence[bytes]) -> "PackedHashes":
        """``hashes`` (bytes of one length, at least 16 and a multiple of 8, as vLLM's block hashers
        produce; anything else bytes-like is normalised to its first 16 bytes, zero-padded)."""
        if not len(hashes):
            return cls(b"", 16)
        try:
            buf = b"".join(hashes)
        except TypeError:
            raise TypeError(f"block hashes must be bytes, got {type(hashes[0]).__name__}") from None
        width = len(hashes[0])
        if width < 16 or width % 8 or len(buf) != len(hashes) * width:
            return cls(b"".join([bytes(h[:16]).ljust(16, b"\0") for h in hashes]), 16)
        return cls(buf, width)

    @classmethod
    def of_runs(cls, runs: Sequence[Sequence[bytes]]) -> "PackedHashes":
        """The hashes of ``runs`` one after the other (``of`` of their concatenation), without
        building the concatenated list: each run is joined as it is, so every hash object is read
        once (on a cold cache, that read is most of the cost)."""
        if len(runs) == 1:
            return cls.of(runs[0])
        try:
            w = len(next(r[0] for r in runs if len(r)))
            buf = b"".join([b"".join(r) for r in runs])
        except (TypeError, StopIteration):
            w = 0  # not bytes (``of`` says so), or nothing at all
        n = len(buf) // w if w >= 16 and not w % 8 else -1
        if n != sum(map(len, runs)):  # not bytes, or of another or several lengths: ``of`` normalises
            return cls.of([h for r in runs for h in r])
        return cls(buf, w)


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
    def of(cls, hashes: "Sequence[bytes] | PackedHashes") -> "HashKeys":
        """Keys of ``hashes`` (as ``PackedHashes.of`` takes them, or packed already)."""
        packed = hashes if type(hashes) is PackedHashes else PackedHashes.of(hashes)
        return cls(*kernels().split_keys(packed.buf, packed.width))

    @classmethod
    def of_rows(cls, rows: np.ndarray) -> "tuple[HashKeys, np.ndarray]":
        """Keys of stored or reported rows (fields ``k1``, ``k2``), and which rows they are: a row
        whose k1 is 0 or 1 (the table's free-cell markers, never a key a scheduler wrote) is left out."""
        ok = rows["k1"] > 1
        return cls(rows["k1"][ok], rows["k2"][ok]), ok


class HashTable:
    """k1 -> int value (a slot, below 2**63). Single-threaded. ``capacity``: most keys live at once.

    Each batch operation is one call into compiled code (kernels.py), so its cost is a couple of
    microseconds of call overhead plus one cache line per key, whatever the number of keys held.
    """

    CELLS_PER_BUCKET = _W

    def __init__(self, capacity: int) -> None:
        nb = 1
        while nb * _W < 4 * max(capacity, 1):
            nb *= 2
        self.num_buckets = nb
        self._k = kernels()
        self._tab = np.zeros((nb, 2 * _W), dtype=np.uint64)  # [k1 x 4 | value x 4] per bucket
        self._words = memoryview(self._tab.reshape(-1))  # the same memory read word by word as Python ints
        self._live = 0
        self._deleted = 0

    def __len__(self) -> int:
        return self._live

    @property
    def buckets(self) -> np.ndarray:
        """The table itself, ``(num_buckets, 8)`` uint64, for compiled loops that probe it
        (kernels.py); only this class writes it."""
        return self._tab

    def find(self, k1: np.ndarray) -> np.ndarray:
        """For each key, the value of a cell holding it (-1 if none). Equal k1 words from two
        different hashes (a 2**-64 event per pair) give one of their values: the caller confirms
        with k2 and treats a mismatch as absent."""
        out = np.empty(len(k1), dtype=np.int64)
        if len(out):
            self._k.find(self._tab, _u64(k1), out)
        return out

    def find_one(self, k1: int) -> int:
        """``find`` for one key, in plain Python over a memoryview of the table (no call into
        compiled code or numpy: about a microsecond, for the per-request lookups)."""
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

    def find_hash(self, h: bytes) -> tuple[int, int]:
        """``find_one`` of a hash's k1, with its k2 to confirm: ``(value or -1, k2)``. One call
        where vLLM asks per request (a call costs about a microsecond on the caches vLLM's step
        leaves)."""
        if len(h) < 16:
            h = bytes(h).ljust(16, b"\0")
        k1, k2 = _TWO_WORDS(h)
        return self.find_one(k1 if k1 > 1 else 2), k2

    def insert(self, k1: np.ndarray, values) -> np.ndarray:
        """Add distinct keys that are absent (the caller checked); returns the cell of each."""
        n = len(k1)
        cells = np.empty(n, dtype=np.int64)
        if not n:
            return cells
        self.check_room(n)
        self.inserted(n, self._k.insert(self._tab, _u64(k1), _i64(values), cells))
        return cells

    def check_room(self, n: int) -> None:
        """Raise unless ``n`` more keys fit."""
        if (self._live + n) * 4 > self.num_buckets * _W + 4 * _W:
            raise ValueError(f"hash table over capacity: {self._live} + {n} keys in {self.num_buckets} buckets")

    def inserted(self, n: int, reused: int) -> None:
        """Account for ``n`` keys that a compiled loop inserted (kernels.py ``_insert``) into
        ``buckets``, ``reused`` of them into deleted cells."""
        self._live += n
        self._deleted -= reused

    def k1_at(self, cells: np.ndarray) -> np.ndarray:
        """The k1 words stored in live ``cells`` (as ``insert`` returned them)."""
        return self._tab.reshape(-1)[(cells >> 2 << 3) | (cells & 3)]

    def delete_cells(self, cells: np.ndarray) -> bool:
        """Empty the given cells (as ``insert`` returned them for live keys). Returns True when
        deleted markers have piled up and the caller should ``rebuild``."""
        if not len(cells):
            return False
        return self.removed(len(cells), self._k.delete(self._tab, _i64(cells)))

    def removed(self, n: int, markers: int) -> bool:
        """Account for ``n`` keys that a compiled loop deleted from ``buckets`` (kernels.py
        ``_delete_cell``), leaving ``markers`` DELETED markers. Returns ``delete_cells``'s answer."""
        self._live -= n
        self._deleted += markers
        return self._deleted > self.num_buckets // 2  # deleted markers in an eighth of the cells

    def clear(self) -> None:
        self._tab[:] = EMPTY_CELL
        self._live = self._deleted = 0

    def rebuild(self) -> tuple[np.ndarray, np.ndarray]:
        """Reinsert every live key into a clean table; returns (values, their new cells)."""
        keys = self._tab[:, :_W]
        live = keys > DELETED
        k1 = keys[live]
        vals = self._tab[:, _W:][live].view(np.int64)
        self.clear()
        return vals, self.insert(k1, vals)


_U64, _I64 = np.dtype(np.uint64), np.dtype(np.int64)  # numpy's dtype objects are singletons


def _u64(a) -> np.ndarray:
    """``a`` as a uint64 array: itself when it is one already (no numpy call: on a cold cache
    each costs microseconds, and the hot path hands over arrays of the right type)."""
    return a if type(a) is np.ndarray and a.dtype is _U64 else np.asarray(a, dtype=np.uint64)


def _i64(a) -> np.ndarray:
    """``a`` as an int64 array (itself when it is one already)."""
    return a if type(a) is np.ndarray and a.dtype is _I64 else np.asarray(a, dtype=np.int64)
