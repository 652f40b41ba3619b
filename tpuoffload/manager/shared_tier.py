"""The shared tier, the scheduler's side: lookups, fetches into host RAM, and what to publish.

One store (a shared directory, a Valkey/Redis server) serves every replica of a deployment; each
host of a replica writes and reads only its own shard of a chunk, as its own object
(worker/shared_stage.py, backend/shared_store.py). The scheduler never talks to the store: it
decides, and every host carries out the same plan. The same agreement path as the disk tier's
fetch (manager/disk_index.py), with one more round so that nothing waits on the store:

    lookup (get_num_new_matched_tokens): the request's host-RAM hit stops before its last full
        block -> the request waits (vLLM is told "ask again") and a probe of the blocks after the
        hit goes into the next plan (``SharedPlan.probe``)
    every host checks, in the background, which of its shard objects exist and reports it; the
        chunks are the leading run that every host has (any host missing one: a miss there, on
        every host). A probe not answered by every host within the store's timeout is a miss.
    plan (with the step's loads pinned): host-RAM slots claimed through ``SavePlanner.claim`` (one
        RAM ledger batch) -> ``SharedPlan.fetch``; every host reads its objects in the background,
        verifies header and checksum and holds the bytes, and reports verified or failed
    all hosts verified -> ``SharedPlan.install``: every host writes the held bytes into the slots
        in the same step (the same programs everywhere; no host loads while another recomputes);
        they confirm it like a save, the RAM ledger makes the chunks READY, and the request's next
        lookup loads them like any host-RAM hit. Any host failed, or no answer in time ->
        ``SharedPlan.cancel`` and the RAM saves are dropped: a miss on every host.

Publishing: every chunk that becomes READY in host RAM from a save (not from a fetch) is queued
once (a bounded memory of keys published or found present); each plan takes at most
``PUBLISH_PER_STEP`` of those still READY in their slots (``SharedPlan.publish``); every host
reads its shard out of the slot and writes it in the background, after asking the store which
objects it holds already (worker/shared_stage.py).

After ``reset_cache()`` (new weights under the same model name) the tier is off for the rest of
the engine's life: the store cannot tell which weights wrote an object. Operators who update
weights change the URL's ``namespace`` parameter when they restart.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from typing_extensions import override

from tpuoffload import counters as C
from tpuoffload.messages import DiskBatch, SharedPlan, SharedReport, id_ranges, pack_keys
from tpuoffload.manager.hash_table import HashKeys, PackedHashes
from tpuoffload.manager.index import READY
from tpuoffload.manager.ledger import CompletionLedger
from tpuoffload.manager.save_planner import SavePlanner
from tpuoffload.manager.tier import Tier

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from tpuoffload.manager.ledger import Resolved

logger = logging.getLogger(__name__)

_NONE = np.zeros(0, dtype=np.int64)


def hash_scope() -> str:
    """The scheduler's part of the objects' namespace: a digest of vLLM's NONE_HASH, the seed of
    every block hash (it differs with the hash function and with PYTHONHASHSEED), so replicas whose
    block hashes cannot agree never share a namespace. Read when the first plan needs it (vLLM's
    engine core sets it before any request is hashed)."""
    from vllm.v1.core import kv_cache_utils

    seed = getattr(kv_cache_utils, "NONE_HASH", None)
    if seed is None:
        raise RuntimeError("vLLM's NONE_HASH is not initialised yet (init_none_hash)")
    return hashlib.blake2b(bytes(seed), digest_size=16).hexdigest()


@dataclass
class _Wait:
    """A request waiting for the shared tier: its keys from the first block after its host-RAM
    hit (``start``), the host-RAM part of the hit (``in_ram``, pinned while its fetch is in
    flight), and where it is (PROBING -> WANTED -> IN_FLIGHT -> DONE)."""

    request: "Request"
    start: int
    hashes: PackedHashes  # blocks start.. (vLLM's hashes; group 0)
    in_ram: PackedHashes
    state: int = 0
    probe: int = -1
    found: int = 0  # blocks every host's store holds, from ``start``
    tries: int = 0
    held: np.ndarray = field(default_factory=lambda: _NONE)
    left: int = 0  # fetched chunks not resolved yet
    forgotten: bool = False  # finished while its fetch was in flight: dropped once it resolves


class SharedTierPlanner(Tier):
    """The shared tier as a ``Tier`` (module doc). One KV cache group only
    (config.LIMITS refuses several)."""

    name = "shared"
    PROBING, WANTED, IN_FLIGHT, DONE = 0, 1, 2, 3
    MAX_PROBE_BLOCKS = 1024  # blocks looked up per request admission
    PUBLISH_PER_STEP = 256  # chunks a plan asks the hosts to publish
    MAX_TRIES = 8  # plans in which no host-RAM slot was free for a wanted fetch before giving up
    MAX_WAITS = 64  # plans a wanted fetch waits for chunks of its hit that are being saved or fetched
    REMEMBERED = 1 << 18  # keys remembered as published (not queued again) ...
    MISSES_REMEMBERED = 1 << 14  # ... and as missing on the last lookup (not looked up again soon)

    def __init__(self, saves: SavePlanner, ram_ledger: CompletionLedger, num_hosts: int, block_size: int,
                 counters: Counter[str], clock: Callable[[], float], timeout_s: float,
                 forget_lookup: Callable[[str], object]) -> None:
        self.saves, self.ram = saves, saves.index
        self.ram_ledger = ram_ledger  # a fetch no host can install is dropped through it
        self.num_hosts = num_hosts
        self.block_size = block_size
        self.counters = counters
        self.clock = clock
        self.timeout_s = timeout_s
        self._forget_lookup = forget_lookup
        self._scope: str | None = None
        self.enabled = True
        self._waits: dict[str, _Wait] = {}
        self._probes: dict[int, tuple[str, bytes, float, dict[int, np.ndarray]]] = {}  # id -> (req, keys, deadline, answers)
        self._next_probe = 0
        self._new_probes: list[tuple[int, bytes]] = []
        self._fetch_batches: list[DiskBatch] = []
        self._fetches: dict[int, tuple[str, float, set[int]]] = {}  # RAM save id -> (req, deadline, hosts verified)
        self._installing: set[int] = set()  # save ids sent to install, until the RAM ledger resolves them
        self._install: list[int] = []
        self._cancel: list[int] = []
        self._publish: deque[tuple[int, int, int, int]] = deque()  # (slot, save id, k1, k2)
        self._published: OrderedDict[tuple[int, int], None] = OrderedDict()
        self._missing: OrderedDict[bytes, float] = OrderedDict()  # first key of a lookup that missed -> until

    def _keys(self, hashes: PackedHashes) -> bytes:
        keys = HashKeys.of(hashes)
        return pack_keys(keys.k1, keys.k2)

    # ---------------------------------------------------------------- lookups
    @override
    def wants(self, request: "Request", local_blocks: int, ram_hits: int) -> bool:
        if not self.enabled:
            return False
        rid = request.request_id
        wait = self._waits.get(rid)
        if wait is not None:
            return wait.state != self.DONE
        start = local_blocks + ram_hits
        limit = min((request.num_tokens - 1) // self.block_size, start + self.MAX_PROBE_BLOCKS)
        if limit <= start:
            return False
        hashes = request.block_hashes
        packed = PackedHashes.of(hashes[start:limit])
        keys = self._keys(packed)
        until = self._missing.get(keys[:16])
        if until is not None:
            if until > self.clock():
                return False
            del self._missing[keys[:16]]
        if self.ram.find(HashKeys.of(PackedHashes(packed.buf[:packed.width], packed.width)))[0] >= 0:
            return False  # being saved in host RAM right now: a host-RAM hit soon
        pid = self._next_probe
        self._next_probe += 1
        self._probes[pid] = (rid, keys, self.clock() + self.timeout_s, {})
        self._new_probes.append((pid, keys))
        self._waits[rid] = _Wait(request, start, packed, PackedHashes.of(hashes[local_blocks:start]), self.PROBING, pid)
        self.counters[C.SHARED_PROBES] += 1
        return True

    @override
    def forget(self, req_id: str) -> None:
        wait = self._waits.get(req_id)
        if wait is None:
            return
        if wait.state == self.IN_FLIGHT:  # its fetch resolves first
            wait.forgotten = True
            return
        del self._waits[req_id]
        self._probes.pop(wait.probe, None)

    def _done(self, rid: str) -> None:
        wait = self._waits.get(rid)
        if wait is not None:
            wait.state = self.DONE
            self._forget_lookup(rid)  # the next lookup sees what host RAM holds now

    def _missed(self, keys: bytes) -> None:
        self._missing[keys[:16]] = self.clock() + self.timeout_s
        if len(self._missing) > self.MISSES_REMEMBERED:
            self._missing.popitem(last=False)

    # ---------------------------------------------------------------- per step
    @override
    def start_step(self, step: int) -> None:
        now = self.clock()
        for pid, (rid, keys, deadline, _) in list(self._probes.items()):
            if now > deadline:
                del self._probes[pid]
                self.counters[C.SHARED_PROBE_TIMEOUTS] += 1
                self._done(rid)
        late = [sid for sid, (_, deadline, _) in self._fetches.items() if now > deadline and sid not in self._installing]
        self._drop_fetches(late)

    @override
    def plan_into_ram(self, step: int) -> None:
        """Fetches of the chunks found since the last plan (module doc); the host-RAM part of each
        hit stays pinned until its fetch resolves, as the disk tier's does."""
        for rid, wait in self._waits.items():
            if wait.state != self.WANTED:
                continue
            width = wait.hashes.width
            keys = HashKeys.of(PackedHashes(wait.hashes.buf[:wait.found * width], width))
            named = self.ram.find(keys) >= 0  # in host RAM meanwhile (saved, or another request's fetch)
            lead = len(named) if named.all() else int(named.argmin())
            if not (self.ram.ready_slots(keys.take(slice(0, lead))) >= 0).all():
                wait.tries += 1  # still being saved or fetched: its READY chunks will extend the hit
                if wait.tries >= self.MAX_WAITS:
                    self._done(rid)
                continue
            m = len(named) - lead if not named[lead:].any() else int(named[lead:].argmax())
            if m == 0:
                self._done(rid)
                continue
            held = self.ram.ready_slots(HashKeys.of(wait.in_ram))
            held = np.concatenate((held[held >= 0], self.ram.ready_slots(keys.take(slice(0, lead)))))
            self.ram.pin(held)
            claim = self.saves.claim(PackedHashes(wait.hashes.buf[lead * width:(lead + m) * width], width), step)
            if not len(claim.slots):
                self.ram.unpin(held)
                wait.tries += 1
                if wait.tries >= self.MAX_TRIES:
                    self._done(rid)
                continue
            n, base = len(claim.slots), claim.first_save_id
            self.ram.events.record(claim.slots, claim.keep, [(wait.request, wait.start + lead, m, 0)])  # KV events
            deadline = self.clock() + 2 * self.timeout_s
            for sid in range(base, base + n):
                self._fetches[sid] = (rid, deadline, set())
            wait.held, wait.left, wait.state = held, n, self.IN_FLIGHT
            self._fetch_batches.append(DiskBatch(tuple(claim.slots.tolist()), range(base, base + n),
                                                 keys=pack_keys(claim.keys.k1, claim.keys.k2)))
            self.counters[C.SHARED_FETCHES_ISSUED] += n

    @override
    def finish_step(self, step: int) -> SharedPlan | None:
        if not self.enabled:  # after a reset: only what the hosts hold goes
            cancel, self._cancel = tuple(self._cancel), []
            return SharedPlan(self._scope or "", self.num_hosts, cancel=cancel) if cancel else None
        probes, self._new_probes = tuple(self._new_probes), []
        install, self._install = tuple(self._install), []
        cancel, self._cancel = tuple(self._cancel), []
        fetch = _concat(self._fetch_batches)
        self._fetch_batches = []
        publish = self._take_publish()
        if not (probes or install or cancel or len(fetch) or len(publish)):
            return None
        if self._scope is None:
            self._scope = hash_scope()
        return SharedPlan(self._scope, self.num_hosts, probes, publish, fetch, install, cancel)

    def _take_publish(self) -> DiskBatch:
        slots, ids, keys = [], [], []
        while self._publish and len(slots) < self.PUBLISH_PER_STEP:
            slot, sid, k1, k2 = self._publish.popleft()
            if self.ram.save_id_of(slot) == sid and self.ram.state_of(slot) == READY:  # (the save id names the key)
                slots.append(slot)
                ids.append(sid)
                keys.append((k1, k2))
        if not slots:
            return DiskBatch()
        self.counters[C.SHARED_PUBLISH_ISSUED] += len(slots)
        k = np.array(keys, dtype=np.uint64)
        return DiskBatch(tuple(slots), tuple(ids), keys=pack_keys(k[:, 0], k[:, 1]))

    # ---------------------------------------------------------------- reports
    @override
    def on_report(self, parts: dict[int, SharedReport]) -> None:
        failed: list[int] = []
        for host, part in parts.items():
            if not 0 <= host < self.num_hosts:
                continue
            for pid, present in part.probed:
                probe = self._probes.get(pid)
                if probe is not None:
                    probe[3][host] = np.frombuffer(present, np.uint8).astype(bool)
            for a, b in part.fetched:
                for sid in range(a, b):
                    fetch = self._fetches.get(sid)
                    if fetch is not None:
                        fetch[2].add(host)
            failed.extend(sid for a, b in part.fetch_failed for sid in range(a, b) if sid in self._fetches)
        for pid, (rid, keys, _, answers) in list(self._probes.items()):
            if len(answers) < self.num_hosts:
                continue
            del self._probes[pid]
            everywhere = np.logical_and.reduce([answers[h] for h in range(self.num_hosts)])
            n = len(everywhere) if everywhere.all() else int(everywhere.argmin())
            wait = self._waits.get(rid)
            if wait is None:
                continue
            if n == 0:
                self._missed(keys)
                self._done(rid)
            else:
                self.counters[C.SHARED_PROBE_HIT_CHUNKS] += n
                wait.found, wait.state = n, self.WANTED
        self._drop_fetches(failed)
        for sid, (_, _, hosts) in self._fetches.items():
            if len(hosts) == self.num_hosts and sid not in self._installing:
                self._installing.add(sid)
                self._install.append(sid)

    def _drop_fetches(self, sids: list[int]) -> None:
        """Fetches some host could not verify, or not in time: the hosts drop what they hold, and
        the RAM saves fail (for every host at once: the ledger drops a save any host failed)."""
        sids = sorted(set(sids) - self._installing)
        if not sids:
            return
        for sid in sids:
            self._installing.add(sid)  # resolved by the RAM ledger now
        self._cancel.extend(sids)
        self.ram_ledger.report(0, failed=id_ranges(sids))

    @override
    def on_resolved(self, resolved: "Resolved") -> None:
        fetched: set[int] = set()
        for ids, ok in ((resolved.ready_ids, True), (resolved.dropped_ids, False)):
            for sid in ids.tolist():
                fetch = self._fetches.pop(sid, None)
                if fetch is None:
                    continue
                fetched.add(sid)
                self._installing.discard(sid)
                self.counters[C.SHARED_FETCHES_READY if ok else C.SHARED_FETCHES_FAILED] += 1
                wait = self._waits.get(fetch[0])
                if wait is None:
                    continue
                wait.left -= 1
                if wait.left <= 0:
                    self.ram.unpin(wait.held)
                    wait.held = _NONE
                    if wait.forgotten:
                        del self._waits[fetch[0]]
                    else:
                        self._done(fetch[0])
        if self.enabled and len(resolved.ready_ids):
            self._queue_publish(resolved, fetched)

    def _queue_publish(self, resolved: "Resolved", fetched: set[int]) -> None:
        """Chunks saved into host RAM (not fetched from the store) go to the store once."""
        slots, ids = resolved.ready_slots, resolved.ready_ids
        keys = self.ram.keys_of(np.asarray(slots, dtype=np.int64))
        for slot, sid, k1, k2 in zip(slots.tolist(), ids.tolist(), keys.k1.tolist(), keys.k2.tolist()):
            key = (k1, k2)
            if key in self._published or sid in fetched:
                continue
            self._published[key] = None
            if len(self._published) > self.REMEMBERED:
                self._published.popitem(last=False)
            self._publish.append((slot, sid, k1, k2))

    @override
    def reset(self, next_save_id: int) -> None:
        """Off for good (module doc): nothing is looked up, fetched or published any more; fetches in
        flight are dropped by the RAM index's revocation."""
        if self.enabled:
            logger.warning("tpuoffload shared tier: off after a connector reset (the store cannot tell which "
                           "weights wrote an object); restart with another shared_url namespace to use it again")
        self.enabled = False
        for wait in self._waits.values():
            self.ram.unpin(wait.held)
            wait.held = _NONE
        self._cancel.extend(sid for sid in self._fetches if sid not in self._installing)
        self._waits = {rid: w for rid, w in self._waits.items() if w.state == self.IN_FLIGHT}
        for w in self._waits.values():
            w.state = self.DONE
        self._probes.clear()
        self._new_probes = []
        self._publish.clear()

    @override
    def leak_report(self) -> dict[str, int]:
        return {"shared_probes": len(self._probes), "shared_fetches": len(self._fetches),
                "shared_waiting": sum(w.state != self.DONE for w in self._waits.values())}


def _concat(batches: list[DiskBatch]) -> DiskBatch:
    if not batches:
        return DiskBatch()
    if len(batches) == 1:
        return batches[0]
    return DiskBatch(tuple(s for b in batches for s in b.slots), tuple(i for b in batches for i in b.save_ids),
                     keys=b"".join(b.keys for b in batches))
