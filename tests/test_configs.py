"""Every file in configs/ is a kv-transfer-config vLLM accepts and tpuoffload validates."""

import glob
import json
import os

import pytest
from vllm.config import KVTransferConfig

from tpuoffload.config import parse_config

CONFIGS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "configs", "*.json")))


def test_configs_exist():
    names = {os.path.basename(p) for p in CONFIGS}
    assert {"qwen3-coder-480b-multihost.json", "single-host.json"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_config_is_valid(path):
    with open(path) as f:
        raw = json.load(f)
    cfg = KVTransferConfig(**raw)  # vLLM's own validation of the top-level keys
    assert cfg.kv_connector == "TPUOffloadConnector"
    assert cfg.kv_connector_module_path == "tpuoffload.connector"
    assert cfg.kv_load_failure_policy == "recompute"  # vLLM's default "fail" would abort requests
    parsed = parse_config(cfg.kv_connector_extra_config, environ={})
    assert parsed.cpu_bytes_to_use == raw["kv_connector_extra_config"]["cpu_bytes_to_use"]


def test_multihost_script_uses_its_config():
    script = os.path.join(os.path.dirname(__file__), "..", "configs", "qwen3-coder-480b-multihost.sh")
    with open(script) as f:
        text = f.read()
    assert "qwen3-coder-480b-multihost.json" in text and "--tensor-parallel-size=16" in text
