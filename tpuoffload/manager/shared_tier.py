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

Objects are named as vLLM's offload key names a block, by content hash and KV cache group: the
content key (vLLM's block hash) and the group travel apart in the plan. Several KV cache groups
(hybrid models, manager/kv_groups.py): a probe asks for every group's chunk of every block after
the host-RAM hit, and the hit the store extends is the one ``KVCacheGroups.hit_length`` decides
over host RAM and the store together, the rule host RAM's hits and the disk tier's fetches follow
(a full-attention group needs every block of it, a sliding-window group the window ending at its
boundary); each group's chunks of it that host RAM lacks are fetched, block by block (a cut keeps
an early prefix of every group). A host-RAM chunk's key has its group mixed in, so a publish takes
the group from the save that filled the slot (``note_saves``, by save id) and names the object by
the content key ``kv_groups.content_keys`` recovers; a chunk READY by any other way (a disk fetch)
is not published: its group is not known.

A GDN/mamba hybrid (manager/kv_groups.py) keeps its state chunks (one row of every state array, at a
block boundary) in a second host slot pool. The hit rule is host RAM's own: the attention chunks of
k blocks and the state chunk keyed by block k - 1, each from host RAM or the store, so the store
extends a hit only to a boundary where both the KV chunks before it and the state row at it are
available (a window of one block for the state group); the mirror groups probe and fetch nothing.
Each fetched chunk claims a slot of its group's pool (``SavePlanner.claim_pools``, the KV pool
first, as saves and disk fetches do), and every chunk the plan names says its pool
(``DiskBatch.pools`` of a publish and a fetch, a probe's pools), which the workers read the right
store with and put in the object's name (``ObjectId.pool``). ``note_saves`` tells a step's saved
blocks apart by pool and block id (a state row's id names an attention block too).

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
from tpuoffload.manager.events import candidate_layout
from tpuoffload.manager.hash_table import HashKeys, PackedHashes
from tpuoffload.manager.index import READY
from tpuoffload.manager.kv_groups import MIRROR, KVCacheGroups, chunk_keys, content_keys
from tpuoffload.manager.ledger import CompletionLedger
from tpuoffload.manager.save_planner import SavePlanner
from tpuoffload.manager.tier import Tier

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from tpuoffload.manager.ledger import Resolved
    from tpuoffload.manager.step_saves import SaveCandidates
    from tpuoffload.messages import SaveBatch

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
    """A request waiting for the shared tier: vLLM's hashes of its blocks from ``local`` (vLLM's
    own hit) on (``span``), probed from ``start`` (after its host-RAM hit), and where it is
    (PROBING -> WANTED -> IN_FLIGHT -> DONE)."""

    request: "Request"
    local: int
    start: int
    span: PackedHashes  # blocks local.. (vLLM's hashes)
    state: int = 0
    probe: int = -1
    stored: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), bool))  # (block of span, group): every host's store holds it
    tries: int = 0
    held: np.ndarray = field(default_factory=lambda: _NONE)
    left: int = 0  # fetched chunks not resolved yet
    forgotten: bool = False  # finished while its fetch was in flight: dropped once it resolves


