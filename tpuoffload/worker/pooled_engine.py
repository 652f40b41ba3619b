"""One transfer engine per block pool of ``runner.kv_caches`` (layout.py:CachePools), behind one
call per save or load.

A GDN/mamba hybrid's caches hold two block pools: the attention arrays' blocks (pool 0) and the
GDN layers' compact state rows (pool 1, every conv and ssm array). Each pool has its own
TransferEngine, hence its own host store and SlotTable, and its own chunk: one block of every
attention array, or one row of every state array.

Slot numbering (the scheduler half's, ``StepPlan.state_slots``): one range, ``[0, boundary)`` pool
0's slots, ``[boundary, boundary + state_slots)`` pool 1's, slot ``s`` of pool 1 being its store's
slot ``s - boundary``. A row of a save or a load names its pool by its slot alone; its block id is
then an id of that pool (a state row for pool 1: the same id may name an attention block in the
same call, so failures come back as positions, never block ids).

Order (invariant 1): every call dispatches pool 0's programs, then pool 1's, each pool's rows in
the order given; which rows go where depends on the arguments alone, so every host dispatches the
same. Both engines record into one DispatchLog: the step digest covers both pools. A plan whose
rows fall outside their pool (a slot or a block id out of range, a repeated slot in a save or a
repeated block of one pool in a load) is refused whole, before anything is dispatched.

Failures: a pool-1 row fails as a pool-0 row does (worker/transfer_engine.py: a late, lost,
faulted or stale slot loads zeros and is reported, a failed save is never loadable); failures of
one pool never touch the other's rows. Under data parallelism both pools split over the batch
shards alike (tpu-inference shards the state pool along axis 0 as it does the attention blocks),
and each row's ``sources`` entry names a block or state row of its own pool.

With one pool every call goes to pool 0's engine unchanged (``boundary`` is ignored): the
behaviour of a TransferEngine alone.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence

import numpy as np

from tpuoffload.backend import SlotTable
from tpuoffload.layout import CacheLayout, CachePools
from tpuoffload.worker.dispatch_log import DispatchLog, StepDigest
from tpuoffload.worker.transfer_engine import SaveResult, TransferEngine, _ints


class PooledEngine:
    """A TransferEngine per block pool behind one save and one load call (module doc). It holds no
    lock: what it keeps is set at construction, and each engine guards its own background state."""

    def __init__(self, pools: CachePools, kv_caches: Sequence, pool_bytes: Sequence[int],
                 layouts: Sequence[CacheLayout] | None = None, **engine_args) -> None:
        """One TransferEngine per pool of ``kv_caches`` (``pools``), pool ``p`` with
        ``pool_bytes[p]`` bytes of host memory and layout ``layouts[p]`` (default: described from
        its arrays); ``engine_args`` go to every engine. The calling thread owns them all."""
        if len(pool_bytes) != pools.num:
            raise ValueError(f"{len(pool_bytes)} host byte budgets for {pools.num} pools")
        self.pools = pools
        self.log = DispatchLog()
        engines = []
        for p in range(pools.num):
            engine = TransferEngine(pools.arrays(kv_caches, p), pool_bytes[p],
                                    layout=layouts[p] if layouts else None, **engine_args)
            engine.log = self.log  # one digest per step, both pools
            engines.append(engine)
        self.engines: tuple[TransferEngine, ...] = tuple(engines)
        # Each pool's counters since start, as take_counters handed them out (owned by the thread
        # that calls take_counters).
        self.pool_totals: tuple[Counter[str], ...] = tuple(Counter() for _ in engines)

    @property
    def tables(self) -> tuple[SlotTable, ...]:
        """Each pool's slot table, in pool order."""
        return tuple(e.slot_table for e in self.engines)

    def num_slots(self, pool: int) -> int:
        """Slots of pool ``pool``'s store on this host."""
        return self.engines[pool].slot_table.num_slots

    # ---------------- saves and loads ----------------
    def save(self, kv_caches: Sequence, block_ids: Sequence[int], slots: Sequence[int], save_ids: Sequence[int],
             boundary: int) -> None:
        """Save each row's block (a state row for slots from ``boundary`` on) into its slot:
        pool 0's programs, then pool 1's (module doc). Outcomes come back via ``drain_results``."""
        if self.pools.num == 1:
            self.engines[0].save(self.pools.arrays(kv_caches, 0), block_ids, slots, save_ids)
            return
        block_ids, slots, save_ids = _ints(block_ids), _ints(slots), _ints(save_ids)
        parts = self._split(block_ids, slots, save_ids, boundary, unique_slots=True)
        for p, (rows, pool_slots) in enumerate(parts):
            if len(rows):
                self._mark(p)
                self.engines[p].save(self.pools.arrays(kv_caches, p), block_ids[rows], pool_slots, save_ids[rows])

    def load(self, kv_caches: Sequence, block_ids: Sequence[int], slots: Sequence[int], save_ids: Sequence[int],
             sources: Sequence[int] | None, boundary: int) -> tuple[list, set[int]]:
        """Load each row's slot (a state slot from ``boundary`` on, into a state row) into its
        block: pool 0's programs, then pool 1's. The cache arrays are donated. Returns the new
        runner list (tuples stay tuples) and the positions, in the given lists, whose row failed
        (placeholders were loaded there). ``sources``: per row, a block or state row of the batch
        shard its slot's bytes came from (TransferEngine.load), in its own pool's ids."""
        if self.pools.num == 1:
            caches, failed = self.engines[0].load(self.pools.arrays(kv_caches, 0), block_ids, slots, save_ids, sources)
            return self.pools.put(kv_caches, 0, caches), _positions(block_ids, failed)
        block_ids, slots, save_ids = _ints(block_ids), _ints(slots), _ints(save_ids)
        parts = self._split(block_ids, slots, save_ids, boundary, unique_slots=False)
        caches, failed = list(kv_caches), set()
        for p, (rows, pool_slots) in enumerate(parts):
            if not len(rows):
                continue
            self._mark(p)
            src = _ints(sources)[rows] if sources is not None else None
            arrays, failed_blocks = self.engines[p].load(self.pools.arrays(caches, p), block_ids[rows], pool_slots,
                                                         save_ids[rows], src)
            caches = self.pools.put(caches, p, arrays)
            failed.update(int(rows[i]) for i in _positions(block_ids[rows], failed_blocks))
        return caches, failed

    def _split(self, block_ids: np.ndarray, slots: np.ndarray, save_ids: np.ndarray, boundary: int,
               unique_slots: bool) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per pool: the positions of its rows and their slots in its store. Refuses, before any
        dispatch, a row outside its pool and a repeat the engine would refuse (a slot in a save,
        ``unique_slots``; a block of one pool in a load)."""
        if not len(block_ids) == len(slots) == len(save_ids):
            raise ValueError(f"block_ids, slots and save_ids differ in length: {len(block_ids)}, {len(slots)}, "
                             f"{len(save_ids)}")
        state = slots >= boundary
        parts = [(np.flatnonzero(~state), slots[~state]), (np.flatnonzero(state), slots[state] - boundary)]
        for p, (rows, pool_slots) in enumerate(parts):
            engine, blocks = self.engines[p], block_ids[rows]
            for name, seq, limit in (("slots", pool_slots, engine.slot_table.num_slots),
                                     ("block ids", blocks, engine.num_blocks)):
                if len(seq) and (seq.min() < 0 or seq.max() >= limit):
                    raise ValueError(f"pool {p}'s {name} out of range 0..{limit - 1} (slot boundary {boundary}): "
                                     f"{seq[(seq < 0) | (seq >= limit)][:8].tolist()}")
            seq = pool_slots if unique_slots else blocks
            if len(np.unique(seq)) != len(seq):
                raise ValueError(f"pool {p}'s {'slots' if unique_slots else 'block ids'} repeat within one "
                                 f"{'save' if unique_slots else 'load'}")
        return parts

    def _mark(self, pool: int) -> None:
        """Name pool 1's programs in the digest (its group numbers restart at 0)."""
        if pool:
            self.log.record("pool", n=pool)

    # ---------------- background work and accounting ----------------
    def drain_results(self) -> list[SaveResult]:
        """Save outcomes completed since the last call, pool 0's first (thread-safe)."""
        return [r for e in self.engines for r in e.drain_results()]

    def inflight(self) -> tuple[int, int, float | None]:
        """(chunks in flight, staging bytes held by them, start time of the oldest or None), over
        both pools."""
        parts = [e.inflight() for e in self.engines]
        starts = [t for _, _, t in parts if t is not None]
        return sum(c for c, _, _ in parts), sum(b for _, b, _ in parts), min(starts) if starts else None

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait for every background write issued so far, in both pools, within ``timeout`` in
        all; True if all finished in time."""
        deadline = None if timeout is None else time.monotonic() + timeout
        idle = True
        for e in self.engines:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            idle = e.wait_idle(left) and idle
        return idle

    def take_counters(self) -> Counter[str]:
        """Both pools' counters accumulated since the last call, summed (thread-safe; each pool's
        also added to ``pool_totals``)."""
        out: Counter[str] = Counter()
        for e, total in zip(self.engines, self.pool_totals):
            taken = e.take_counters()
            total.update(taken)
            out.update(taken)
        return out

    def finish_step(self) -> StepDigest:
        """Close the step's digest (both pools' dispatches)."""
        return self.log.finish_step()

    def close(self) -> None:
        for e in self.engines:
            e.close()


def _positions(block_ids: Sequence[int], failed: Sequence[int]) -> set[int]:
    """Positions of the ``failed`` block ids in ``block_ids`` (distinct within one pool's load)."""
    if not len(failed):
        return set()
    failed = set(failed)
    return {i for i, b in enumerate(np.asarray(block_ids).tolist()) if b in failed}
