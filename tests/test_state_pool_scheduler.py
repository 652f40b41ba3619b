"""Issue 21, GDN (Qwen3.5-like) hybrids, the scheduler half: the state group of vLLM's KV cache
config (manager/kv_groups.py), the second slot pool of the index (manager/index.py) and the save
planner's pool-by-pool claims (manager/save_planner.py), on vLLM's own spec classes and on the KV
cache config tpu-inference's and vLLM's code build for a Qwen3.5-like model (sim/gdn_layout.py)."""

from __future__ import annotations

import copy
import hashlib
from collections import Counter

import numpy as np
import pytest
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

from tpuoffload import counters as C
from tpuoffload.config import OffloadConfig
from tpuoffload.manager.hash_table import HashKeys, PackedHashes
from tpuoffload.manager.index import READY, ChunkIndex
from tpuoffload.manager.kv_groups import MIRROR, KVCacheGroups, chunk_keys
from tpuoffload.manager.ledger import CompletionLedger
from tpuoffload.manager.offload_scheduler import OffloadScheduler
from tpuoffload.manager.save_planner import SavePlanner
from tpuoffload.manager.staging import StagingBudget
from tpuoffload.manager.topology import host_chunk_bytes, host_state_bytes

BS = 16
FULL = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.bfloat16)


def _mamba(mode: str = "align") -> MambaSpec:
    return MambaSpec(block_size=BS, shapes=((3, 8), (2, 4, 4)), dtypes=(torch.bfloat16, torch.float32),
                     mamba_cache_mode=mode)


def _config(*specs) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec([f"layer.{g}"], s) for g, s in enumerate(specs)])


def _hashes(n: int, seed: int = 0) -> list[bytes]:
    return [hashlib.sha256(f"{seed}:{i}".encode()).digest() for i in range(n)]


# Qwen3.5-like: three mamba groups (the first is the state group, the others mirror it), then attention.
GDN = KVCacheGroups((1, MIRROR, MIRROR, None), (1, 1, 1, 0))


def test_groups_of_a_gdn_hybrid():
    groups = KVCacheGroups.of(_config(_mamba(), _mamba(), _mamba(), FULL), BS)
    assert groups == GDN
    assert groups.num_pools == 2 and groups.state_group == 0 and groups.several
    assert "GDN/mamba state, one row per hit" in groups.describe() and "mirrors" in groups.describe()
    assert KVCacheGroups.of(_config(FULL, FULL), BS).num_pools == 1
    # Only align mode keeps a state per block boundary; other modes, and state alone, are refused.
    for mode in ("none", "all"):
        with pytest.raises(ValueError, match=f"mamba cache mode '{mode}'"):
            KVCacheGroups.of(_config(_mamba(mode), FULL), BS)
    with pytest.raises(ValueError, match="needs an attention group"):
        KVCacheGroups.of(_config(_mamba(), _mamba()), BS)


def test_a_state_is_saved_only_at_the_boundary_its_step_ends_on():
    m = [0, 0, 0, 7, 0, 9]  # the mamba table: the state after 4 blocks (7), the running state (9)
    attn = [11, 12, 13, 14, 15, 16]
    ids = (m, list(m), list(m), attn)
    # The step ended exactly after 4 blocks: row 7 holds that state; mirrors save nothing.
    s = GDN.state_ids(ids, 4, exact=True)
    assert s[0] == [0, 0, 0, 7] and s[1] == s[2] == [0, 0, 0, 0] and s[3] is attn
    # It ended 3 tokens later: no row holds the state after exactly 4 (or any earlier) blocks.
    assert GDN.state_ids(ids, 4, exact=False)[0] == [0, 0, 0, 0]
    blocks, keys, pools = GDN.candidates([(GDN.state_ids(ids, 4, True), _hashes(6), 2, 4)])
    # Block by block: block 2 (attention only), block 3 (its state row, then its attention block).
    assert blocks == [13, 7, 14] and pools.tolist() == [0, 1, 0]
    h = _hashes(6)
    assert keys.buf == chunk_keys(PackedHashes.of([h[2]]), 3).buf + chunk_keys(PackedHashes.of([h[3]]), 0).buf + \
        chunk_keys(PackedHashes.of([h[3]]), 3).buf


