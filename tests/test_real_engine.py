"""tpuoffload inside the real engine (issue 23): vLLM's ``LLM`` (EngineCore, UniProcExecutor,
Scheduler) on tpu-inference's TpuPlatform, TPUWorker and TPUModelRunner, its JAX Qwen3 model and
sampler, on CPU JAX, with a tiny model written at test time; once without and once with
TPUOffloadConnector, in one child process under an outside timeout (the platform is process-wide,
and the rest of the suite runs vLLM on its CPU platform). Two engines: tensor parallel 1,
and data parallel 2, for which tpu-inference's platform installs its DPScheduler (one vLLM
AsyncScheduler per rank in a forked process, each with its own scheduler-half connector).

Every shim is in ``tpuoffload/sim/engine_shims.py``; the passes are described in
``tpuoffload/sim/real_engine.py``.
"""

from __future__ import annotations

import pytest

from tpuoffload.sim.real_engine import (
    PROMPT_BLOCKS,
    config_name,
    engine_shapes,
    run_child,
    summarize,
)

# TP 2 runs in the demo only (the suite's time). Every shape runs without the connector too, and
# its greedy tokens must be the same in every pass (the engine without the connector is
# deterministic once the copy shim, engine_shims.py 10, keeps the runner's host inputs owned).
TPS, DPS = (1,), (2,)
SHAPES = engine_shapes(TPS, DPS)  # (dp, tp)
NUM_PROMPTS = 4


def saved_blocks(dp: int) -> int:
    """Full blocks a cold pass saves. One scheduler: 4 prompts x PROMPT_BLOCKS, less the
    PROMPT_BLOCKS - 1 that two prompts share. DP 2: DPScheduler puts the two prompts that share a
    prefix on different ranks (the second goes to the less loaded rank, as nothing is computed
    yet), and each rank's host RAM is its own, so each rank saves its own copy of the prefix."""
    shared = PROMPT_BLOCKS - 1
    return NUM_PROMPTS * PROMPT_BLOCKS - (shared if dp == 1 else 0)


# What a warm pass loads: every full block but each prompt's last (vLLM computes the last token),
# the shared blocks once per prompt that uses them.
LOADED_BLOCKS = NUM_PROMPTS * (PROMPT_BLOCKS - 1)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return run_child(str(tmp_path_factory.mktemp("real-engine")), TPS, timeout_s=900, dps=DPS)


def conn_run(report, dp, tp):
    return report["runs"][config_name(tp, True, dp)]


@pytest.mark.parametrize("dp,tp", SHAPES)
def test_real_path_and_layout(report, dp, tp):
    conn = conn_run(report, dp, tp)
    assert conn["platform"] == "tpu_inference.platforms.tpu_platform.TpuPlatform"
    assert conn["mesh"] == {"data": dp, "model": tp}
    assert conn["devices"] == [f"cpu:{i}" for i in range(dp * tp)]
    # tpu-inference's own 5-D ragged-paged-attention cache (K and V interleaved), sharded over the model axis
    assert len(conn["kv_cache_shapes"]) == 2 and all(len(s) == 5 for s in conn["kv_cache_shapes"])
    assert conn["kv_cache_sharding"] == "P('data', None, 'model')"


@pytest.mark.parametrize("dp,tp", SHAPES)
def test_tokens_identical_with_and_without_connector(report, dp, tp):
    base, conn = report["runs"][config_name(tp, False, dp)], conn_run(report, dp, tp)
    s = summarize(conn, base)
    assert s["baseline_passes_agree"], "the engine without the connector is not deterministic across passes"
    for n in (1, 2, 3, 4):
        assert s["tokens_equal"][n], (
            f"pass {n}: with connector {conn['passes'][n - 1]['tokens']} != without {base['passes'][n - 1]['tokens']}"
            f"; every pass with the connector (HBM-cached tokens, counters): "
            f"{[(e['num_cached_tokens'], e.get('counters')) for e in conn['passes']]}; byte audit "
            f"{conn['passes'][-1]['byte_audit']}; pass {n}'s steps {conn['passes'][n - 1]['steps']}; "
            f"blocks and slots moved {conn['moves']}")
    for e in conn["passes"] + base["passes"]:
        assert [len(t) for t in e["tokens"]] == [6] * NUM_PROMPTS


