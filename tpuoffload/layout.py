"""The one description of a KV cache layout that every other part derives from.

tpu-inference hands the connector ``runner.kv_caches``: one jax.Array per attention layer, e.g.
ragged-paged-attention caches ``(num_blocks, block_size, heads*2/packing, packing, head_dim)`` sharded
``P(BATCH, KV_CONTEXT, KV_HEAD)``, MLA latent caches ``(num_blocks, ...)`` sharded
``P(BATCH, KV_CONTEXT)``, layers of different shapes in one model. Whatever the rank, axis 0 is the
blocks axis; everything else about a layer is read from its shape and its NamedSharding here, so no
other module hard-codes an axis number.

For each group of layers that share shape, dtype and sharding it records the distinct tiles
(per-device index ranges over the non-block axes) this host's devices hold: ``slot_bytes`` is this
host's unique part of one chunk (one block of every layer), ``device_bytes_per_chunk`` what a chunk
takes where the worker keeps it, next to each device's shard (replicas and batch-shard rows
included: tpuoffload/worker/programs.py).

Blocks may really be split across devices (data or attention-data parallelism shard axis 0): each
batch shard holds a contiguous range of blocks (``shard_of``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

Range = tuple[int, int]  # [start, stop) along one axis


class UnsupportedCache(ValueError):
    """The runner's KV cache has a feature this connector cannot offload (named in the message)."""


def _axis_names(entry) -> tuple[str, ...]:
    """Mesh axis names of one PartitionSpec entry (None, a name, or a tuple of names)."""
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)


@dataclass(frozen=True)
class GroupLayout:
    """Layers of one shape, dtype and sharding, and what this host holds of each of their blocks."""

    layers: tuple[int, ...]  # positions in runner.kv_caches
    shape: tuple[int, ...]  # full (global) shape of one layer
    dtype: np.dtype
    sharding: NamedSharding
    batch_axes: tuple[str, ...]  # mesh axes that split the blocks axis (may have size 1)
    num_shards: int  # number of block ranges (product of the batch axes' sizes)
    tiles: tuple[tuple[Range, ...], ...]  # distinct local tiles, over axes 1..ndim-1
    held: frozenset[tuple[int, int]]  # (batch shard, tile index) pairs this host's devices hold
    offset: int  # byte offset of this group inside a slot

    @property
    def num_blocks(self) -> int:
        return self.shape[0]

    @property
    def blocks_per_shard(self) -> int:
        return self.shape[0] // self.num_shards

    @property
    def tile_shape(self) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in self.tiles[0]) if self.tiles else ()

    @property
    def wire_dtype(self) -> np.dtype:
        """Unsigned integer of the dtype's width: how blocks travel and sit in slots (bit-exact)."""
        return np.dtype(f"uint{8 * self.dtype.itemsize}")

    @property
    def nbytes(self) -> int:
        """Bytes this group takes in one slot."""
        return len(self.layers) * len(self.tiles) * math.prod(self.tile_shape) * self.dtype.itemsize

    @property
    def spec(self) -> tuple:
        spec = tuple(self.sharding.spec)
        return spec + (None,) * (len(self.shape) - len(spec))

    def shard_of(self, block_id: int) -> int:
        return block_id // self.blocks_per_shard

    def describe(self) -> str:
        return (f"{len(self.layers)} layers of {self.shape} {self.dtype} sharded {self.sharding.spec}: "
                f"{len(self.tiles)} local tile(s) of {self.tile_shape}, {self.num_shards} block shard(s)")


