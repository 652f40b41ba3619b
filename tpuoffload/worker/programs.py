"""The jitted programs that move a group of layers' blocks between the KV cache and host slots.

Host slots live in one preallocated *store* per layer group: a jax.Array in pinned host memory,
``(num_shards, num_slots, layers, *block dims)``, sharded like the cache on the block dims (each
device's part of every slot sits in the host memory attached to that device). A save is ONE
program: gather the blocks on the devices, move each row to host memory and write it into its
slot of the donated store (XLA updates it in place); a load is ONE program: read each slot's row
from the store into device memory, then scatter the rows into the donated cache. Both move a large
batch in a few parts, so that device work on one part (gather, scatter) overlaps the transfer of
another. No host thread copies a byte, and the runtime orders every program after the previous one
that produced or read the store version it takes: write-after-write and read-after-write hold by
data dependency.

Gather and scatter run as ``shard_map`` over the cache's own mesh, so every device works on its
own shard: each device moves the requested blocks that fall in its batch shard's block range and
ignores the others. With several batch shards (data parallelism) a device's store rows hold its own
shard's chunks only: slot ``s`` is row ``s % shard_slots`` of shard ``s // shard_slots``, and a
save writes its copies inside ``shard_map`` too, each device at its own row (``_write_own``): a copy
of another shard's rows goes to the device's spare rows (backend/slot_table.py SHARD_SPARE_ROWS), so no shard's
rows are written by another's save and every device's rows serve its rank whole. The one collective: a load whose rows come from another batch shard's store
rows (under DPScheduler, a DP rank loading a chunk another rank saved) sums the source shards' rows
over the batch axes before its scatter (``_from_sources``); the plan alone says whether a load
needs it, so every host compiles and dispatches the same program. Blocks travel as unsigned integers (a bitcast:
32-bit words packing the last axis where it allows, ``Wire``; else the cache dtype's width), so every
bit pattern, NaN payloads included, arrives unchanged.

The ids of one call are one int32 array ``(3, P)``: block ids, slots, and (loads) the row's
source: ``1 +`` a block of the batch shard whose store row holds the slot's bytes, or 0 for a row
that is not valid, which scatters zeros (a placeholder for a block this host could not supply).
They arrive in host memory (worker/ids_ring.py) and each program first copies them to the device.

Copies: a program moves its rows as a few slices of consecutive slots, one dynamic slice of the
store, one transfer and one update per copy, by a copy structure ``((width, count), ...)`` that is
a static argument of the program (worker/copy_plan.py: runs of consecutive slots, power-of-two
copies of one width per program besides a save's single rows, counts on a ladder: a set of structures
bounded whatever the store's history, so a serving engine compiles each once). Slots come from the
manager's free slots and sorted LRU victims, so a fresh store's plan is one run and a churned
store's a few runs per request. Per-copy cost is what limits small chunks on a churned store
(docs/performance.md). The structure is a pure function of the slots and the layout (every host
receives the same slots), so every host dispatches the same programs; it is logged with each
program.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from tpuoffload.layout import GroupLayout, stacked_spec
from tpuoffload.backend.slot_table import SHARD_SPARE_ROWS
from tpuoffload.worker.copy_plan import copy_rows

HOST, DEVICE = jax.memory.Space.Host, jax.memory.Space.Device
SAVE_UNROLL = 4  # the loop unrolling of a save's copies (docs/performance.md: why these values)
LOAD_UNROLL = 16
# A load reads its slots with one dynamic slice per copy written out in the program (XLA issues
# them as asynchronous host-to-device copies, all in flight at once) up to this many copies; more use
# one fori_loop per width (unrolled LOAD_UNROLL), whose compile time does not grow with the count.
LOAD_STATIC_MAX = 32
# The same for a save's writes into the store; 0: always fori_loops.
SAVE_STATIC_MAX = 0
# A save or load is split into up to MAX_PARTS equal parts of at least SAVE_PART_BYTES /
# LOAD_PART_BYTES (bytes per device): a save gathers part k+1 while part k crosses to host memory; a
# load scatters part k while part k+1's rows are still crossing. A load of few copies runs as two
# programs instead, reads then scatter (TransferEngine._reads_first).
LOAD_PART_BYTES = 256 << 20
SAVE_PART_BYTES = 128 << 20
MAX_PARTS = 4
# What one more copy costs a program, as the bytes the interconnect moves in that time (per device):
# covering copies (worker/copy_plan.py) move rows twice where that saves a copy costing more.
SAVE_COPY_BYTES = 64 << 10
LOAD_COPY_BYTES = 224 << 10
# A save (or install) writes rows of at least this many bytes per device into the store one row per
# copy (a wide copy of such rows is slower; every copy more costs the dispatching thread time).
SAVE_SINGLE_ROW_BYTES = 2 << 20
# Blocks travel and sit in the store as unsigned words of this many bytes where the last axis allows
# (unsharded, a whole number of words): an fp8 or bf16 block packed into uint32 words, the same
# bytes. 0: words of the cache dtype's own width.
WIRE_WORD = 4
# Every value above was chosen by measurement: docs/performance.md ("What the engine's constants
# rest on", "What the issue-24 constants rest on") gives the figures, the machine and the command.


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def cap_copies(copies, width: int) -> tuple[tuple[int, int], ...]:
    """The same rows in copies no wider than ``width`` (a power of two): a wider copy is split
    into consecutive ones. Derived from the structure alone (every host alike)."""
    out: list[tuple[int, int]] = []
    for w, c in copies:
        if w > width:
            w, c = width, c * (w // width)
        if out and out[-1][0] == w:
            out[-1] = (w, out[-1][1] + c)
        else:
            out.append((w, c))
    return tuple(out)


def split_parts(copies, parts: int) -> tuple[tuple[int, int, tuple[tuple[int, int, int], ...]], ...]:
    """Cut a structure into up to ``parts`` consecutive parts at copy boundaries, each ending at
    the first copy boundary at or past its share of the rows: ``((lo, hi, groups), ...)``, groups
    ``((offset from lo, width, count), ...)``."""
    total = copy_rows(copies)
    flat = [w for w, c in copies for _ in range(c)]
    out, lo, row, k = [], 0, 0, 1
    bounds = []
    for w in flat:
        row += w
        if k < parts and row * parts >= k * total:
            bounds.append(row)
            while k < parts and row * parts >= k * total:
                k += 1
    if not bounds or bounds[-1] != total:
        bounds.append(total)
    row, i = 0, 0
    for hi in bounds:
        groups: list[list[int]] = []
        while row < hi:
            w = flat[i]
            if groups and groups[-1][1] == w:
                groups[-1][2] += 1
            else:
                groups.append([row - lo, w, 1])
            row += w
            i += 1
        out.append((lo, hi, tuple(map(tuple, groups))))
        lo = hi
    return tuple(out)


@dataclass(frozen=True)
class Wire:
    """How a layer group's blocks travel and sit in the store: unsigned words of ``dtype``, each
    ``pack`` cache elements of the last axis (bit-exact: a bitcast, NaN payloads included)."""

    dtype: np.dtype
    pack: int

    @staticmethod
    def of(group: GroupLayout) -> "Wire":
        item = group.dtype.itemsize
        if (WIRE_WORD > item and group.spec[-1] is None and len(group.shape) > 1
                and group.shape[-1] * item % WIRE_WORD == 0):
            return Wire(np.dtype(f"uint{8 * WIRE_WORD}"), WIRE_WORD // item)
        return Wire(group.wire_dtype, 1)

    def shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The wire shape of an array of cache ``shape``."""
        return (*shape[:-1], shape[-1] // self.pack)

    def to_wire(self, x):
        if self.pack == 1:
            return jax.lax.bitcast_convert_type(x, self.dtype)
        return jax.lax.bitcast_convert_type(x.reshape(*x.shape[:-1], x.shape[-1] // self.pack, self.pack), self.dtype)

    def from_wire(self, x, dtype):
        out = jax.lax.bitcast_convert_type(x, dtype)
        return out if self.pack == 1 else out.reshape(*x.shape[:-1], x.shape[-1] * self.pack)


def _local_ids(ids, group: GroupLayout):
    """Global block ids -> ids in this device's batch shard (out of range where not local)."""
    if not group.batch_axes:
        return ids
    shard = jax.lax.axis_index(group.batch_axes)
    return ids - shard * group.blocks_per_shard


def _gather_local(ids, caches, *, group: GroupLayout, wire: Wire):
    local = _local_ids(ids, group)
    rows = jnp.stack([jnp.take(wire.to_wire(c), local, axis=0, mode="clip") for c in caches], axis=1)
    return rows[None]  # (1, P, layers, *tile in wire words)


def _from_sources(valid, rows, *, group: GroupLayout):
    """Rows moved across the batch axes: each row as the batch shard named by its ``valid`` entry
    (``1 + a block of the shard whose store row holds the slot's bytes``; 0: a placeholder) read
    it, on every batch shard. Each shard contributes the rows it is the source of and zeros
    elsewhere, and one sum over the batch axes adds them: exact, whatever the bits (integer words,
    one non-zero term). A host whose own check failed a row contributes zeros there and reports
    the block, so vLLM recomputes it on every host."""
    shard = jax.lax.axis_index(group.batch_axes)
    mine = (valid != 0) & ((valid - 1) // group.blocks_per_shard == shard)
    rows = jnp.where(mine.reshape((1, -1) + (1,) * (rows.ndim - 2)), rows, 0)
    return jax.lax.psum(rows, group.batch_axes)


def _scatter_local(ids, valid, rows, caches, *, group: GroupLayout, wire: Wire, cross: bool = False):
    """Scatter rows into their blocks of this device's batch shard. The blocks of a load are
    distinct (the engine checks), and a row that is not ours (padding, another batch shard) gets
    its own index past the shard's end, where it is dropped: every index is unique, which XLA is
    told (docs/performance.md: what that saves). ``cross``: some rows come from another batch
    shard's store row (``_from_sources``, a DP rank's chunk loaded by another rank)."""
    if cross:
        rows = _from_sources(valid, rows, group=group)
    local = _local_ids(ids, group)
    per_shard = group.blocks_per_shard
    spare = per_shard + jnp.arange(local.shape[0], dtype=local.dtype)
    local = jnp.where((local >= 0) & (local < per_shard), local, spare)  # not ours: dropped
    keep = (valid != 0).reshape((-1,) + (1,) * (rows.ndim - 3))
    # A row that is not valid scatters zeros (a placeholder for a chunk this host could not supply).
    return tuple(wire.from_wire(wire.to_wire(c).at[local].set(jnp.where(keep, rows[0, :, i], 0), mode="drop",
                                                              unique_indices=True), group.dtype)
                 for i, c in enumerate(caches))


def _write_own(store, rows, ids, *, group: GroupLayout, spare_row: int, write):
    """``write`` (``GroupPrograms._write_rows``) on one device's store rows, each copy at its slot
    where the copy's rows are blocks of this device's batch shard, else at ``spare_row`` (a copy
    never spans two shards' slots: worker/transfer_engine.py plans them apart)."""
    shard = jax.lax.axis_index(group.batch_axes)

    def start(r):
        return jnp.where(ids[0, r] // group.blocks_per_shard == shard, ids[1, r], spare_row)

    return write(store, rows, start)


def _token(ids):
    """A small output that is ready when the program is (PJRT marks an execution's outputs ready
    together): what a background thread waits on, since the store itself is donated onward, and
    what tells the engine that the program's ids buffer may be written again (worker/ids_ring.py)."""
    return ids[0, 0] + 0


@functools.lru_cache(maxsize=8)
def programs_for(group: GroupLayout, host_memory_kind: str, num_slots: int, own_rows: int) -> "GroupPrograms":
    """The programs of a layout, shared by every engine built on it (each compiles once per process)."""
    return GroupPrograms(group, host_memory_kind, num_slots, own_rows)


class GroupPrograms:
    """The store, save and load programs of one layer group."""

    def __init__(self, group: GroupLayout, host_memory_kind: str, num_slots: int, own_rows: int) -> None:
        """``num_slots`` rows per device, the first ``own_rows`` its batch shard's slots and the rest
        spare (``_write_own``; backend/slot_table.py)."""
        self.group = group
        self.num_slots = num_slots
        self.own_rows = own_rows
        mesh = group.sharding.mesh
        cache_spec = PartitionSpec(*group.spec)
        rows_spec = stacked_spec(group)
        self.device_sharding = NamedSharding(mesh, rows_spec)
        self.store_sharding = NamedSharding(mesh, rows_spec, memory_kind=host_memory_kind)
        n = len(group.layers)
        self.wire = Wire.of(group)
        self._gather = jax.shard_map(partial(_gather_local, group=group, wire=self.wire), mesh=mesh,
                                     in_specs=(PartitionSpec(), (cache_spec,) * n), out_specs=rows_spec,
                                     check_vma=False)
        self._scatters = {cross: jax.shard_map(partial(_scatter_local, group=group, wire=self.wire, cross=cross),
                                               mesh=mesh, in_specs=(PartitionSpec(), PartitionSpec(), rows_spec,
                                                                    (cache_spec,) * n),
                                               out_specs=(cache_spec,) * n, check_vma=False)
                          for cross in (False, True)}
        token_sharding = NamedSharding(mesh, PartitionSpec())
        # ``copies`` (static, keyword): the copy structure of the program's rows (``copy_plan``).
        self.save = jax.jit(self._save, donate_argnums=1, static_argnames="copies",
                            out_shardings=(self.store_sharding, token_sharding))
        # ``cross`` (static, keyword): rows move across the batch axes (``_from_sources``).
        self.load = jax.jit(self._load, donate_argnums=0, static_argnames=("copies", "cross"),
                            out_shardings=((group.sharding,) * n, token_sharding))
        # The disk tier's two programs: copy slots out (the store is read, not donated) and write
        # rows read back from disk into slots (as a save writes gathered rows).
        self.read = jax.jit(self._read, static_argnames="copies",
                            out_shardings=(self.device_sharding, token_sharding))
        self.scatter = jax.jit(self._scatter_rows, donate_argnums=0, static_argnames="cross",
                               out_shardings=((group.sharding,) * n, token_sharding))
        self.install = jax.jit(self._install, donate_argnums=1, static_argnames="copies",
                               out_shardings=(self.store_sharding, token_sharding))
        self.store_shape = (group.num_shards, num_slots, n, *self.wire.shape(group.shape[1:]))
        self._mesh, self._rows_spec = mesh, rows_spec
        # Bytes of one slot's row on each device (what each device's copies move per row).
        self.row_bytes = n * int(np.prod(group.tile_shape)) * group.dtype.itemsize
        self._parts_of: dict[tuple[str, tuple], tuple] = {}

    def allocate(self) -> jax.Array:
        """The zeroed store (one dispatch, main thread, same on every host)."""
        shape, dtype = self.store_shape, self.wire.dtype
        return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=self.store_sharding)()

    def op_parts(self, op: str, rows: int) -> int:
        """Parts program ``op`` moves ``rows`` rows in (a power of two up to MAX_PARTS, each part
        at least SAVE_PART_BYTES / LOAD_PART_BYTES per device unless there is one)."""
        part_bytes = {"save": SAVE_PART_BYTES, "load": LOAD_PART_BYTES}.get(op)
        parts = 1
        if part_bytes is not None:
            while parts < MAX_PARTS and rows >= 2 * parts and rows * self.row_bytes // (2 * parts) >= part_bytes:
                parts *= 2
        return parts

    def parts_of(self, op: str, copies) -> tuple:
        """``split_parts`` of program ``op`` on structure ``copies``, copies first narrowed to a
        part's rows (so that part k+1's gather or scatter overlaps part k's copies) and, writing the
        store, to one row where rows reach SAVE_SINGLE_ROW_BYTES. A function of the structure and
        the layout only; cached."""
        key = (op, copies)
        out = self._parts_of.get(key)
        if out is None:
            rows = copy_rows(copies)
            parts = self.op_parts(op, rows)
            if parts > 1:
                copies = cap_copies(copies, _pow2_floor(-(-rows // parts)))
            if op in ("save", "install") and self.row_bytes >= SAVE_SINGLE_ROW_BYTES:
                copies = cap_copies(copies, 1)
            elif op in ("save", "install") and self.group.num_shards > 1:  # a copy fits the spare rows
                copies = cap_copies(copies, SHARD_SPARE_ROWS)
            out = self._parts_of[key] = split_parts(copies, parts)
        return out

    def num_copies(self, op: str, copies) -> int:
        """Copies program ``op`` issues for structure ``copies`` (after the parts' narrowing)."""
        return sum(c for _, _, groups in self.parts_of(op, copies) for _, _, c in groups)

    def _save(self, caches, store, ids, copies=()):
        ids = jax.device_put(ids, DEVICE)
        parts = self.parts_of("save", copies)
        total = sum(c for _, _, groups in parts for _, _, c in groups)
        for lo, hi, groups in parts:  # part k+1's gather overlaps part k's copies to host memory
            rows = self._gather(ids[0, lo:hi], caches)
            store = self._store_rows(store, rows, ids[:, lo:hi], groups, total)
        return store, _token(ids)

    def _install(self, rows, store, ids, copies=()):
        """Write rows read back from disk (``(shards, P, ...)`` in device memory) into slots ``ids[1]``."""
        ids = jax.device_put(ids, DEVICE)
        (_, _, groups), = self.parts_of("install", copies)
        return self._store_rows(store, rows, ids, groups, sum(c for _, _, c in groups)), _token(ids)

    def _read(self, store, ids, copies=()):
        """Slots ``ids[1]`` copied into device memory (the disk tier's spills, a load's reads
        dispatched first; the store is not donated)."""
        ids = jax.device_put(ids, DEVICE)
        (lo, hi, groups), = self.parts_of("read", copies)
        return self._read_rows(store, ids, lo, hi, groups, sum(c for _, _, c in groups)), _token(ids)

    def _scatter_rows(self, caches, rows, ids, cross=False):
        """Scatter rows read by ``read`` (``(shards, P, ...)`` on the devices) into blocks ``ids[0]``."""
        ids = jax.device_put(ids, DEVICE)
        return self._scatters[cross](ids[0], ids[2], rows, caches), _token(ids)

    def _store_rows(self, store, rows, ids, groups, total: int):
        """Write rows ``(shards, k, ...)`` at the slots ``ids[1]`` names (``ids``: the rows' own,
        ``(3, k)``): on the whole store, or with several batch shards on each device's own rows."""
        if self.group.num_shards == 1:
            return self._write_rows(store, rows, lambda r: ids[1, r], groups=groups, total=total)
        write = partial(self._write_rows, groups=groups, total=total)
        own = jax.shard_map(partial(_write_own, group=self.group, spare_row=self.own_rows, write=write),
                            mesh=self._mesh, in_specs=(self._rows_spec, self._rows_spec, PartitionSpec()),
                            out_specs=self._rows_spec, check_vma=False)
        return own(store, rows, ids)

    @staticmethod
    def _write_rows(store, rows, start, *, groups, total: int):
        """Write rows ``(shards, k, ...)`` into the store: each group ``(offset, width, count)``
        is ``count`` copies of ``width`` rows into ``width`` consecutive slots starting at
        ``start(offset + j * width)``; written out (one copy, or few in all), else a fori_loop
        per group."""
        for off, w, c in groups:
            if c == 1 or total <= SAVE_STATIC_MAX:
                for j in range(c):
                    r = off + j * w
                    group = jax.device_put(jax.lax.slice_in_dim(rows, r, r + w, axis=1), HOST)
                    store = jax.lax.dynamic_update_slice_in_dim(store, group, start(r), axis=1)
                continue

            def write(j, st, off=off, w=w):
                r = off + j * w
                group = jax.device_put(jax.lax.dynamic_slice_in_dim(rows, r, w, axis=1), HOST)
                return jax.lax.dynamic_update_slice_in_dim(st, group, start(r), axis=1)

            store = jax.lax.fori_loop(0, c, write, store, unroll=min(SAVE_UNROLL, c))
        return store

    def _load(self, caches, store, ids, copies=(), cross=False):
        ids = jax.device_put(ids, DEVICE)
        parts = self.parts_of("load", copies)
        total = sum(c for _, _, groups in parts for _, _, c in groups)
        for lo, hi, groups in parts:  # part k's scatter overlaps part k+1's copies
            rows = self._read_rows(store, ids, lo, hi, groups, total)
            caches = self._scatters[cross](ids[0, lo:hi], ids[2, lo:hi], rows, caches)
        return caches, _token(ids)

    def _read_rows(self, store, ids, lo: int, hi: int, groups, total: int):
        """Rows ``lo:hi`` of the program, read from their slots into device memory
        ``(shards, hi-lo, ...)``, by the copies of ``groups`` (as in ``_write_rows``)."""
        if total <= LOAD_STATIC_MAX:
            reads = [jax.device_put(jax.lax.dynamic_slice_in_dim(store, ids[1, lo + off + j * w], w, axis=1), DEVICE)
                     for off, w, c in groups for j in range(c)]
            return reads[0] if len(reads) == 1 else jnp.concatenate(reads, axis=1)
        g = self.group
        acc = jnp.zeros((g.num_shards, hi - lo, *self.store_shape[2:]), self.wire.dtype)
        acc = jax.lax.with_sharding_constraint(acc, self.device_sharding)
        for off, w, c in groups:
            def read(j, a, off=off, w=w):
                r = off + j * w
                group = jax.device_put(jax.lax.dynamic_slice_in_dim(store, ids[1, lo + r], w, axis=1), DEVICE)
                return jax.lax.dynamic_update_slice_in_dim(a, group, r, axis=1)

            acc = read(0, acc) if c == 1 else jax.lax.fori_loop(0, c, read, acc, unroll=min(LOAD_UNROLL, c))
        return acc
