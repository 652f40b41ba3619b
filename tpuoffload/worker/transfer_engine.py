"""Moves KV blocks between a sharded JAX KV cache and this host's slots in pinned host memory.

Threading contract (invariants 1-4):

* Every JAX dispatch happens in ``save``/``load`` on the thread that created the engine, in an
  order that depends only on the arguments: per layer group and piece, ONE save program (gather,
  device-to-host, write into the slot store) or ONE load program (read slots, host-to-device,
  scatter; a load moved in one part, or in parts of one copy each, runs as a read program per
  group, dispatched before the checks, then a scatter program per group); see worker/programs.py.
  Each program moves its slots in copies of consecutive slots (worker/copy_plan.py), a function of
  the slots and the layout alone, so the same on every host. Calls from any other thread raise
  RuntimeError before touching JAX.
* A plan larger than the transfer buffer moves in pieces, a function of its length and the layout
  alone.
* The bytes never pass through a host thread: the programs read and write the store, and the
  runtime orders each program after the one that produced the store version it takes, so writes
  land in issue order and a load sees every earlier write. Background threads only wait for a
  save call's programs (all its pieces) to finish and then record, in the slot table, which chunk
  each slot holds; those records for one slot are chained, first issued first done.
* A load waits (bounded by ``load_wait_timeout_s``) for the record of an earlier save to the
  slots it reads; a save still unconfirmed then is a load error, never a hang. It checks the
  whole plan once, after its first piece's reads are dispatched and before any scatter.

Local trouble never changes what is dispatched (invariant 2): a slot that is late, lost, failed,
does not hold the expected save id, or lacks the bytes this host needs for the destination block,
and any exception while preparing a load, only turns rows of the load's ids into placeholders
(zeros scattered, the blocks reported as load errors); a failure while completing a save marks
its chunks failed (never loadable). Fault points are injected through ``FaultInjector``
(worker/faults.py).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import weakref
from collections import Counter
from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from tpuoffload import counters as C
from tpuoffload.backend import SlotTable
from tpuoffload.layout import CacheLayout
from tpuoffload.worker.dispatch_log import DispatchLog, StepDigest
from tpuoffload.worker.faults import NO_FAULTS, FaultInjector, FaultPoint
from tpuoffload.worker.ids_ring import IdsRing
from tpuoffload.worker import programs as programs_module
from tpuoffload.worker.copy_plan import CopyPlan, copy_rows, load_plan, save_plan
from tpuoffload.worker.programs import programs_for

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SaveResult:
    """One chunk's save outcome on this host: its save id and whether its bytes and record are in
    place."""

    save_id: int
    ok: bool


class SlotRows(NamedTuple):
    """Rows ``read_slots`` copied out of the stores: ``arrays``, one device array per layer group
    (program rows, in the copy plan's order); ``order[i]``, the program row holding the i-th
    listed slot."""

    arrays: list[jax.Array]
    order: np.ndarray


# A load of at most this many copies (per layer group) reads first, then scatters (two programs):
# see TransferEngine._reads_first.
READS_FIRST_COPIES = 8


def _ints(seq) -> np.ndarray:
    """A fresh int64 array of an int sequence (a range without a Python loop)."""
    if isinstance(seq, range):
        return np.arange(seq.start, seq.stop, seq.step, dtype=np.int64)
    if isinstance(seq, np.ndarray):
        return seq.astype(np.int64).ravel()
    return np.fromiter(seq, np.int64, len(seq))


def _snapshot(seq: Sequence[int]) -> Sequence[int]:
    """``seq`` as it is now, for a later conversion by ``_ints``: immutable sequences as they are,
    an array or a list copied (cheap: no per-element conversion), anything else as a tuple."""
    if isinstance(seq, (tuple, range)):
        return seq
    if isinstance(seq, np.ndarray):
        return seq.copy()
    return list(seq)


def _plan_ids(plan: CopyPlan, block_ids: np.ndarray, valid: np.ndarray | int, pad_block: int | None = None) -> np.ndarray:
    """``(3, rows)`` int32 ids of a program moving ``plan``: row ``i`` moves plan row
    ``plan.rows[i]`` at slot ``plan.slots[i]``. A load's rows of no plan row (``pad_block``
    given) target ``pad_block``, outside every batch shard, and are not valid: each block is
    scattered once. A save's rows all name a plan row (a repeated one rewrites the same bytes)."""
    rows = plan.rows
    ids = np.empty((3, len(rows)), np.int32)
    ids[1] = plan.slots
    if pad_block is None:
        ids[0], ids[2] = block_ids[rows], valid
        return ids
    none = rows < 0  # block_ids[-1] below is never used: replaced where ``none``
    ids[0] = np.where(none, pad_block, block_ids[rows])
    ids[2] = np.where(none, 0, valid if isinstance(valid, int) else valid[rows])
    return ids


def _batch_shards(layout: CacheLayout) -> int:
    """The batch shards the blocks are split over (every layer group alike)."""
    shards = {g.num_shards for g in layout.groups}
    if len(shards) > 1:
        raise ValueError(f"layer groups split their blocks over different numbers of batch shards {sorted(shards)}")
    return shards.pop()


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


