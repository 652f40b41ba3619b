"""Every file in configs/ is a kv-transfer-config vLLM accepts and tpuoffload validates; the llm-d
tiered-prefix-cache deployment's model server and router agree with each other and with it."""

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


# ---------------------------------------------------------------------------- llm-d tiered prefix cache
LLMD = os.path.join(os.path.dirname(__file__), "..", "configs", "llm-d-tiered-prefix-cache")


def _llmd():
    """(vLLM leader's serve arguments, the router's EndpointPickerConfig, the router values)."""
    import shlex

    import yaml

    with open(os.path.join(LLMD, "modelserver-patch.yaml")) as f:
        lws = yaml.safe_load(f)
    (leader,) = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"]
    (script,) = leader["args"]
    serve = next(line for line in script.replace("\\\n", " ").splitlines() if "vllm serve" in line)
    argv = shlex.split(serve)
    with open(os.path.join(LLMD, "router.values.yaml")) as f:
        values = yaml.safe_load(f)
    epp = values["router"]["epp"]
    picker = yaml.safe_load(epp["pluginsCustomConfig"][epp["pluginsConfigFile"]])
    return argv[argv.index("serve"):], picker, values


def _flag(argv, name):
    for i, a in enumerate(argv):
        if a == name:
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    raise AssertionError(f"{name} missing")


def test_llmd_model_server_runs_tpuoffload_and_publishes_kv_events():
    from vllm.config.kv_events import KVEventsConfig

    argv, picker, _ = _llmd()
    with open(os.path.join(os.path.dirname(__file__), "..", "configs", "qwen3-coder-480b-multihost.json")) as f:
        assert json.loads(_flag(argv, "--kv-transfer-config")) == json.load(f)  # the multi-host deployment's
    events = KVEventsConfig(**json.loads(_flag(argv, "--kv-events-config")))  # vLLM's own validation
    assert events.enable_kv_cache_events and events.publisher == "zmq"
    assert "*" not in events.endpoint and events.endpoint.endswith(":5556")  # connects to the router's Service
    assert events.topic == "kv@$(POD_IP):8000@" + argv[1] and _flag(argv, "--port") == "8000"
    assert _flag(argv, "--data-parallel-size") == "1" and _flag(argv, "--tensor-parallel-size") == "16"
    assert "--enable-prefix-caching" in argv


def test_llmd_router_scores_host_ram_from_kv_events():
    argv, picker, values = _llmd()
    plugins = {p.get("name", p["type"]): p for p in picker["plugins"]}
    assert not any(p["type"] == "approx-prefix-cache-producer" for p in picker["plugins"])
    assert "lruCapacityPerServer" not in json.dumps(picker)
    producer = plugins["precise-prefix-cache-producer"]["parameters"]
    assert producer["tokenProcessorConfig"]["blockSize"] == int(_flag(argv, "--block-size"))
    tiers = {t["name"]: t["weight"] for t in producer["indexerConfig"]["kvCacheBackendConfigs"]}
    assert tiers == {"gpu": 1.0, "cpu": 0.8}  # vLLM's media GPU and CPU (tpuoffload's host RAM)
    kv = producer["kvEventsConfig"]
    assert kv["zmqEndpoint"] == "tcp://*:5556" and not kv["discoverPods"]
    from vllm.config.kv_events import KVEventsConfig

    topic = KVEventsConfig(**json.loads(_flag(argv, "--kv-events-config"))).topic
    assert topic.startswith(kv["topicFilter"])
    assert plugins["prefix-cache-scorer"]["parameters"]["prefixMatchInfoProducerName"] == "precise-prefix-cache-producer"
    profile = {p["pluginRef"] for p in picker["schedulingProfiles"][0]["plugins"]}
    assert "prefix-cache-scorer" in profile
    ports = {p["name"]: p["port"] for p in values["router"]["extraServicePorts"]}
    assert ports["zmq"] == 5556 and values["router"]["modelServers"]["matchLabels"]["role"] == "leader"
