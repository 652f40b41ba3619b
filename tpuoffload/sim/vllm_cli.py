"""vLLM's own command line (``vllm serve ...``) with the engine shims installed first.

    python -m tpuoffload.sim.vllm_cli serve MODEL [vLLM's arguments]

The launcher (``tpuoffload.sim.serve_stack``) starts the OpenAI API server through this module:
it installs every shim of ``tpuoffload.sim.engine_shims`` at import (before vLLM resolves its
platform) and then runs vLLM's ``vllm`` entry point as is. The EngineCore process vLLM starts from
the API server inherits the shims (forked), or re-imports this module as ``__mp_main__`` (spawned),
which installs them again. The Ray workers get them through ``ray_worker_setup`` (the launcher's
runtime_env hook, ``runtime_env_hook``). Test and demo code: product code never imports it.
"""

from __future__ import annotations

import os
import sys
from typing import Any

def runtime_env_hook(runtime_env: dict[str, Any] | None) -> dict[str, Any]:
    """RAY_RUNTIME_ENV_HOOK: the job's runtime_env (tpu-inference's executor calls ``ray.init()``
    without one) plus the shims' setup hook for every Ray worker process."""
    env = dict(runtime_env or {})
    env["worker_process_setup_hook"] = "tpuoffload.sim.vllm_cli.ray_worker_setup"
    return env


def ray_worker_setup() -> None:
    """Ray's worker_process_setup_hook: the engine shims, before the worker builds its actor."""
    from tpuoffload.sim import engine_shims

    engine_shims.install()


#: What the EngineCore prints once built (``serve_stack.engine_classes`` reads it from the log).
CLASSES_LINE = "tpuoffload-serve engine classes:"


def _install() -> None:
    from tpuoffload.sim import engine_shims

    engine_shims.install()
    if os.environ.get(engine_shims.DP_AGGREGATOR_ENV) == "1":  # an experiment, not a shim (see its docstring)
        engine_shims.dp_output_aggregator()
    _log_engine_classes()


def _log_engine_classes() -> None:
    """Observation only, not a shim: once vLLM's EngineCore is built, print the classes of its
    executor, scheduler and (through DPScheduler) rank schedulers, as the running engine has them."""
    import logging

    from vllm.v1.engine.core import EngineCore

    built = EngineCore.__init__

    def init_and_log(self, *args, **kwargs):
        built(self, *args, **kwargs)
        sched = self.scheduler
        ranks = getattr(getattr(sched, "vllm_config", None), "scheduler_config", None)
        rank_cls = getattr(ranks, "_original_scheduler_cls", None)
        logging.getLogger("vllm").warning(
            "%s executor=%s.%s scheduler=%s.%s rank_scheduler=%s", CLASSES_LINE, type(self.model_executor).__module__,
            type(self.model_executor).__name__, type(sched).__module__, type(sched).__name__,
            f"{rank_cls.__module__}.{rank_cls.__name__}" if rank_cls is not None else "-")

    EngineCore.__init__ = init_and_log


_install()  # at import: before vLLM resolves its platform, in the API server and a spawned EngineCore


def main() -> int:
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    return vllm_main() or 0


if __name__ == "__main__":
    sys.exit(main())
