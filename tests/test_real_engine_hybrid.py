"""tpuoffload inside the real engine with a hybrid model (issues 21 and 23): vLLM's ``LLM`` on
tpu-inference's TpuPlatform, TPUWorker and TPUModelRunner on CPU JAX, with vLLM's hybrid KV cache
manager ON, running a tiny Llama whose layers alternate sliding window (32 tokens, 2 blocks: half a
prompt, so vLLM drops blocks) and full attention, through tpu-inference's vLLM-model path; once
without and once with TPUOffloadConnector, in one child process under an outside timeout, the same
four passes as the Qwen3 engine (tests/test_real_engine.py).

The groups are vLLM's own (from the runner's ``kv_cache_config``), the arrays tpu-inference's own
(two arrays, each serving one layer of each group). Every shim is in
``tpuoffload/sim/engine_shims.py``; the model and the passes are in ``tpuoffload/sim/real_engine.py``.
"""

from __future__ import annotations

from collections import Counter

import pytest

from tpuoffload.sim.real_engine import BLOCK_SIZE, HYBRID, PROMPT_BLOCKS, config_name, run_child, summarize

pytestmark = pytest.mark.slow  # one child process, two engine start-ups: about 2.5 minutes

NUM_PROMPTS = 4
WINDOW_TOKENS = HYBRID.config["sliding_window"]
# The blocks a sliding-window hit needs, ending at the hit (vLLM keeps window - 1 tokens before it).
WINDOW_BLOCKS = -(-(WINDOW_TOKENS - 1) // BLOCK_SIZE)
HIT_BLOCKS = PROMPT_BLOCKS - 1  # per prompt, every full block but the last (vLLM computes the last token)
# Blocks a cold pass computes, per group: two prompts share all but their last block (HBM prefix cache).
COMPUTED_BLOCKS = NUM_PROMPTS * PROMPT_BLOCKS - (PROMPT_BLOCKS - 1)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return run_child(str(tmp_path_factory.mktemp("real-engine-hybrid")), (1,), timeout_s=600, model=HYBRID)


@pytest.fixture(scope="module")
def runs(report):
    return report["runs"][config_name(1, False)], report["runs"][config_name(1, True)]


@pytest.fixture(scope="module")
def groups(runs):
    """(sliding-window group, full-attention group): their indices, as the connector numbers them."""
    windows = runs[1]["connector_groups"]["windows"]
    return str(windows.index(WINDOW_BLOCKS)), str(windows.index(None))


def test_connector_sees_vllms_groups_and_tpu_inferences_arrays(report, runs):
    base, conn = runs
    assert report["model"] == "hybrid"
    assert conn["platform"] == "tpu_inference.platforms.tpu_platform.TpuPlatform"
    # vLLM's hybrid KV cache manager made two groups from the model's own layers
    want = [("SlidingWindowSpec", WINDOW_TOKENS, [0, 2]), ("FullAttentionSpec", None, [1, 3])]
    for run in runs:
        got = [(g["spec"], g["sliding_window"], [int(name.split(".")[2]) for name in g["layers"]])
               for g in run["kv_cache_groups"]]
        assert got == want, run["kv_cache_groups"]
        # tpu-inference shares its arrays between the groups: array i serves layer i of each group
        assert run["layer_to_array"] == {f"model.layers.{i}.self_attn.attn": i // 2 for i in range(4)}
        assert run["kv_cache_shapes"] == [[160, BLOCK_SIZE, 4, 1, 128]] * 2
        assert run["kv_cache_sharding"] == "P('data', None, 'model')"
    # the connector's scheduler half built its groups from the scheduler's kv_cache_config
    assert conn["connector_groups"]["windows"] == [WINDOW_BLOCKS, None]
    assert WINDOW_BLOCKS < HIT_BLOCKS  # so the sliding-window group really drops blocks of a hit


def test_tokens_identical_with_and_without_connector(runs):
    base, conn = runs
    s = summarize(conn, base)
    assert s["baseline_passes_agree"], "the engine without the connector is not deterministic across passes"
    for n in (1, 2, 3, 4):
        assert s["tokens_equal"][n], (
            f"pass {n}: with connector {conn['passes'][n - 1]['tokens']} != without {base['passes'][n - 1]['tokens']}"
            f"; every pass with the connector: {[(e['num_cached_tokens'], e['counters']) for e in conn['passes']]}")
    assert all(len(t) == 6 for e in conn["passes"] + base["passes"] for t in e["tokens"])


def per_pass(conn, kind: str) -> list[Counter]:
    """Blocks saved or loaded per group in each pass (the byte audit's totals are cumulative)."""
    totals = [Counter(e["byte_audit"]["by_group"][kind]) for e in conn["passes"]]
    return [totals[0]] + [b - a for a, b in zip(totals, totals[1:])]


def test_saves_and_loads_per_group(runs, groups):
    """A cold pass saves every computed block of both groups (a sliding-window block is saved when
    computed, before vLLM drops it); a warm pass loads every block of the hit for the full-attention
    group and only the window that ends at the hit for the sliding-window group."""
    base, conn = runs
    window, full = groups
    s = summarize(conn, base)
    saved, loaded = per_pass(conn, "save"), per_pass(conn, "load")
    for n in (1, 3):
        assert saved[n - 1] == {window: COMPUTED_BLOCKS, full: COMPUTED_BLOCKS}, saved
        assert s["chunks_saved"][n] == s["saves_issued"][n] == 2 * COMPUTED_BLOCKS
        assert loaded[n - 1] == {} and s["chunks_loaded"][n] == 0
    for n in (2, 4):
        assert loaded[n - 1] == {window: NUM_PROMPTS * WINDOW_BLOCKS, full: NUM_PROMPTS * HIT_BLOCKS}, loaded
        assert s["chunks_loaded"][n] == NUM_PROMPTS * (WINDOW_BLOCKS + HIT_BLOCKS)
        assert s["hit_tokens"][n] == NUM_PROMPTS * HIT_BLOCKS * BLOCK_SIZE
        # vLLM counted the hits as computed tokens; without the connector only HBM sharing
        assert conn["passes"][n - 1]["num_cached_tokens"] == [HIT_BLOCKS * BLOCK_SIZE] * NUM_PROMPTS
        assert sum(base["passes"][n - 1]["num_cached_tokens"]) == HIT_BLOCKS * BLOCK_SIZE
        assert saved[n - 1] == {} and s["chunks_saved"][n] == 0  # already held
    assert s["load_errors"] == 0 and s["save_failures"] == 0


def test_no_stale_load_after_reset_connector(runs):
    base, conn = runs
    s = summarize(conn, base)
    assert s["resets"] == 1 and s["revoked_at_reset"] == 2 * COMPUTED_BLOCKS
    assert s["chunks_loaded"][3] == 0 and s["hit_tokens"][3] == 0 and s["dedup_index"][3] == 0
    assert conn["passes"][2]["num_cached_tokens"] == base["passes"][2]["num_cached_tokens"]


def test_every_loaded_block_holds_the_saved_bytes(runs):
    _, conn = runs
    audit = conn["passes"][-1]["byte_audit"]
    assert audit["saves"] == 2 * 2 * COMPUTED_BLOCKS  # passes 1 and 3, both groups
    assert audit["loads_checked"] == 2 * NUM_PROMPTS * (WINDOW_BLOCKS + HIT_BLOCKS)  # passes 2 and 4
    assert audit["num_mismatches"] == 0, audit["mismatches"]


def test_connector_idle_at_the_end(runs):
    _, conn = runs
    assert all(v == 0 for v in conn["worker_idle"].values()), conn["worker_idle"]
    assert len(conn["scheduler_leaks"]) == 1
    assert all(v == 0 for v in conn["scheduler_leaks"][0].values()), conn["scheduler_leaks"]
