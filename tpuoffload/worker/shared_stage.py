"""The shared tier, the worker's side: this host's shard objects in the store every replica shares.

Per step, in ``bind`` (``act``, on the main thread, before the step's flush and loads), from the
plan's ``SharedPlan`` (manager/shared_tier.py decides; every host gets the same part):

    cancel    drop held fetches some host could not verify
    install   write held, verified fetches into their host-RAM slots (``TransferEngine.install``:
              one program per layer group; the same on every host, since the scheduler plans an
              install only once every host reported its bytes verified); completed like a save
    publish   copy READY chunks out of their slots (one read program per layer group); a
              background writer asks the store which of this host's objects exist and publishes
              the others (put-if-absent), under a byte bound on its queue (a full queue drops the
              write, counted) and an optional bandwidth bound
    probe     background: which of this host's objects exist (one exists-many per probe)
    fetch     background: read each object, verify header and checksum against the name asked
              for (namespace, key, group, shard, length), hold the payload, report it

Nothing here waits on the store: the main thread only dispatches programs and hands work to the
tier's threads, and whatever the store does (slow, gone, corrupt) only changes what this host
reports; the scheduler turns late answers into misses. Every object is this host's part of a
chunk only: ``ObjectId(namespace, key, group, part, parts)``, the key the chunk's content hash and
the group its KV cache group (the plan names both, as vLLM's offload key is a block hash and a
group: with several groups every group's chunk of a block is its own object). The namespace digests what changes
the bytes, with the scheduler's hash scope (vLLM's block-hash seed), the operator's salt and the
object format:

* one scheduler: the part is the host (``host`` of ``hosts``), and the namespace digests the
  deployment fingerprint this host computes (model, every layer group's shape, dtype and
  sharding, block size, hosts, chunk bytes: worker/persistence.py:fingerprint);
* under DPScheduler each DP rank has its own stage (``rank``), acting on its rank's plan only: a
  rank's chunk lives on the devices of its batch shard only (backend/slot_table.py), so its
  objects hold those devices' pieces (``TransferEngine.rows_to_payloads``) and installs write
  them into that shard's rows (``TransferEngine.install``). The part is this host's place among
  the processes holding a device of the shard, and the namespace digests the model, the block
  size and the rank's layout (``TransferEngine.shard_part``: each group's row shape and dtype,
  each holding process's pieces; with a state pool, each pool's), not the rank: every rank
  computes the same KV for the same tokens, so an object any rank of any replica wrote is read by
  every rank whose layout is equal (another DP size, TP size or split over hosts is another
  namespace). A host holding no device of
  the rank keeps no object for it: it answers every probe "present", every fetch "verified" with
  no bytes, writes nothing, and dispatches the same programs as every host.

A GDN/mamba hybrid has two host slot pools (worker/pooled_engine.py): KV chunks (one block of every
attention array) and state chunks (one row of every state array, another size). The stage acts on
both, each through its pool's transfer engine, as the disk stage does: which pool a chunk is in is
what the plan says (``DiskBatch.pools`` of a publish and a fetch, the fourth element of a probe),
the one mechanism. A publish reads its pool's store, a fetch is verified against its pool's chunk
size and installed into its pool's store, and the object's name and header carry the pool
(``ObjectId.pool``), so a state chunk is never read as a KV chunk or the reverse. A state chunk's
slot is the plan's state slot moved into the state store by the placement
(``Placement.state_offset``), as the disk stage places it; each pool's rows are dispatched in pool
order, pool 0's first. Under DPScheduler a rank's state chunks are its state objects exactly as its
KV chunks are its KV objects: its batch shard's pieces of the row (``rows_to_payloads(rows,
rank)``), installed as rows of that shard, its state slot placed by its share of the state store
(``Placement.state_offset``), and the rank's namespace digests the state pool's layout beside the
KV pool's (``shard_part`` of each): another state row shape, dtype or split is another namespace,
so a rank reads a state object another rank wrote only where the bytes are the same (as for KV).
Both pools of a rank are held by the same processes (refused otherwise: one part names both).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent import futures

import numpy as np
from typing_extensions import override

from tpuoffload import counters as C
from tpuoffload.backend.shared_store import (FORMAT_VERSION, ObjectError, ObjectId, SharedStore, SharedURL,
                                             StoreUnavailable, decode_object, encode_header, open_store)
from tpuoffload.messages import DiskBatch, SharedPlan, SharedReport, id_ranges, unpack_keys
from tpuoffload.worker.tier import Placement, WorkerTier
from tpuoffload.worker.transfer_engine import TransferEngine

logger = logging.getLogger(__name__)

_MISS = {ObjectError.ABSENT: C.SHARED_MISS_ABSENT, ObjectError.SHORT: C.SHARED_MISS_SHORT,
         ObjectError.CORRUPT: C.SHARED_MISS_CORRUPT, ObjectError.FOREIGN: C.SHARED_MISS_FOREIGN,
         ObjectError.UNAVAILABLE: C.SHARED_MISS_UNAVAILABLE}


def namespace(deployment: str, scope: str, salt: str) -> bytes:
    """The 16-byte namespace of every object of this host (module doc)."""
    text = json.dumps({"deployment": deployment, "scope": scope, "salt": salt, "format": FORMAT_VERSION},
                      sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


class SharedStage(WorkerTier):
    """The worker's "shared" tier (worker/tier.py)."""

    name = "shared"
    READERS = 4  # background threads reading (probes, fetches)

    def __init__(self, engines: Sequence[TransferEngine], spec: SharedURL, host: int, deployment: str,
                 store: SharedStore | None = None, before_donate: Callable[[], None] = lambda: None,
                 rank: int = 0) -> None:
        """``engines``: the transfer engine of each host slot pool (pool 0's alone without a state
        pool); ``deployment``: this host's deployment fingerprint (JSON); ``store``: the backend
        (tests pass one; default: the one ``spec`` names); ``rank``: the DP rank (batch shard) whose
        plans it acts on (module doc)."""
        engine = engines[0]
        self.engines = tuple(engines)
        self.engine = engine
        self.spec = spec
        self.host = host
        self.rank = rank
        # Each pool's bytes of one chunk on this host (its pieces of the rank's batch shard).
        self.pool_bytes = tuple(e.disk_chunk_bytes(rank) for e in self.engines)
        self.payload_bytes = self.pool_bytes[0]
        self._ranked = engine.slot_table.shards > 1  # under DPScheduler: named by the rank's layout
        if self._ranked:
            self.part, self.parts, layout = engine.shard_part(rank)
            fp = json.loads(deployment)
            named = {"model": fp["model"], "block_size": fp["block_size"], "parts": self.parts, "rank_layout": layout}
            if len(self.engines) > 1:  # a state pool: its layout names the objects too (absent: KV names kept)
                part, parts, named["state_layout"] = self.engines[1].shard_part(rank)
                if (part, parts) != (self.part, self.parts):
                    raise ValueError(f"rank {rank}'s state pool is held by other processes than its KV pool (part "
                                     f"{part} of {parts}, KV part {self.part} of {self.parts}): one object part "
                                     "per host and rank names both pools' objects")
            self.deployment = json.dumps(named, sort_keys=True)
        else:
            self.part, self.parts, self.deployment = host, 0, deployment  # parts: the plan's hosts
        self.store = store if store is not None else open_store(spec)
        self._before_donate = before_donate
        self._namespaces: dict[tuple[str, int], bytes] = {}  # (scope, hosts) -> namespace; main thread
        # fetch save id -> (pool, slot in that pool's store, save id placed); main thread
        self._slots: dict[int, tuple[int, int, int]] = {}
        self._readers = futures.ThreadPoolExecutor(self.READERS, thread_name_prefix="shared-read")
        self._writer = futures.ThreadPoolExecutor(1, thread_name_prefix="shared-write")
        self._lock = threading.Lock()  # guards everything below (the tier's threads and the main thread)
        self._held: dict[int, np.ndarray] = {}  # fetch save id -> verified payload
        self._reading: set[int] = set()  # fetch save ids submitted, not yet read
        self._cancelled: set[int] = set()  # of those, the ones cancelled meanwhile: dropped when read
        self._probed: list[tuple[int, bytes]] = []
        self._fetched: list[int] = []
        self._fetch_failed: list[int] = []
        self._queued_bytes = 0
        self._pending = 0  # background tasks not finished
        self._next_write = 0.0  # the bandwidth bound's clock (writer thread)
        self._counts: Counter[str] = Counter()
        logger.info("tpuoffload shared tier (host %d): %s store at %s; objects of %s bytes (per slot pool)", host,
                    self.store.kind, spec.location, "/".join(map(str, self.pool_bytes)))

    def _namespace(self, part: SharedPlan) -> bytes:
        key = (part.scope, part.hosts)
        ns = self._namespaces.get(key)
        if ns is None:
            scope = part.scope if self._ranked else f"{part.scope}/{part.hosts}"  # (ranked: parts in the layout)
            ns = self._namespaces[key] = namespace(self.deployment, scope, self.spec.namespace)
        return ns

    def _ids(self, ns: bytes, keys: bytes, groups: bytes, pools: bytes, hosts: int) -> list[ObjectId]:
        """The objects of this host's part of chunks with these content keys, of these KV cache
        groups (b"": group 0 each), in these host slot pools (b"": the KV pool each): as vLLM's
        offload key, a block hash and a group, and the pool whose chunk it holds."""
        parts = self.parts or hosts
        rows = unpack_keys(keys)
        of = np.frombuffer(groups, np.uint8).tolist() if groups else [0] * len(rows)
        pool = np.frombuffer(pools, np.int8).tolist() if pools else [0] * len(rows)
        return [ObjectId(ns, row.tobytes(), g, max(self.part, 0), parts, p) for row, g, p in zip(rows, of, pool)]

    def _place(self, pool: int, slot: int, placement: Placement) -> int:
        """A plan's slot of ``pool`` in that pool's store (``Placement``)."""
        return slot + (placement.slot_offset if pool == 0 else placement.state_offset)

    # ---------------------------------------------------------------- per step (main thread)
    @override
    def act(self, step: int, part: SharedPlan | None, placement: Placement = Placement()) -> None:
        if part is None:
            return
        try:
            self._act(part, placement)
        except Exception:  # what failed is reported (failed fetches; publishes are best effort)
            logger.exception("tpuoffload: shared-tier step failed on host %d", self.host)

    def _act(self, part: SharedPlan, placement: Placement) -> None:
        ns = self._namespace(part)
        if part.cancel:  # the scheduler drops a fetch on one host's failure: the others may still read
            with self._lock:
                for sid in part.cancel:
                    if sid in self._reading:
                        self._cancelled.add(sid)
                    else:
                        self._held.pop(sid, None)
            for sid in part.cancel:
                self._slots.pop(sid, None)
        if part.install:
            self._install(part.install)
        if len(part.publish):
            oids = self._ids(ns, part.publish.keys, part.publish_groups, part.publish.pools, part.hosts)
            self._publish(part.publish, oids, placement)
        for pid, keys, groups, pools in part.probe:
            self._submit(self._readers, self._probe, pid, self._ids(ns, keys, groups, pools, part.hosts))
        if len(part.fetch):
            oids = self._ids(ns, part.fetch.keys, part.fetch_groups, part.fetch.pools, part.hosts)
            pools = part.fetch.pool_of().tolist()
            for sid, slot, oid, pool in zip(part.fetch.save_ids, part.fetch.slots, oids, pools):
                self._slots[sid] = (pool, self._place(pool, slot, placement), sid + placement.id_offset)
                with self._lock:
                    self._reading.add(sid)
                self._submit(self._readers, self._fetch, sid, oid, self.pool_bytes[pool])

    def _install(self, save_ids: tuple[int, ...]) -> None:
        """Every host installs the same save ids into the same slots, each pool's into its own
        store, pool 0's first; a host without the bytes (it never should have: it reported them
        verified) writes zeros and reports the save failed."""
        with self._lock:
            payloads = [self._held.pop(sid, None) for sid in save_ids]
        pools, slots, ids = (np.array(x, np.int64) for x in zip(*(self._slots.pop(sid) for sid in save_ids)))
        self._before_donate()  # installs donate the stores
        for pool, engine in enumerate(self.engines):
            rows = np.flatnonzero(pools == pool)
            for piece in engine.pieces(len(rows)):
                at = rows[piece]
                engine.install([payloads[r] for r in at.tolist()], slots[at].tolist(), ids[at].tolist(),
                               self.rank)

    def _publish(self, batch: DiskBatch, oids: list[ObjectId], placement: Placement) -> None:
        pools = batch.pool_of()
        for pool, engine in enumerate(self.engines):  # pool 0's rows first (invariant 1)
            rows = np.flatnonzero(pools == pool).tolist()
            slots = [self._place(pool, batch.slots[r], placement) for r in rows]
            save_ids = [batch.save_ids[r] + placement.id_offset for r in rows]
            for piece in engine.pieces(len(slots)):
                got, ok = engine.read_slots(slots[piece], save_ids[piece])  # on every host (invariant 1)
                if self.part < 0:  # no device of the rank here: nothing of it to write
                    continue
                chosen = [oids[r] for r, good in zip(rows[piece], ok) if good]
                size = len(ok) * self.pool_bytes[pool]
                with self._lock:
                    if self._queued_bytes + size > self.spec.queue_bytes:
                        self._counts[C.SHARED_WRITE_DROPPED] += len(chosen)
                        continue
                    self._queued_bytes += size
                self._submit(self._writer, self._write, pool, got, ok, chosen, size)

    def _submit(self, pool: futures.ThreadPoolExecutor, fn, *args) -> None:
        with self._lock:
            self._pending += 1
        pool.submit(self._run, fn, *args)

    def _run(self, fn, *args) -> None:
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - a bug must not kill the tier's threads silently
            logger.exception("tpuoffload: shared-tier background task failed on host %d", self.host)
        finally:
            with self._lock:
                self._pending -= 1

    # ---------------------------------------------------------------- background
    def _probe(self, pid: int, oids: list[ObjectId]) -> None:
        if self.part < 0:  # no device of the rank here: this host has every part it keeps
            with self._lock:
                self._probed.append((pid, bytes([1]) * len(oids)))
            return
        try:
            present = bytes(np.array(self.store.exists_many([o.name for o in oids]), dtype=np.uint8))
        except StoreUnavailable as e:
            logger.warning("tpuoffload shared tier (host %d): lookup failed: %s", self.host, e)
            present = bytes(len(oids))
            with self._lock:
                self._counts[C.SHARED_PROBE_UNAVAILABLE] += 1
        with self._lock:
            self._probed.append((pid, present))

    def _fetch(self, sid: int, oid: ObjectId, payload_bytes: int) -> None:
        """Read and verify ``oid``, a chunk of ``payload_bytes`` on this host (its pool's size)."""
        t0 = time.monotonic()
        try:
            if self.part < 0:  # no device of the rank here: no bytes to read, verified as they are
                payload, error, detail = memoryview(b""), None, ""
            else:
                data = self.store.get(oid.name)
                payload, error, detail = decode_object(oid, data, payload_bytes)
        except StoreUnavailable as e:
            payload, error, detail = None, ObjectError.UNAVAILABLE, str(e)
        took = time.monotonic() - t0
        if error is not None and error is not ObjectError.ABSENT:
            logger.warning("tpuoffload shared tier (host %d): object %s is a miss (%s: %s)", self.host, oid.name,
                           error.value, detail)
        with self._lock:
            self._counts[C.SHARED_READ_SECONDS] += took
            self._reading.discard(sid)
            cancelled = sid in self._cancelled  # dropped while it was read: nothing to hold or report
            self._cancelled.discard(sid)
            if error is None:
                if self.part >= 0:
                    self._counts[C.SHARED_READ_CHUNKS] += 1
                    self._counts[C.SHARED_READ_BYTES] += payload_bytes
                if not cancelled:
                    self._held[sid] = np.frombuffer(payload, np.uint8)
                    self._fetched.append(sid)
            else:
                self._counts[_MISS[error]] += 1
                if not cancelled:
                    self._fetch_failed.append(sid)

    def _write(self, pool: int, rows, ok: list[bool], oids: list[ObjectId], size: int) -> None:
        t0 = time.monotonic()
        counts: Counter[str] = Counter()
        try:
            payloads = [p for p, good in zip(self.engines[pool].rows_to_payloads(rows, self.rank), ok) if good]
            present = self.store.exists_many([o.name for o in oids])  # deduplicated against the store
            counts[C.SHARED_WRITE_EXISTS] += sum(present)
            for oid, payload, there in zip(oids, payloads, present):
                if there:
                    continue
                self._throttle(len(payload))
                if self.store.put_if_absent(oid.name, encode_header(oid, payload), payload):
                    counts[C.SHARED_WRITTEN_CHUNKS] += 1
                    counts[C.SHARED_WRITTEN_BYTES] += len(payload)
                else:
                    counts[C.SHARED_WRITE_EXISTS] += 1
        except StoreUnavailable as e:
            logger.warning("tpuoffload shared tier (host %d): writes failed: %s", self.host, e)
            counts[C.SHARED_WRITE_FAILED] += len(oids) - counts[C.SHARED_WRITTEN_CHUNKS] - counts[C.SHARED_WRITE_EXISTS]
        except Exception as e:  # noqa: BLE001 - e.g. the server refusing a write (out of memory)
            logger.warning("tpuoffload shared tier (host %d): writes failed: %s: %s", self.host, type(e).__name__, e)
            counts[C.SHARED_WRITE_FAILED] += len(oids) - counts[C.SHARED_WRITTEN_CHUNKS] - counts[C.SHARED_WRITE_EXISTS]
        with self._lock:
            self._queued_bytes -= size
            counts[C.SHARED_WRITE_SECONDS] += time.monotonic() - t0
            self._counts.update(counts)

    def _throttle(self, nbytes: int) -> None:
        """The bandwidth bound: writes start no faster than ``write_bytes_per_s`` (writer thread)."""
        rate = self.spec.write_bytes_per_s
        if rate is None:
            return
        now = time.monotonic()
        start = max(now, self._next_write)
        self._next_write = start + nbytes / rate
        if start > now:
            time.sleep(start - now)

    # ---------------------------------------------------------------- reports
    @override
    def report(self) -> SharedReport | None:
        with self._lock:
            probed, fetched, failed = self._probed, self._fetched, self._fetch_failed
            self._probed, self._fetched, self._fetch_failed = [], [], []
        if not (probed or fetched or failed):
            return None
        return SharedReport(tuple(probed), id_ranges(fetched), id_ranges(failed))

    @override
    def take_counters(self) -> Counter[str]:
        with self._lock:
            out, self._counts = self._counts, Counter()
        return out

    def pending(self) -> int:
        with self._lock:
            return self._pending

    @override
    def wait_idle(self, timeout: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.pending():
                return True
            time.sleep(0.005)
        return False

    @override
    def idle_report(self) -> dict[str, int]:
        with self._lock:
            return {"shared_pending": self._pending, "shared_held": len(self._held)}

    @override
    def close(self) -> None:
        self._readers.shutdown(wait=True)
        self._writer.shutdown(wait=True)
        self.store.close()
