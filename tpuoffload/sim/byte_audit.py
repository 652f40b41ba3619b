"""Byte audit of a worker inside a real engine: every block a load writes must hold exactly the
bytes that were in the block saved to that slot.

The real engine's greedy tokens can only say "something differed"; this says which load, which
slot and which block. It wraps one ``OffloadWorker`` instance (test and demo use only): before
each save is dispatched it copies the source blocks out of the runner's caches (block axis 0 of
every layer, as tpu-inference allocates them) and keeps them under the destination slot; after
each load it reads the destination blocks back and compares, at the start of the next step (so the
audit does not wait on the load before the forward that reads it) or at ``report()``. Loads the
worker reports failed are not compared (their blocks are recomputed).

It also counts the blocks each save and load moved per KV cache group (vLLM's hybrid KV cache
manager), from the runner's block tables (``runner.requests[...].block_ids``, one list per group;
a block id belongs to one group at a time): a saved block's group is the one of the live request
that holds it; a loaded block's, the one of its own request as soon as the runner holds that
request (with several groups loads are asynchronous: vLLM schedules the request after its load).
"""

from __future__ import annotations

from collections import Counter
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
        # blocks saved / loaded (not failed) per KV cache group; group -1: in no live request's block table
        self.by_group: dict[str, Counter] = {"save": Counter(), "load": Counter()}
        self._ungrouped_loads: list[tuple[int, str]] = []  # (block, req) whose request the runner lacks yet
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

    def _count_save_groups(self, block_ids) -> None:
        group_of = {b: g for req in self._worker._runner.requests.values()
                    for g, ids in enumerate(req.block_ids) for b in ids}
        self.by_group["save"].update(group_of.get(int(b), -1) for b in block_ids)

    def _count_load_groups(self, final: bool) -> None:
        """Counts the loaded blocks whose request the runner holds; ``final``: the others as -1."""
        requests, waiting = self._worker._runner.requests, []
        for block, req_id in self._ungrouped_loads:
            req = requests.get(req_id)
            if req is None:
                waiting.append((block, req_id))
            else:
                self.by_group["load"][next((g for g, ids in enumerate(req.block_ids) if block in ids), -1)] += 1
        if final and waiting:
            self.by_group["load"][-1] += len(waiting)
        self._ungrouped_loads = [] if final else waiting

    def _record_save(self, batch) -> None:
        if any(c.is_deleted() for c in self._worker._runner.kv_caches):  # the worker skips this save
            for slot in batch.slots:
                self._slots.pop(int(slot), None)
            return
        blocks = self._blocks(batch.block_ids)
        step = {"step": self._step, "save": list(zip(map(int, batch.block_ids), map(int, batch.slots)))}
        self._count_save_groups(batch.block_ids)
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
                        self._ungrouped_loads.append((int(b), ld.req_id))
        if moved:
            self.steps.append({"step": self._step, "load": moved})

    def _check_pending(self) -> None:
        self._count_load_groups(final=False)
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
        self._count_load_groups(final=True)
        return {"saves": self.saves, "loads_checked": self.loads_checked, "mismatches": self.mismatches[:20],
                "num_mismatches": len(self.mismatches),
                "by_group": {kind: dict(sorted(c.items())) for kind, c in self.by_group.items()}}
