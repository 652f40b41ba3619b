"""Warm restart: every host's slots and the scheduler's index as ONE multi-host orbax checkpoint.

What one checkpoint holds (``<persist_path>/ckpt-<n>``, an orbax Composite of three items):

* ``slots`` (orbax PyTree of global jax.Arrays, each sharded over a 1-D mesh of one device per
  process, so every host writes only its own row): ``storage`` (num_hosts, num_slots, slot_bytes)
  uint8 -- every host's HostBackend storage; ``tags`` (num_hosts, num_slots, 8) uint8 -- the slot
  tags (int64 save ids, -1 empty) as raw bytes (JAX without x64 would narrow int64); ``crc``
  (num_hosts, num_slots) uint32 -- zlib.crc32 of every tagged slot (0 for empty ones).
* ``meta`` (JSON, written by host 0): fingerprint, checkpoint number, num_slots, slot_bytes and the
  crc32 of the index's canonical JSON.
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

* save: for ``storage``, ``tags``, ``crc`` in turn: ``jax.device_put`` of this host's row onto its
  device (host memory: the CPU device, or ``pinned_host`` memory of an accelerator; on CPU an aligned
  row is aliased, not copied) and ``jax.make_array_from_single_device_arrays``; then orbax's blocking
  phase (coordination barriers, temp directory, device-to-host copies of those host arrays, which
  are no-ops or memcpys). The writes, the commit barrier and the finalize run on orbax's background
  thread; ``SaveHandle`` resolves when this host's part is committed (on success, after the whole
  checkpoint is finalized).
* restore: orbax restores the three arrays onto the same sharding (one ``device_put`` per array onto
  this host's device) -- only if every host accepted the fingerprint first. Host agreement (which
  checkpoint, and whether every host accepts it) goes through the coordination service's key-value
  store, not through JAX.

Consistency of a save: the rows whose tag is not -1 must not change until the handle resolves
(the worker drains its background writes before saving and the scheduler keeps the chunks of the
index it shipped pinned until every host confirmed the checkpoint). Memory: on CPU an aligned
storage is aliased; otherwise (and on TPU/GPU, into pinned host memory) the device_put copies it,
so a checkpoint briefly needs a second copy of host RAM.

Refusals: anything that does not match (fingerprint field, number of hosts, num_slots), is
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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger("tpuoffload.persist")

FORMAT_VERSION = 1
CKPT_PREFIX = "ckpt-"
_CKPT_RE = re.compile(r"^ckpt-(\d+)$")
_TMP_RE = re.compile(r"^ckpt-(\d+)\.orbax-checkpoint-tmp.*$")
EMPTY = -1

# Counter names (tpuoffload/counters.py registers them).
PERSIST_SAVED_CHUNKS = "persist_saved_chunks"
PERSIST_SAVED_BYTES = "persist_saved_bytes"
PERSIST_SAVE_FAILED = "persist_save_failed"
PERSIST_RESTORED_CHUNKS = "persist_restored_chunks"
PERSIST_RESTORED_BYTES = "persist_restored_bytes"
PERSIST_RESTORE_REFUSED = "persist_restore_refused"


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

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: Any) -> "Fingerprint":
        names = {f.name: f.type for f in dataclasses.fields(cls)}
        if not isinstance(d, dict) or set(d) != set(names):
            raise ValueError(f"fingerprint fields {sorted(d) if isinstance(d, dict) else d!r} are not {sorted(names)}")
        return cls(**d)

    def mismatches(self, stored: "Fingerprint") -> list[str]:
        """``field: checkpoint X, this deployment Y`` for every field that differs."""
        return [f"{f.name}: checkpoint {getattr(stored, f.name)!r}, this deployment {getattr(self, f.name)!r}"
                for f in dataclasses.fields(self) if getattr(stored, f.name) != getattr(self, f.name)]


@dataclass(frozen=True)
class SaveReport:
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


@dataclass(frozen=True)
class Restored:
    seq: int
    path: str
    tags: np.ndarray  # (num_slots,) int64, EMPTY for empty slots
    index: dict
    chunks: int  # tagged slots restored on this host
    bytes: int
    seconds: float
    ignored_partial: tuple[str, ...] = ()  # newer checkpoints some host never committed


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
    tagged = np.nonzero(tags != EMPTY)[0]

    def one(i: int) -> None:
        crc[i] = zlib.crc32(memoryview(storage[i]))

    if pool is None:
        for i in tagged:
            one(int(i))
    else:
        list(pool.map(one, tagged.tolist()))
    return crc


# ---------------------------------------------------------------- host agreement
class _Agreement:
    """Every host contributes a value; every host gets all of them, or a timeout. Through the
    jax.distributed coordination service's key-value store (no JAX program); one process: local."""

    def __init__(self, host: int, num_hosts: int, timeout_s: float) -> None:
        self.host, self.num_hosts, self.timeout_ms = host, num_hosts, int(timeout_s * 1000)
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
        """A name shared by this run's hosts and fresh across runs that reuse a coordinator: host
        0's start time, published once."""
        key = "tpuoffload/persist/session"
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

    def _abstract(self, num_slots: int, slot_bytes: int) -> dict:
        import jax

        sharding, _, _ = self._sharding()
        h = self.num_hosts
        return {"storage": jax.ShapeDtypeStruct((h, num_slots, slot_bytes), np.uint8, sharding=sharding),
                "tags": jax.ShapeDtypeStruct((h, num_slots, 8), np.uint8, sharding=sharding),
                "crc": jax.ShapeDtypeStruct((h, num_slots), np.uint32, sharding=sharding)}

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
    def restore(self, into: np.ndarray) -> tuple[Restored | None, str]:
        """Restore the newest complete checkpoint into ``into`` (this host's storage, (num_slots,
        slot_bytes) uint8, writable). Returns ``(Restored, "")`` on every host, or ``(None,
        reason)`` on every host (``into`` then holds no restored bytes the caller may use: treat
        every slot as empty). Never raises for a bad, partial or foreign checkpoint."""
        t0 = time.perf_counter()
        try:
            restored, reason = self._restore(into, t0)
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

    def _restore(self, into: np.ndarray, t0: float) -> tuple[Restored | None, str]:
        num_slots, slot_bytes = into.shape
        if into.dtype != np.uint8 or into.ndim != 2 or not into.flags.writeable:
            raise ValueError("restore target must be a writable (num_slots, slot_bytes) uint8 array")
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
        meta_ok, index, why = self._check_meta(path, seq, num_slots, slot_bytes)
        verdict = self._all_accept("meta", meta_ok, why)
        if verdict:
            return None, f"{path}: {verdict}{note}"

        # 3. every host restores its row (the same JAX calls on every host), checks every checksum.
        arrays_ok, why, tags, chunks = self._restore_rows(path, into, num_slots, slot_bytes)
        verdict = self._all_accept("rows", arrays_ok, why)
        if verdict:
            into[...] = 0
            return None, f"{path}: {verdict}{note}"
        return Restored(seq, path, tags, index, chunks, chunks * slot_bytes, time.perf_counter() - t0,
                        tuple(choice["partial"])), ""

    def _all_accept(self, name: str, ok: bool, why: str) -> str:
        """'' if every host accepted, else the first refusal (``host i: why``)."""
        answers = self._agree.exchange(name, "ok" if ok else f"no:{why}")
        for h, a in enumerate(answers):
            if a is None:
                return f"host {h} did not answer within {self.barrier_timeout_s:.0f} s"
            if a != "ok":
                return f"host {h}: {a[3:]}"
        return ""

    def _check_meta(self, path: str, seq: int, num_slots: int, slot_bytes: int) -> tuple[bool, dict, str]:
        try:
            meta = _read_json(os.path.join(path, "meta", "metadata"))
            stored = Fingerprint.from_json(meta.get("fingerprint"))
        except Exception as e:  # noqa: BLE001
            return False, {}, f"unreadable meta ({type(e).__name__}: {e})"
        diff = self.fingerprint.mismatches(stored)
        if diff:
            return False, {}, "fingerprint mismatch: " + "; ".join(diff)
        if meta.get("seq") != seq:
            return False, {}, f"meta names checkpoint {meta.get('seq')!r}, not {seq}"
        if meta.get("num_slots") != num_slots or meta.get("slot_bytes") != slot_bytes:
            return False, {}, (f"host slots: checkpoint {meta.get('num_slots')} x {meta.get('slot_bytes')} bytes, "
                               f"this deployment {num_slots} x {slot_bytes} (cpu_bytes_to_use changed?)")
        try:
            encoded = _read_json(os.path.join(path, "index", "metadata"))
        except Exception as e:  # noqa: BLE001
            return False, {}, f"unreadable index ({type(e).__name__}: {e})"
        if _canonical_crc(encoded) != meta.get("index_crc"):
            return False, {}, "index checksum mismatch"
        return True, decode_index(encoded), ""

    def _restore_rows(self, path: str, into: np.ndarray, num_slots: int,
                      slot_bytes: int) -> tuple[bool, str, np.ndarray, int]:
        import orbax.checkpoint as ocp
        from etils import epath

        empty = np.full(num_slots, EMPTY, np.int64)
        try:
            handler, _ = self._handler()
            abstract = self._abstract(num_slots, slot_bytes)
            restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
            out = handler.restore(epath.Path(path), ocp.args.Composite(
                slots=ocp.args.PyTreeRestore(item=abstract, restore_args=restore_args)))
            rows = {k: np.asarray(v.addressable_shards[0].data)[0] for k, v in out["slots"].items()}
        except Exception as e:  # noqa: BLE001 - a missing/truncated/garbled data file
            return False, f"unreadable slots ({type(e).__name__}: {str(e).splitlines()[0][:300]})", empty, 0
        if rows["storage"].shape != (num_slots, slot_bytes) or rows["tags"].shape != (num_slots, 8):
            return False, "slot arrays have the wrong shape", empty, 0
        tags = rows["tags"].copy().view(np.int64).reshape(num_slots)
        np.copyto(into, rows["storage"])
        crc = slot_checksums(into, tags, self._pool)
        bad = np.nonzero(crc != rows["crc"])[0]
        if bad.size:
            return False, f"{bad.size} slot(s) fail their checksum (first: slot {int(bad[0])})", empty, 0
        return True, "", tags, int(np.count_nonzero(tags != EMPTY))

    # ---------------------------------------------------------------- save
    def save(self, storage: np.ndarray, tags: np.ndarray, index: dict,
             checksums: np.ndarray | None = None) -> SaveHandle:
        """Write checkpoint number ``next_seq`` (call on every host, main thread, same step).

        ``storage`` (num_slots, slot_bytes) uint8 and ``tags`` (num_slots,) int64 are this host's;
        ``index`` is the scheduler's (identical on every host; host 0's copy is written);
        ``checksums`` may give the crc32 of every tagged slot (else computed here, in parallel).
        Tagged rows must not change until the handle resolves. Waits for the previous save first."""
        t0 = time.perf_counter()
        if self._next_seq is None:
            raise RuntimeError("call restore() once before the first save (it picks the checkpoint number)")
        if storage.dtype != np.uint8 or storage.ndim != 2 or tags.shape != (storage.shape[0],):
            raise ValueError("storage must be (num_slots, slot_bytes) uint8 and tags (num_slots,)")
        if storage.shape[1] != self.fingerprint.chunk_bytes:
            raise ValueError(f"slot_bytes {storage.shape[1]} != fingerprint chunk_bytes {self.fingerprint.chunk_bytes}")
        if self._inflight is not None:
            self._inflight.result()  # bounded by the commit timeout
        seq = self._next_seq
        self._next_seq += 1
        encoded = encode_index(index)
        tags = np.ascontiguousarray(tags, dtype=np.int64)
        if checksums is None:
            checksums = slot_checksums(storage, tags, self._pool)
        n_tagged = int(np.count_nonzero(tags != EMPTY))
        meta = {"fingerprint": self.fingerprint.to_json(), "seq": seq, "num_slots": int(storage.shape[0]),
                "slot_bytes": int(storage.shape[1]), "index_crc": _canonical_crc(encoded),
                "created_unix": time.time()}
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
            item = {"storage": self._global(storage), "tags": self._global(tags.view(np.uint8).reshape(-1, 8)),
                    "crc": self._global(np.ascontiguousarray(checksums, dtype=np.uint32))}
            ckptr = self._get_checkpointer()
            ckptr.save(path, args=ocp.args.Composite(
                slots=ocp.args.PyTreeSave(item, save_args=self._save_args(ocp, storage.nbytes)),
                meta=ocp.args.JsonSave(meta), index=ocp.args.JsonSave(encoded)))
        except Exception as e:  # noqa: BLE001
            return fail(f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}",
                        time.perf_counter() - t0)
        blocking = time.perf_counter() - t0
        self._faults.after_save_started(seq)

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
            self._count({PERSIST_SAVED_CHUNKS: n_tagged, PERSIST_SAVED_BYTES: n_tagged * storage.shape[1]})
            future.set_result(SaveReport(seq, True, "", path, n_tagged, n_tagged * storage.shape[1], blocking,
                                         time.perf_counter() - t0))

        threading.Thread(target=wait, name=f"persist-wait-{seq}", daemon=True).start()
        return handle

    def _save_args(self, ocp, nbytes: int) -> dict:
        """Storage in chunks of at most ``chunk_mib`` MiB: tensorstore writes and reads chunks in
        parallel, and no single chunk has to be assembled in memory whole."""
        return {"storage": ocp.SaveArgs(chunk_byte_size=self.chunk_bytes), "tags": ocp.SaveArgs(),
                "crc": ocp.SaveArgs()}

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


def _read_json(path: str) -> Any:
    with open(path, "rb") as f:
        return json.loads(f.read())


__all__ = ["CKPT_PREFIX", "FORMAT_VERSION", "Fingerprint", "PersistFaults", "Persister", "Restored",
           "SaveHandle", "SaveReport", "decode_index", "encode_index", "slot_checksums"]