class TransferEngine:
    """Moves chunks between the runner's KV cache and this host's slot stores (the module docstring
    gives the threading contract and the invariants it keeps). ``save`` and ``load`` dispatch on
    the creating thread only; ``slots`` records which chunk each slot holds; ``drain_results``,
    ``take_counters`` and ``wait_idle`` report what the background completions did. The disk
    tier and warm restart use ``read_slots``, ``install`` and ``stores``."""

    def __init__(
        self,
        kv_caches: Sequence[jax.Array],
        cpu_bytes_to_use: int,
        *,
        host_memory_kind: str = "pinned_host",
        save_threads: int = 4,
        load_wait_timeout_s: float = 10.0,
        faults: FaultInjector | None = None,
        layout: CacheLayout | None = None,
        transfer_buffer_bytes: int = 256 << 20,
    ) -> None:
        if not isinstance(save_threads, int) or save_threads <= 0:
            raise ValueError(f"save_threads must be a positive int, got {save_threads!r}")
        if not load_wait_timeout_s > 0:
            raise ValueError(f"load_wait_timeout_s must be > 0, got {load_wait_timeout_s!r}")
        self.layout = layout or CacheLayout.from_caches(kv_caches)
        self.layout.check_same(kv_caches)
        self._owner = threading.get_ident()
        self.num_blocks = self.layout.num_blocks
        self._load_wait_timeout_s = load_wait_timeout_s
        self._faults = faults or NO_FAULTS
        # A slot row takes device_bytes_per_chunk of this host's memory in the store (replicas
        # included); with several batch shards each device's rows are its own shard's slots.
        self.slot_table = SlotTable(cpu_bytes_to_use, self.layout.device_bytes_per_chunk, _batch_shards(self.layout))
        # Accelerator memory of one gathered (or to-be-scattered) batch is bounded: a larger plan
        # is moved in consecutive pieces, a pure function of its length, so every host splits alike.
        self.max_chunks_per_transfer = _pow2_floor(max(1, transfer_buffer_bytes // self.layout.device_bytes_per_chunk))
        self._programs = [programs_for(g, host_memory_kind, self.slot_table.rows, self.slot_table.shard_slots)
                          for g in self.layout.groups]
        row_bytes = sum(p.row_bytes for p in self._programs)  # one chunk, on each device
        self._stores = [p.allocate() for p in self._programs]  # newest version of each store; main thread only
        # Each call's ids, written into preallocated host buffers (worker/ids_ring.py); main thread only.
        self._ids = IdsRing(NamedSharding(self.layout.mesh, PartitionSpec(), memory_kind=host_memory_kind))
        # Weak references to the arrays last checked or produced (never keeping a cache alive); main thread only.
        self._known_caches: tuple[weakref.ref, ...] = ()
        self.log = DispatchLog()

        # Layer groups whose layers are all the cache's, in order, take ``tuple(kv_caches)`` as is.
        self._whole = [g.layers == tuple(range(self.layout.num_layers)) for g in self.layout.groups]
        self._run_caps_of: dict[tuple, dict] = {}  # (program, op, copies) -> ``_copies_fields``

        # What a copy costs, in rows of this layout, for saves and loads: how covering copies
        # trade rows moved twice for copies (programs.SAVE_COPY_BYTES, worker/copy_plan.py). One program per
        # layer group, each paying its own copies.
        groups = len(self._programs)
        self._copy_cost = {"save": groups * programs_module.SAVE_COPY_BYTES / row_bytes,
                           "load": groups * programs_module.LOAD_COPY_BYTES / row_bytes}

        self._pool = futures.ThreadPoolExecutor(save_threads, thread_name_prefix="tpuoffload-save")
        # Write-after-write and read-after-write: the completion call that last wrote each slot,
        # and the future of every call not yet seen done; main thread only.
        self._write_call = np.full(self.slot_table.num_slots, -1, np.int64)
        self._writes: dict[int, futures.Future] = {}
        # (save ids, positions that failed) of each finished completion; SaveResults are built when
        # drained, on the caller's thread, not on the completion's path to wait_idle.
        self._results: list[tuple[np.ndarray, set[int]]] = []
        self._calls = 0  # completions submitted; main thread only
        # call number -> (t0, chunks, bytes, future); a completion removes its own entry once its
        # results are published, under the lock its submission holds while adding the entry.
        self._inflight: dict[int, tuple[float, int, int, futures.Future]] = {}
        self._lock = threading.Lock()  # guards _results, _inflight and counters
        self.counters: Counter[str] = Counter()  # chunks/bytes saved and loaded, failures, seconds

    # ---------------- checks ----------------
    def _check_owner(self) -> None:
        if threading.get_ident() != self._owner:
            raise RuntimeError(
                "TransferEngine dispatches JAX work only from the thread that created it; "
                f"called from {threading.current_thread().name!r}")

    def _plan_arrays(self, block_ids, slots, save_ids, *, save: bool) -> tuple[np.ndarray, np.ndarray, Sequence[int]]:
        """A plan's block ids and slots as fresh int64 arrays, validated, and its save ids. A load
        (``save`` False) may read one slot into several blocks but never two chunks into one block;
        its save ids come back as an array. A save's slots must not repeat (two chunks in one
        slot): ``save_plan`` refuses that on its own sort, before any dispatch; its save ids come
        back as given (a snapshot: the caller's list may change), for the completion to convert
        off the calling thread (``_record_save``)."""
        if not (len(block_ids) == len(slots) == len(save_ids)):
            raise ValueError(
                f"block_ids, slots and save_ids differ in length: {len(block_ids)}, {len(slots)}, {len(save_ids)}")
        block_ids, slots = _ints(block_ids), _ints(slots)
        for name, seq, limit in (("block_ids", block_ids, self.num_blocks), ("slots", slots, self.slot_table.num_slots)):
            if len(seq) and (seq.min() < 0 or seq.max() >= limit):
                raise ValueError(f"{name} out of range 0..{limit - 1}: {seq[(seq < 0) | (seq >= limit)][:8].tolist()}")
        if save:
            return block_ids, slots, _snapshot(save_ids)
        if len(block_ids) > 1 and not (block_ids[1:] > block_ids[:-1]).all():  # ascending: distinct, no sort
            srt = np.sort(block_ids)
            if (srt[1:] == srt[:-1]).any():
                raise ValueError("block_ids repeat within one load")
        return block_ids, slots, _ints(save_ids)

    def _check_caches(self, kv_caches) -> None:
        """The layout check, skipped for the very arrays the last call checked or produced (the
        common case: the runner hands back what the last load returned)."""
        known = self._known_caches
        if len(known) == len(kv_caches) and all(r() is c for r, c in zip(known, kv_caches)):
            return
        self.layout.check_same(kv_caches)
        self._known_caches = tuple(map(weakref.ref, kv_caches))

    def _group_caches(self, kv_caches, i: int) -> tuple:
        """The cache arrays of layer group ``i``, in the group's order."""
        if self._whole[i]:
            return tuple(kv_caches)
        return tuple(kv_caches[layer] for layer in self._programs[i].group.layers)

    # ---------------- saves ----------------
    def save(self, kv_caches: Sequence[jax.Array], block_ids: Sequence[int], slots: Sequence[int],
             save_ids: Sequence[int]) -> None:
        """Dispatch, per layer group and piece, one save program (gather, move to host memory,
        write into ``slots`` of the store); a background thread records each slot's chunk once the
        program finished. Results come back via ``drain_results``."""
        self._check_owner()
        self._check_caches(kv_caches)
        block_ids, slots, save_ids = self._plan_arrays(block_ids, slots, save_ids, save=True)
        if not len(slots):
            return
        self._check_shards(block_ids, slots)
        pieces = self.pieces(len(slots))
        if len(pieces) > 1:  # pieces of a plan sorted by slot: runs stay whole across the pieces (rows' order is free)
            perm = np.argsort(slots, kind="stable")
            block_ids, slots, save_ids = block_ids[perm], slots[perm], _ints(save_ids)[perm]
            if (slots[1:] == slots[:-1]).any():  # one piece's plan refuses a repeat itself (save_plan)
                raise ValueError("slots repeat within one save")
        tokens = []
        for piece in pieces:
            tokens += self._dispatch_save(kv_caches, block_ids[piece], slots[piece])
        self._complete_in_background(tokens, block_ids, slots, save_ids)

    def _check_shards(self, block_ids: np.ndarray, slots: np.ndarray) -> None:
        """With several batch shards a chunk is saved into a slot of its block's shard: its bytes
        exist on that shard's devices only (slot_table.py)."""
        if self.slot_table.shards == 1:
            return
        per = self.slot_table.shard_slots
        wrong = self.layout.groups[0].shard_of(block_ids) != slots // per
        if wrong.any():
            raise ValueError(f"slots {slots[wrong][:8].tolist()} are not in the batch shard of blocks "
                             f"{block_ids[wrong][:8].tolist()} (each shard has {per} slots)")

    def pieces(self, n: int) -> list[slice]:
        """Consecutive pieces of a plan of ``n`` chunks, each within ``transfer_buffer_bytes``:
        as many full buffers as fit, then the rest (one program each per layer group; the copy
        structures are bounded whatever the number of rows, worker/copy_plan.py). A function of
        ``n`` and the layout alone: every host splits a plan alike."""
        cap = self.max_chunks_per_transfer
        return [slice(start, min(n, start + cap)) for start in range(0, n, cap)]

    def _dispatch_save(self, kv_caches, block_ids: np.ndarray, slots: np.ndarray) -> list[jax.Array]:
        """One piece's save program per layer group; returns their tokens."""
        plan = self.copy_plan("save", slots)
        copies = plan.copies
        ids, entry = self._ids.put(_plan_ids(plan, block_ids, 1))
        tokens = []
        for i, prog in enumerate(self._programs):
            self._stores[i], token = prog.save(self._group_caches(kv_caches, i), self._stores[i], ids, copies=copies)
            tokens.append(token)
        self._ids.read_by(entry, tokens)
        for i, prog in enumerate(self._programs):  # logged after the dispatch (formatted at finish_step)
            self.log.record("save", shape=ids.shape, group=i, **self._copies_fields(prog, "save", copies),
                            blocks=block_ids, slots=slots)
        return tokens

    def copy_plan(self, op: str, slots) -> CopyPlan:
        """The copies one piece's save or load (``op``) of ``slots`` moves in: worker/copy_plan.py
        with this layout's copy costs, the transfer buffer's rows as the cap and, for a load, the
        store's size (a load may read slots outside the plan, never past the store). Its slots are
        store rows: with several batch shards a slot's row in its shard (slot_table.py), and a save
        plans each shard's slots apart (no copy spans two shards: ``programs._write_own``)."""
        if self.slot_table.shards > 1:
            per = self.slot_table.shard_slots
            slots = np.asarray(slots, np.int64)
            if op == "save":  # a gap after each shard's slots: no run crosses into the next shard
                plan = save_plan(slots + slots // per, self._copy_cost["save"], self.max_chunks_per_transfer)
                return plan._replace(slots=plan.slots % (per + 1))
            slots = slots % per
        if op == "save":
            return save_plan(slots, self._copy_cost["save"], self.max_chunks_per_transfer)
        return load_plan(slots, self._copy_cost["load"], self.max_chunks_per_transfer, self.slot_table.rows)

    def _copies_fields(self, prog, op: str, copies) -> dict:
        """What the log says of a program's copies: the widest, how many, the structure."""
        key = (id(prog), op, copies)
        out = self._run_caps_of.get(key)
        if out is None:
            groups = [(w, c) for _, _, gs in prog.parts_of(op, copies) for _, w, c in gs]
            out = self._run_caps_of[key] = {"run": max(w for w, _ in groups), "copies": sum(c for _, c in groups),
                                            "structure": "+".join(f"{w}x{c}" for w, c in copies)}
        return out

    def _complete_in_background(self, tokens: list[jax.Array], block_ids: np.ndarray, slots: np.ndarray,
                                save_ids: np.ndarray, missing: frozenset[int] = frozenset()) -> None:
        """One background completion for every program of a call (``tokens``), chained after the
        newest earlier write of each of its slots (write-after-write). Submitted last: the woken
        completion thread finds this one's work done."""
        n = len(slots)
        previous = set(self._earlier_writes(slots).values())
        call, self._calls = self._calls, self._calls + 1
        self._write_call[slots] = call
        with self._lock:  # the completion removes its entry under this lock: never before it is in
            fut = self._pool.submit(self._complete_save, tokens, block_ids, slots, save_ids, previous, missing, call)
            self._inflight[call] = (time.monotonic(), n, n * self.slot_table.slot_bytes, fut)
        self._writes[call] = fut

    def _earlier_writes(self, slots: np.ndarray) -> dict[int, futures.Future]:
        """The calls not yet seen done that last wrote any of ``slots``, with their futures
        (forgetting every call seen done)."""
        writes = self._writes
        for call in [c for c, fut in writes.items() if fut.done()]:
            del writes[call]
        if not writes or not len(slots):
            return {}
        calls = self._write_call[slots]
        recent = calls[calls >= min(writes)]
        return {c: writes[c] for c in np.unique(recent).tolist() if c in writes}

    def _complete_save(self, tokens: list[jax.Array], block_ids: np.ndarray, slots: np.ndarray,
                       save_ids: np.ndarray, previous: set[futures.Future], missing: frozenset[int], call: int) -> None:
        try:
            self._record_save(tokens, block_ids, slots, save_ids, previous, missing)
        finally:  # after its results are published: wait_idle never returns before them
            with self._lock:
                self._inflight.pop(call, None)

    def _record_save(self, tokens: list[jax.Array], block_ids: np.ndarray, slots: np.ndarray,
                     save_ids: np.ndarray, previous: set[futures.Future], missing: frozenset[int]) -> None:
        """Once the programs finished (``tokens``), record the slots' chunks and publish the results
        (``save_ids`` as the caller gave them: converted here, off the dispatching thread)."""
        futures.wait(previous)  # records for the same slot land in issue order
        n = len(slots)
        failed: set[int] = set(missing)  # rows that had no bytes to write (a failed disk read)
        t0 = time.monotonic()
        try:
            self.slot_table.invalidate(slots)
            failed |= self._faults.hit(FaultPoint.SAVE_PROGRAM, n)
            jax.block_until_ready(tokens)  # the program, hence its writes into the store, finished
            save_ids = _ints(save_ids)
            failed |= self._faults.hit(FaultPoint.SAVE_RECORD, n)
            if failed:
                ok = np.ones(n, bool)
                ok[list(failed)] = False
                self.slot_table.commit(slots[ok], save_ids[ok], block_ids[ok])
            else:
                self.slot_table.commit(slots, save_ids, block_ids)
        except Exception as exc:  # noqa: BLE001 - any failure makes the whole batch unloadable
            logger.warning("tpuoffload: save of %d chunks failed on this host: %s", n, exc)
            failed = set(range(n))
            self.slot_table.invalidate(slots)
            save_ids = _ints(save_ids)  # (again, where the try got that far: a copy, harmless)
        with self._lock:
            self._results.append((save_ids, failed))
            done = n - len(failed)
            self.counters[C.CHUNKS_SAVED] += done
            self.counters[C.BYTES_SAVED] += done * self.slot_table.slot_bytes
            self.counters[C.SAVE_FAILURES] += len(failed)
            if done:
                self.counters[C.SAVE_SECONDS] += time.monotonic() - t0

    def take_counters(self) -> Counter[str]:
        """Counters accumulated since the last call (thread-safe)."""
        with self._lock:
            out, self.counters = self.counters, Counter()
        return out

    def drain_results(self) -> list[SaveResult]:
        """Save outcomes completed since the last call (thread-safe)."""
        with self._lock:
            done, self._results = self._results, []
        return [SaveResult(s, i not in failed) for save_ids, failed in done for i, s in enumerate(save_ids.tolist())]

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
            pending = [v[3] for v in self._inflight.values()]
        _, not_done = futures.wait(pending, timeout=timeout)
        return not not_done

    # ---------------- loads ----------------
    def load(self, kv_caches: Sequence[jax.Array], block_ids: Sequence[int], slots: Sequence[int],
             save_ids: Sequence[int], sources: Sequence[int] | None = None) -> tuple[list[jax.Array], list[int]]:
        """Copy ``slots`` into ``block_ids`` of the cache with, per layer group and piece, one load
        program (read the slots, move to the device, scatter). The cache arrays are donated: use the
        returned ones. Returns ``(new_caches, failed_block_ids)``.

        ``sources``: per row, a block of the batch shard whose store row holds the slot's bytes
        (default: the destination block itself). Under DPScheduler a rank's slots hold its own
        batch shard's bytes, and a rank may load another rank's chunk: such rows move across the
        batch axes inside the same program (``programs._from_sources``), whose variant depends on
        the plan alone. A slot whose record names another shard than its row's source is a load
        error."""
        self._check_owner()
        self._check_caches(kv_caches)
        block_ids, slots, save_ids = self._plan_arrays(block_ids, slots, save_ids, save=False)
        sources = block_ids if sources is None else self._sources(sources, len(block_ids))
        n = len(block_ids)
        if not n:
            return list(kv_caches), []
        t0 = time.monotonic()
        pieces = self.pieces(n)
        perm, listed = None, block_ids
        if len(pieces) > 1:  # pieces of a plan sorted by slot (runs stay whole); failures map back
            perm = np.argsort(slots, kind="stable")
            block_ids, slots, save_ids, sources = block_ids[perm], slots[perm], save_ids[perm], sources[perm]
        moved = self._moved(block_ids, sources)
        cross = bool(moved.any())  # from the plan alone: every host dispatches the same variant
        plans = [self.copy_plan("load", slots[p]) for p in pieces]  # once per piece
        rows = self._maybe_read_first(slots[pieces[0]], plans[0])  # before the checks: the copies start now
        failed = self._load_failures(block_ids, slots, save_ids, sources)
        valid = (sources + 1).astype(np.int32)
        valid[list(failed)] = 0
        caches = list(kv_caches)
        for k, piece in enumerate(pieces):
            if k:  # later pieces read after the previous piece's scatter: one piece's rows at a time
                rows = self._maybe_read_first(slots[piece], plans[k])
            caches = self._dispatch_load(caches, block_ids[piece], slots[piece], valid[piece], rows, plans[k], cross)
        self._known_caches = tuple(map(weakref.ref, caches))
        moved_failed = int(moved[list(failed)].sum()) if failed else 0
        if perm is not None:
            failed = {int(perm[i]) for i in failed}
        with self._lock:
            self.counters[C.CHUNKS_LOADED] += n - len(failed)
            self.counters[C.BYTES_LOADED] += (n - len(failed)) * self.slot_table.slot_bytes
            self.counters[C.LOAD_ERRORS] += len(failed)
            self.counters[C.CROSS_RANK_CHUNKS_LOADED] += int(moved.sum()) - moved_failed
            self.counters[C.CROSS_RANK_LOAD_ERRORS] += moved_failed
            self.counters[C.LOAD_SECONDS] += time.monotonic() - t0
        return caches, [int(listed[i]) for i in sorted(failed)]

    def _sources(self, sources: Sequence[int], n: int) -> np.ndarray:
        sources = _ints(sources)
        if len(sources) != n:
            raise ValueError(f"{len(sources)} sources for a load of {n} blocks")
        if n and (sources.min() < 0 or sources.max() >= self.num_blocks):
            raise ValueError(f"source blocks out of range 0..{self.num_blocks - 1}")
        return sources

    def _moved(self, block_ids: np.ndarray, sources: np.ndarray) -> np.ndarray:
        """Rows whose bytes sit in another batch shard than their destination's (any layer group)."""
        moved = np.zeros(len(block_ids), bool)
        for g in self.layout.groups:
            if g.num_shards > 1:
                moved |= g.shard_of(block_ids) != g.shard_of(sources)
        return moved

    def _load_failures(self, block_ids: np.ndarray, slots: np.ndarray, save_ids: np.ndarray,
                       sources: np.ndarray) -> set[int]:
        """Positions of a load that become placeholders: late writes, injected faults, slots that
        do not hold the expected chunk; every position if anything here raises. Checked once per
        load, whatever its pieces."""
        n = len(slots)
        failed = self._wait_for_writes(slots)
        try:
            failed |= self._faults.hit(FaultPoint.LOAD_SLOT_CHECK, n)
            failed |= self._unusable(sources, slots, save_ids)
            failed |= self._faults.hit(FaultPoint.LOAD_PREPARE, n)
        except Exception as exc:  # noqa: BLE001 - placeholders keep the dispatch identical
            logger.warning("tpuoffload: preparing a load of %d slots failed on this host: %s", n, exc)
            failed = set(range(n))
        return failed

    def _maybe_read_first(self, slots: np.ndarray, plan: CopyPlan) -> list[jax.Array] | None:
        """A piece's reads (``_read_first``) when it runs as reads then scatter, else None
        (``plan``: the piece's ``load_plan``)."""
        return self._read_first(slots, plan) if self._reads_first(plan.copies) else None

    def _dispatch_load(self, kv_caches: list[jax.Array], block_ids: np.ndarray, slots: np.ndarray, valid: np.ndarray,
                       rows: list[jax.Array] | None, plan: CopyPlan, cross: bool) -> list[jax.Array]:
        """One piece's load program per layer group, or its scatter program of ``rows`` already
        read; returns the new caches (``plan``: the piece's ``load_plan``; ``cross``: rows move
        across the batch axes)."""
        copies = plan.copies
        ids, entry = self._ids.put(_plan_ids(plan, block_ids, valid, self.num_blocks))
        new, tokens = list(kv_caches), []
        for i, prog in enumerate(self._programs):
            if rows is None:
                out, token = prog.load(self._group_caches(kv_caches, i), self._stores[i], ids, copies=copies,
                                       cross=cross)
                self.log.record("load", shape=ids.shape, group=i, **self._copies_fields(prog, "load", copies),
                                cross=cross, blocks=block_ids, slots=slots)
            else:
                out, token = prog.scatter(self._group_caches(kv_caches, i), rows[i], ids, cross=cross)
                self.log.record("load", shape=ids.shape, group=i, cross=cross, blocks=block_ids, slots=slots)
            tokens.append(token)
            for layer, arr in zip(prog.group.layers, out):
                new[layer] = arr
        self._ids.read_by(entry, tokens)
        return new

    def _reads_first(self, copies) -> bool:
        """Whether a load whose rows have copy structure ``copies`` (worker/copy_plan.py) runs as
        two programs, reads then scatter, rather than as one load program: when that program
        would have one part, or at most READS_FIRST_COPIES copies in all (nothing much to overlap
        inside: the copies start before the checks and the scatter's dispatch). Why, measured:
        docs/performance.md ("What the engine's constants rest on", reads first)."""
        return all(prog.op_parts("load", copy_rows(copies)) == 1 or prog.num_copies("load", copies) <= READS_FIRST_COPIES
                   for prog in self._programs)

    def _read_first(self, slots: np.ndarray, plan: CopyPlan) -> list[jax.Array]:
        """Dispatch the reads of a load before its checks: they need only the slots, and the store
        version each takes orders it after every earlier save's writes; the checks only decide
        which rows count. The copies run while this thread checks and dispatches the scatter."""
        ids = _plan_ids(plan, np.full(len(slots), self.num_blocks, np.int64), 1, self.num_blocks)
        return self._read_programs("load.read", ids, plan.copies, slots)

    def _read_programs(self, op: str, ids_np: np.ndarray, copies, slots: np.ndarray) -> list[jax.Array]:
        """One read program per layer group: the slots of ``ids_np`` copied into device rows by
        the copies of ``copies``; the stores are read, not donated."""
        ids, entry = self._ids.put(ids_np)
        rows, tokens = [], []
        for i, prog in enumerate(self._programs):
            group_rows, token = prog.read(self._stores[i], ids, copies=copies)
            self.log.record(op, shape=ids.shape, group=i, **self._copies_fields(prog, "read", copies), slots=slots)
            rows.append(group_rows)
            tokens.append(token)
        self._ids.read_by(entry, tokens)
        return rows

    def _unusable(self, sources: np.ndarray, slots: np.ndarray, save_ids: np.ndarray) -> set[int]:
        """Positions whose slot does not hold the expected chunk (a stale plan: the slot was
        reused, even by another DP rank's save), or whose chunk was saved from another batch
        shard than the row's declared source (the store keeps a chunk in its source block's
        batch shard only)."""
        ok, recorded = self.slot_table.lookup(slots, save_ids)
        for g in self.layout.groups:
            if g.num_shards > 1:
                ok &= g.shard_of(sources) == g.shard_of(recorded)
        return set(np.flatnonzero(~ok).tolist())

    def _wait_for_writes(self, slots: np.ndarray) -> set[int]:
        """Read-after-write: wait for in-flight writes to these slots. Returns the positions whose
        write did not finish within the timeout."""
        pending = self._earlier_writes(slots)  # one save writes many slots: each call once
        if not pending:
            return set()
        _, late_writes = futures.wait(pending.values(), timeout=self._load_wait_timeout_s)
        late = [c for c, fut in pending.items() if fut in late_writes]
        return set(np.flatnonzero(np.isin(self._write_call[slots], late)).tolist()) if late else set()

    # ---------------- the disk tier (tpuoffload/worker/disk_stage.py) ----------------
    # A chunk's bytes on this host, as the disk tier keeps them, are the local pieces of its rows on
    # the devices of its batch shard (``shard``): with one scheduler every device (one shard); under
    # DPScheduler rank r's chunks sit on the devices of batch shard r only (slot_table.py), so rank
    # r's files hold those devices' pieces, and a host without a device of shard r holds none.
    def _row_pieces(self, n: int, shard: int) -> list[list[tuple[jax.Device, tuple[int, ...], bool]]]:
        """Per layer group: (device, local piece shape, whether the device is in batch shard
        ``shard``) of a rows array of ``n`` chunks, this host's devices in id order (replicas
        included: each device holds its own copy)."""
        out = []
        for prog in self._programs:
            shape = (prog.group.num_shards, n, *prog.store_shape[2:])
            piece = prog.device_sharding.shard_shape(shape)
            index = prog.device_sharding.addressable_devices_indices_map(shape)
            devices = sorted(prog.device_sharding.addressable_devices, key=lambda d: d.id)
            out.append([(d, piece, (index[d][0].start or 0) == shard) for d in devices])
        return out

    def disk_chunk_bytes(self, shard: int = 0) -> int:
        """Bytes of one chunk of batch shard ``shard`` on this host as the disk tier keeps it: the
        local pieces of its rows on that shard's devices (0: this host holds none of them)."""
        return sum(int(np.prod(shape)) // shape[1] * prog.wire.dtype.itemsize
                   for prog, pieces in zip(self._programs, self._row_pieces(1, shard))
                   for _, shape, mine in pieces if mine)

    def shard_part(self, shard: int) -> tuple[int, int, str]:
        """Where this host's bytes of a chunk of batch shard ``shard`` (``rows_to_payloads``) sit in
        the whole chunk of that shard: ``(part, parts, layout)``. ``parts``: the JAX processes
        holding a device of the shard; ``part``: this process's place among them (-1: none);
        ``layout``: every group's store row shape and dtype and, per holding process in order, the
        index ranges (batch dim left out) of its devices' pieces in payload order. Two shards (of
        one deployment or of two) with equal ``layout`` hold the same bytes of a chunk in the same
        order on their ``part``-th process (the shared tier names objects by it)."""
        groups, owners = [], set()
        for prog in self._programs:
            shape = (prog.group.num_shards, 1, *prog.store_shape[2:])
            index = prog.device_sharding.devices_indices_map(shape)
            mine = sorted((d for d, i in index.items() if (i[0].start or 0) == shard),
                          key=lambda d: (d.process_index, d.id))
            owners |= {d.process_index for d in mine}
            pieces = [(d.process_index, [s.indices(n)[:2] for s, n in zip(index[d][2:], shape[2:])]) for d in mine]
            groups.append({"row": list(shape[2:]), "dtype": str(prog.wire.dtype), "pieces": pieces})
        procs = sorted(owners)
        part = procs.index(jax.process_index()) if jax.process_index() in owners else -1
        ranked = {p: i for i, p in enumerate(procs)}  # processes by their place, not their number
        for g in groups:
            g["pieces"] = [(ranked[p], s) for p, s in g["pieces"]]
        return part, len(procs), json.dumps(groups, sort_keys=True)

    def _shard_block(self, shard: int) -> int:
        """The block an install names as its rows' source: the first of batch shard ``shard``, so
        the rows land in that shard's store rows only and its loads accept them."""
        return shard * self.layout.groups[0].blocks_per_shard

    def _check_shard(self, slots: np.ndarray, shard: int) -> None:
        per = self.slot_table.shard_slots
        if len(slots) and not (slots // per == shard).all():
            raise ValueError(f"slots {slots[slots // per != shard][:8].tolist()} are not batch shard {shard}'s "
                             f"(each shard has {per} slots)")

    def read_slots(self, slots: Sequence[int], save_ids: Sequence[int]) -> tuple[SlotRows, list[bool]]:
        """Copy ``slots`` out of the stores into device rows, one program per layer group (main
        thread; the stores are read, not donated), by the copies a load of those slots would use
        (``copy_plan``). ``ok[i]``: the slot held chunk ``save_ids[i]`` and no write to it was
        late (otherwise its bytes must not be used). Turn the rows into bytes with
        ``rows_to_payloads`` (the pieces of the slots' batch shard)."""
        self._check_owner()
        slots = _ints(slots)
        late = self._wait_for_writes(slots)
        ok, _ = self.slot_table.lookup(slots, save_ids)
        valid = [bool(v) and i not in late for i, v in enumerate(ok.tolist())]
        plan = self.copy_plan("load", slots)
        ids = _plan_ids(plan, np.full(len(slots), self.num_blocks, np.int64), 1, self.num_blocks)
        arrays = self._read_programs("read", ids, plan.copies, slots)
        listed = np.flatnonzero(plan.rows >= 0)
        first = np.empty(len(slots), np.int64)
        first[plan.rows[listed[::-1]]] = listed[::-1]  # the first program row that moves each slot
        return SlotRows(arrays, first), valid

    def rows_to_payloads(self, rows: SlotRows, shard: int = 0) -> list[np.ndarray]:
        """This host's bytes of each chunk of ``read_slots`` rows, in the listed order (uint8,
        ``disk_chunk_bytes(shard)`` each: the pieces of batch shard ``shard``'s devices, whose rows
        hold the slots' chunks; the other shards' rows at those slots are other chunks). Waits for
        the program; any thread (no dispatch)."""
        parts = []
        for arr in rows.arrays:
            shard_of = {d: (i[0].start or 0) for d, i in arr.sharding.addressable_devices_indices_map(arr.shape).items()}
            for piece in sorted(arr.addressable_shards, key=lambda sh: sh.device.id):
                if shard_of[piece.device] != shard:
                    continue
                data = np.asarray(piece.data)[:, rows.order]  # (1, n, layers, *tile)
                parts.append(np.moveaxis(data, 1, 0).reshape(len(rows.order), -1).view(np.uint8))
        if not parts:
            return [np.zeros(0, np.uint8) for _ in rows.order]
        return list(np.concatenate(parts, axis=1))

    def install(self, payloads: Sequence[np.ndarray | None], slots: Sequence[int], save_ids: Sequence[int],
                shard: int = 0) -> None:
        """Write chunks read back from disk into ``slots`` (of batch shard ``shard``) under
        ``save_ids``, like a save whose rows come from host memory: one H2D copy per device and one
        program per layer group, by the copies a save of those slots would use (``copy_plan``),
        then the background completion records the slots. The rows are written as blocks of
        ``shard`` (its first block: ``programs._write_own`` writes them into that shard's store
        rows only, the other shards' devices into their spare rows), and the slot table records
        that block as their source, so a load checks them like any chunk of the shard. A None
        payload (a failed read on this host) writes zeros and is reported failed. Main thread; the
        same dispatch on every host."""
        self._check_owner()
        n = len(slots)
        source = self._shard_block(shard)
        _, slots, save_ids = self._plan_arrays([source] * n, slots, save_ids, save=True)
        self._check_shard(slots, shard)
        width = self.disk_chunk_bytes(shard)
        host = np.zeros((n, width), np.uint8)
        missing = frozenset(i for i, p in enumerate(payloads) if p is None or len(p) != width)
        for i, p in enumerate(payloads):
            if i not in missing:
                host[i] = p
        plan = self.copy_plan("save", slots)
        host = host[plan.rows]  # program row i writes plan row plan.rows[i] (a repeat: the same bytes)
        p_rows = len(plan.rows)
        ids, entry = self._ids.put(_plan_ids(plan, np.full(n, source, np.int64), 1))
        offset, tokens = 0, []
        for i, (prog, pieces) in enumerate(zip(self._programs, self._row_pieces(p_rows, shard))):
            arrays = []
            for device, shape, mine in pieces:
                size = int(np.prod(shape)) // p_rows * prog.wire.dtype.itemsize
                if mine:
                    chunk = host[:, offset:offset + size].copy().view(prog.wire.dtype)
                    chunk = np.moveaxis(chunk.reshape(p_rows, shape[0], *shape[2:]), 0, 1)
                    offset += size
                else:  # another shard's device: its copy goes to its spare rows (``_write_own``)
                    chunk = np.zeros(shape, prog.wire.dtype)
                arrays.append(jax.device_put(np.ascontiguousarray(chunk), device))
            shape = (prog.group.num_shards, p_rows, *prog.store_shape[2:])
            rows = jax.make_array_from_single_device_arrays(shape, prog.device_sharding, arrays)
            self._stores[i], token = prog.install(rows, self._stores[i], ids, copies=plan.copies)
            self.log.record("install", shape=ids.shape, group=i, **self._copies_fields(prog, "install", plan.copies),
                            slots=slots)
            tokens.append(token)
        self._ids.read_by(entry, tokens)
        self._complete_in_background(tokens, np.full(n, source, np.int64), slots, save_ids, missing)

    # ---------------- warm restart (tpuoffload/worker/persistence.py) ----------------
    def stores(self) -> dict[str, jax.Array]:
        """The current store of each layer group, by a name stable across restarts. Main thread;
        they must not be donated (no save dispatched) while a checkpoint reads them."""
        self._check_owner()
        return {f"group{i}": store for i, store in enumerate(self._stores)}

    def store_targets(self) -> dict[str, jax.ShapeDtypeStruct]:
        """What ``stores()`` looks like (shape, dtype, sharding): the restore targets."""
        return {f"group{i}": jax.ShapeDtypeStruct(p.store_shape, p.wire.dtype, sharding=p.store_sharding)
                for i, p in enumerate(self._programs)}

    def replace_stores(self, stores: dict[str, jax.Array]) -> None:
        """Adopt restored stores (start-up, before the first step, on every host alike)."""
        self._check_owner()
        targets = self.store_targets()
        if set(stores) != set(targets):
            raise ValueError(f"stores {sorted(stores)} are not {sorted(targets)}")
        for name, t in targets.items():
            if stores[name].shape != t.shape or stores[name].dtype != t.dtype:
                raise ValueError(f"store {name}: {stores[name].shape} {stores[name].dtype}, expected {t.shape} {t.dtype}")
        self._stores = [stores[f"group{i}"] for i in range(len(self._programs))]

    # ---------------- lifecycle ----------------
    def finish_step(self) -> StepDigest:
        return self.log.finish_step()

    def close(self) -> None:
        self._pool.shutdown(wait=True)

