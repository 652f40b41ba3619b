"""Moves KV blocks between a sharded JAX KV cache and this host's slots in host RAM.

Threading contract (invariants 1-4):

* Every JAX dispatch (the gather, both transfers, the scatter) happens in ``save``/``load`` on the
  thread that created the engine, in an order that depends only on the arguments. Calls from any
  other thread raise RuntimeError before touching JAX.
* Background threads only wait for device-to-host transfers that were already issued and copy the
  bytes into backend slots. Writes to the same slot are chained: each write task first waits for
  the previous write to that slot, so first issued is first done. The pool is FIFO, so the task a
  write waits for was dequeued earlier and is running or done: chaining cannot deadlock.
* A load waits (bounded by ``load_wait_timeout_s``) for an in-flight write to the slots it reads.
  A slot that is late, failed, or does not hold the expected save id yields a load error for
  exactly those blocks; zeros are scattered in their place so the dispatch sequence is identical
  on every host whatever its local state.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from tpuoffload.backend import HostBackend
from tpuoffload.worker.dispatch_log import DispatchLog, StepDigest


@dataclass(frozen=True)
class SaveResult:
    save_id: int
    ok: bool


class Faults:
    """Fault-injection hook for tests; the default does nothing. ``before_write`` runs on a
    background thread just before a save's bytes are copied into slots: it may sleep (a slow
    host) or raise (a failed device-to-host copy)."""

    def before_write(self, save_ids: Sequence[int]) -> None:
        pass

    def before_load(self, backend: HostBackend, slots: Sequence[int]) -> None:
        """Runs on the main thread before a load reads its slots; may invalidate some (local loss)."""


HEADS_AXIS = 2  # KV cache layer layout: (num_blocks, block_size, heads, head_dim), sharded on heads
STACKED_HEADS_AXIS = 3  # gathered layout: (blocks, layers, block_size, heads, head_dim)


def _bucket(n: int) -> int:
    """Pad batch sizes to powers of two (>= 8) so the jitted gather/scatter compile a few times."""
    return max(8, 1 << (n - 1).bit_length())


def _local_head_ranges(cache: jax.Array) -> list[tuple[int, int]]:
    """The global heads ranges held by this host's devices, in order (replicas counted once)."""
    ranges = set()
    for index in cache.sharding.addressable_devices_indices_map(cache.shape).values():
        start, stop, _ = index[HEADS_AXIS].indices(cache.shape[HEADS_AXIS])
        ranges.add((start, stop))
    return sorted(ranges)


def host_slot_shape(kv_caches: Sequence[jax.Array]) -> tuple[int, int, int, int]:
    """Shape of one host slot: this host's heads of one block, all layers: (L, block_size, heads, head_dim)."""
    first = kv_caches[0]
    host_heads = sum(stop - start for start, stop in _local_head_ranges(first))
    return (len(kv_caches), first.shape[1], host_heads, first.shape[3])


def _gather(caches, ids):
    return jnp.stack([c[ids] for c in caches], axis=1)  # (P, L, block_size, heads, head_dim)


def _scatter(caches, ids, rows):
    return tuple(c.at[ids].set(rows[:, i], mode="drop") for i, c in enumerate(caches))