@dataclass(frozen=True)
class CacheLayout:
    """The one description of the runner's KV cache: its layer groups (arrays of one shape, dtype and
    sharding) and the number of layers; what a chunk is on this host and what the engine's
    programs are built for. ``check_same`` refuses caches that changed shape."""

    groups: tuple[GroupLayout, ...]
    num_layers: int

    @property
    def num_blocks(self) -> int:
        return self.groups[0].num_blocks

    @property
    def slot_bytes(self) -> int:
        """Bytes one host stores per chunk (one block of every layer, this host's part)."""
        return sum(g.nbytes for g in self.groups)

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return self.groups[0].sharding.mesh

    @property
    def device_bytes_per_chunk(self) -> int:
        """Accelerator bytes one gathered chunk takes on this host's devices (replicas included)."""
        total = 0
        for g in self.groups:
            per_device = len(g.layers) * math.prod(g.tile_shape) * g.dtype.itemsize
            total += per_device * len(g.sharding.addressable_devices)
        return total

    def fingerprint(self) -> str:
        """A string that changes whenever what a slot holds would change (for persisted caches)."""
        parts = [f"{len(g.layers)}x{g.shape}:{g.dtype}:{g.spec}:{g.tiles}:{sorted(g.held)}" for g in self.groups]
        return ";".join(parts)

    def describe(self) -> str:
        return "; ".join(g.describe() for g in self.groups) + f"; {self.slot_bytes} bytes per slot on this host"

    def check_same(self, kv_caches: Sequence) -> None:
        """The arrays handed to a save or load must be laid out as the ones this layout describes
        (otherwise a load silently casts, a save fails later): same shape and dtype, and a sharding
        that places every shard where this layout's does. Equivalent, not equal: tpu-inference's
        vLLM-model path returns its step's caches with the sharding XLA propagated (on one device
        ``P()`` for ``P('data', None, 'model')``); the programs then compile once more for it."""
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"kv_caches has {len(kv_caches)} layers; the engine was built for {self.num_layers}")
        for g in self.groups:
            for i in g.layers:
                c = kv_caches[i]
                if not isinstance(c, jax.Array) or c.shape != g.shape or c.dtype != g.dtype \
                        or not c.sharding.is_equivalent_to(g.sharding, c.ndim):
                    raise ValueError(
                        f"kv_caches[{i}] is {getattr(c, 'shape', type(c).__name__)} {getattr(c, 'dtype', '')}; "
                        f"the engine was built for {g.shape} {g.dtype} with the same sharding")

    @classmethod
    def from_caches(cls, kv_caches: Sequence) -> "CacheLayout":
        """Describe ``runner.kv_caches``. Raises UnsupportedCache naming the model feature this
        connector cannot offload, before anything reaches JAX."""
        if not kv_caches:
            raise ValueError("runner.kv_caches is empty: register the runner after the KV cache is allocated")
        by_key: dict[tuple, list[int]] = {}
        for i, c in enumerate(kv_caches):
            if isinstance(c, (tuple, list)):
                raise UnsupportedCache(
                    f"kv_caches[{i}] is a tuple of {len(c)} arrays: mamba/SSM state layers (hybrid models) "
                    "cannot be offloaded by tpuoffload yet")
            if not isinstance(c, jax.Array):
                raise UnsupportedCache(f"kv_caches[{i}] is {type(c).__name__}, not a jax.Array")
            if not isinstance(c.sharding, NamedSharding):
                raise UnsupportedCache(f"kv_caches[{i}] has a {type(c.sharding).__name__}; a NamedSharding is needed")
            if c.ndim < 2:
                raise UnsupportedCache(f"kv_caches[{i}] has shape {c.shape}: expected (num_blocks, ...)")
            by_key.setdefault((c.shape, np.dtype(c.dtype), c.sharding), []).append(i)
        num_blocks = {key[0][0] for key in by_key}
        if len(num_blocks) != 1:
            raise UnsupportedCache(f"layers disagree on the number of blocks: {sorted(num_blocks)}")
        groups, offset = [], 0
        for (shape, dtype, sharding), layers in by_key.items():
            g = _group(tuple(layers), shape, dtype, sharding, offset)
            groups.append(g)
            offset += g.nbytes
        return cls(tuple(groups), len(kv_caches))


