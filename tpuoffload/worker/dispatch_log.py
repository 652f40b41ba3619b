"""Per-step record of every JAX operation the transfer engine dispatched.

Two hosts that ran the same step must produce the same digest; the pod-slice harness compares
them every step, and a mismatch names the first diverging op.

``record`` only keeps its arguments; the lines are formatted and hashed in ``finish_step``, off
the dispatch path, where formatting a save's line (two lists of ints) and hashing it would cost
the engine's main thread time between its program's dispatch and ``save()``'s return
(docs/performance.md, "Dispatch log formatted late"). The text and the digest are what eager
formatting produced; callers hand over values they never mutate afterwards (the engine's fresh
arrays, lists and tuples of ints). An array is written as the list of its values.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StepDigest:
    """One step's dispatches: the step number, a digest of its op lines, and the lines."""

    step: int
    digest: str
    ops: tuple[str, ...]


def _line(op: str, fields: dict) -> str:
    return op + " " + " ".join(f"{k}={v.tolist() if isinstance(v, np.ndarray) else v}" for k, v in fields.items())


class DispatchLog:
    """The engine's record of every program it dispatched in the current step: ``record`` keeps each
    op's fields, ``finish_step`` formats them and returns the step's ``StepDigest`` (the same on
    every host that dispatched the same programs)."""

    def __init__(self) -> None:
        self._step = 0
        self._ops: list[tuple[str, dict]] = []

    def record(self, op: str, **fields) -> None:
        self._ops.append((op, fields))

    def finish_step(self) -> StepDigest:
        lines = tuple(_line(op, fields) for op, fields in self._ops)
        digest = hashlib.blake2b(digest_size=16)
        for line in lines:
            digest.update(line.encode())
            digest.update(b"\n")
        out = StepDigest(self._step, digest.hexdigest(), lines)
        self._step += 1
        self._ops = []
        return out
