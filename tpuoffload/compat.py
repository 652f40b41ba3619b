"""The one place that knows where moving outside code lives (design brief: "one small compatibility
module, not scattered checks"). Product code reaches tpu-inference and vLLM internals that move
between releases only through these functions.

* tpu-inference is being renamed vLLM JAX: its import package ``tpu_inference`` is expected to
  become ``vllm_jax``. ``tpu_inference()`` is whichever is installed (``vllm_jax`` first),
  ``tpu_inference_module("core.sched.dp_scheduler")`` a submodule of it, and
  ``is_tpu_inference_name`` tells whether a dotted module or class name is one of its, under
  either package name (the executor and DPScheduler checks of ``manager/topology.py`` need this).
* vLLM 0.33 moved KV-cache planning (``get_kv_cache_configs``,
  ``generate_scheduler_kv_cache_config``...) from ``vllm.v1.core.kv_cache_utils`` to
  ``vllm.v1.core.kv_cache_planning``; the block-hash helpers stay in ``kv_cache_utils``.
  ``kv_cache_function(name)`` finds a function in the new module first, then the old one.

Nothing here imports anything at module import time: the scheduler half runs without
tpu-inference installed (vLLM on GPU hosts, the tests' CPU scheduler).
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Any

#: tpu-inference's import package, newest name first.
TPU_INFERENCE_PACKAGES = ("vllm_jax", "tpu_inference")
#: Where vLLM keeps its KV-cache planning functions, newest first (0.33, then 0.32 and before).
KV_CACHE_PLANNING_MODULES = ("vllm.v1.core.kv_cache_planning", "vllm.v1.core.kv_cache_utils")


def _import_first(names: tuple[str, ...]) -> ModuleType:
    """The first of ``names`` that imports. A module that exists but fails inside its own import
    is an error of that module and propagates; only its absence moves on to the next name."""
    missing = []
    for name in names:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is None or not (name == exc.name or name.startswith(exc.name + ".")):
                raise  # the module exists; something it imports is missing
            missing.append(name)
    raise ModuleNotFoundError(f"none of {', '.join(missing)} is installed", name=names[-1])


@functools.cache
def tpu_inference() -> ModuleType:
    """tpu-inference's package as installed: ``vllm_jax`` (its new name) or ``tpu_inference``."""
    return _import_first(TPU_INFERENCE_PACKAGES)


def tpu_inference_module(submodule: str) -> ModuleType:
    """``submodule`` (dotted, relative to the package) of the installed tpu-inference."""
    return importlib.import_module(f"{tpu_inference().__name__}.{submodule}")


def is_tpu_inference_name(name: str, submodule: str = "") -> bool:
    """Whether the dotted ``name`` lies in tpu-inference (under either package name), and, with
    ``submodule``, in that submodule of it (``"core.sched.dp_scheduler"``)."""
    for pkg in TPU_INFERENCE_PACKAGES:
        root = f"{pkg}.{submodule}" if submodule else pkg
        if name == root or name.startswith(root + "."):
            return True
    return False


@functools.cache
def _planning_modules() -> tuple[ModuleType, ...]:
    out = []
    for name in KV_CACHE_PLANNING_MODULES:
        try:
            out.append(_import_first((name,)))
        except ModuleNotFoundError:
            continue
    if not out:
        raise ModuleNotFoundError(f"none of {', '.join(KV_CACHE_PLANNING_MODULES)} is installed")
    return tuple(out)


def kv_cache_function(name: str) -> Any:
    """vLLM's KV-cache planning or block-hash function ``name``, wherever this vLLM keeps it."""
    for module in _planning_modules():
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"vLLM has no {name} in {', '.join(m.__name__ for m in _planning_modules())}")
