"""Shared by the transfer engine's tests (tests/test_engine_*.py): tpu-inference's real KV cache
layouts (``tpuoffload.sim.tpu_layouts``: the caches its own ``create_kv_caches`` allocates, on 16
CPU devices) filled with random bytes and special bit patterns, the ``engines`` fixture, and
injectors that count or fail what an engine runs.

The bytes of a slot live in the engine's store and are only ever observed through loads: every
check of a slot's content is a load compared byte for byte with the block it was saved from.
"""

from __future__ import annotations

import re
import threading
from collections import Counter
from functools import cache

import jax
import numpy as np

from tpuoffload.sim.tpu_layouts import LAYOUTS, create_caches
from tpuoffload.worker import transfer_engine as te
from tpuoffload.worker.faults import FaultInjector, FaultPoint
from tpuoffload.worker.transfer_engine import SaveResult, TransferEngine
BF16, FP8, INT8 = "bf16-8kv-tp4", "fp8-8kv-tp4", "int8-8kv-tp4"
MIXED = "bf16-mixed-hd256-512-tp4"  # two layer groups
DP = ("bf16-dp2-tp4", "bf16-attndp4-tp2")  # blocks split over 2 / 4 batch shards
NUM_SLOTS = 32


# ---------------------------------------------------------------- helpers
@cache
def template(name: str) -> tuple[jax.Array, ...]:
    return tuple(create_caches(LAYOUTS[name])[0])


# Bit patterns no float op may touch: NaNs with payloads (quiet, signalling, negative), infinity,
# -0, the smallest denormal; for 8-bit types the e4m3fn NaNs.
SPECIAL = {1: [0x7F, 0xFF, 0x80, 0x01, 0x00], 2: [0x7FC1, 0xFFFF, 0x7F81, 0xFF81, 0x7F80, 0x8000, 0x0001]}


@cache
def _random_host(name: str, seed: int) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    out = []
    for c in template(name):
        wire = np.dtype(f"uint{8 * c.dtype.itemsize}")
        raw = np.frombuffer(rng.bytes(c.size * c.dtype.itemsize), wire).reshape(c.shape[0], -1).copy()
        raw[:, :len(SPECIAL[wire.itemsize])] = SPECIAL[wire.itemsize]
        raw.flags.writeable = False
        out.append(raw.view(c.dtype).reshape(c.shape))
    return tuple(out)


def random_caches(name: str, seed: int) -> list[jax.Array]:
    """``name``'s caches (shape, dtype, sharding from tpu-inference) filled with random bytes,
    every block of every layer starting with the SPECIAL bit patterns. Fresh arrays every call
    (a load donates the ones it is given)."""
    return [jax.device_put(h, c.sharding) for h, c in zip(_random_host(name, seed), template(name))]


def host(caches) -> list[np.ndarray]:
    """Each layer's bytes, one row per block."""
    return [np.asarray(c).view(np.uint8).reshape(c.shape[0], -1) for c in caches]


def chunk(host_caches, block: int) -> np.ndarray:
    """A block's bytes in every layer, layers back to back (they may differ in size)."""
    return np.concatenate([h[block] for h in host_caches])


def save_ok(eng, caches, blocks, slots, ids):
    eng.save(caches, blocks, slots, ids)
    assert eng.wait_idle(30)
    assert sorted(eng.drain_results(), key=lambda r: r.save_id) == [SaveResult(i, True) for i in sorted(ids)]


def op_names(ops) -> list[str]:
    return [op.split()[0] for op in ops]


def small_load_ops(groups: int) -> list[str]:
    """What a load moved in one part logs: its reads per group, then its scatters per group."""
    return ["load.read"] * groups + ["load"] * groups


def op_shape(op: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.search(r"shape=\(([^)]*)\)", op).group(1).split(",") if x.strip())


def logged_blocks(op: str) -> list[int]:
    return [int(x) for x in re.search(r"blocks=\[([^]]*)\]", op).group(1).split(",") if x.strip()]


def logged_copies(op: str) -> int:
    return int(re.search(r"\bcopies=(\d+)", op).group(1))


def same_step(a: TransferEngine, b: TransferEngine):
    """Close the step on two engines; they must have dispatched the same thing."""
    da, db = a.finish_step(), b.finish_step()
    assert da.digest == db.digest and da.ops == db.ops, (da.ops, db.ops)
    return da


class Counting:
    """Counts what an engine runs: its per-group save and load programs, and any transfer it
    starts itself."""

    def __init__(self, monkeypatch, eng: TransferEngine) -> None:
        self.calls: Counter[str] = Counter()
        monkeypatch.setattr(te.jax, "device_put", self._wrap("device_put", jax.device_put))
        monkeypatch.setattr(te.jax, "make_array_from_callback",
                            self._wrap("from_callback", jax.make_array_from_callback))
        for prog in eng._programs:
            monkeypatch.setattr(prog, "save", self._wrap("save", prog.save))
            for name in ("load", "read", "scatter"):
                monkeypatch.setattr(prog, name, self._wrap(name, getattr(prog, name)))

    def _wrap(self, name, fn):
        def counted(*a, **k):
            self.calls[name] += 1
            return fn(*a, **k)
        return counted

    def programs(self) -> Counter[str]:
        return Counter({k: v for k, v in self.calls.items() if k in ("save", "load", "read", "scatter")})


class Injected(FaultInjector):
    """One fault at one point, acting only while armed: ``raise`` (the whole operation fails),
    ``positions`` (positions 1 and 3 fail alone) or ``block`` (a slow host: waits until
    ``release``). Records every call."""

    def __init__(self, point: FaultPoint, mode: str, positions=(1, 3)) -> None:
        assert mode in ("raise", "positions", "block")
        self.point, self.mode, self.positions = point, mode, frozenset(positions)
        self._lock = threading.Lock()  # guards calls, _armed, _gate
        self.calls: list[tuple[FaultPoint, int]] = []
        self._armed = False
        self._gate = threading.Event()

    def arm(self) -> None:
        with self._lock:
            self._armed, self._gate = True, threading.Event()

    def release(self) -> None:
        with self._lock:
            self._gate.set()

    def disarm(self) -> None:
        with self._lock:
            self._armed = False
            self._gate.set()

    def hit(self, point: FaultPoint, n: int) -> set[int]:
        with self._lock:
            self.calls.append((point, n))
            active, gate = self._armed and point is self.point, self._gate
        if not active:
            return set()
        if self.mode == "raise":
            raise OSError(f"injected failure at {point.name}")
        if self.mode == "positions":
            return {p for p in self.positions if p < n}
        if not gate.wait(20):  # safety net only: every test releases
            raise TimeoutError("injected slow host never released")
        return set()


