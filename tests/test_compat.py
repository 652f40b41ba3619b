"""tpuoffload/compat.py against the installed vLLM and tpu-inference (and stand-ins for the releases
that are not installable here: a ``vllm_jax`` package, vLLM 0.33's ``kv_cache_planning``), and the
connector's registration with vLLM's own ``KVConnectorFactory``."""
from __future__ import annotations

import sys
import types

import pytest

from tpuoffload import compat


@pytest.fixture
def fresh(monkeypatch):
    """compat's caches cleared before and after (a stand-in module never outlives its test)."""
    compat.tpu_inference.cache_clear()
    compat._planning_modules.cache_clear()
    yield monkeypatch
    compat.tpu_inference.cache_clear()
    compat._planning_modules.cache_clear()


def test_tpu_inference_is_the_installed_package(fresh):
    import tpu_inference

    assert compat.tpu_inference() is tpu_inference  # no vllm_jax installed here
    from tpu_inference import envs  # a submodule that imports without torchax (tpuoffload/sim shims the rest)

    assert compat.tpu_inference_module("envs") is envs


def test_vllm_jax_is_preferred_once_installed(fresh):
    pkg = types.ModuleType("vllm_jax")
    pkg.__path__ = []  # a package
    sub = types.ModuleType("vllm_jax.core")
    fresh.setitem(sys.modules, "vllm_jax", pkg)
    fresh.setitem(sys.modules, "vllm_jax.core", sub)
    assert compat.tpu_inference() is pkg
    assert compat.tpu_inference_module("core") is sub


def test_a_package_that_fails_inside_its_import_is_not_skipped(fresh):
    """Only a missing package moves on to the next name; a broken one is an error of its own."""
    broken = types.ModuleType("vllm_jax")
    fresh.setitem(sys.modules, "vllm_jax", None)  # Python's marker for "import fails"
    with pytest.raises(ModuleNotFoundError):
        compat._import_first(("vllm_jax",))
    fresh.setitem(sys.modules, "vllm_jax", broken)

    def boom(name, *a, **k):
        raise ModuleNotFoundError("No module named 'jaxlib_x'", name="jaxlib_x")

    fresh.setattr(compat.importlib, "import_module", boom)
    with pytest.raises(ModuleNotFoundError, match="jaxlib_x"):
        compat._import_first(("vllm_jax", "tpu_inference"))


@pytest.mark.parametrize("name,sub,expected", [
    ("tpu_inference.executors.ray_distributed_executor.RayDistributedExecutor", "", True),
    ("vllm_jax.executors.multiproc_executor.MultiprocExecutor", "", True),
    ("tpu_inference.core.sched.dp_scheduler", "core.sched.dp_scheduler", True),
    ("vllm_jax.core.sched.dp_scheduler", "core.sched.dp_scheduler", True),
    ("tpu_inference.core.sched.dp_scheduler_x", "core.sched.dp_scheduler", False),
    ("tpu_inference_extra.core", "", False),
    ("vllm.v1.executor.multiproc_executor.MultiprocExecutor", "", False),
])
def test_is_tpu_inference_name(name, sub, expected):
    assert compat.is_tpu_inference_name(name, sub) is expected


def test_kv_cache_functions_from_vllm_0_32(fresh):
    from vllm.v1.core import kv_cache_utils

    for name in ("get_kv_cache_configs", "generate_scheduler_kv_cache_config", "get_request_block_hasher",
                 "init_none_hash"):
        assert compat.kv_cache_function(name) is getattr(kv_cache_utils, name)
    with pytest.raises(AttributeError, match="no_such_function"):
        compat.kv_cache_function("no_such_function")


def test_kv_cache_planning_of_vllm_0_33_comes_first(fresh):
    """vLLM 0.33 keeps the planning functions in ``kv_cache_planning``: found there first; what
    stayed in ``kv_cache_utils`` (the block-hash helpers) is still found."""
    from vllm.v1.core import kv_cache_utils

    planning = types.ModuleType("vllm.v1.core.kv_cache_planning")
    planning.get_kv_cache_configs = lambda *a, **k: "0.33"
    fresh.setitem(sys.modules, "vllm.v1.core.kv_cache_planning", planning)
    assert compat.kv_cache_function("get_kv_cache_configs") is planning.get_kv_cache_configs
    assert compat.kv_cache_function("init_none_hash") is kv_cache_utils.init_none_hash


def test_connector_is_registered_with_vllms_factory_by_name():
    """vLLM's own factory resolves the name to the class, a second registration is refused
    quietly, and a MultiConnector parent rebuilds the connector's serialized stats by name."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    from tpuoffload import connector
    from tpuoffload.stats import OffloadStats

    assert KVConnectorFactory.get_connector_class_by_name("TPUOffloadConnector") is connector.TPUOffloadConnector
    assert connector.register_with_vllm() is False  # already registered at import: no error
    assert KVConnectorFactory.get_connector_class_by_name("TPUOffloadConnector") is connector.TPUOffloadConnector
    multi = MultiConnector.build_kv_connector_stats(data={"TPUOffloadConnector": {"chunks_saved": 3}})
    stats = multi.data["TPUOffloadConnector"]
    assert isinstance(stats, OffloadStats) and stats.data == {"chunks_saved": 3}


def test_registration_is_the_import_itself(monkeypatch):
    """Negative control: with the registry emptied of the name, vLLM's factory no longer finds the
    class; registering (what the import does) brings it back."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from tpuoffload import connector

    monkeypatch.setattr(KVConnectorFactory, "_registry",
                        {k: v for k, v in KVConnectorFactory._registry.items() if k != "TPUOffloadConnector"})
    with pytest.raises(ValueError, match="not registered"):
        KVConnectorFactory.get_connector_class_by_name("TPUOffloadConnector")
    assert connector.register_with_vllm() is True
    assert KVConnectorFactory.get_connector_class_by_name("TPUOffloadConnector") is connector.TPUOffloadConnector
