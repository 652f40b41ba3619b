"""Issue 21: the scheduler half's view of vLLM's KV cache groups (manager/kv_groups.py), on a real
ChunkIndex and vLLM's own spec classes: keys by group, save candidates, hits every group can serve."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec,
                                        SlidingWindowSpec)

from tpuoffload.manager.hash_table import HashKeys, PackedHashes
from tpuoffload.manager.index import ChunkIndex
from tpuoffload.manager.kv_groups import NULL_BLOCK, KVCacheGroups, chunk_hash, chunk_keys

BS = 16


def _hashes(n: int, seed: int = 0) -> list[bytes]:
    return [hashlib.sha256(f"{seed}:{i}".encode()).digest() for i in range(n)]


def _config(*specs) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec([f"layer.{g}"], s) for g, s in enumerate(specs)])


FULL = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.bfloat16)


def _window(tokens: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.bfloat16, sliding_window=tokens)


def test_groups_from_vllm_specs():
    assert KVCacheGroups.of(_config(FULL), BS).windows == (None,)
    groups = KVCacheGroups.of(_config(_window(128), FULL), BS)
    assert groups.windows == (8, None) and groups.several and groups.windowed
    assert KVCacheGroups.of(_config(_window(129), FULL), BS).windows == (8, None)  # cdiv(128, 16)
    assert KVCacheGroups.of(_config(_window(130), FULL), BS).windows == (9, None)
    mamba = MambaSpec(block_size=BS, shapes=((4, 8),), dtypes=(torch.float32,))
    with pytest.raises(ValueError, match="MambaSpec"):
        KVCacheGroups.of(_config(FULL, mamba), BS)


def test_keys_differ_by_group_and_group_0_is_the_content_hash():
    hashes = _hashes(5)
    packed = PackedHashes.of(hashes)
    assert chunk_keys(packed, 0).buf == packed.buf
    k = [HashKeys.of(chunk_keys(packed, g)) for g in range(3)]
    for a in range(3):
        for b in range(a + 1, 3):
            assert not np.intersect1d(k[a].k1, k[b].k1).size
    assert chunk_hash(hashes[2], 1) == chunk_keys(packed, 1).buf[64:96]


def test_candidates_block_by_block_and_skip_the_null_block():
    groups = KVCacheGroups((2, None))
    hashes = _hashes(6)
    # The sliding-window group has dropped blocks 0 and 1 (null); blocks 0..5, span 1..4 then 0..1.
    ids = ([NULL_BLOCK, NULL_BLOCK, 11, 12, 13, 14], [20, 21, 22, 23, 24, 25])
    blocks, keys, pools = groups.candidates([(ids, hashes, 1, 5)])
    assert pools.tolist() == [0] * 7
    assert blocks == [21, 11, 22, 12, 23, 13, 24]
    want = [chunk_hash(hashes[1], 1)] + [chunk_hash(hashes[i], g) for i in (2, 3, 4) for g in (0, 1)]
    assert keys.buf == b"".join(want)


def _store(index: ChunkIndex, hashes, group: int, which) -> None:
    packed = chunk_keys(PackedHashes.of([hashes[i] for i in which]), group)
    first = 1000 * (group + 1) + min(which, default=0)
    _, _, _, _, slots, _ = index.select_and_name(packed, len(which), first)
    index.mark_ready(slots, np.arange(first, first + len(slots)))


def test_find_hit_every_group_serves_it():
    groups = KVCacheGroups((4, None))  # a 4-block window, full attention
    hashes = _hashes(20)
    index = ChunkIndex(256)
    _store(index, hashes, 1, range(0, 16))  # full attention: blocks 0..15
    _store(index, hashes, 0, [*range(4, 9), *range(11, 14)])  # window: 4..8 and 11..13
    hit = groups.find_hit(index, hashes, 0, 20)
    # 16 (full) is too long for the window (13..15 missing), 14 needs 10..13 (10 missing);
    # 9 needs 5..8: present.
    assert hit.n == 9 and hit.first == (5, 0)
    assert len(hit.slots[0]) == 4 and len(hit.slots[1]) == 9
    # Beyond a local hit of 6 blocks: the window still ends at the boundary.
    hit = groups.find_hit(index, hashes, 6, 20)
    assert hit.n == 3 and hit.first == (0, 0)  # blocks 6..8: window 5..8, of which 6..8 load
    # A short hit inside the window needs every block from the local hit on.
    assert groups.find_hit(index, hashes, 0, 3).n == 0  # block 0 of the window group missing
    # Nothing for the full group: no hit whatever the window holds.
    assert groups.find_hit(index, _hashes(20, 1), 0, 20).n == 0
