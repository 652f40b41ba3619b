"""The jitted programs that move a group of layers' blocks: one gather and one donating scatter.

Both run as ``shard_map`` over the cache's own mesh, so every device works on its own shard and
no collective is added, whatever the sharding: each device gathers (or scatters) the requested
blocks that fall in its batch shard's block range and ignores the others. The gathered batch is
``(num_shards, P, layers, *block dims)``: one row of ``P`` chunks per batch shard, every block dim
sharded as in the cache. ``P`` is padded to a power of two so the programs compile a few times.

Blocks travel as unsigned integers of the cache dtype's width (a bitcast, free on the device), so
every bit pattern, NaN payloads included, arrives unchanged: no float op ever touches the bytes.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from tpuoffload.layout import GroupLayout, stacked_spec


def bucket(n: int, cap: int) -> int:
    """Pad batch sizes to powers of two (>= 8 unless ``cap``, a power of two >= n, is smaller)."""
    return max(min(8, cap), 1 << (n - 1).bit_length())


def padded_ids(block_ids, num_blocks: int, cap: int) -> np.ndarray:
    """Block ids padded to ``bucket(n, cap)`` with ``num_blocks``, which is outside every batch shard."""
    ids = np.full(bucket(len(block_ids), cap), num_blocks, np.int32)
    ids[:len(block_ids)] = block_ids
    return ids


def _local_ids(ids, group: GroupLayout):
    """Global block ids -> ids in this device's batch shard (out of range where not local)."""
    if not group.batch_axes:
        return ids
    shard = jax.lax.axis_index(group.batch_axes)
    return ids - shard * group.blocks_per_shard


class GroupPrograms:
    """The gather and scatter of one layer group, and the shardings of what they move."""

    def __init__(self, group: GroupLayout, host_memory_kind: str) -> None:
        self.group = group
        mesh = group.sharding.mesh
        cache_spec = PartitionSpec(*group.spec)
        rows_spec = stacked_spec(group)
        self.device_sharding = NamedSharding(mesh, rows_spec)
        self.host_sharding = NamedSharding(mesh, rows_spec, memory_kind=host_memory_kind)
        n = len(group.layers)
        gather = jax.shard_map(partial(_gather_local, group=group), mesh=mesh,
                               in_specs=(PartitionSpec(), (cache_spec,) * n), out_specs=rows_spec, check_vma=False)
        scatter = jax.shard_map(partial(_scatter_local, group=group), mesh=mesh,
                                in_specs=(PartitionSpec(), rows_spec, (cache_spec,) * n),
                                out_specs=(cache_spec,) * n, check_vma=False)
        self.gather = jax.jit(lambda caches, ids: gather(ids, caches), out_shardings=self.device_sharding)
        self.scatter = jax.jit(lambda caches, ids, rows: scatter(ids, rows, caches), donate_argnums=0,
                               out_shardings=(group.sharding,) * n)

    def rows_shape(self, padded: int) -> tuple[int, ...]:
        g = self.group
        return (g.num_shards, padded, len(g.layers), *g.shape[1:])


def _gather_local(ids, caches, *, group: GroupLayout):
    local = _local_ids(ids, group)
    wire = group.wire_dtype
    rows = jnp.stack([jnp.take(jax.lax.bitcast_convert_type(c, wire), local, axis=0, mode="clip") for c in caches],
                     axis=1)
    return rows[None]  # (1, P, layers, *tile)


def _scatter_local(ids, rows, caches, *, group: GroupLayout):
    local = _local_ids(ids, group)
    per_shard = group.blocks_per_shard
    local = jnp.where((local >= 0) & (local < per_shard), local, per_shard)  # not ours: dropped
    wire, dtype = group.wire_dtype, group.dtype
    return tuple(jax.lax.bitcast_convert_type(
        jax.lax.bitcast_convert_type(c, wire).at[local].set(rows[0, :, i], mode="drop"), dtype)
        for i, c in enumerate(caches))
