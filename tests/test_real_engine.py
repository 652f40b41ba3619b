"""tpuoffload inside the real engine (issue 23): vLLM's ``LLM`` (EngineCore, UniProcExecutor,
Scheduler) on tpu-inference's TpuPlatform, TPUWorker and TPUModelRunner, its JAX Qwen3 model and
sampler, on CPU JAX, with a tiny model written at test time; once without and once with
TPUOffloadConnector, in one child process under an outside timeout (the platform is process-wide,
and the rest of the suite runs vLLM on its CPU platform).

Every shim is in ``tpuoffload/sim/engine_shims.py``; the passes are described in
``tpuoffload/sim/real_engine.py``.
"""

from __future__ import annotations

import pytest

from tpuoffload.sim.real_engine import PROMPT_BLOCKS, config_name, run_child, summarize

TPS = (1,)  # TP 2 runs in the demo; on CPU its tokens are not deterministic even without the connector (README)
NUM_PROMPTS = 4
# Full blocks per pass: 4 prompts x PROMPT_BLOCKS, less the PROMPT_BLOCKS - 1 shared ones.
UNIQUE_BLOCKS = NUM_PROMPTS * PROMPT_BLOCKS - (PROMPT_BLOCKS - 1)
# What a warm pass loads: every full block but each prompt's last (vLLM computes the last token),
# the shared blocks once per prompt that uses them.
LOADED_BLOCKS = NUM_PROMPTS * (PROMPT_BLOCKS - 1)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return run_child(str(tmp_path_factory.mktemp("real-engine")), TPS, timeout_s=400)


@pytest.mark.parametrize("tp", TPS)
def test_real_path_and_layout(report, tp):
    conn = report["runs"][config_name(tp, True)]
    assert conn["platform"] == "tpu_inference.platforms.tpu_platform.TpuPlatform"
    assert conn["mesh"] == {"data": 1, "model": tp}
    assert conn["devices"] == [f"cpu:{i}" for i in range(tp)]
    # tpu-inference's own 5-D ragged-paged-attention cache (K and V interleaved), sharded over the model axis
    assert len(conn["kv_cache_shapes"]) == 2 and all(len(s) == 5 for s in conn["kv_cache_shapes"])
    assert conn["kv_cache_sharding"] == "P('data', None, 'model')"


@pytest.mark.parametrize("tp", TPS)
def test_tokens_identical_with_and_without_connector(report, tp):
    base, conn = report["runs"][config_name(tp, False)], report["runs"][config_name(tp, True)]
    s = summarize(base, conn)
    assert s["baseline_passes_agree"], "the engine without the connector is not deterministic across passes"
    for n in (1, 2, 3, 4):
        assert s["tokens_equal"][n], (f"pass {n}: with connector {conn['passes'][n - 1]['tokens']} != "
                                      f"without {base['passes'][n - 1]['tokens']}")
    for e in conn["passes"] + base["passes"]:
        assert [len(t) for t in e["tokens"]] == [6] * NUM_PROMPTS


@pytest.mark.parametrize("tp", TPS)
def test_second_pass_loads_from_host_ram(report, tp):
    base, conn = report["runs"][config_name(tp, False)], report["runs"][config_name(tp, True)]
    s = summarize(base, conn)
    # pass 1 (cold): every unique full block saved, nothing loaded
    assert s["chunks_saved"][1] == s["saves_issued"][1] == UNIQUE_BLOCKS
    assert s["chunks_loaded"][1] == 0 and s["hit_tokens"][1] == 0
    # pass 2, after reset_prefix_cache() dropped vLLM's HBM prefix cache: the prefixes come from host RAM
    assert s["chunks_loaded"][2] == LOADED_BLOCKS > 0
    assert s["hit_tokens"][2] == LOADED_BLOCKS * 16
    assert s["chunks_saved"][2] == 0 and s["dedup_index"][2] == UNIQUE_BLOCKS  # already held, not saved again
    # vLLM saw them as computed tokens; without the connector it recomputed them
    assert all(n == (PROMPT_BLOCKS - 1) * 16 for n in conn["passes"][1]["num_cached_tokens"])
    assert sum(base["passes"][1]["num_cached_tokens"]) == (PROMPT_BLOCKS - 1) * 16  # only HBM sharing
    assert s["load_errors"] == 0 and s["save_failures"] == 0


@pytest.mark.parametrize("tp", TPS)
def test_no_stale_load_after_reset_connector(report, tp):
    base, conn = report["runs"][config_name(tp, False)], report["runs"][config_name(tp, True)]
    s = summarize(base, conn)
    # reset_prefix_cache(reset_connector=True) (what a weight update calls) reached the connector
    assert s["resets"] == 1 and s["revoked_at_reset"] == UNIQUE_BLOCKS
    # pass 3: nothing saved before the reset is loaded; every block is computed and saved afresh
    assert s["chunks_loaded"][3] == 0 and s["hit_tokens"][3] == 0
    assert s["dedup_index"][3] == 0 and s["saves_issued"][3] == s["chunks_saved"][3] == UNIQUE_BLOCKS
    # pass 4: loads again, only chunks saved after the reset (pass 3's), tokens still identical
    assert s["chunks_loaded"][4] == LOADED_BLOCKS and s["tokens_equal"][4]
    assert s["chunks_saved"][4] == 0


@pytest.mark.parametrize("tp", TPS)
def test_connector_idle_at_the_end(report, tp):
    conn = report["runs"][config_name(tp, True)]
    assert all(v == 0 for v in conn["worker_idle"].values()), conn["worker_idle"]
    assert all(v == 0 for v in conn["scheduler_leaks"].values()), conn["scheduler_leaks"]

