"""tpuoffload on the real serving stack (issue 33): ``vllm serve`` (OpenAI API server, AsyncLLM,
EngineCore in its own process, ``--async-scheduling``) on tpu-inference's TpuPlatform with its Ray
executor over a local Ray cluster of 2 nodes ("hosts") on this machine, ``jax.distributed`` across
them, driven by vLLM's own ``vllm bench serve --dataset-name prefix_repetition`` and plain OpenAI
completions at temperature 0; once without and once with TPUOffloadConnector (the README's
``--kv-transfer-config``). Two rounds, ``POST /reset_prefix_cache`` between them; the HBM KV cache
(``--num-gpu-blocks-override``) holds fewer blocks than the prefixes, so HBM evicts them.

Everything runs in one child process under an outside timeout that kills it and then every process
of the run (Ray nodes, their workers, the server and its EngineCore), found by a marker in their
environment; see ``tpuoffload/sim/serve_stack.py``. Shims: ``tpuoffload/sim/engine_shims.py``.
"""

from __future__ import annotations

import pytest

import os
import subprocess
import sys
import time

from tpuoffload.sim.serve_stack import MARKER_ENV, Workload, run_child, run_processes, sweep, write_tokenizer

SHAPE = "tp2-2hosts"
slow = pytest.mark.slow  # one Ray cluster, two server start-ups: about 10 minutes on an idle 2-core machine
# the first test that asks for the report waits for the whole run (its own outside timeout: run_child's)
TIMEOUT_S = 2700


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return run_child(str(tmp_path_factory.mktemp("serve")), SHAPE, timeout_s=TIMEOUT_S - 60)


@pytest.fixture(scope="module")
def runs(report):
    return report["runs"]["baseline"], report["runs"]["connector"]


@slow
@pytest.mark.timeout(TIMEOUT_S)
def test_the_real_stack_ran(runs):
    for run in runs:
        # as the running EngineCore printed them
        assert run["classes"]["executor"] == "tpu_inference.executors.ray_distributed_executor_v2.RayDistributedExecutorV2"
        assert run["classes"]["scheduler"] == "vllm.v1.core.sched.async_scheduler.AsyncScheduler", run["classes"]


@slow
@pytest.mark.timeout(TIMEOUT_S)
def test_every_request_succeeds(runs):
    w = Workload()
    for run in runs:
        for rnd in run["rounds"]:
            assert rnd["bench"]["completed"] == w.num_prompts and rnd["bench"]["failed"] == 0, rnd["bench"]
            assert all(c["ok"] for c in rnd["completions"]), rnd["completions"]


@slow
@pytest.mark.timeout(TIMEOUT_S)
def test_greedy_tokens_equal_without_the_connector(runs):
    base, conn = runs
    for rb, rc in zip(base["rounds"], conn["rounds"]):
        texts_b = [c["text"] for c in rb["completions"]]
        assert [c["text"] for c in rc["completions"]] == texts_b
        assert all(len(t.split()) == Workload().output_len for t in texts_b)  # one word per token
    # the engine without the connector gives the same tokens in both rounds (deterministic)
    assert [c["text"] for c in base["rounds"][0]["completions"]] == [c["text"] for c in base["rounds"][1]["completions"]]


@slow
@pytest.mark.timeout(TIMEOUT_S)
def test_second_round_hits_host_ram(runs):
    base, conn = runs
    assert conn["reset"][0] == 200 and base["reset"][0] == 200
    hits = conn["rounds"][1]["external"]["vllm:external_prefix_cache_hits_total"]
    assert hits > 0, conn["rounds"][1]["external"]
    assert base["rounds"][1]["external"]["vllm:external_prefix_cache_hits_total"] == 0


@slow
@pytest.mark.timeout(TIMEOUT_S)
def test_the_connectors_prometheus_series(runs):
    base, conn = runs
    assert "vllm:tpuoffload_chunks_saved_total" in conn["tpuoffload_series"], conn["tpuoffload_series"]
    assert "vllm:tpuoffload_chunks_loaded_total" in conn["tpuoffload_series"], conn["tpuoffload_series"]
    assert base["tpuoffload_series"] == []


@slow
@pytest.mark.timeout(TIMEOUT_S)
def test_dispatch_digests_identical_on_every_host(runs):
    _, conn = runs
    hosts = {name: snap for name, snap in conn["snapshots"].items() if snap.get("kind") == "host"}
    assert sorted(hosts) == ["host-0.json", "host-1.json"], sorted(conn["snapshots"])
    digests = [dict(map(tuple, snap["recent_digests"])) for snap in hosts.values()]
    common = set(digests[0]) & set(digests[1])
    assert len(common) >= 8, digests
    assert all(digests[0][s] == digests[1][s] for s in common), digests
    assert hosts["host-0.json"]["totals"]["chunks_saved"] > 0


@slow
@pytest.mark.timeout(TIMEOUT_S)
def test_every_host_and_scheduler_half_idle_at_the_end(runs):
    _, conn = runs
    for name, snap in conn["snapshots"].items():
        if snap.get("kind") == "host":
            assert snap["inflight_chunks"] == 0 and snap["staging_bytes"] == 0, (name, snap)
        elif snap.get("kind") == "scheduler":
            assert all(snap[g] == 0 for g in snap["leak_gauges"]), (name, snap)
    assert any(s.get("kind") == "scheduler" for s in conn["snapshots"].values()), sorted(conn["snapshots"])


@slow
@pytest.mark.timeout(TIMEOUT_S)
def test_no_ray_or_worker_process_left(report):
    assert report["leaks"] == [] and report["left_after"] == [], (report["leaks"], report["left_after"])


def test_the_tokenizer_round_trips_any_ids(tmp_path):
    """prefix_repetition draws random ids and needs decode -> encode to give them back."""
    import random

    from transformers import AutoTokenizer

    write_tokenizer(str(tmp_path))
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    ids = [random.Random(0).randrange(512) for _ in range(400)]
    assert tok.encode(tok.decode(ids), add_special_tokens=False) == ids and tok.vocab_size == 512


def test_a_process_left_behind_is_found_and_killed(tmp_path):
    """The leak check's negative control: a process of the run (its marker in the environment, in
    its own session, as the launcher starts them) is listed and then killed by pid."""
    run = tmp_path / "run"
    env = dict(os.environ, **{MARKER_ENV: str(run)})
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while not run_processes(str(run)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [pid for pid, _ in run_processes(str(run))] == [proc.pid]
        assert [pid for pid, _ in sweep(str(run))] == [proc.pid]
        assert proc.wait(timeout=10) == -9
        assert run_processes(str(run)) == []
        assert run_processes(str(tmp_path / "other")) == []
    finally:
        if proc.poll() is None:
            proc.kill()
