"""Warm restart: every host's slots and the scheduler's index as ONE multi-host orbax checkpoint.

What one checkpoint holds (``<persist_path>/ckpt-<n>``, an orbax Composite of three items):

* ``slots`` (orbax PyTree of global jax.Arrays, each host writing only its own shards):
  ``tags`` (num_hosts, num_slots, 8 * columns) uint8 -- every host's slot table as raw bytes of
  int64 (JAX without x64 would narrow int64): column 0 the save id (-1 empty), further columns
  whatever else the host keeps per slot (e.g. the block a chunk was gathered from); ``crc``
  (num_hosts, num_slots) uint32 -- zlib.crc32 of this host's part of every tagged slot (0 for empty
  ones); both sharded over a 1-D mesh of one device per process (host memory). And the slot data, in one of two forms:

  - ``storage`` (num_hosts, num_slots, slot_bytes) uint8, sharded like ``tags``: each host's slots
    as a plain (num_slots, slot_bytes) numpy array (``Persister.save(storage=ndarray)``);
  - ``stores`` {name: array}: the transfer engine's own stores, global arrays in pinned host memory
    with the slot axis at 1, sharded over the cache's mesh, saved as they are (no copy) and
    restored onto the sharding the caller describes.

  With more than one slot pool (a GDN/mamba hybrid: the KV pool above, then the state pool), each
  further pool ``p`` is an item ``pool<p>`` of the same tree: its own ``tags``, ``crc`` and
  ``stores`` (its own number of slots and slot bytes), written and checked like the first pool's
  (``PoolSlots``). A checkpoint of one pool has no such item (the format of one pool is unchanged).

* ``meta`` (JSON, written by host 0): fingerprint, checkpoint number, num_slots, the slot layout
  (the form, slot_bytes or every store's shape and dtype), with further pools ``pools`` (each
  pool's num_slots, tag shape and slot layout; absent with one pool) and the crc32 of the index's
  canonical JSON.
* ``index`` (JSON, written by host 0): the scheduler's index, an opaque dict (bytes values are
  encoded as ``{"__bytes__": hex}``; tuples come back as lists).

Commit: orbax writes into a temporary directory and renames it to ``ckpt-<n>`` only after every
host's part is written (barriers through jax.distributed's coordination service; the primary host
finalizes). A checkpoint whose name is not finalized is never restored; restore takes the newest
finalized one. Barriers use the coordination service (``MultiprocessingOptions.active_processes``
set to every process), never JAX collectives, so they time out (``barrier_timeout_s`` for the
background commit) instead of hanging, and they may run on orbax's background thread.

JAX work and threads (the multi-host contract). ``Persister.save`` and ``Persister.restore`` must be
called on the engine's main thread, at the same point of the step sequence on every host (the
scheduler plans them in the step metadata). The JAX calls they issue are local (no collective
program) and always the same, in this order, whatever the data:

* save: for ``tags``, ``crc`` (and ``storage`` in the numpy form), then each further pool's
  ``tags`` and ``crc``, in turn: ``jax.device_put`` of this host's row onto its device (host
  memory: the CPU device, or ``pinned_host`` memory of an accelerator; on CPU an aligned row is
  aliased, not copied) and
  ``jax.make_array_from_single_device_arrays``; then orbax's blocking phase (coordination barriers,
  temp directory, device-to-host copies of those host arrays, which are no-ops: ``np.asarray`` of a
  host-memory array is a view). Checksums of the stores form read the local shards the same way.
  The writes, the commit barrier and the finalize run on orbax's background thread; ``SaveHandle``
  resolves when this host's part is committed (on success, after the whole checkpoint is
  finalized).
* restore: orbax restores the arrays onto the same shardings (``device_put`` of each local shard)
  -- only if every host accepted the fingerprint and the slot layout first. Host agreement (which
  checkpoint, and whether every host accepts it) goes through the coordination service's key-value
  store, not through JAX.

Consistency of a save: the slots whose tag is not -1 must not change until the handle resolves
(the worker drains its background writes before saving and the scheduler keeps the chunks of the
index it shipped pinned until every host confirmed the checkpoint), and a store must not be
donated to a program meanwhile (orbax writes from numpy views of its buffers): the engine skips
saves (loads may go on) until the handle resolves. Memory: the stores form copies nothing; the
numpy form is aliased on CPU when 64-byte aligned, and otherwise (and on TPU/GPU, into pinned host
memory) copied by the device_put, which blocks the caller (2.4 GiB/s from pageable numpy into
pinned memory on the H200 host) and briefly needs a second copy of host RAM.

Refusals: anything that does not match (fingerprint field, number of hosts, num_slots, slot layout), is
partial, unreadable or fails a checksum is refused: ``restore`` returns ``(None, reason)`` on every
host, logs ONE line saying why, and the caller starts cold. It never raises for a bad checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import threading
import time
import zlib
from collections import Counter
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from tpuoffload.backend.slot_table import EMPTY_SLOT

from tpuoffload.counters import (PERSIST_RESTORE_REFUSED, PERSIST_RESTORED_BYTES, PERSIST_RESTORED_CHUNKS,
                                 PERSIST_SAVE_FAILED, PERSIST_SAVED_BYTES, PERSIST_SAVED_CHUNKS)

log = logging.getLogger("tpuoffload.persist")

FORMAT_VERSION = 1
CKPT_PREFIX = "ckpt-"
_CKPT_RE = re.compile(r"^ckpt-(\d+)$")
_TMP_RE = re.compile(r"^ckpt-(\d+)\.orbax-checkpoint-tmp.*$")



@dataclass(frozen=True)
class Fingerprint:
    """What a checkpoint must match to be restored into this deployment."""

    model: str
    kv_layout: str  # the cache layout's description (layer shapes, sharding, per-host part)
    kv_dtype: str
    block_size: int
    num_hosts: int
    chunk_bytes: int  # bytes one host stores per chunk (= slot_bytes)
    format_version: int = FORMAT_VERSION
    # DP ranks (batch shards of the cache) the slots are split over: another DP size splits each
    # chunk's bytes over other devices and numbers the slots per rank differently. Left out of the
    # JSON when 1, so checkpoints and disk tiers of one scheduler keep the fingerprint they had.
    dp_ranks: int = 1
    # A GDN/mamba hybrid's state pool (a second slot pool): its arrays' row shape, dtype and
    # sharding, and the bytes of a state chunk on one host; "" without one. Left out of the JSON
    # when empty, like dp_ranks.
    state_layout: str = ""

    #: Fields left out of the JSON at these values (older checkpoints and disk tiers lack them).
    _OPTIONAL = {"dp_ranks": 1, "state_layout": ""}

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for name, default in self._OPTIONAL.items():
            if out[name] == default:
                del out[name]
        return out

    @classmethod
    def from_json(cls, d: Any) -> "Fingerprint":
        names = {f.name: f.type for f in dataclasses.fields(cls)}
        if isinstance(d, dict):
            d = {**cls._OPTIONAL, **d}
        if not isinstance(d, dict) or set(d) != set(names):
            raise ValueError(f"fingerprint fields {sorted(d) if isinstance(d, dict) else d!r} are not {sorted(names)}")
        return cls(**d)

    def mismatches(self, stored: "Fingerprint") -> list[str]:
        """``field: checkpoint X, this deployment Y`` for every field that differs."""
        return [f"{f.name}: checkpoint {getattr(stored, f.name)!r}, this deployment {getattr(self, f.name)!r}"
                for f in dataclasses.fields(self) if getattr(stored, f.name) != getattr(self, f.name)]


@dataclass(frozen=True)
class SaveReport:
    """The outcome of this host's part of one checkpoint: committed or not (with the reason), what it
    wrote and how long it held the calling thread."""

    seq: int
    ok: bool
    reason: str = ""
    path: str = ""
    chunks: int = 0  # tagged slots this host wrote
    bytes: int = 0  # bytes of slot storage this host wrote
    blocking_s: float = 0.0  # time save() held the calling thread
    total_s: float = 0.0  # until this host's part was committed (or failed)


class SaveHandle:
    """A checkpoint being written. ``result()`` never raises for a failed checkpoint: it returns a
    SaveReport with ``ok=False`` and the reason."""

    def __init__(self, seq: int, future: Future) -> None:
        self.seq = seq
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> SaveReport:
        return self._future.result(timeout)

    def add_done_callback(self, fn) -> None:
        """``fn(report)`` once the checkpoint resolved (on the thread that resolved it, or at once)."""
        self._future.add_done_callback(lambda f: fn(f.result()))


@dataclass(frozen=True)
class PoolSlots:
    """A further slot pool's part of a checkpoint (a GDN/mamba state pool beside the KV pool): its
    stores ``{name: global jax.Array}`` (slot axis 1, as the first pool's stores form) and its slot
    table (``tags``, shaped as ``Persister.save``'s). At restore: the stores are the targets
    (``jax.ShapeDtypeStruct`` with sharding) and ``tags`` is None."""

    stores: Mapping[str, Any]
    tags: np.ndarray | None = None


@dataclass(frozen=True)
class Restored:
    """What a host restored from a checkpoint: its number and path, the slot tags saved with it, the
    index, the stores (or None when restored into host rows), and what it cost."""

    seq: int
    path: str
    tags: np.ndarray  # int64, the shape saved: (num_slots,), (num_slots, columns) or (num_slots, chunks, columns);
    # save id (column 0) EMPTY_SLOT: empty
    index: dict
    stores: dict | None  # the restored global arrays (stores form), None for host rows (in ``into``)
    chunks: int  # tagged slots restored on this host (every pool's)
    bytes: int
    seconds: float
    ignored_partial: tuple[str, ...] = ()  # newer checkpoints some host never committed
    pools: tuple[PoolSlots, ...] = ()  # each further slot pool's restored stores and tags, in pool order


class PersistFaults:
    """Test hook (default: nothing). ``after_save_started`` runs on the main thread right after the
    blocking phase of a save, while the background commit runs (a test kills the host there)."""

    def after_save_started(self, seq: int) -> None:
        pass


# ---------------------------------------------------------------- index encoding
def encode_index(obj: Any) -> Any:
    """JSON-compatible copy of ``obj``: bytes become ``{"__bytes__": hex}``. TypeError on other
    non-JSON values."""
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return {"__bytes__": bytes(obj).hex()}
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, str):
                raise TypeError(f"index keys must be str, got {type(k).__name__}")
            out[k] = encode_index(v)
        return out
    if isinstance(obj, (list, tuple)):
        return [encode_index(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, np.integer):
        return int(obj)
    raise TypeError(f"index values must be JSON values or bytes, got {type(obj).__name__}")


def decode_index(obj: Any) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {"__bytes__"}:
            return bytes.fromhex(obj["__bytes__"])
        return {k: decode_index(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_index(v) for v in obj]
    return obj


def _canonical_crc(encoded: Any) -> int:
    return zlib.crc32(json.dumps(encoded, sort_keys=True, separators=(",", ":")).encode())


def slot_checksums(storage: np.ndarray, tags: np.ndarray, pool: ThreadPoolExecutor | None = None) -> np.ndarray:
    """crc32 of every tagged slot (0 for empty ones), on ``pool``'s threads (crc32 drops the GIL)."""
    crc = np.zeros(storage.shape[0], np.uint32)
    tagged = np.nonzero(_tagged_rows(tags))[0]

    def one(i: int) -> None:
        crc[i] = zlib.crc32(memoryview(storage[i]))

    if pool is None:
        for i in tagged:
            one(int(i))
    else:
        list(pool.map(one, tagged.tolist()))
    return crc


def _save_ids(tags: np.ndarray) -> np.ndarray:
    """Column 0 of a slot table: the save ids, one per row, or (a table of shape (rows, chunks per
    row, columns): a row of the stores holds one chunk per DP rank, each on its batch shard's
    devices) one per chunk of each row."""
    return tags if tags.ndim == 1 else tags[..., 0]


def _tagged_rows(ids: np.ndarray) -> np.ndarray:
    """Which rows hold a chunk (any of theirs), from ``_save_ids``."""
    held = ids != EMPTY_SLOT
    return held if held.ndim == 1 else held.any(axis=1)


def _store_views(stores: Mapping[str, Any]) -> list[np.ndarray]:
    """This host's parts of the stores as numpy views (zero-copy for host-memory arrays), in a fixed
    order: by store name, then by device id."""
    views = []
    for name in sorted(stores):
        for shard in sorted(stores[name].addressable_shards, key=lambda sh: sh.device.id):
            views.append(np.asarray(shard.data))
    return views


def store_checksums(stores: Mapping[str, Any], tags: np.ndarray,
                    pool: ThreadPoolExecutor | None = None) -> np.ndarray:
    """crc32 of this host's part of every tagged slot of ``stores`` (global jax.Arrays whose axis 1
    is the slot axis), chained over the stores and their local shards in ``_store_views`` order."""
    views = _store_views(stores)
    crc = np.zeros(tags.shape[0], np.uint32)

    def one(slot: int) -> None:
        c = 0
        for v in views:
            for lead in range(v.shape[0]):
                c = zlib.crc32(memoryview(np.ascontiguousarray(v[lead, slot])).cast("B"), c)
        crc[slot] = c

    tagged = np.nonzero(_tagged_rows(tags))[0].tolist()
    if pool is None:
        for slot in tagged:
            one(slot)
    else:
        list(pool.map(one, tagged))
    return crc


def _host_slot_bytes(stores: Mapping[str, Any]) -> int:
    return sum(v[:, 0].nbytes for v in _store_views(stores))


def _num_slots(stores: Mapping[str, Any]) -> int:
    """The slots (axis 1) every store of a pool has."""
    counts = {int(v.shape[1]) for v in stores.values()}
    if len(counts) != 1:
        raise ValueError(f"stores disagree on the number of slots (axis 1): {sorted(counts)}")
    return counts.pop()


def _slots_spec(storage: Any) -> dict:
    """What the slot data looks like (checked at restore against the deployment's)."""
    if isinstance(storage, np.ndarray):
        return {"kind": "host_rows", "slot_bytes": int(storage.shape[1])}
    return {"kind": "stores", "stores": {name: {"shape": list(storage[name].shape), "dtype": str(storage[name].dtype)}
                                         for name in sorted(storage)}}


# ---------------------------------------------------------------- host agreement
class _Agreement:
    """Every host contributes a value; every host gets all of them, or a timeout. Through the
    jax.distributed coordination service's key-value store (no JAX program); one process: local."""

    _instances = 0  # Agreements made in this process: the same sequence on every host (main thread)

    def __init__(self, host: int, num_hosts: int, timeout_s: float) -> None:
        self.host, self.num_hosts, self.timeout_ms = host, num_hosts, int(timeout_s * 1000)
        _Agreement._instances += 1
        self._instance = _Agreement._instances
        self._n = 0  # operations so far: identical on every host (main thread, same order)
        self._session = None

    def _client(self):
        from jax._src import distributed  # the coordination service client jax.distributed made

        return distributed.global_state.client

    def exchange(self, name: str, value: str) -> list[str | None]:
        """Publish ``value`` and collect every host's (None: that host did not answer in time)."""
        self._n += 1
        if self.num_hosts == 1:
            return [value]
        client = self._client()
        if self._session is None:
            self._session = self._first_session(client)
        prefix = f"tpuoffload/persist/{self._session}/{self._n}-{name}"
        client.key_value_set(f"{prefix}/{self.host}", value)
        out: list[str | None] = []
        deadline = time.monotonic() + self.timeout_ms / 1000
        for h in range(self.num_hosts):
            left = max(1, int((deadline - time.monotonic()) * 1000))
            try:
                out.append(client.blocking_key_value_get(f"{prefix}/{h}", left))
            except Exception:  # noqa: BLE001 - a timeout or a dead coordination service
                out.append(None)
        return out

    def _first_session(self, client) -> str:
        """A name shared by this Persister's hosts and by no other: host 0's clock and pid,
        published under this process's n-th Persister."""
        key = f"tpuoffload/persist/session/{self._instance}"
        if self.host == 0:
            client.key_value_set(key, f"{time.time_ns()}-{os.getpid()}")
        return client.blocking_key_value_get(key, self.timeout_ms)


# ---------------------------------------------------------------- the persister
class Persister:
    """Saves and restores this deployment's checkpoints at ``persist_path`` (a directory every host
    sees: NFS/Filestore, a gcsfuse mount, or one host's disk when there is one host).

    ``host``/``num_hosts`` default to jax.process_index()/jax.process_count(). Call ``restore`` once
    at start-up (it also picks the next checkpoint number), then ``save`` as planned."""

    def __init__(self, persist_path: str, fingerprint: Fingerprint, *, host: int | None = None,
                 num_hosts: int | None = None, barrier_timeout_s: float = 300.0, keep: int = 2,
                 threads: int = 4, chunk_mib: int = 64, faults: PersistFaults | None = None) -> None:
        import jax

        self.path = os.path.abspath(persist_path)
        self.fingerprint = fingerprint
        self.host = jax.process_index() if host is None else host
        self.num_hosts = jax.process_count() if num_hosts is None else num_hosts
        if self.num_hosts != jax.process_count() or self.host != jax.process_index():
            raise ValueError(f"host {self.host}/{self.num_hosts} is not this JAX process "
                             f"({jax.process_index()}/{jax.process_count()})")
        if fingerprint.num_hosts != self.num_hosts:
            raise ValueError(f"fingerprint says {fingerprint.num_hosts} hosts, JAX has {self.num_hosts}")
        self.barrier_timeout_s = barrier_timeout_s
        self.keep = max(1, keep)
        self.chunk_bytes = chunk_mib << 20
        self._faults = faults or PersistFaults()
        self._agree = _Agreement(self.host, self.num_hosts, barrier_timeout_s)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="persist")
        self._next_seq: int | None = None  # set by restore (agreed by every host)
        self._inflight: SaveHandle | None = None  # main thread only
        self._checkpointer = None
        self._mesh_sharding = None
        self.counters: Counter[str] = Counter()  # this host's totals (the PERSIST_* names)
        self._counters_lock = threading.Lock()  # guards counters (main thread and save waiters)

    # ---------------------------------------------------------------- layout of the global arrays
    def _sharding(self):
        """NamedSharding over one device per process (host memory), axis 0 = host."""
        if self._mesh_sharding is None:
            import jax
            from jax.sharding import Mesh, NamedSharding, PartitionSpec

            devices = [min((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
                       for p in range(self.num_hosts)]
            mine = devices[self.host]
            kinds = {m.kind for m in mine.addressable_memories()}
            kind = None if mine.platform == "cpu" or "pinned_host" not in kinds else "pinned_host"
            mesh = Mesh(np.array(devices), ("hosts",))
            self._mesh_sharding = (NamedSharding(mesh, PartitionSpec("hosts"), memory_kind=kind), mine, kind)
        return self._mesh_sharding

    def _global(self, local: np.ndarray):
        """This host's row (a leading axis of 1) as its shard of a (num_hosts, ...) global array."""
        import jax
        from jax.sharding import SingleDeviceSharding

        sharding, device, kind = self._sharding()
        shard = jax.device_put(local[None], SingleDeviceSharding(device, memory_kind=kind), may_alias=True)
        return jax.make_array_from_single_device_arrays((self.num_hosts, *local.shape), sharding, [shard])

    def _abstract(self, num_slots: int, tag_bytes: int) -> dict:
        """Restore targets of the per-host arrays every checkpoint has (tags and checksums)."""
        import jax

        sharding, _, _ = self._sharding()
        h = self.num_hosts
        return {"tags": jax.ShapeDtypeStruct((h, num_slots, tag_bytes), np.uint8, sharding=sharding),
                "crc": jax.ShapeDtypeStruct((h, num_slots), np.uint32, sharding=sharding)}

    def _abstract_rows(self, shape: tuple[int, int]):
        import jax

        sharding, _, _ = self._sharding()
        return jax.ShapeDtypeStruct((self.num_hosts, *shape), np.uint8, sharding=sharding)

    def _handler(self):
        import orbax.checkpoint as ocp

        mp = ocp.options.MultiprocessingOptions(primary_host=0, active_processes=set(range(self.num_hosts)))
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        pytree = ocp.PyTreeCheckpointHandler(use_compression=False, multiprocessing_options=mp)
        for item in ("meta", "index"):
            js = ocp.JsonCheckpointHandler(multiprocessing_options=mp)
            registry.add(item, ocp.args.JsonSave, js)
            registry.add(item, ocp.args.JsonRestore, js)
        registry.add("slots", ocp.args.PyTreeSave, pytree)
        registry.add("slots", ocp.args.PyTreeRestore, pytree)
        return ocp.CompositeCheckpointHandler(
            handler_registry=registry,
            composite_options=ocp.CompositeOptions(multiprocessing_options=mp)), mp

    def _get_checkpointer(self):
        if self._checkpointer is None:
            import orbax.checkpoint as ocp

            handler, mp = self._handler()
            timeout = max(1, int(self.barrier_timeout_s))
            self._checkpointer = ocp.AsyncCheckpointer(
                handler, multiprocessing_options=mp,
                async_options=ocp.options.AsyncOptions(timeout_secs=timeout))
        return self._checkpointer

    # ---------------------------------------------------------------- listing
    def _scan(self) -> tuple[int | None, int, list[str]]:
        """(newest finalized checkpoint number or None, highest number in use, partial names)."""
        import orbax.checkpoint as ocp

        best, highest, partial = None, 0, []
        try:
            names = os.listdir(self.path)
        except FileNotFoundError:
            return None, 0, []
        for name in names:
            m, t = _CKPT_RE.match(name), _TMP_RE.match(name)
            if m:
                n = int(m.group(1))
                highest = max(highest, n)
                if ocp.utils.is_checkpoint_finalized(os.path.join(self.path, name)):
                    best = n if best is None else max(best, n)
                else:
                    partial.append(name)
            elif t:
                highest = max(highest, int(t.group(1)))
                partial.append(name)
        return best, highest, sorted(partial)

    # ---------------------------------------------------------------- restore
    def restore(self, into: np.ndarray | Mapping[str, Any],
                pools: Sequence[Mapping[str, Any]] = ()) -> tuple[Restored | None, str]:
        """Restore the newest complete checkpoint. ``into`` is either this host's storage
        ((num_slots, slot_bytes) uint8, writable: filled in place) or, for slots kept in global
        jax.Arrays, ``{name: jax.ShapeDtypeStruct(shape, dtype, sharding=...)}`` describing the
        stores (slot axis 1): the restored arrays come back in ``Restored.stores``. ``pools``:
        the targets of each further slot pool's stores (stores form only), which the checkpoint
        must hold alike (``Restored.pools``).

        Returns ``(Restored, "")`` on every host, or ``(None, reason)`` on every host (then nothing
        restored may be used: every slot is empty). Never raises for a bad, partial or foreign
        checkpoint. Call it once at start-up, also when nothing is expected: it numbers the saves."""
        t0 = time.perf_counter()
        try:
            restored, reason = self._restore(into, tuple(pools), t0)
        except Exception as e:  # noqa: BLE001 - never crash the engine over a checkpoint
            restored, reason = None, f"restore failed: {type(e).__name__}: {e}"
        if restored is None:
            self._count({PERSIST_RESTORE_REFUSED: 1})
            log.warning("tpuoffload persist: starting cold: %s", reason)
        else:
            self._count({PERSIST_RESTORED_CHUNKS: restored.chunks, PERSIST_RESTORED_BYTES: restored.bytes})
            log.info("tpuoffload persist: restored %s on host %d: %d chunks, %.2f GiB in %.2f s%s",
                     restored.path, self.host, restored.chunks, restored.bytes / 2**30, restored.seconds,
                     f" (ignored partial: {', '.join(restored.ignored_partial)})" if restored.ignored_partial else "")
        return restored, reason

    def _restore(self, into: np.ndarray | Mapping[str, Any], pools: tuple[Mapping[str, Any], ...],
                 t0: float) -> tuple[Restored | None, str]:
        if isinstance(into, np.ndarray):
            if into.dtype != np.uint8 or into.ndim != 2 or not into.flags.writeable:
                raise ValueError("restore target must be a writable (num_slots, slot_bytes) uint8 array")
            if pools:
                raise ValueError("further slot pools need the stores form")
            num_slots = into.shape[0]
        else:
            num_slots = _num_slots(into)
        pool_specs = [{"num_slots": _num_slots(targets), "slots": _slots_spec(targets)} for targets in pools]
        # 1. host 0 picks the checkpoint; everyone learns the numbering.
        pick = ""
        if self.host == 0:
            try:
                best, highest, partial = self._scan()
                pick = json.dumps({"best": best, "highest": highest, "partial": partial})
            except OSError as e:  # told to every host, so that all of them start cold
                pick = json.dumps({"error": f"cannot list {self.path}: {type(e).__name__}: {e}"})
        got = self._agree.exchange("pick", pick)
        if got[0] is None:
            return None, "host 0 did not say which checkpoint to restore (timeout)"
        choice = json.loads(got[0])
        if "error" in choice:
            return None, choice["error"]
        self._next_seq = choice["highest"] + 1
        note = f" (ignored partial: {', '.join(choice['partial'])})" if choice["partial"] else ""
        if choice["best"] is None:
            return None, f"no complete checkpoint in {self.path}{note}"
        seq = choice["best"]
        path = os.path.join(self.path, f"{CKPT_PREFIX}{seq}")

        # 2. every host reads and checks the meta and the index; all must accept.
        meta_ok, index, tag_tail, why = self._check_meta(path, seq, num_slots, _slots_spec(into), pool_specs)
        verdict = self._all_accept("meta", meta_ok, why)
        if verdict:
            return None, f"{path}: {verdict}{note}"

        # 3. every host restores its part (the same JAX calls on every host), checks every checksum.
        ok, why, parts = self._restore_slots(path, into, num_slots, tag_tail, pools, pool_specs)
        verdict = self._all_accept("slots", ok, why)
        if verdict:
            if isinstance(into, np.ndarray):
                into[...] = 0
            return None, f"{path}: {verdict}{note}"
        chunks = held_bytes = 0
        for tags, _, slot_bytes in parts:
            ids = _save_ids(tags)
            chunks += int(np.count_nonzero(ids != EMPTY_SLOT))
            held_bytes += int(_tagged_rows(ids).sum()) * slot_bytes
        (tags, stores, _), further = parts[0], parts[1:]
        return Restored(seq, path, tags, index, stores, chunks, held_bytes, time.perf_counter() - t0,
                        tuple(choice["partial"]), tuple(PoolSlots(s, t) for t, s, _ in further)), ""

    def _all_accept(self, name: str, ok: bool, why: str) -> str:
        """'' if every host accepted, else the first refusal (``host i: why``)."""
        answers = self._agree.exchange(name, "ok" if ok else f"no:{why}")
        for h, a in enumerate(answers):
            if a is None:
                return f"host {h} did not answer within {self.barrier_timeout_s:.0f} s"
            if a != "ok":
                return f"host {h}: {a[3:]}"
        return ""

    def _check_meta(self, path: str, seq: int, num_slots: int, spec: dict,
                    pool_specs: list[dict]) -> tuple[bool, dict, list[tuple[int, ...]], str]:
        """(ok, decoded index, shape of a slot's tag row of each pool, why not)."""
        try:
            meta = _read_json(os.path.join(path, "meta", "metadata"))
            stored = Fingerprint.from_json(meta.get("fingerprint"))
        except Exception as e:  # noqa: BLE001
            return False, {}, (), f"unreadable meta ({type(e).__name__}: {e})"
        diff = self.fingerprint.mismatches(stored)
        if diff:
            return False, {}, (), "fingerprint mismatch: " + "; ".join(diff)
        if meta.get("seq") != seq:
            return False, {}, (), f"meta names checkpoint {meta.get('seq')!r}, not {seq}"
        if meta.get("num_slots") != num_slots:
            return False, {}, (), (f"host slots: checkpoint {meta.get('num_slots')}, this deployment {num_slots} "
                                   "(cpu_bytes_to_use changed?)")
        stored_pools = meta.get("pools", [])
        if not isinstance(stored_pools, list) or not all(isinstance(p, dict) for p in stored_pools):
            return False, {}, (), f"unreadable meta (pools {stored_pools!r})"
        if len(stored_pools) != len(pool_specs):
            return False, {}, (), (f"slot pools: checkpoint {1 + len(stored_pools)}, this deployment "
                                   f"{1 + len(pool_specs)} (a GDN/mamba state pool on one side only)")
        tails = []
        for p, (want, have) in enumerate(zip([{"num_slots": num_slots, "slots": spec}] + pool_specs,
                                             [meta] + stored_pools)):
            tail = have.get("tags_tail")
            if not isinstance(tail, list) or len(tail) > 2 or not all(isinstance(t, int) and t > 0 for t in tail):
                return False, {}, (), f"unreadable meta (tags_tail {tail!r})"
            where = f"pool {p} " if p else ""
            if p and have.get("num_slots") != want["num_slots"]:
                return False, {}, (), (f"{where}host slots: checkpoint {have.get('num_slots')}, this deployment "
                                       f"{want['num_slots']} (cpu_bytes_to_use or state_ram_fraction changed?)")
            if have.get("slots") != want["slots"]:
                return False, {}, (), (f"{where}slot layout: checkpoint {have.get('slots')}, "
                                       f"this deployment {want['slots']}")
            tails.append(tuple(tail))
        try:
            encoded = _read_json(os.path.join(path, "index", "metadata"))
        except Exception as e:  # noqa: BLE001
            return False, {}, (), f"unreadable index ({type(e).__name__}: {e})"
        if _canonical_crc(encoded) != meta.get("index_crc"):
            return False, {}, (), "index checksum mismatch"
        return True, decode_index(encoded), tails, ""

    def _restore_slots(self, path: str, into: np.ndarray | Mapping[str, Any], num_slots: int,
                       tag_tails: list[tuple[int, ...]], pools: tuple[Mapping[str, Any], ...],
                       pool_specs: list[dict]) -> tuple[bool, str, list[tuple[np.ndarray, dict | None, int]]]:
        """(ok, why, each pool's (tags, restored stores or None, this host's bytes per slot))."""
        import orbax.checkpoint as ocp
        from etils import epath

        counts = [num_slots] + [p["num_slots"] for p in pool_specs]
        empty = [(np.full((n, *tail), EMPTY_SLOT, np.int64), None, 0) for n, tail in zip(counts, tag_tails)]
        rows = isinstance(into, np.ndarray)
        abstract = self._abstract(num_slots, 8 * int(np.prod(tag_tails[0], dtype=np.int64)))
        if rows:
            abstract["storage"] = self._abstract_rows(into.shape)
        else:
            abstract["stores"] = dict(into)
        for p, (targets, n, tail) in enumerate(zip(pools, counts[1:], tag_tails[1:]), start=1):
            abstract[f"pool{p}"] = {**self._abstract(n, 8 * int(np.prod(tail, dtype=np.int64))),
                                    "stores": dict(targets)}
        try:
            handler, _ = self._handler()
            restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
            out = handler.restore(epath.Path(path), ocp.args.Composite(
                slots=ocp.args.PyTreeRestore(item=abstract, restore_args=restore_args)))["slots"]
            items = [out] + [out[f"pool{p}"] for p in range(1, len(counts))]
            tags = [np.asarray(item["tags"].addressable_shards[0].data)[0].copy().view(np.int64).reshape(n, *tail)
                    for item, n, tail in zip(items, counts, tag_tails)]
            stored_crc = [np.asarray(item["crc"].addressable_shards[0].data)[0] for item in items]
            if rows:
                np.copyto(into, np.asarray(out["storage"].addressable_shards[0].data)[0])
        except Exception as e:  # noqa: BLE001 - a missing/truncated/garbled data file
            return False, f"unreadable slots ({type(e).__name__}: {str(e).splitlines()[0][:300]})", empty
        parts = []
        for p, (item, pool_tags, crc_stored) in enumerate(zip(items, tags, stored_crc)):
            if rows:
                crc, stores, slot_bytes = slot_checksums(into, _save_ids(pool_tags), self._pool), None, into.shape[1]
            else:
                stores = dict(item["stores"])
                crc, slot_bytes = store_checksums(stores, _save_ids(pool_tags), self._pool), _host_slot_bytes(stores)
            bad = np.nonzero(crc != crc_stored)[0]
            if bad.size:
                where = f"pool {p}: " if p else ""
                return False, f"{where}{bad.size} slot(s) fail their checksum (first: slot {int(bad[0])})", empty
            parts.append((pool_tags, stores, slot_bytes))
        return True, "", parts

    # ---------------------------------------------------------------- save
    def save(self, storage: np.ndarray | Mapping[str, Any], tags: np.ndarray, index: dict,
             checksums: np.ndarray | None = None, pools: Sequence[PoolSlots] = ()) -> SaveHandle:
        """Write checkpoint number ``next_seq`` (call on every host, main thread, same step).

        ``storage`` is this host's slots, (num_slots, slot_bytes) uint8, or the engine's stores
        ``{name: global jax.Array}`` (slot axis 1, sharded over every host, in host memory: saved
        as they are, each host writing its own shards). ``tags`` is this host's slot table, int64
        (num_slots,) or (num_slots, columns) with the save id (EMPTY_SLOT: empty slot) in column 0,
        or (num_slots, chunks, columns) where a slot row holds several chunks (one per DP rank);
        ``index`` is the scheduler's (identical on every host; host 0's copy is written);
        ``checksums`` may give the crc32 of every tagged slot (else computed here, in parallel).
        ``pools``: each further slot pool's stores and slot table (stores form only; a GDN/mamba
        state pool), written beside the first pool's as item ``pool<p>``.
        Tagged slots must not change until the handle resolves, and a store must not be donated to
        a program meanwhile (orbax reads it through numpy views). Waits for the previous save.
        A failed checkpoint is a SaveReport with ``ok=False`` (ValueError only for arrays of the
        wrong shape or dtype, a caller's bug)."""
        t0 = time.perf_counter()
        if self._next_seq is None:  # the same on every host: the number comes from host 0's pick
            refused: Future = Future()
            refused.set_result(SaveReport(-1, False, "no checkpoint number: restore() did not list persist_path"))
            return SaveHandle(-1, refused)
        rows = isinstance(storage, np.ndarray)
        tags = np.ascontiguousarray(tags, dtype=np.int64)
        if tags.ndim not in (1, 2, 3):
            raise ValueError("tags must be (num_slots,), (num_slots, columns) or (num_slots, chunks per slot, columns)")
        num_slots, ids = tags.shape[0], _save_ids(tags)
        if rows:
            if storage.dtype != np.uint8 or storage.ndim != 2 or storage.shape[0] != num_slots:
                raise ValueError("storage must be (num_slots, slot_bytes) uint8, one row per tag")
            if storage.shape[1] != self.fingerprint.chunk_bytes:
                raise ValueError(f"slot_bytes {storage.shape[1]} != fingerprint chunk_bytes "
                                 f"{self.fingerprint.chunk_bytes}")
        elif not storage or any(v.ndim < 2 or v.shape[1] != num_slots for v in storage.values()):
            raise ValueError("stores must be global arrays whose axis 1 has one entry per tag")
        if pools and rows:
            raise ValueError("further slot pools need the stores form")
        pool_tags = [np.ascontiguousarray(p.tags, dtype=np.int64) for p in pools]
        for p, t in zip(pools, pool_tags):
            if t.ndim not in (1, 2, 3) or not p.stores or any(v.ndim < 2 or v.shape[1] != t.shape[0]
                                                               for v in p.stores.values()):
                raise ValueError("a further pool's stores must be global arrays whose axis 1 has one entry per tag")
        if self._inflight is not None:
            self._inflight.result()  # bounded by the commit timeout
        seq = self._next_seq
        self._next_seq += 1
        encoded = encode_index(index)
        if checksums is None:
            checksums = (slot_checksums(storage, ids, self._pool) if rows
                         else store_checksums(storage, ids, self._pool))
        slot_bytes = storage.shape[1] if rows else _host_slot_bytes(storage)
        n_tagged = int(np.count_nonzero(ids != EMPTY_SLOT))  # chunks
        held_bytes = int(_tagged_rows(ids).sum()) * slot_bytes  # bytes of the rows holding them
        pool_crc = []
        for p, t in zip(pools, pool_tags):
            pool_ids = _save_ids(t)
            pool_crc.append(store_checksums(p.stores, pool_ids, self._pool))
            n_tagged += int(np.count_nonzero(pool_ids != EMPTY_SLOT))
            held_bytes += int(_tagged_rows(pool_ids).sum()) * _host_slot_bytes(p.stores)
        meta = {"fingerprint": self.fingerprint.to_json(), "seq": seq, "num_slots": num_slots,
                "tags_tail": list(tags.shape[1:]),
                "slots": _slots_spec(storage), "index_crc": _canonical_crc(encoded), "created_unix": time.time()}
        if pools:
            meta["pools"] = [{"num_slots": int(t.shape[0]), "tags_tail": list(t.shape[1:]),
                              "slots": _slots_spec(p.stores)} for p, t in zip(pools, pool_tags)]
        path = os.path.join(self.path, f"{CKPT_PREFIX}{seq}")
        future: Future = Future()
        handle = SaveHandle(seq, future)
        self._inflight = handle

        def fail(reason: str, blocking: float) -> SaveHandle:
            self._count({PERSIST_SAVE_FAILED: 1})
            future.set_result(SaveReport(seq, False, reason, path, blocking_s=blocking,
                                         total_s=time.perf_counter() - t0))
            log.warning("tpuoffload persist: checkpoint %s failed on host %d: %s", path, self.host, reason)
            return handle

        try:
            import orbax.checkpoint as ocp

            os.makedirs(self.path, exist_ok=True)
            # The JAX calls of a save, always these, in this order (see the module docstring).
            item = {"tags": self._global(tags.view(np.uint8).reshape(num_slots, -1)),
                    "crc": self._global(np.ascontiguousarray(checksums, dtype=np.uint32))}
            if rows:
                item["storage"] = self._global(storage)
            else:
                item["stores"] = dict(storage)
            for p, (pool, t, crc) in enumerate(zip(pools, pool_tags, pool_crc), start=1):
                item[f"pool{p}"] = {"tags": self._global(t.view(np.uint8).reshape(t.shape[0], -1)),
                                    "crc": self._global(np.ascontiguousarray(crc, dtype=np.uint32)),
                                    "stores": dict(pool.stores)}
            ckptr = self._get_checkpointer()
            ckptr.save(path, args=ocp.args.Composite(
                slots=ocp.args.PyTreeSave(item, save_args=self._save_args(ocp, item)),
                meta=ocp.args.JsonSave(meta), index=ocp.args.JsonSave(encoded)))
            del item
        except Exception as e:  # noqa: BLE001
            return fail(f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}",
                        time.perf_counter() - t0)
        blocking = time.perf_counter() - t0
        self._faults.after_save_started(seq)
        del storage, pools  # the waiter must not keep the caller's arrays alive

        def wait() -> None:
            try:
                ckptr.wait_until_finished()
                if not os.path.isdir(path):
                    raise RuntimeError("not finalized")
            except Exception as e:  # noqa: BLE001 - a host died, a barrier timed out, a write failed
                fail(f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}", blocking)
                return
            if self.host == 0:
                self._prune(seq)
            self._count({PERSIST_SAVED_CHUNKS: n_tagged, PERSIST_SAVED_BYTES: held_bytes})
            future.set_result(SaveReport(seq, True, "", path, n_tagged, held_bytes, blocking,
                                         time.perf_counter() - t0))

        threading.Thread(target=wait, name=f"persist-wait-{seq}", daemon=True).start()
        return handle

    def _save_args(self, ocp, item: dict) -> dict:
        """Slot data in tensorstore chunks of at most ``chunk_mib`` MiB: they are written and read
        in parallel, and no chunk has to be assembled in memory whole."""
        big = ocp.SaveArgs(chunk_byte_size=self.chunk_bytes)
        out = {"tags": ocp.SaveArgs(), "crc": ocp.SaveArgs()}
        if "storage" in item:
            out["storage"] = big
        else:
            out["stores"] = {name: big for name in item["stores"]}
        for name, part in item.items():
            if name.startswith("pool"):
                out[name] = {"tags": ocp.SaveArgs(), "crc": ocp.SaveArgs(),
                             "stores": {store: big for store in part["stores"]}}
        return out

    def _prune(self, newest: int) -> None:
        """Host 0, after checkpoint ``newest`` committed: keep the ``keep`` newest complete
        checkpoints; delete older ones and every partial one older than ``newest``."""
        best = []
        for name in os.listdir(self.path):
            m, t = _CKPT_RE.match(name), _TMP_RE.match(name)
            full = os.path.join(self.path, name)
            if m and int(m.group(1)) <= newest and os.path.isdir(full):
                best.append((int(m.group(1)), full))
            elif t and int(t.group(1)) < newest:
                shutil.rmtree(full, ignore_errors=True)
        for _, full in sorted(best)[:-self.keep]:
            shutil.rmtree(full, ignore_errors=True)

    def _count(self, amounts: dict[str, int]) -> None:
        with self._counters_lock:
            self.counters.update(amounts)

    def counters_snapshot(self) -> dict[str, int]:
        with self._counters_lock:
            return dict(self.counters)

    @property
    def next_seq(self) -> int | None:
        return self._next_seq

    def close(self) -> None:
        """Wait for the save in flight (bounded), then release the threads."""
        if self._inflight is not None:
            self._inflight.result()
        if self._checkpointer is not None:
            self._checkpointer.close()
        self._pool.shutdown(wait=True)


def read_index(persist_path: str, seq: int, fingerprint: Fingerprint) -> tuple[dict | None, str]:
    """The index of checkpoint ``seq`` for the scheduler process (no JAX): ``(index, "")`` if the
    checkpoint is complete, matches ``fingerprint`` and its index passes its checksum, else
    ``(None, reason)``. The scheduler calls it once every host reported that it restored ``seq``."""
    path = os.path.join(os.path.abspath(persist_path), f"{CKPT_PREFIX}{seq}")
    try:
        meta = _read_json(os.path.join(path, "meta", "metadata"))
        diff = fingerprint.mismatches(Fingerprint.from_json(meta.get("fingerprint")))
        if diff:
            return None, f"{path}: fingerprint mismatch: " + "; ".join(diff)
        encoded = _read_json(os.path.join(path, "index", "metadata"))
    except Exception as e:  # noqa: BLE001 - missing, partial or garbled: the scheduler starts cold
        return None, f"{path}: unreadable ({type(e).__name__}: {e})"
    if meta.get("seq") != seq or _canonical_crc(encoded) != meta.get("index_crc"):
        return None, f"{path}: index checksum mismatch"
    return decode_index(encoded), ""


def _read_json(path: str) -> Any:
    with open(path, "rb") as f:
        return json.loads(f.read())


__all__ = ["CKPT_PREFIX", "FORMAT_VERSION", "Fingerprint", "PersistFaults", "Persister", "PoolSlots", "Restored",
           "SaveHandle", "SaveReport", "decode_index", "encode_index", "read_index", "slot_checksums",
           "store_checksums"]