@dataclass(frozen=True)
class CachePools:
    """``runner.kv_caches`` split by block pool. tpu-inference allocates a GDN/mamba hybrid's
    caches as one jax.Array per attention layer, whose blocks are the attention pool's, and one
    ``(conv, ssm)`` tuple per GDN layer, whose rows are a separate compact state pool's: the same
    block id names different storage in the two. Pool 0 is every plain array entry, pool 1 every
    element of every tuple entry, each in runner order; ``CacheLayout.from_caches`` describes each
    pool's flat list."""

    #: Per runner entry: None for a plain array (pool 0), else the length of its tuple (pool 1).
    widths: tuple[int | None, ...]

    @classmethod
    def of(cls, kv_caches: Sequence) -> "CachePools":
        """The pools of ``runner.kv_caches``. Raises UnsupportedCache naming an entry that is
        neither a jax.Array nor a non-empty tuple of them, or a model with state layers only."""
        if not kv_caches:
            raise ValueError("runner.kv_caches is empty: register the runner after the KV cache is allocated")
        widths: list[int | None] = []
        for i, c in enumerate(kv_caches):
            if isinstance(c, tuple):
                bad = [type(a).__name__ for a in c if not isinstance(a, jax.Array)]
                if not c or bad:
                    raise UnsupportedCache(f"kv_caches[{i}] is a tuple of {len(c)} entries (not arrays: {bad}): a "
                                           "state layer must be a non-empty tuple of jax.Arrays")
                widths.append(len(c))
            elif isinstance(c, jax.Array):
                widths.append(None)
            else:
                raise UnsupportedCache(f"kv_caches[{i}] is {type(c).__name__}, not a jax.Array or a tuple of them")
        if all(w is not None for w in widths):
            raise UnsupportedCache("kv_caches holds state tuples only: a model without attention layers has no KV "
                                   "chunks for tpuoffload to key its state chunks by")
        return cls(tuple(widths))

    @cached_property
    def num(self) -> int:
        """1 (attention arrays only) or 2 (with a state pool)."""
        return 2 if any(w is not None for w in self.widths) else 1

    def arrays(self, kv_caches: Sequence, pool: int) -> list[jax.Array]:
        """Pool ``pool``'s arrays of ``kv_caches`` (laid out as at ``of``), flat, in runner order."""
        self._check(kv_caches, pool)
        if self.num == 1:  # every entry is an array (every model step: no per-layer work)
            return list(kv_caches)
        if pool == 0:
            return [c for c, w in zip(kv_caches, self.widths) if w is None]
        return [a for c, w in zip(kv_caches, self.widths) if w is not None for a in c]

    def put(self, kv_caches: Sequence, pool: int, arrays: Sequence[jax.Array]) -> list:
        """A new runner list: ``kv_caches`` with pool ``pool``'s arrays replaced by ``arrays`` (in
        ``arrays``' order), tuple entries rebuilt as tuples; the other pool's entries as they were."""
        self._check(kv_caches, pool)
        if self.num == 1:
            if len(arrays) != len(kv_caches):
                raise ValueError(f"{len(arrays)} arrays for pool 0, which holds {len(kv_caches)}")
            return list(arrays)
        mine = [(w is None) == (pool == 0) for w in self.widths]
        held = sum(w or 1 for w, m in zip(self.widths, mine) if m)
        if len(arrays) != held:
            raise ValueError(f"{len(arrays)} arrays for pool {pool}, which holds {held}")
        out, at = [], 0
        for c, w, m in zip(kv_caches, self.widths, mine):
            if not m:
                out.append(c)
            elif w is None:
                out.append(arrays[at])
                at += 1
            else:
                out.append(tuple(arrays[at:at + w]))
                at += w
        return out

    def describe(self) -> str:
        """The pools in words (for logs and errors)."""
        state = [i for i, w in enumerate(self.widths) if w is not None]
        out = f"pool 0: {len(self.widths) - len(state)} attention arrays"
        if state:
            out += f"; pool 1: {sum(self.widths[i] for i in state)} state arrays of {len(state)} state layers {state}"
        return out

    def _check(self, kv_caches: Sequence, pool: int) -> None:
        """``pool`` exists and ``kv_caches`` has the entries the pools were split from."""
        if pool not in range(self.num):
            raise ValueError(f"no pool {pool}: these caches have {self.num}")
        if len(kv_caches) != len(self.widths):
            raise ValueError(f"kv_caches has {len(kv_caches)} entries; the pools were split from {len(self.widths)}")


