"""Per-step record of every JAX operation the transfer engine dispatched.

Two hosts that ran the same step must produce the same digest; the pod-slice harness compares
them every step, and a mismatch names the first diverging op.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True)
class StepDigest:
    step: int
    digest: str
    ops: tuple[str, ...]


class DispatchLog:
    def __init__(self) -> None:
        self._step = 0
        self._ops: list[str] = []
        self._hash = hashlib.blake2b(digest_size=16)

    def record(self, op: str, **fields) -> None:
        line = op + " " + " ".join(f"{k}={v}" for k, v in fields.items())
        self._ops.append(line)
        self._hash.update(line.encode())
        self._hash.update(b"\n")

    def finish_step(self) -> StepDigest:
        out = StepDigest(self._step, self._hash.hexdigest(), tuple(self._ops))
        self._step += 1
        self._ops = []
        self._hash = hashlib.blake2b(digest_size=16)
        return out