def _store(index: ChunkIndex, hashes, group: int, which, pool: int) -> None:
    packed = chunk_keys(PackedHashes.of([hashes[i] for i in which]), group)
    first = 1000 * (group + 1) + min(which, default=0)
    _, _, _, _, slots, _ = index.select_and_name(packed, len(which), first, pool)
    assert len(slots) == len(which)
    index.mark_ready(slots, np.arange(first, first + len(slots)))


def test_a_hit_ends_where_a_state_chunk_is():
    hashes = _hashes(12)
    index = ChunkIndex(40, pools=(30, 10))
    _store(index, hashes, 3, range(0, 10), pool=0)  # attention: blocks 0..9
    _store(index, hashes, 0, [2, 5], pool=1)  # states after 3 and after 6 blocks
    hit = GDN.find_hit(index, hashes, 0, 12)
    assert hit.n == 6 and hit.first == (5, 6, 6, 0)
    assert [len(s) for s in hit.slots] == [1, 0, 0, 6]
    assert 30 <= hit.slots[0][0] < 40 and (hit.slots[3] < 30).all()
    # Beyond a local hit of 3 blocks (vLLM's own state after 3 blocks): the next boundary with a state.
    assert GDN.find_hit(index, hashes, 3, 12).n == 3
    # No state chunk beyond the local hit: no hit, however many attention blocks are there.
    assert GDN.find_hit(index, hashes, 6, 12).n == 0


def test_index_pools_have_their_own_free_slots_and_lru():
    index = ChunkIndex(10, pools=(6, 4))
    assert index.pool_sizes == (6, 4) and index.num_slots == 10
    kv, state = _hashes(8, 1), _hashes(8, 2)
    _store(index, kv, 0, range(6), pool=0)
    _store(index, state, 0, range(4), pool=1)
    assert index.num_free_slots == 0
    # A full state pool evicts its own LRU chunk, never a KV chunk (the KV pool is full and older).
    victims = index.allocate(2, pool=1)
    assert sorted(victims.tolist()) == [6, 7]
    assert all(index.state_of(s) == READY for s in range(6))
    assert index.pool_of(np.array([0, 5, 6, 9])).tolist() == [0, 0, 1, 1]
    index.add_saving(HashKeys.of(chunk_keys(PackedHashes.of(state[4:6]), 0)), victims, 50)
    index.drop(victims, np.array([50, 51]))
    # Dropped slots go back to their own pool's free list.
    assert index.allocate(1, pool=0).size == 1 and index.pool_of(index.allocate(2, pool=1)).tolist() == [1, 1]
    with pytest.raises(ValueError, match="do not split"):
        ChunkIndex(10, pools=(6, 5))


def _planner(pools, staging_bytes, kv_bytes=10, state_bytes=40):
    index = ChunkIndex(sum(pools), pools=pools)
    ledger = CompletionLedger(1)
    counters: Counter = Counter()
    planner = SavePlanner(index, ledger, StagingBudget(staging_bytes), chunk_bytes=kv_bytes,
                          state_chunk_bytes=state_bytes, save_timeout_s=5.0, clock=lambda: 0.0, counters=counters)
    return planner, index, counters


def test_planner_claims_each_pool_apart_in_one_batch():
    planner, index, counters = _planner((8, 4), staging_bytes=1000)
    hashes = _hashes(6)
    packed = PackedHashes.of(hashes)
    blocks = [10, 70, 11, 71, 12, 13]
    pools = np.array([0, 1, 0, 1, 0, 0], np.int8)
    batch = planner.plan(blocks, packed, step=0, pools=pools)
    slots = list(batch.slots)
    # KV chunks first, then state chunks: each block id beside a slot of its own pool.
    assert list(batch.block_ids) == [10, 11, 12, 13, 70, 71]
    assert index.pool_of(np.array(slots)).tolist() == [0, 0, 0, 0, 1, 1]
    assert list(batch.save_ids) == list(range(6))  # one run of save ids
    assert planner.staging.in_use == 4 * 10 + 2 * 40 == planner.staged_bytes(np.array(slots))
    assert counters[C.SAVES_ISSUED] == 6


