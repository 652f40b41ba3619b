"""tpuoffload/manager/hash_table.py: HashTable, HashKeys and PackedHashes, randomized against a dict."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tpuoffload.manager.hash_table import HashKeys, HashTable, PackedHashes


@pytest.mark.parametrize("seed", range(4))
def test_hash_table_randomized_against_a_dict(seed):
    """Small tables, clustered keys (many share a home bucket, so buckets fill, overflow, get
    deleted markers and rebuilds): every find agrees with a dict."""
    rng = random.Random(seed)
    cap = (4, 16, 64, 64)[seed]
    t = HashTable(cap)
    model: dict[int, int] = {}
    cells: dict[int, int] = {}
    universe = [2 + (rng.randrange(4) << 8) + (i << 20) if rng.random() < 0.7 else rng.randrange(2, 1 << 63)
                for i in range(4 * cap)]
    next_val = 0
    rebuilds = 0
    for _ in range(3000):
        op = rng.random()
        if op < 0.45:
            absent = [k for k in universe if k not in model]
            room = cap - len(model)
            new = rng.sample(absent, min(len(absent), room, rng.randrange(0, 6)))
            vals = np.arange(next_val, next_val + len(new))
            next_val += len(new)
            got = t.insert(np.array(new, dtype=np.uint64), vals)
            for k, v, c in zip(new, vals.tolist(), got.tolist()):
                model[k], cells[k] = v, c
        elif op < 0.8 and model:
            gone = rng.sample(sorted(model), rng.randrange(1, min(len(model), 5) + 1))
            if t.delete_cells(np.array([cells[k] for k in gone], dtype=np.int64)):
                vals, new_cells = t.rebuild()
                by_val = {v: k for k, v in model.items()}
                for v, c in zip(vals.tolist(), new_cells.tolist()):
                    cells[by_val[v]] = c
                rebuilds += 1
            for k in gone:
                del model[k], cells[k]
        q = rng.sample(universe, 8)
        assert t.find(np.array(q, dtype=np.uint64)).tolist() == [model.get(k, -1) for k in q]
        assert [t.find_one(k) for k in q] == [model.get(k, -1) for k in q]
        assert len(t) == len(model)
    if cap == 64:
        assert rebuilds > 0, "the test must reach the rebuild path"


def test_hash_table_overflow_past_full_buckets():
    w = HashTable.CELLS_PER_BUCKET
    t = HashTable(16)
    keys = np.array([2 + (i << 20) for i in range(20)], dtype=np.uint64)  # all home in bucket 0
    cells = t.insert(keys, np.arange(20))
    full, rest = divmod(20, w)
    assert sorted((cells // w).tolist()) == [b for b in range(full) for _ in range(w)] + [full] * rest
    assert t.find(keys).tolist() == list(range(20))
    gone = np.flatnonzero((cells // w) == 0)[:3]
    t.delete_cells(cells[gone])  # bucket 0 was full: deleted markers, lookups still go past it
    want = [-1 if i in gone else i for i in range(20)]
    assert t.find(keys).tolist() == want
    new = np.array([2 + (100 << 20)], dtype=np.uint64)
    assert (t.insert(new, [99]) // w).tolist() == [0]  # a deleted cell is reused
    assert t.find(np.concatenate((keys, new))).tolist() == want + [99]


def test_hash_keys_of_vllm_hashes_and_odd_input():
    hs = [bytes(range(i, i + 32)) for i in range(3)]
    k = HashKeys.of(hs)
    assert k.k1.tolist() == [int.from_bytes(x[:8], "little") for x in hs]
    assert k.k2.tolist() == [int.from_bytes(x[8:16], "little") for x in hs]
    t = HashTable(8)  # the per-request path splits one hash in plain Python: the same keys
    t.insert(k.k1, [10, 11, 12])
    assert [t.find_hash(x) for x in hs] == list(zip([10, 11, 12], k.k2.tolist()))
    assert t.find_hash(b"\0" * 16) == (-1, 0)  # k1 0 is looked up as 2, absent here
    assert HashKeys.of([b"\0" * 16]).k1.tolist() == [2]  # 0 and 1 mark empty/deleted cells
    odd = HashKeys.of([b"short", b"x" * 20])  # normalised to 16 bytes
    assert len(odd) == 2 and odd.k1[0] == max(int.from_bytes(b"short\0\0\0", "little"), 2)
    with pytest.raises(TypeError, match="bytes"):
        HashKeys.of([1, 2])


@pytest.mark.parametrize("seed", range(3))
def test_packed_hashes_of_runs_is_of_the_concatenation(seed):
    rng = random.Random(seed)
    for _ in range(50):
        width = rng.choice([16, 32])
        runs = [[rng.randbytes(width) for _ in range(rng.randrange(0, 5))] for _ in range(rng.randrange(1, 5))]
        if not any(runs):
            runs[0].append(rng.randbytes(width))
        flat = [x for r in runs for x in r]
        got, want = HashKeys.of(PackedHashes.of_runs(runs)), HashKeys.of(flat)
        assert got.k1.tolist() == want.k1.tolist() and got.k2.tolist() == want.k2.tolist()
    mixed = [[b"a" * 32], [b"b" * 16, b"short"]]  # lengths differ: normalised like ``of``
    got, want = HashKeys.of(PackedHashes.of_runs(mixed)), HashKeys.of([b"a" * 32, b"b" * 16, b"short"])
    assert got.k1.tolist() == want.k1.tolist() and got.k2.tolist() == want.k2.tolist()
    with pytest.raises(TypeError, match="bytes"):
        PackedHashes.of_runs([[b"x" * 16], [1]])
