"""The real engine's byte audit (tpuoffload/sim/byte_audit.py) must see a wrong block: a negative
control on a stand-in worker whose "load" writes the saved bytes, or on purpose other bytes."""

from __future__ import annotations

from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np

from tpuoffload.messages import LoadRequest, SaveBatch
from tpuoffload.sim.byte_audit import ByteAudit


class _Worker:
    """What ByteAudit wraps: bind, _save, _load, the runner's caches and the failure sets. Its
    load copies each slot's bytes (kept by its save) into the destination blocks, plus ``skew``."""

    def __init__(self, skew: float) -> None:
        rng = np.random.default_rng(0)
        self._runner = SimpleNamespace(kv_caches=[jnp.asarray(rng.standard_normal((8, 4), np.float32)) for _ in range(2)],
                                       requests={})
        self._load_errors: set[int] = set()
        self._failed_recving: set[str] = set()
        self._store: dict[int, list[np.ndarray]] = {}
        self._skew = skew

    def bind(self, meta) -> None:
        pass

    def _save(self, batch: SaveBatch) -> None:
        for b, s in zip(batch.block_ids, batch.slots):
            self._store[s] = [np.asarray(c)[b] for c in self._runner.kv_caches]

    def _load(self, placed) -> None:
        caches = list(self._runner.kv_caches)
        for p in placed:
            for ld in p.loads:
                for b, s in zip(ld.block_ids, ld.slots):
                    caches = [c.at[b].set(row + self._skew) for c, row in zip(caches, self._store[s])]
        self._runner.kv_caches = caches


def _run(skew: float) -> dict:
    worker = _Worker(skew)
    audit = ByteAudit(worker)
    worker.bind(SimpleNamespace(requests_meta=[SimpleNamespace(step=0)]))
    worker._save(SaveBatch(block_ids=(1, 2), slots=(0, 1), save_ids=(0, 1)))
    load = LoadRequest("r", block_ids=(5, 6), slots=(0, 1), save_ids=(0, 1))
    worker._load([SimpleNamespace(loads=(load,), block_offset=0)])
    return audit.report()


def test_loaded_blocks_equal_to_the_saved_ones_pass():
    report = _run(0.0)
    assert report["saves"] == 2 and report["loads_checked"] == 2 and report["num_mismatches"] == 0, report


def test_a_loaded_block_that_differs_is_reported():
    report = _run(1.0)
    assert report["loads_checked"] == 2 and report["num_mismatches"] == 2, report
    assert [(m["block"], m["slot"]) for m in report["mismatches"]] == [(5, 0), (6, 1)]