def _group(layers: tuple[int, ...], shape: tuple[int, ...], dtype: np.dtype, sharding: NamedSharding,
           offset: int) -> GroupLayout:
    spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
    batch_axes = _axis_names(spec[0])
    mesh_shape = dict(sharding.mesh.shape)
    num_shards = math.prod(mesh_shape[a] for a in batch_axes)
    if shape[0] % num_shards:
        raise UnsupportedCache(f"{shape[0]} blocks do not split evenly over {num_shards} batch shards")
    per_shard = shape[0] // num_shards
    tiles: list[tuple[Range, ...]] = []
    held: set[tuple[int, int]] = set()
    for index in sharding.addressable_devices_indices_map(shape).values():
        start, stop, _ = index[0].indices(shape[0])
        if stop - start != per_shard:
            raise UnsupportedCache(f"a device holds blocks {start}:{stop}; expected ranges of {per_shard}")
        tile = tuple(sl.indices(n)[:2] for sl, n in zip(index[1:], shape[1:]))
        if tile not in tiles:
            tiles.append(tile)
        held.add((start // per_shard, tiles.index(tile)))
    tiles_sorted = sorted(tiles)
    remap = {tiles.index(t): tiles_sorted.index(t) for t in tiles}
    held_sorted = frozenset((s, remap[t]) for s, t in held)
    shapes = {tuple(b - a for a, b in t) for t in tiles_sorted}
    if len(shapes) != 1:
        raise UnsupportedCache(f"devices hold tiles of different shapes {sorted(shapes)}: uneven sharding")
    return GroupLayout(layers, tuple(shape), np.dtype(dtype), sharding, batch_axes, num_shards,
                       tuple(tiles_sorted), held_sorted, offset)


def stacked_spec(group: GroupLayout) -> PartitionSpec:
    """Sharding of a gathered batch ``(num_shards, P, layers, *block dims)``: one row of P chunks per
    batch shard, every block dim sharded as in the cache."""
    spec = group.spec
    return PartitionSpec(spec[0], None, None, *spec[1:])


@dataclass(frozen=True)
class KVGroupMap:
    """Which of vLLM's KV cache groups (its hybrid KV cache manager, HMA) each array of
    ``runner.kv_caches`` serves, and through which block ids. Not to be confused with
    ``GroupLayout`` (arrays of one shape, dtype and sharding).

    With HMA on, vLLM's groups (layers of one attention type) draw block ids from one shared
    pool, and tpu-inference's ``initialize_kv_cache`` allocates arrays that each serve one layer of
    several groups: e.g. gpt-oss-like, 4 layers alternating sliding window and full attention, two
    groups, two arrays, layers 0 (sliding) and 1 (full) sharing array 0. Layer ``L`` of group ``g``
    reads and writes its array at group ``g``'s block ids, and a block id belongs to one group at a
    time, so block ``b`` of every array holds group ``g``'s KV when ``b`` is one of ``g``'s blocks:
    a chunk (one block of every array, ``CacheLayout``) serves every group alike, keyed by group
    on the scheduler side (manager/kv_groups.py).
    """

    #: Per array, the (KV cache group, vLLM layer name) pairs it serves.
    uses: tuple[tuple[tuple[int, str], ...], ...]
    num_kv_groups: int

    @classmethod
    def of(cls, kv_cache_config, layer_to_array: dict[str, int], num_arrays: int) -> "KVGroupMap":
        """From vLLM's KV cache config (the groups' layer names) and the runner's
        ``layer_name_to_kvcache_index``. Raises UnsupportedCache when a chunk of one block of every
        array could not serve every group: a layer without an array, two layers of one group on
        one array (they would write the same block), or arrays not shared between the groups."""
        uses: list[list[tuple[int, str]]] = [[] for _ in range(num_arrays)]
        groups = kv_cache_config.kv_cache_groups
        for g, group in enumerate(groups):
            for name in group.layer_names:
                array = layer_to_array.get(name)
                if array is None or not 0 <= array < num_arrays:
                    raise UnsupportedCache(f"layer {name} of KV cache group {g} has no array in runner.kv_caches")
                if any(og == g for og, _ in uses[array]):
                    raise UnsupportedCache(f"array {array} serves two layers of KV cache group {g}")
                uses[array].append((g, name))
        widest = max(len(group.layer_names) for group in groups)
        if num_arrays != widest:
            # The scheduler half sizes a chunk from vLLM's config alone (manager/topology.py:
            # host_chunk_bytes): one page of the largest group's layers, one array per layer.
            raise UnsupportedCache(
                f"{num_arrays} arrays serve {len(groups)} KV cache groups of at most {widest} layers: tpu-inference "
                "did not share its arrays between the groups (it allocates one array per KV cache tensor when a "
                "group has a single layer), so a chunk would not be one page of a group's layers")
        return cls(tuple(tuple(u) for u in uses), len(groups))

    def describe(self) -> str:
        return "; ".join(f"array {i}: " + ", ".join(f"{name} (group {g})" for g, name in u)
                         for i, u in enumerate(self.uses))
