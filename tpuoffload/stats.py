"""Transfer statistics that merge by Counter union.

Each report a process makes is keyed ``"<source>|<seq>|<name>"`` (source: a host id, or "sched"
for the scheduler, "sched-dp<rank>" for each DPScheduler rank's; seq: that source's report
number). Merging takes the per-key maximum, so:

* merging the same report twice counts it once (idempotent),
* merge order does not matter (commutative, associative),
* the same counter from two hosts stays two entries and ``reduce`` adds them.

The payload is a plain ``dict[str, int | float]`` so it survives vLLM's serialization between
processes and is rebuilt by ``build_kv_connector_stats``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from typing_extensions import override
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from tpuoffload import counters as C


def make_report(source: str | int, seq: int, values: Mapping[str, int | float]) -> dict[str, int | float]:
    """One process's report: the non-zero ``values`` under keys unique to (source, seq)."""
    return {f"{source}|{seq}|{name}": v for name, v in values.items() if v}


@dataclass
class OffloadStats(KVConnectorStats):
    """The connector's stats as vLLM carries them (``KVConnectorStats``): counter name -> value, merged
    across workers by Counter union (per-key maximum, idempotent and order-free) and reduced for
    vLLM's log line."""

    data: dict[str, int | float] = field(default_factory=dict)

    @override
    def aggregate(self, other: KVConnectorStats) -> "OffloadStats":
        """Invariant 7: Counter union (per-key maximum), idempotent and order-free."""
        merged = Counter(self.data) | Counter(other.data)  # per-key max: idempotent union
        return OffloadStats(dict(merged))

    @override
    def reset(self) -> None:
        self.data = {}

    @override
    def is_empty(self) -> bool:
        return not self.data

    def totals(self) -> Counter[str]:
        out: Counter[str] = Counter()
        for key, value in self.data.items():
            out[key.rsplit("|", 1)[-1]] += value
        return out

    @override
    def reduce(self) -> dict[str, int | float]:
        """The figures an operator logs for the interval."""
        t = self.totals()
        out: dict[str, int | float] = {name: t[name] for name in C.NAMES if t[name]}
        if t[C.LOOKUP_TOKENS]:
            out["hit_rate"] = round(t[C.HIT_TOKENS] / t[C.LOOKUP_TOKENS], 4)
        if t[C.SAVE_SECONDS]:
            out["save_GiB_per_s"] = round(t[C.BYTES_SAVED] / t[C.SAVE_SECONDS] / 2**30, 3)
        if t[C.LOAD_SECONDS]:
            out["load_GiB_per_s"] = round(t[C.BYTES_LOADED] / t[C.LOAD_SECONDS] / 2**30, 3)
        return out
