"""Byte audit of a worker inside a real engine: every block a load writes must hold exactly the
bytes that were in the block saved to that slot.

The real engine's greedy tokens can only say "something differed"; this says which load, which
slot and which block. It wraps one ``OffloadWorker`` instance (test and demo use only). When a
save is dispatched it gathers the source blocks out of the runner's caches (block axis 0 of every
layer, as tpu-inference allocates them), and after a load the destination blocks, each with one
more JAX gather dispatched on the same thread: nothing waits for a result, so the audit leaves the
engine's timing alone (a host read here would wait for the forward or the load). ``report()``
reads the gathered blocks back and compares each load's with the save that last wrote its slot.
Loads the worker reports failed are not compared (their blocks are recomputed).

It also counts the blocks each save and load moved per KV cache group (vLLM's hybrid KV cache
manager), from the runner's block tables (``runner.requests[...].block_ids``, one list per group;
a block id belongs to one group at a time): a saved block's group is the one of the live request
that holds it; a loaded block's, the one of its own request as soon as the runner holds that
request (with several groups loads are asynchronous: vLLM schedules the request after its load).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@jax.jit
def _gather(caches, idx):
    return [jnp.take(c, idx, axis=0) for c in caches]


@dataclass
class _Moved:
    step: int
    blocks: list[int]
    slots: list[int]
    gathered: list[jax.Array]  # each layer's blocks, in ``blocks`` order
    host: list[np.ndarray] | None = None

    def layers(self, i: int) -> list[np.ndarray]:
        if self.host is None:
            self.host = [np.asarray(g) for g in self.gathered]
        return [h[i] for h in self.host]


def _digest(layers) -> str:
    h = hashlib.blake2b(digest_size=8)
    for layer in layers:
        h.update(np.ascontiguousarray(layer).tobytes())
    return h.hexdigest()


class ByteAudit:
    """Simulation only: follows every block a worker saved and loaded, as dispatched, so a test can say
    which chunk each loaded block must hold and count saves and loads per KV cache group."""

    def __init__(self, worker) -> None:
        self._worker = worker
        self._saves: list[_Moved] = []
        # slot -> (save, position in it) that last wrote it, as the worker dispatched them
        self._written: dict[int, tuple[_Moved, int]] = {}
        # each load not reported failed: (load, position, req, position in the request's load, its slot's writer)
        self._loads: list[tuple[_Moved, int, str, int, tuple[_Moved, int] | None]] = []
        # blocks saved / loaded (not failed) per KV cache group; group -1: in no live request's block table
        self.by_group: dict[str, Counter] = {"save": Counter(), "load": Counter()}
        self._ungrouped_loads: list[tuple[int, str]] = []  # (block, req) whose request the runner lacks yet
        self._step = -1
        self._checked = 0  # loads compared by report() so far
        self._mismatches: list[dict[str, Any]] = []
        save, load, bind = worker._save, worker._load, worker.bind

        def audited_bind(meta):
            self._count_load_groups(final=False)
            self._step = meta.requests_meta[0].step
            return bind(meta)

        def audited_save(batch):
            if batch:
                self._record_save(batch)
            return save(batch)

        def audited_load(placed):
            load(placed)
            self._record_loads(placed)

        worker._save, worker._load, worker.bind = audited_save, audited_load, audited_bind

    def _gather(self, blocks: list[int]) -> list[jax.Array]:
        return _gather(list(self._worker._runner.kv_caches), jnp.asarray(blocks, jnp.int32))

    def _record_save(self, batch) -> None:
        slots = list(map(int, batch.slots))
        if any(c.is_deleted() for c in self._worker._runner.kv_caches):  # the worker skips this save
            for slot in slots:
                self._written.pop(slot, None)
            return
        moved = _Moved(self._step, list(map(int, batch.block_ids)), slots, self._gather(list(map(int, batch.block_ids))))
        self._saves.append(moved)
        self._count_save_groups(moved.blocks)
        for i, slot in enumerate(slots):
            self._written[slot] = (moved, i)

    def _record_loads(self, placed) -> None:
        rows = []
        for p in placed:
            for ld in p.loads:
                failed_req = ld.req_id in self._worker._failed_recving
                for k, (b, s) in enumerate(zip(ld.block_ids, ld.slots)):
                    failed = failed_req or (b - p.block_offset) in self._worker._load_errors
                    rows.append((int(b), int(s), ld.req_id, k, failed))
        if not rows:
            return
        moved = _Moved(self._step, [r[0] for r in rows], [r[1] for r in rows], self._gather([r[0] for r in rows]))
        for i, (_, slot, req, k, failed) in enumerate(rows):
            if not failed:
                self._loads.append((moved, i, req, k, self._written.get(slot)))
                self._ungrouped_loads.append((moved.blocks[i], req))

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

    def report(self) -> dict[str, Any]:
        """Compares every load recorded since the last report; totals since the start."""
        self._count_load_groups(final=True)
        for load, i, req, k, writer in self._loads[self._checked:]:
            got = load.layers(i)
            ok = writer is not None and all(np.array_equal(g, w) for g, w in zip(got, writer[0].layers(writer[1])))
            if not ok:
                self._mismatches.append({"step": load.step, "block": load.blocks[i], "slot": load.slots[i], "req": req,
                                   "never_saved": writer is None})
        self._checked = len(self._loads)
        return {"saves": sum(len(s.slots) for s in self._saves), "loads_checked": self._checked,
                "num_mismatches": len(self._mismatches), "mismatches": self._mismatches[:20],
                "by_group": {kind: dict(sorted(c.items())) for kind, c in self.by_group.items()}}

    def digests(self) -> dict[str, list]:
        """Content digests, to tell a wrong chunk from a wrong byte: each save's [step, slot,
        digest] and each checked load's [step, req, position in its request's load, digest]."""
        saved = [[s.step, slot, _digest(s.layers(i))] for s in self._saves for i, slot in enumerate(s.slots)]
        loaded = [[ld.step, req, k, _digest(ld.layers(i))] for ld, i, req, k, _ in self._loads]
        return {"saved": saved, "loaded": loaded}

    @property
    def steps(self) -> list[dict[str, Any]]:
        """What each step moved, in dispatch order: saves and loads as (block, slot) pairs."""
        out = [(s.step, 0, {"step": s.step, "save": list(zip(s.blocks, s.slots))}) for s in self._saves]
        loads = {id(ld): ld for ld, *_ in self._loads}
        out += [(ld.step, 1, {"step": ld.step, "load": list(zip(ld.blocks, ld.slots))}) for ld in loads.values()]
        return [entry for *_, entry in sorted(out, key=lambda e: (e[0], e[1]))]
