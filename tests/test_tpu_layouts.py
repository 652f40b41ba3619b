"""Issue 8: every KV cache tpu-inference 0.32 allocates, built by tpu-inference's own code.

The caches come from tpu-inference's ``create_kv_caches`` on meshes built by its runner's own mesh
methods (``tpuoffload.sim.tpu_layouts`` says exactly what is run and how), on CPU devices. Each is
saved, overwritten, loaded elsewhere and compared byte for byte; the rest of the cache must be
untouched and the sharding preserved.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from tpuoffload.layout import CacheLayout
from tpuoffload.backend.slot_table import SHARD_SPARE_ROWS
from tpuoffload.sim.tpu_layouts import LAYOUTS, create_caches
from tpuoffload.worker.transfer_engine import TransferEngine


def _random_bytes_like(caches, seed):
    """Each layer filled with random bytes (as its dtype), with the layer's sharding."""
    rng = np.random.default_rng(seed)
    out = []
    for c in caches:
        raw = rng.integers(0, 256, size=c.size * c.dtype.itemsize, dtype=np.uint8)
        out.append(jax.device_put(raw.view(c.dtype).reshape(c.shape), c.sharding))
    return out


def _bytes(arr) -> np.ndarray:
    a = np.asarray(arr)
    return a.view(np.uint8).reshape(a.shape[0], -1)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layout_round_trip_byte_exact(name):
    spec = LAYOUTS[name]
    caches, mesh = create_caches(spec)
    layout = CacheLayout.from_caches(caches)
    assert layout.slot_bytes > 0
    first = _random_bytes_like(caches, seed=1)
    engine = TransferEngine(first, 64 * layout.device_bytes_per_chunk)
    group = layout.groups[0]
    rows = 64 - (SHARD_SPARE_ROWS if group.num_shards > 1 else 0)  # each batch shard's slots
    assert engine.slot_table.num_slots == group.num_shards * rows
    nb, per = spec.num_blocks, group.blocks_per_shard
    # Sources and destinations straddle every batch shard (data / attention-data parallelism); a
    # chunk goes into a slot of its source's shard, and both saves of a slot come from one shard.
    src_a = [1, nb // 2 + 3, nb - 2, 5]
    src_b = [a - a % per + (a % per + 7) % per for a in src_a]
    dst = [nb // 2 + 1, 0, nb - 3, nb // 2 + 5]
    slots = [x + group.shard_of(a) * rows for x, a in zip([4, 9, 0, rows - 1], src_a)]
    ids_a, ids_b = [10, 11, 12, 13], [20, 21, 22, 23]
    engine.save(first, src_a, slots, ids_a)
    second = _random_bytes_like(caches, seed=2)
    engine.save(second, src_b, slots, ids_b)  # overwrites the same slots: write-after-write
    assert engine.wait_idle(30)
    assert {(r.save_id, r.ok) for r in engine.drain_results()} == {(i, True) for i in ids_a + ids_b}
    before = [_bytes(c) for c in first]
    want = [_bytes(c)[src_b] for c in second]
    loaded, failed = engine.load(first, dst, slots, ids_b)
    # A chunk is stored in its source block's batch shard: a load into another shard (data
    # parallelism) is a load error with zeros in place, never another shard's bytes.
    cross = [d for s, d in zip(src_b, dst) if group.shard_of(s) != group.shard_of(d)]
    assert failed == cross
    assert (group.num_shards > 1) == bool(cross)
    same = [i for i, (s, d) in enumerate(zip(src_b, dst)) if d not in cross]
    others = [b for b in range(nb) if b not in dst]
    for i, (arr, old, new) in enumerate(zip(loaded, before, want)):
        got = _bytes(arr)
        assert np.array_equal(got[[dst[j] for j in same]], new[same]), f"layer {i}: loaded bytes differ"
        assert not got[cross].any(), f"layer {i}: a failed block must hold zeros"
        assert np.array_equal(got[others], old[others]), f"layer {i}: other blocks changed"
        assert arr.sharding == caches[i].sharding and arr.shape == caches[i].shape and arr.dtype == caches[i].dtype
    # The first save's ids were overwritten: reading them is an error for exactly those blocks.
    loaded, failed = engine.load(loaded, dst, slots, ids_a)
    assert failed == dst
    engine.close()


def test_layouts_cover_issue_list():
    """The layouts exercised above are tpu-inference's real shapes: 5-D packed RPA caches, MLA, DP."""
    shapes = {name: create_caches(spec)[0][0] for name, spec in LAYOUTS.items()}
    assert shapes["bf16-8kv-tp4"].ndim == 5 and shapes["bf16-8kv-tp4"].shape[3] == 2  # bf16 packing 2
    assert shapes["fp8-8kv-tp4"].shape[3] == 4 and shapes["int8-8kv-tp4"].shape[3] == 4  # packing 4
    assert shapes["mla-tp4"].ndim == 4
    assert shapes["bf16-dcp2-tp2"].shape[1] == 2 * LAYOUTS["bf16-dcp2-tp2"].block_size  # DCP scales block_size
    dp = CacheLayout.from_caches([shapes["bf16-dp2-tp4"]]).groups[0]
    assert dp.num_shards == 2 and dp.batch_axes == ("data",)  # blocks really split
    adp = CacheLayout.from_caches([shapes["bf16-attndp4-tp2"]]).groups[0]
    assert adp.num_shards == 4
    mixed = CacheLayout.from_caches(create_caches(LAYOUTS["bf16-mixed-hd256-512-tp4"])[0])
    assert len(mixed.groups) == 2  # layers of two shapes, grouped


def test_layout_describes_per_host_part():
    """Per-host slot bytes: the whole block on one host; the replicated-over-data-axis case counts once."""
    spec = LAYOUTS["bf16-8kv-tp4"]
    caches, _ = create_caches(spec)
    layout = CacheLayout.from_caches(caches)
    per_layer = int(np.prod(caches[0].shape[1:])) * caches[0].dtype.itemsize
    assert layout.slot_bytes == spec.num_layers * per_layer
    assert layout.groups[0].tile_shape == (spec.block_size, caches[0].shape[2] // spec.tp, 2, 128)


@pytest.mark.parametrize("name", ["mla-attndp2-tp2", "mla-attndp4-tp2"])
def test_mla_attention_dp_is_what_tpu_inference_allocates(name):
    """DeepSeek-V3-like MLA under attention DP (NEW_MODEL_DESIGN): tpu-inference's create_kv_caches
    gives 4-D latent arrays sharded ``P(BATCH, KV_CONTEXT)``: axis 0 names its batch axes
    ('data', 'attn_dp', 'attn_dp_expert'), split over the attention-DP ranks, and the latent is
    whole on every device (replicated over 'model'): every device of a rank holds the same tile."""
    from tpuoffload.sim.tpu_layouts import tpu_inference

    spec = LAYOUTS[name]
    caches, mesh = create_caches(spec)
    ti = tpu_inference()
    shape = ti.kv_cache.get_kv_cache_shape_with_mesh(mesh, spec.num_blocks, spec.block_size, 1, spec.head_dim,
                                                     jax.numpy.dtype(spec.dtype), use_mla=True)
    assert all(c.shape == shape and c.ndim == 4 for c in caches) and shape[-1] == 640  # 576 padded to 128
    group = CacheLayout.from_caches(caches).groups[0]
    assert group.batch_axes == ("data", "attn_dp", "attn_dp_expert") and group.num_shards == spec.attn_dp
    assert tuple(caches[0].sharding.spec)[1] == ("pcp", "dcp") and len(tuple(caches[0].sharding.spec)) == 2
    assert mesh.shape["model"] == spec.tp and mesh.shape["attn_dp"] == spec.attn_dp
    assert len(group.tiles) == 1 and group.tile_shape == shape[1:]  # whole latent on every device
    assert sorted(group.held) == [(s, 0) for s in range(spec.attn_dp)]
    # Each device keeps its own copy: tp copies of each rank's block on the slice.
    layout = CacheLayout.from_caches(caches)
    per_block = len(caches) * int(np.prod(shape[1:])) * caches[0].dtype.itemsize
    assert layout.device_bytes_per_chunk == spec.num_devices * per_block
