"""Byte audit of a worker inside a real engine: every block a load writes must hold exactly the
bytes that were in the block saved to that slot.

The real engine's greedy tokens can only say "something differed"; this says which load, which
slot and which block. It wraps one ``OffloadWorker`` instance (test and demo use only): before
each save is dispatched it copies the source blocks out of the runner's caches (block axis 0 of
every layer, as tpu-inference allocates them) and keeps them under the destination slot; after
each load it reads the destination blocks back and compares, at the start of the next step (so the
audit does not wait on the load before the forward that reads it) or at ``report()``. Loads the
worker reports failed are not compared (their blocks are recomputed).
"""

from __future__ import annotations

from typing import Any

import numpy as np


class ByteAudit:
    def __init__(self, worker) -> None:
        self._worker = worker
        self._slots: dict[int, list[np.ndarray]] = {}  # slot -> each layer's block, as saved
        self.saves = 0
        self.loads_checked = 0
        self.mismatches: list[dict[str, Any]] = []
        self.steps: list[dict[str, Any]] = []  # what each step moved: (block, slot) pairs
        self._pending: list[tuple[int, int, str, int]] = []  # loads not yet compared: (block, slot, req, step)
        self._step = -1
        save, load, bind = worker._save, worker._load, worker.bind

        def audited_bind(meta):
            self._check_pending()
            self._step = meta.requests_meta[0].step
            return bind(meta)

        def audited_save(batch):
            if batch:
                self._record_save(batch)
            return save(batch)

        def audited_load(placed):
            load(placed)
            self._check_loads(placed)

        worker._save, worker._load, worker.bind = audited_save, audited_load, audited_bind

    def _blocks(self, block_ids) -> list[np.ndarray]:
        caches = self._worker._runner.kv_caches
        idx = np.asarray(list(block_ids))
        return [np.asarray(c)[idx] for c in caches]

    def _record_save(self, batch) -> None:
        if any(c.is_deleted() for c in self._worker._runner.kv_caches):  # the worker skips this save
            for slot in batch.slots:
                self._slots.pop(int(slot), None)
            return
        blocks = self._blocks(batch.block_ids)
        step = {"step": self._step, "save": list(zip(map(int, batch.block_ids), map(int, batch.slots)))}
        for i, slot in enumerate(batch.slots):
            self._slots[int(slot)] = [layer[i].copy() for layer in blocks]
            self.saves += 1
        self.steps.append(step)

    def _check_loads(self, placed) -> None:
        """Keeps the loads that did not fail for the next ``_check_pending``."""
        moved = []
        for p in placed:
            for ld in p.loads:
                for b, s in zip(ld.block_ids, ld.slots):
                    moved.append((int(b), int(s)))
                    failed = (b - p.block_offset) in self._worker._load_errors or ld.req_id in self._worker._failed_recving
                    if not failed:
                        self._pending.append((int(b), int(s), ld.req_id, self._step))
        if moved:
            self.steps.append({"step": self._step, "load": moved})

    def _check_pending(self) -> None:
        pending, self._pending = self._pending, []
        if not pending:
            return
        blocks = self._blocks([p[0] for p in pending])
        for i, (block, slot, req, step) in enumerate(pending):
            want = self._slots.get(slot)
            self.loads_checked += 1
            if want is None or any(not np.array_equal(layer[i], w) for layer, w in zip(blocks, want)):
                self.mismatches.append({"block": block, "slot": slot, "req": req, "step": step,
                                        "never_saved": want is None})

    def report(self) -> dict[str, Any]:
        self._check_pending()
        return {"saves": self.saves, "loads_checked": self.loads_checked, "mismatches": self.mismatches[:20],
                "num_mismatches": len(self.mismatches)}