class SharedTierPlanner(Tier):
    """The shared tier as a ``Tier`` (module doc), for one KV cache group or several, GDN/mamba state
    groups included."""

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
                 forget_lookup: Callable[[str], object], groups: KVCacheGroups = KVCacheGroups()) -> None:
        self.saves, self.ram = saves, saves.index
        self.groups = groups  # vLLM's KV cache groups: a hit is one every group can serve
        # The groups whose chunks are probed and fetched (a mamba group mirroring another: none).
        self._probed = np.array([g for g, w in enumerate(groups.windows) if w != MIRROR], dtype=np.int64)
        self._pools = groups.pool_of_groups()  # each group's host slot pool
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
        self._probes: dict[int, tuple[str, bytes, float, dict[int, np.ndarray]]] = {}  # id -> (req, first key, deadline, answers)
        self._next_probe = 0
        self._new_probes: list[tuple[int, bytes, bytes, bytes]] = []  # (probe id, keys, groups, pools)
        self._fetch_batches: list[tuple[DiskBatch, np.ndarray]] = []  # (batch, each chunk's group)
        self._fetches: dict[int, tuple[str, float, set[int]]] = {}  # RAM save id -> (req, deadline, hosts verified)
        self._installing: set[int] = set()  # save ids sent to install, until the RAM ledger resolves them
        self._install: list[int] = []
        self._cancel: list[int] = []
        self._publish: deque[tuple[int, int, int, int, int]] = deque()  # (slot, save id, content k1, k2, group)
        # Several groups: the group of each save in flight (save id -> group), from ``note_saves``.
        self._save_groups: dict[int, int] = {}
        self._published: OrderedDict[tuple[int, int], None] = OrderedDict()
        self._missing: OrderedDict[bytes, float] = OrderedDict()  # first key of a lookup that missed -> until

    def _chunk_keys(self, span: PackedHashes) -> np.ndarray:
        """The host-RAM keys of every probed group's chunk of every block of ``span``: (block,
        probed group, hash width) bytes, block by block."""
        n, width = len(span), span.width
        return np.stack([np.frombuffer(chunk_keys(span, int(g)).buf, np.uint8).reshape(n, width)
                         for g in self._probed], axis=1)

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
        first = HashKeys.of([hashes[start]])
        memo = pack_keys(first.k1, first.k2)
        until = self._missing.get(memo)
        if until is not None:
            if until > self.clock():
                return False
            del self._missing[memo]
        probe = self.groups.probe_key(hashes[start])
        if probe is not None:
            key = HashKeys.of([probe])
            if self.ram.find(key)[0] >= 0 and self.ram.ready_slots(key)[0] < 0:
                return False  # being saved in host RAM right now: a host-RAM hit soon
        probed = PackedHashes.of(hashes[start:limit])
        keys = HashKeys.of(probed)  # each block's content key, once per probed group
        groups = np.tile(self._probed, len(probed))
        k1, k2 = np.repeat(keys.k1, len(self._probed)), np.repeat(keys.k2, len(self._probed))
        pid = self._next_probe
        self._next_probe += 1
        self._probes[pid] = (rid, memo, self.clock() + self.timeout_s, {})
        self._new_probes.append((pid, pack_keys(k1, k2), self._groups_bytes(groups),
                                 self._pools_bytes(self._pools[groups])))
        self._waits[rid] = _Wait(request, local_blocks, start, PackedHashes.of(hashes[local_blocks:limit]),
                                 self.PROBING, pid)
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

    def _missed(self, memo: bytes) -> None:
        self._missing[memo] = self.clock() + self.timeout_s
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

    def _in_ram(self, wait: _Wait) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The chunks of the request's span, (block, probed group): their host-RAM keys (with the
        hash width as a last axis), READY slots (-1: none) and whether host RAM names them at all
        (READY, or being saved or fetched)."""
        keys = self._chunk_keys(wait.span)
        rows, cols, width = keys.shape
        flat = HashKeys.of(PackedHashes(keys.tobytes(), width))
        return (keys, self.ram.ready_slots(flat).reshape(rows, cols),
                (self.ram.find(flat) >= 0).reshape(rows, cols))

    def _hit_length(self, available: np.ndarray) -> int:
        """The longest hit every group can serve from the chunks ``available`` (block, probed
        group): ``KVCacheGroups.hit_length``, host RAM's own rule."""
        cols = dict(zip(self._probed.tolist(), available.T))
        none = np.zeros(len(available), bool)
        return self.groups.hit_length([cols.get(g, none) for g in range(self.groups.num)])

    def _part(self, n: int, rows: int) -> np.ndarray:
        """(block, probed group): the chunks a hit of ``n`` blocks loads (``first_blocks``)."""
        first = np.array(self.groups.first_blocks(n), dtype=np.int64)[self._probed]
        block = np.arange(rows)[:, None]
        return (block >= first[None, :]) & (block < n)

    @override
    def plan_into_ram(self, step: int) -> None:
        """Fetches of the chunks found since the last plan (module doc): each group's chunks of the
        longest hit host RAM and the store serve together that host RAM lacks; the host-RAM part of
        the hit stays pinned until its fetch resolves, as the disk tier's does."""
        for rid, wait in self._waits.items():
            if wait.state != self.WANTED:
                continue
            keys, slots, named = self._in_ram(wait)
            ready = slots >= 0
            base = self._hit_length(ready)
            n = self._hit_length(ready | (wait.stored & ~named))  # a chunk being saved or fetched: not again
            if n <= base:
                if self._hit_length(ready | wait.stored) > base:
                    wait.tries += 1  # still being saved or fetched: its READY chunks will extend the hit
                    if wait.tries >= self.MAX_WAITS:
                        self._done(rid)
                else:
                    self._done(rid)
                continue
            part = self._part(n, len(ready))
            need = part & ~ready  # block by block: a cut keeps an early prefix of every group
            held = slots[part & ready]
            self.ram.pin(held)
            groups = np.broadcast_to(self._probed, need.shape)[need]
            pools = self._pools[groups]  # each chunk into a slot of its own pool, the KV pool's first
            claim = self.saves.claim_pools(PackedHashes(keys[need].tobytes(), keys.shape[2]), pools, step)
            if not len(claim.slots):
                self.ram.unpin(held)
                wait.tries += 1
                if wait.tries >= self.MAX_TRIES:
                    self._done(rid)
                continue
            n, base = len(claim.slots), claim.first_save_id
            blocks = np.nonzero(need)[0]
            self.saves.record(claim, [(wait.request, wait.local + b, 1, g) for b, g in
                                      zip(blocks.tolist(), groups.tolist())])  # KV events
            groups, pools = groups[claim.keep], pools[claim.keep]
            deadline = self.clock() + 2 * self.timeout_s
            for sid in range(base, base + n):
                self._fetches[sid] = (rid, deadline, set())
            wait.held, wait.left, wait.state = held, n, self.IN_FLIGHT
            content = content_keys(claim.keys, groups)
            self._fetch_batches.append((DiskBatch(tuple(claim.slots.tolist()), range(base, base + n),
                                                  keys=pack_keys(content.k1, content.k2),
                                                  pools=self._pools_bytes(pools)), groups))
            self.counters[C.SHARED_FETCHES_ISSUED] += n

    def note_saves(self, candidates: "SaveCandidates", batch: "SaveBatch") -> None:
        """Several KV cache groups: the group of each chunk a step's saves claimed, by save id, for
        its publish (a host-RAM key has its group mixed in). A block id is one group's at a time,
        so the step's candidates name the group of each saved block; with a GDN/mamba state pool a
        block id is one group's per pool (a state row's id names an attention block too), so a
        saved chunk is found by its pool (its slot's) and its block id."""
        if not self.enabled or not len(batch):
            return
        _, _, _, groups = candidate_layout(candidates.origins)
        blocks = np.asarray(candidates.block_ids, np.int64)
        saved = np.asarray(batch.block_ids, np.int64)
        if candidates.pools is not None:  # (pool, block id) as one number: block ids are below 2**40
            blocks = blocks + (np.asarray(candidates.pools, np.int64) << 40)
            saved = saved + (self.ram.pool_of(np.asarray(batch.slots, np.int64)).astype(np.int64) << 40)
        order = np.argsort(blocks, kind="stable")
        at = order[np.searchsorted(blocks, saved, sorter=order)]
        self._save_groups.update(zip(np.asarray(batch.save_ids).tolist(), groups[at].tolist()))

    def _groups_bytes(self, groups) -> bytes:
        """A plan's groups of its chunks (b"": one KV cache group, every chunk group 0's)."""
        return np.asarray(groups, dtype=np.uint8).tobytes() if self.groups.several else b""

    def _pools_bytes(self, pools) -> bytes:
        """A plan's host slot pools of its chunks (b"": one pool, every chunk the KV pool's)."""
        return np.asarray(pools, dtype=np.int8).tobytes() if self.groups.num_pools > 1 else b""

    @override
    def finish_step(self, step: int) -> SharedPlan | None:
        if not self.enabled:  # after a reset: only what the hosts hold goes
            cancel, self._cancel = tuple(self._cancel), []
            return SharedPlan(self._scope or "", self.num_hosts, cancel=cancel) if cancel else None
        probes, self._new_probes = tuple(self._new_probes), []
        install, self._install = tuple(self._install), []
        cancel, self._cancel = tuple(self._cancel), []
        fetch = _concat([b for b, _ in self._fetch_batches])
        fetch_groups = self._groups_bytes(np.concatenate([g for _, g in self._fetch_batches])
                                          if self._fetch_batches else ())
        self._fetch_batches = []
        publish, publish_groups = self._take_publish()
        if not (probes or install or cancel or len(fetch) or len(publish)):
            return None
        if self._scope is None:
            self._scope = hash_scope()
        return SharedPlan(self._scope, self.num_hosts, probes, publish, fetch, install, cancel,
                          publish_groups=publish_groups, fetch_groups=fetch_groups)

    def _take_publish(self) -> tuple[DiskBatch, bytes]:
        slots, ids, keys, groups = [], [], [], []
        while self._publish and len(slots) < self.PUBLISH_PER_STEP:
            slot, sid, k1, k2, g = self._publish.popleft()
            if self.ram.save_id_of(slot) == sid and self.ram.state_of(slot) == READY:  # (the save id names the key)
                slots.append(slot)
                ids.append(sid)
                keys.append((k1, k2))
                groups.append(g)
        if not slots:
            return DiskBatch(), b""
        self.counters[C.SHARED_PUBLISH_ISSUED] += len(slots)
        k = np.array(keys, dtype=np.uint64)
        pools = self._pools_bytes(self.ram.pool_of(np.asarray(slots, np.int64)))
        return (DiskBatch(tuple(slots), tuple(ids), keys=pack_keys(k[:, 0], k[:, 1]), pools=pools),
                self._groups_bytes(groups))

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
        for pid, (rid, memo, _, answers) in list(self._probes.items()):
            if len(answers) < self.num_hosts:
                continue
            del self._probes[pid]
            wait = self._waits.get(rid)
            if wait is None:
                continue
            stored = np.zeros((len(wait.span), len(self._probed)), bool)
            probed = stored[wait.start - wait.local:]
            if all(len(answers[h]) == probed.size for h in range(self.num_hosts)):  # (else a host's answer is garbled: a miss)
                probed[:] = np.logical_and.reduce([answers[h] for h in range(self.num_hosts)]).reshape(probed.shape)
            # The chunks of the longest hit host RAM and the store serve together that the store adds.
            _, slots, _ = self._in_ram(wait)
            ready = slots >= 0
            found = int((self._part(self._hit_length(ready | stored), len(ready)) & stored & ~ready).sum())
            if found == 0:
                self._missed(memo)
                self._done(rid)
            else:
                self.counters[C.SHARED_PROBE_HIT_CHUNKS] += found
                wait.stored, wait.state = stored, self.WANTED
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
        groups = np.zeros(len(resolved.ready_ids), np.int64)
        if self._save_groups:  # several groups: each save's, popped (-1: not a save's: never published)
            groups = np.array([self._save_groups.pop(sid, -1) for sid in resolved.ready_ids.tolist()], np.int64)
            for sid in resolved.dropped_ids.tolist():
                self._save_groups.pop(sid, None)
        elif self.groups.several:
            groups -= 1
        fetched: set[int] = set()
        for ids, ok in ((resolved.ready_ids, True), (resolved.dropped_ids, False)):
            for sid in ids.tolist():
                fetch = self._fetches.pop(sid, None)
                if fetch is None:
                    continue
                fetched.add(sid)
                if sid not in self._installing:  # dropped by the RAM ledger (expired) before any install
                    self._cancel.append(sid)     # or cancel named it: the hosts drop what they hold of it
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
            self._queue_publish(resolved, fetched, groups)

    def _queue_publish(self, resolved: "Resolved", fetched: set[int], groups: np.ndarray) -> None:
        """Chunks saved into host RAM (not fetched from the store) of a known group go to the store
        once, named by content key and group."""
        slots, ids = resolved.ready_slots, resolved.ready_ids
        keys = self.ram.keys_of(np.asarray(slots, dtype=np.int64))
        content = content_keys(keys, np.maximum(groups, 0))
        for slot, sid, k1, k2, c1, c2, g in zip(slots.tolist(), ids.tolist(), keys.k1.tolist(), keys.k2.tolist(),
                                                content.k1.tolist(), content.k2.tolist(), groups.tolist()):
            key = (k1, k2)  # the host-RAM key: hash and group
            if key in self._published or sid in fetched or g < 0:
                continue
            self._published[key] = None
            if len(self._published) > self.REMEMBERED:
                self._published.popitem(last=False)
            self._publish.append((slot, sid, c1, c2, g))

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
        self._save_groups.clear()

    @override
    def leak_report(self) -> dict[str, int]:
        return {"shared_probes": len(self._probes), "shared_fetches": len(self._fetches),
                "shared_waiting": sum(w.state != self.DONE for w in self._waits.values()),
                "shared_save_groups": len(self._save_groups)}


def _concat(batches: list[DiskBatch]) -> DiskBatch:
    if not batches:
        return DiskBatch()
    if len(batches) == 1:
        return batches[0]
    return DiskBatch(tuple(s for b in batches for s in b.slots), tuple(i for b in batches for i in b.save_ids),
                     keys=b"".join(b.keys for b in batches), pools=b"".join(b.pools for b in batches))