def test_planner_staging_takes_each_pools_chunk_size():
    # Room for 100 bytes. The KV pool claims first (a state is useless without the attention blocks
    # before it): three KV chunks (30), then one state chunk (40); the next state (40) has no room.
    planner, index, counters = _planner((8, 4), staging_bytes=100)
    batch = planner.plan([70, 71, 72, 10, 11, 12], PackedHashes.of(_hashes(6)), step=0,
                         pools=np.array([1, 1, 1, 0, 0, 0], np.int8))
    assert list(batch.block_ids) == [10, 11, 12, 70]
    assert counters[C.SKIPPED_STAGING] == 2 and planner.staging.in_use == 70


def test_scheduler_splits_host_ram_between_the_pools():
    from dataclasses import replace

    # Padded as tpu-inference pads a GDN hybrid (update_mamba_page_size_padded): every page is
    # attention groups x its attention page (here twice vLLM's count, as head_dim 64 padded to 128
    # makes it) + mamba groups x the unpadded mamba page.
    mamba = _mamba().real_page_size_bytes
    tpu_page = 2 * FULL.real_page_size_bytes
    padded = tpu_page + 2 * mamba
    cfg = _config(*(replace(s, page_size_padded=padded) for s in (_mamba(), _mamba(), FULL)))
    state = host_state_bytes(cfg, 1)
    assert state == 2 * mamba == 2 * (3 * 8 * 2 + 2 * 4 * 4 * 4)  # the real (unpadded) state of both mamba layers
    kv = host_chunk_bytes(cfg, 1)
    assert kv == tpu_page  # the array's block, not vLLM's count (tests/test_chunk_bytes_agree.py)
    # Pages not padded as tpu-inference pads them: an attention block's bytes are unknown.
    with pytest.raises(ValueError, match="not padded as tpu-inference pads it"):
        host_chunk_bytes(_config(_mamba(), _mamba(), FULL), 1)
    groups = KVCacheGroups.of(cfg, BS)
    sched = OffloadScheduler(OffloadConfig(cpu_bytes_to_use=100 * kv, state_ram_fraction=0.5), block_size=BS,
                             chunk_bytes=kv, num_hosts=1, kv_groups=groups, state_chunk_bytes=state)
    assert sched.index.pool_sizes == (50, 50 * kv // state)
    with pytest.raises(ValueError, match="holds no state chunk"):
        OffloadScheduler(OffloadConfig(cpu_bytes_to_use=100 * kv, state_ram_fraction=0.01), block_size=BS,
                         chunk_bytes=kv, num_hosts=1, kv_groups=groups, state_chunk_bytes=100 * kv)


def test_connector_scheduler_half_on_the_qwen35_like_layout():
    """The KV cache config tpu-inference's and vLLM's own code build (sim/gdn_layout.py): the
    scheduler half starts, with a state pool sized from the real mamba page."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from tpuoffload.connector import TPUOffloadConnector
    from tpuoffload.sim import gdn_layout as gl

    layout = gl.build(gl.QWEN35_LIKE)
    cfg = layout.kv_cache_config
    groups = KVCacheGroups.of(cfg, BS)
    assert groups.windows == (1, MIRROR, MIRROR, None) and groups.pools == (1, 1, 1, 0)
    vc = gl.make_vllm_config(gl.QWEN35_LIKE, {"cpu_bytes_to_use": 64 << 20})
    conn = TPUOffloadConnector(vc, KVConnectorRole.SCHEDULER, copy.deepcopy(cfg))
    sched = conn.scheduler
    # 6 GDN layers of (3, 512) bf16 + (8, 32, 32) float32; 2 attention layers of 32 KiB blocks (the
    # arrays' (16, 4, 2, 128) bf16: head_dim 64 padded to 128; vLLM's own count says 16 KiB).
    assert list(sched.saves.pool_chunk_bytes) == [2 * 32768, 6 * 35840]
    kv_slots, state_slots = sched.index.pool_sizes
    assert kv_slots == (48 << 20) // (2 * 32768) and state_slots == (16 << 20) // (6 * 35840)
