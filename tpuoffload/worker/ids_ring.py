"""Preallocated host buffers for the ids of a save or load (see worker/programs.py).

Transferring a call's small ids array costs more than its size suggests: the dispatch of the
program that takes a just-transferred array blocks until the transfer landed, and a load cannot
start its first copy before that (docs/performance.md, "Ids in pinned host buffers").
Instead each call's ids are written, by the calling thread, into a buffer in pinned host memory
that the runtime already holds (through a numpy view of it), and the program copies them to the
device as its first step: no transfer, no allocation per call.

JAX believes its arrays immutable, so a buffer is written again only once every program that read
it has finished (their tokens are ready); when every buffer of that width is still in use (more
calls in flight than the ring is deep), the call gets a freshly transferred array instead. Main
thread only, like all dispatch.

Writing through a buffer's address is outside JAX's contract, so the first ring of each width is
checked before use: a program must read back exactly what was written through the views. If
anything in that fails (a platform whose host buffers have no writable address, or whose programs
read a copy), the ring is off for good and every call transfers its ids (one log line says so):
slower, never wrong.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

logger = logging.getLogger(__name__)


class _Unread:
    """Readers of a buffer handed out whose programs were not reported yet (``read_by``): never
    ready, so a dispatch that failed half-way never lets a later call overwrite the ids that the
    programs it did dispatch may still copy."""

    @staticmethod
    def is_ready() -> bool:
        return False


_UNREAD = (_Unread(),)


@dataclass
class _Entry:
    array: jax.Array
    views: list[np.ndarray]  # one per local copy (each device keeps its own)
    readers: Sequence[jax.Array] = field(default_factory=tuple)  # tokens of the programs that read it

    def free(self) -> bool:
        return all(t.is_ready() for t in self.readers)


class IdsRing:
    """Preallocated host buffers for the ids of each program call (the module docstring says why):
    ``put`` writes a call's ids into a free buffer of their shape, ``read_by`` marks it busy
    until the programs that read it are done. Main thread only."""

    def __init__(self, sharding: NamedSharding, depth: int = 8) -> None:
        self._sharding = sharding  # replicated, in a host memory kind
        self._depth = depth
        self._rings: dict[tuple[int, ...], list[_Entry]] = {}
        self._next: dict[tuple[int, ...], int] = {}
        self.fallbacks = 0  # calls that found every buffer of their width in use
        self.enabled = True  # False once the start-up check failed: every call transfers its ids

    def put(self, ids: np.ndarray) -> tuple[jax.Array, _Entry | None]:
        """An array holding ``ids`` (int32), and the entry to hand to ``read_by`` once dispatched
        (None: a fresh array, nothing to track)."""
        ring = self._rings.get(ids.shape)
        if ring is None and self.enabled:  # the first call of this width (it compiles its programs too)
            ring = self._new_ring(ids.shape)
        if ring is None:
            return self._transfer(ids), None
        i = self._next.get(ids.shape, 0)
        self._next[ids.shape] = (i + 1) % self._depth
        entry = ring[i]
        if not entry.free():  # a program in flight may still copy these ids: never overwrite them
            self.fallbacks += 1
            return self._transfer(ids), None
        for view in entry.views:
            view[...] = ids
        entry.readers = _UNREAD
        return entry.array, entry

    @staticmethod
    def read_by(entry: _Entry | None, tokens: Sequence[jax.Array]) -> None:
        if entry is not None:
            entry.readers = tuple(tokens)

    def _transfer(self, ids: np.ndarray) -> jax.Array:
        # From this host's own values: device_put onto a mesh spanning processes would compare
        # them across processes (a hidden collective).
        return jax.make_array_from_callback(ids.shape, self._sharding, lambda index: ids[index])

    def _new_ring(self, shape: tuple[int, ...]) -> list[_Entry] | None:
        try:
            ring = [self._allocate(shape) for _ in range(self._depth)]
            self._check(ring[0])
        except Exception as exc:  # noqa: BLE001 - any failure: the safe path, for good
            logger.warning("tpuoffload: ids are transferred per call (host buffers unusable here: %s)", exc)
            self.enabled = False
            return None
        self._rings[shape] = ring
        return ring

    def _check(self, entry: _Entry) -> None:
        """A program must read exactly what is written through the views, on every local device."""
        pattern = (np.arange(entry.array.size, dtype=np.int32) * 7 + 3).reshape(entry.array.shape)
        for view in entry.views:
            view[...] = pattern
        mesh = self._sharding.mesh
        on_device = NamedSharding(mesh, PartitionSpec())
        seen = jax.jit(lambda x: jax.device_put(x, jax.memory.Space.Device) + 0, out_shardings=on_device)(entry.array)
        for shard in seen.addressable_shards:
            if not np.array_equal(np.asarray(shard.data), pattern):
                raise RuntimeError("a program read other ids than those written into its buffer")

    def _allocate(self, shape: tuple[int, ...]) -> _Entry:
        array = self._transfer(np.zeros(shape, np.int32))
        array.block_until_ready()  # the zeros must land before anything is written over them
        count = int(np.prod(shape))
        views = [np.ctypeslib.as_array((ctypes.c_int32 * count).from_address(s.data.unsafe_buffer_pointer()))
                 .reshape(shape) for s in array.addressable_shards]
        return _Entry(array, views)
