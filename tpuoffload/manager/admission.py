"""Load admission: how many requests may wait with a loaded prefix before they run.

Each request vLLM admits with an asynchronous load holds what it allocated for the hit until it
runs. vLLM bounds that for the blocks its scheduler sees (``Scheduler``: an async load is admitted
only if it fits beside the reservations of the loads already in flight). tpu-inference's hybrid
coordinator for GDN/mamba models in align mode (``TPUHybridKVCacheCoordinator``) keeps the state
rows in a compact pool of their own, and its ``can_allocate_tokens`` applies that reservation to
the attention pool only: every loading request takes a state row (the row its hit's state is
loaded into), and a burst of prefix hits can take every row. Then no loaded request finds the row
of its next block, none runs, nothing frees a row, and the engine waits forever (reproduced in
``tests/test_gdn_admission.py`` on vLLM's Scheduler with tpu-inference's coordinator).

So with such a pool the scheduler half admits a load only while fewer than ``limit`` requests hold
loaded prefixes that have not run yet; the next hit is answered "ask again" (vLLM then skips the
request for this step and asks again in the next one, scheduling the requests behind it). The
limit leaves, of the pool's rows (less the null row), the rows every request of a full batch can
hold while it runs (``max_num_seqs`` requests of ``num_speculative_tokens + 2`` rows each:
tpu-inference's ``mamba_blocks_per_request`` minimum in align mode), and never less than one, so
a loaded request always finds its rows once nothing else runs.

Every other deployment has nothing to bound here: ``NO_LIMIT``, decided once at construction.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Container
from typing import TYPE_CHECKING

from typing_extensions import override

from tpuoffload.manager.kv_groups import KVCacheGroups

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_interface import KVCacheConfig


class LoadAdmission(ABC):
    """Whether one more request may be admitted with a load now. The scheduler half tells it
    when a request was admitted with a load, when requests ran, and when one finished."""

    @abstractmethod
    def may_load(self) -> bool:
        """True when a request admitted with a load now could not keep loaded requests from
        running; False: answer vLLM "ask again" (the hit stays, the request waits a step)."""

    @abstractmethod
    def admitted(self, req_id: str) -> None:
        """vLLM admitted ``req_id`` with a load: it holds its hit's allocation until it runs."""

    @abstractmethod
    def ran(self, scheduled: Container[str]) -> None:
        """The requests in ``scheduled`` run in this step: they hold what any running request holds."""

    @abstractmethod
    def finished(self, req_id: str) -> None:
        """``req_id`` finished or was aborted (before or after its load)."""

    @property
    @abstractmethod
    def waiting(self) -> int:
        """Requests admitted with a load that have not run yet (a gauge)."""

    @abstractmethod
    def describe(self) -> str:
        """The rule, for the connector's start-up log."""


class _NoLimit(LoadAdmission):
    """vLLM's own reservations bound every pool the loads take from."""

    @override
    def may_load(self) -> bool:
        return True

    @override
    def admitted(self, req_id: str) -> None:
        pass

    @override
    def ran(self, scheduled: Container[str]) -> None:
        pass

    @override
    def finished(self, req_id: str) -> None:
        pass

    @property
    @override
    def waiting(self) -> int:
        return 0

    @override
    def describe(self) -> str:
        return "admitted as vLLM reserves for them"


NO_LIMIT: LoadAdmission = _NoLimit()


class StateRowLimit(LoadAdmission):
    """At most ``limit`` requests hold loaded prefixes before they run (module doc). Used on the
    scheduler's thread only, like the rest of the scheduler half: no lock."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"a load admission limit of {limit} would admit no load")
        self.limit = limit
        self._waiting: set[str] = set()

    @override
    def may_load(self) -> bool:
        return len(self._waiting) < self.limit

    @override
    def admitted(self, req_id: str) -> None:
        self._waiting.add(req_id)

    @override
    def ran(self, scheduled: Container[str]) -> None:
        if self._waiting:
            self._waiting = {r for r in self._waiting if r not in scheduled}

    @override
    def finished(self, req_id: str) -> None:
        self._waiting.discard(req_id)

    @property
    @override
    def waiting(self) -> int:
        return len(self._waiting)

    @override
    def describe(self) -> str:
        return f"at most {self.limit} loaded requests wait to run (GDN/mamba state rows in a compact pool)"


def load_admission(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig",
                   kv_groups: KVCacheGroups) -> LoadAdmission:
    """The admission this scheduler needs: ``StateRowLimit`` with a GDN/mamba state group in
    tpu-inference's compact pool (``kv_cache_config.mamba_num_blocks``: the rows of this scheduler,
    one DP rank's under DPScheduler), else ``NO_LIMIT``."""
    rows = int(getattr(kv_cache_config, "mamba_num_blocks", None) or 0)
    if kv_groups.state_group is None or rows <= 0:
        return NO_LIMIT
    spec = vllm_config.speculative_config
    rows_per_request = (spec.num_speculative_tokens if spec is not None else 0) + 2
    batch = vllm_config.scheduler_config.max_num_seqs
    return StateRowLimit(max(1, rows - 1 - batch * rows_per_request))