@pytest.mark.parametrize("dp,tp", SHAPES)
def test_second_pass_loads_from_host_ram(report, dp, tp):
    conn = conn_run(report, dp, tp)
    s = summarize(conn)
    # pass 1 (cold): every unique full block saved (per rank), nothing loaded
    assert s["chunks_saved"][1] == s["saves_issued"][1] == saved_blocks(dp)
    assert s["chunks_loaded"][1] == 0 and s["hit_tokens"][1] == 0
    # pass 2, after reset_prefix_cache() dropped vLLM's HBM prefix cache: the prefixes come from host RAM
    assert s["chunks_loaded"][2] == LOADED_BLOCKS > 0
    assert s["hit_tokens"][2] == LOADED_BLOCKS * 16
    assert s["chunks_saved"][2] == 0 and s["dedup_index"][2] == saved_blocks(dp)  # already held, not saved again
    # vLLM saw them as computed tokens; without the connector it recomputed them
    assert all(n == (PROMPT_BLOCKS - 1) * 16 for n in conn["passes"][1]["num_cached_tokens"])
    # in the cold pass, only HBM sharing: between the two prompts that share a prefix, on one rank
    assert sum(conn["passes"][0]["num_cached_tokens"]) == ((PROMPT_BLOCKS - 1) * 16 if dp == 1 else 0)
    assert s["load_errors"] == 0 and s["save_failures"] == 0


@pytest.mark.parametrize("dp,tp", SHAPES)
def test_no_stale_load_after_reset_connector(report, dp, tp):
    s = summarize(conn_run(report, dp, tp))
    # reset_prefix_cache(reset_connector=True) (what a weight update calls) reached the connector:
    # under DPScheduler, every rank's
    assert s["resets"] == dp and s["revoked_at_reset"] == saved_blocks(dp)
    # pass 3: nothing saved before the reset is loaded; every block is computed and saved afresh
    assert s["chunks_loaded"][3] == 0 and s["hit_tokens"][3] == 0
    assert s["dedup_index"][3] == 0 and s["saves_issued"][3] == s["chunks_saved"][3] == saved_blocks(dp)
    # pass 4: loads again, only chunks saved after the reset (pass 3's)
    assert s["chunks_loaded"][4] == LOADED_BLOCKS  # (tokens: test_tokens_identical_with_and_without_connector)
    assert s["chunks_saved"][4] == 0


@pytest.mark.parametrize("dp,tp", SHAPES)
def test_every_loaded_block_holds_the_saved_bytes(report, dp, tp):
    """The byte audit (tpuoffload/sim/byte_audit.py) compared every block each load wrote with the
    block saved to its slot."""
    conn = conn_run(report, dp, tp)
    audit = conn["passes"][-1]["byte_audit"]
    assert audit["saves"] == 2 * saved_blocks(dp)  # passes 1 and 3
    assert audit["loads_checked"] == 2 * LOADED_BLOCKS  # passes 2 and 4
    assert audit["num_mismatches"] == 0, audit["mismatches"]
    if dp == 1:  # one KV cache group: every block the runner's requests hold is group 0's
        assert audit["by_group"] == {"save": {"0": 2 * saved_blocks(dp)}, "load": {"0": 2 * LOADED_BLOCKS}}


@pytest.mark.parametrize("dp,tp", SHAPES)
def test_connector_idle_at_the_end(report, dp, tp):
    conn = conn_run(report, dp, tp)
    assert all(v == 0 for v in conn["worker_idle"].values()), conn["worker_idle"]
    assert len(conn["scheduler_leaks"]) == dp  # one scheduler half per rank, each idle
    for leaks in conn["scheduler_leaks"]:
        assert all(v == 0 for v in leaks.values()), conn["scheduler_leaks"]