class TransferEngine:
    def __init__(
        self,
        kv_caches: Sequence[jax.Array],
        cpu_bytes_to_use: int,
        *,
        host_memory_kind: str = "pinned_host",
        save_threads: int = 4,
        load_wait_timeout_s: float = 10.0,
        faults: Faults | None = None,
    ) -> None:
        first = self.validate_caches(kv_caches)
        if not isinstance(save_threads, int) or save_threads <= 0:
            raise ValueError(f"save_threads must be a positive int, got {save_threads!r}")
        if not load_wait_timeout_s > 0:
            raise ValueError(f"load_wait_timeout_s must be > 0, got {load_wait_timeout_s!r}")
        self._owner = threading.get_ident()
        self.num_layers = len(kv_caches)
        self.num_blocks = first.shape[0]
        self.block_shape = tuple(first.shape[1:])
        self.dtype = first.dtype
        self._cache_sharding = first.sharding
        self._load_wait_timeout_s = load_wait_timeout_s
        self._faults = faults or Faults()

        mesh = first.sharding.mesh
        cache_spec = tuple(first.sharding.spec) + (None,) * (first.ndim - len(first.sharding.spec))
        # Stacked layout (P, L, block_size, heads, head_dim): the heads stay sharded as in the cache.
        stacked_spec = PartitionSpec(None, None, *cache_spec[1:])
        self._device_sharding = NamedSharding(mesh, stacked_spec)
        self._host_sharding = NamedSharding(mesh, stacked_spec, memory_kind=host_memory_kind)
        self._total_heads = first.shape[HEADS_AXIS]
        self._local_heads = _local_head_ranges(first)
        self.backend = HostBackend(cpu_bytes_to_use, host_slot_shape(kv_caches), np.dtype(first.dtype))

        self._gather = jax.jit(_gather, out_shardings=self._device_sharding)
        self._scatter = jax.jit(_scatter, donate_argnums=0, out_shardings=tuple(c.sharding for c in kv_caches))
        self.log = DispatchLog()

        self._pool = futures.ThreadPoolExecutor(save_threads, thread_name_prefix="tpuoffload-save")
        self._last_write: dict[int, futures.Future] = {}  # slot -> newest write; main thread only
        self._results: list[SaveResult] = []
        self._inflight: dict[futures.Future, tuple[float, int, int]] = {}  # fut -> (t0, chunks, bytes)
        self._lock = threading.Lock()  # guards _results, _inflight and counters
        self.counters: Counter[str] = Counter()  # chunks/bytes saved and loaded, failures, seconds

    # ---------------- validation ----------------
    @staticmethod
    def validate_caches(kv_caches) -> jax.Array:
        if not kv_caches:
            raise ValueError("kv_caches is empty")
        first = kv_caches[0]
        for i, c in enumerate(kv_caches):
            if not isinstance(c, jax.Array):
                raise ValueError(f"kv_caches[{i}] is {type(c).__name__}, not a jax.Array")
            if c.shape != first.shape or c.dtype != first.dtype:
                raise ValueError(
                    f"kv_caches[{i}] has shape {c.shape} dtype {c.dtype}; layer 0 has {first.shape} {first.dtype}"
                )
            if not isinstance(c.sharding, NamedSharding):
                raise ValueError(f"kv_caches[{i}] must have a NamedSharding, got {type(c.sharding).__name__}")
            if c.sharding != first.sharding:
                raise ValueError(f"kv_caches[{i}] is sharded differently from layer 0")
        if first.ndim != 4:
            raise ValueError(f"each KV cache layer must be (num_blocks, block_size, heads, head_dim), got {first.shape}")
        spec = tuple(first.sharding.spec)
        if spec and spec[0] is not None:
            raise ValueError("the blocks axis (0) of the KV cache must not be sharded")
        return first

    def _host_head_slice(self, global_slice: slice) -> slice:
        """Map a global heads range of a local shard to its place in this host's slot."""
        start, stop, _ = global_slice.indices(self._total_heads)
        offset = 0
        for s, e in self._local_heads:
            if (s, e) == (start, stop):
                return slice(offset, offset + e - s)
            offset += e - s
        raise AssertionError(f"heads {start}:{stop} are not local to this host")

    def _check_call_caches(self, kv_caches) -> None:
        """The caches handed to save/load must be laid out like the ones the engine was built for
        (otherwise the jitted programs retrace, a load silently casts, a save fails later)."""
        first = self.validate_caches(kv_caches)
        if (len(kv_caches) != self.num_layers or first.shape != (self.num_blocks, *self.block_shape)
                or first.dtype != self.dtype or first.sharding != self._cache_sharding):
            raise ValueError(
                f"kv_caches ({len(kv_caches)} layers of {first.shape} {first.dtype}) do not match the engine's "
                f"({self.num_layers} layers of {(self.num_blocks, *self.block_shape)} {self.dtype}, same sharding)"
            )

    def _check_owner(self) -> None:
        if threading.get_ident() != self._owner:
            raise RuntimeError(
                "TransferEngine dispatches JAX work only from the thread that created it; "
                f"called from {threading.current_thread().name!r}"
            )

    def _check_plan(self, block_ids, slots, save_ids, *, unique: str) -> None:
        """Validate a plan; ``unique`` names the argument that must not repeat ("slots" for a save:
        two chunks in one slot; "block_ids" for a load: two chunks into one block). A load may
        read one slot into several blocks."""
        if not (len(block_ids) == len(slots) == len(save_ids)):
            raise ValueError(
                f"block_ids, slots and save_ids differ in length: {len(block_ids)}, {len(slots)}, {len(save_ids)}"
            )
        for name, seq, limit in (("block_ids", block_ids, self.num_blocks), ("slots", slots, self.backend.num_slots)):
            if len(seq) and not (0 <= min(seq) and max(seq) < limit):  # one pass each on the hot path
                bad = [int(x) for x in seq if not 0 <= int(x) < limit]
                raise ValueError(f"{name} out of range 0..{limit - 1}: {bad[:8]}")
        seq = slots if unique == "slots" else block_ids
        if len(set(seq)) != len(seq):
            raise ValueError(f"{unique} repeat within one {'save' if unique == 'slots' else 'load'}")

    # ---------------- saves ----------------
    def save(self, kv_caches: Sequence[jax.Array], block_ids: Sequence[int], slots: Sequence[int],
             save_ids: Sequence[int]) -> None:
        """Dispatch one gather and one device-to-host transfer for all the blocks, then complete
        the copies into ``slots`` in the background. Results come back via ``drain_results``."""
        self._check_owner()
        self._check_call_caches(kv_caches)
        self._check_plan(block_ids, slots, save_ids, unique="slots")
        n = len(block_ids)
        if n == 0:
            return
        ids = np.zeros(_bucket(n), np.int32)
        ids[:n] = block_ids
        gathered = self._gather(tuple(kv_caches), ids)
        self.log.record("gather", shape=gathered.shape, dtype=gathered.dtype, blocks=list(map(int, block_ids)))
        on_host = jax.device_put(gathered, self._host_sharding)
        self.log.record("d2h", shape=on_host.shape, sharding=self._host_sharding.spec,
                        kind=self._host_sharding.memory_kind)
        slots = [int(s) for s in slots]
        save_ids = [int(s) for s in save_ids]
        previous = {self._last_write[s] for s in slots if s in self._last_write}
        fut = self._pool.submit(self._complete_save, on_host, n, slots, save_ids, previous)
        with self._lock:
            self._inflight[fut] = (time.monotonic(), n, n * self.backend.slot_bytes)
        fut.add_done_callback(self._forget_inflight)
        for s in slots:
            self._last_write[s] = fut

    def _complete_save(self, on_host: jax.Array, n: int, slots: list[int], save_ids: list[int],
                       previous: set[futures.Future]) -> None:
        futures.wait(previous)  # write-after-write: older writes to these slots land first
        ok = True
        t0 = time.monotonic()
        try:
            self.backend.invalidate(slots)
            self._faults.before_write(save_ids)
            on_host.block_until_ready()
            done_heads = set()
            for shard in on_host.addressable_shards:
                heads = shard.index[STACKED_HEADS_AXIS]
                key = heads.indices(self._total_heads)
                if key in done_heads:  # replicated over another mesh axis
                    continue
                done_heads.add(key)
                rows = np.asarray(shard.data)[:n]
                self.backend.write_rows(slots, rows, self._host_head_slice(heads))
            self.backend.commit(slots, save_ids)
        except Exception:
            ok = False
            self.backend.invalidate(slots)
        with self._lock:
            self._results.extend(SaveResult(s, ok) for s in save_ids)
            if ok:
                self.counters["chunks_saved"] += n
                self.counters["bytes_saved"] += n * self.backend.slot_bytes
                self.counters["save_seconds"] += time.monotonic() - t0
            else:
                self.counters["save_failures"] += n

    def _forget_inflight(self, fut: futures.Future) -> None:
        with self._lock:
            self._inflight.pop(fut, None)

    def take_counters(self) -> Counter[str]:
        """Counters accumulated since the last call (thread-safe)."""
        with self._lock:
            out, self.counters = self.counters, Counter()
        return out

    def drain_results(self) -> list[SaveResult]:
        """Save outcomes completed since the last call (thread-safe)."""
        with self._lock:
            out, self._results = self._results, []
        return out

    def inflight(self) -> tuple[int, int, float | None]:
        """(chunks in flight, staging bytes held by them, start time of the oldest or None)."""
        with self._lock:
            vals = list(self._inflight.values())
        if not vals:
            return 0, 0, None
        return sum(v[1] for v in vals), sum(v[2] for v in vals), min(v[0] for v in vals)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait for every background write issued so far; True if all finished in time."""
        with self._lock:
            pending = list(self._inflight)
        _, not_done = futures.wait(pending, timeout=timeout)
        return not not_done

    # ---------------- loads ----------------
    def load(self, kv_caches: Sequence[jax.Array], block_ids: Sequence[int], slots: Sequence[int],
             save_ids: Sequence[int]) -> tuple[list[jax.Array], list[int]]:
        """Copy ``slots`` into ``block_ids`` of the cache with one host-to-device transfer and one
        scatter. The cache arrays are donated: use the returned ones. Returns
        ``(new_caches, failed_block_ids)``."""
        self._check_owner()
        self._check_call_caches(kv_caches)
        self._check_plan(block_ids, slots, save_ids, unique="block_ids")
        n = len(block_ids)
        if n == 0:
            return list(kv_caches), []
        t0 = time.monotonic()
        late = self._wait_for_writes(slots)
        self._faults.before_load(self.backend, slots)
        rows, bad = self.backend.read(slots, save_ids, pad_to=_bucket(n))
        bad = sorted(set(bad) | late)
        if late:
            rows[sorted(late)] = 0
        device_rows = jax.make_array_from_callback(
            rows.shape[:STACKED_HEADS_AXIS] + (self._total_heads,) + rows.shape[STACKED_HEADS_AXIS + 1:],
            self._device_sharding,
            lambda index: rows[index[:STACKED_HEADS_AXIS] + (self._host_head_slice(index[STACKED_HEADS_AXIS]),)],
        )
        self.log.record("h2d", shape=device_rows.shape, sharding=self._device_sharding.spec)
        ids = np.full(_bucket(n), self.num_blocks, np.int32)  # padding rows fall outside: dropped
        ids[:n] = block_ids
        new = self._scatter(tuple(kv_caches), ids, device_rows)
        self.log.record("scatter", shape=device_rows.shape, blocks=list(map(int, block_ids)))
        with self._lock:
            self.counters["chunks_loaded"] += n - len(bad)
            self.counters["bytes_loaded"] += (n - len(bad)) * self.backend.slot_bytes
            self.counters["load_errors"] += len(bad)
            self.counters["load_seconds"] += time.monotonic() - t0
        return list(new), [int(block_ids[i]) for i in bad]

    def _wait_for_writes(self, slots: Sequence[int]) -> set[int]:
        """Read-after-write: wait for in-flight writes to these slots. Returns the positions whose
        write did not finish within the timeout."""
        deadline = time.monotonic() + self._load_wait_timeout_s
        late = set()
        for i, s in enumerate(slots):
            fut = self._last_write.get(int(s))
            if fut is None or fut.done():
                continue
            done, _ = futures.wait([fut], timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                late.add(i)
        return late

    # ---------------- lifecycle ----------------
    def finish_step(self) -> StepDigest:
        return self.log.finish_step()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
