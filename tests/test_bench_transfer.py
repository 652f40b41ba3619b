"""Smoke tests of tools/bench_transfer.py on CPU JAX: it measures only on the platform it was told,
it checks the bytes of every load, and a load that does not move the bytes makes it fail."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tpuoffload.worker import transfer_engine

TOOL = Path(__file__).resolve().parents[1] / "tools" / "bench_transfer.py"
# 2 layers of (16 tokens, 2, 2, 128) bf16: 32 KiB per block, 16 blocks per 0.5 MiB step.
TINY = ["--sizes-mib", "0.5", "--layers", "2", "--block-size", "16", "--kv-heads", "2"]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_transfer", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cpu_run_verifies_bytes(bench, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench.main(["--expect-platform", "cpu", *TINY, "--verify-blocks", "0", "--json", str(out),
                       "--patterns", "contiguous", "scattered"]) == 0
    printed = capsys.readouterr().out
    assert "platform cpu" in printed and "all bytes verified" in printed
    report = json.loads(out.read_text())
    assert report["platform"] == "cpu" and report["verified"] and report["failures"] == []
    (row,) = report["results"]
    assert row["blocks"] == 16
    for key in ("raw_save_gibps", "raw_load_gibps", "per_block_save_gibps", "per_block_load_gibps"):
        assert row[key] > 0, key
    for pat in ("contiguous", "scattered"):
        for key in ("save_gibps", "load_gibps", "save_main_ms", "save_main_warm_ms", "raw_load_ratio",
                    "raw_save_ratio", "floor_save_ratio", "floor_load_ratio"):
            assert row[f"engine_{pat}_{key}"] > 0, (pat, key)
    assert row["floor_save_gibps"] > 0 and row["floor_load_gibps"] > 0 and row["raw_save_main_ms"] > 0
    # 16 blocks in one run: one copy per call; 16 of 128 slots at random: short runs (sorted by slot).
    assert row["engine_contiguous_runs"] == {"save": [16], "load": [16]}
    assert row["engine_contiguous_copies"]["save"] == row["engine_contiguous_copies"]["load"] == 1
    assert max(row["engine_scattered_runs"]["save"]) <= 4 and row["engine_scattered_copies"]["save"] <= 32
    assert row["engine_contiguous_rows_moved"] == 16 and 16 <= row["engine_scattered_rows_moved"] < 32
    assert len(row["samples_ms"]["contiguous_save"]) == 7


def test_step_of_no_power_of_two_blocks_reports_the_rows_moved(bench, monkeypatch, tmp_path):
    """A 10-block step: the raw path moves 10 blocks; the engine moves them in copies of
    consecutive slots and reports the 10 rows it moved, bytes checked."""
    out = tmp_path / "bench.json"
    argv = ["--expect-platform", "cpu", *TINY, "--no-per-block", "--json", str(out)]
    argv[argv.index("0.5")] = "0.3125"  # 10 blocks of 32 KiB
    assert bench.main(argv) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert row["blocks"] == 10
    assert row["engine_contiguous_rows_moved"] == row["engine_churned_rows_moved"] == 10


def test_load_that_moves_nothing_fails_the_run(bench, monkeypatch, capsys):
    """Negative control: an engine whose load returns the caches untouched (and claims success)
    must be caught by the byte check, not reported as a fast load."""

    def load_nothing(self, kv_caches, block_ids, slots, save_ids):
        return list(kv_caches), []

    monkeypatch.setattr(transfer_engine.TransferEngine, "load", load_nothing)
    assert bench.main(["--expect-platform", "cpu", *TINY, "--no-per-block"]) == 1
    err = capsys.readouterr().err
    assert "VERIFY FAILED" in err and "engine contiguous" in err and "engine churned" in err


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_refuses_a_platform_it_was_not_told(bench, platform, capsys):
    assert bench.main(["--expect-platform", platform, *TINY]) == 2
    captured = capsys.readouterr()
    assert "refusing to measure" in captured.err and "'cpu'" in captured.err
    assert "---" not in captured.out  # nothing was measured


def test_expect_platform_is_required(bench):
    with pytest.raises(SystemExit):
        bench.parse_args(TINY)


# ---------------- churned store, deployments, floor, summary (issue 24) ----------------

def test_churned_mode_reaches_steady_state_and_verifies_bytes(bench, tmp_path, capsys):
    """The default patterns: a fresh store's run and the real scheduler's slots after LRU churn.
    The churned slots are what a ChunkIndex hands out once every slot was recycled about four
    times (not one run: churn happened), the load's slots are READY chunks' prefixes (other slots
    than the save's), and every load is checked byte for byte."""
    out = tmp_path / "bench.json"
    assert bench.main(["--expect-platform", "cpu", *TINY, "--verify-blocks", "0", "--no-per-block",
                       "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "summary:" in printed and "churned" in printed
    (row,) = json.loads(out.read_text())["results"]
    assert row["patterns"] == ["contiguous", "churned"]
    churn = row["churn"]["churned"]
    assert churn["evicted_per_slot"] >= 4 and churn["warmup_steps"] >= 40
    for key in ("raw_save_ratio", "raw_load_ratio", "floor_save_ratio", "floor_load_ratio", "save_main_ms"):
        assert row[f"engine_churned_{key}"] > 0, key
    (summary_contiguous, summary_churned) = bench.summary_rows([row])
    assert summary_contiguous["slots"] == "contiguous" and summary_churned["slots"] == "churned"
    assert summary_churned["mean_run"] == (churn["save_mean_run"], churn["load_mean_run"])


def test_churn_simulation_is_the_scheduler_in_steady_state():
    """tools/churn_slots.py drives the real ChunkIndex: the measured step's slots are distinct, in
    range, exactly one step of them, not one ascending run (a fresh store's), and the load's are
    not the save's; the steady-state statistics are reported."""
    import sys
    sys.path.insert(0, str(TOOL.parent))
    import churn_slots

    r = churn_slots.simulate(256, 32, seed=1)
    save, load = r["save_slots"], r["load_slots"]
    for slots in (save, load):
        assert len(slots) == 32 and len(set(slots)) == 32 and all(0 <= s < 256 for s in slots)
    assert save != list(range(save[0], save[0] + 32))  # churned: not a fresh store's run
    assert r["save_mean_run"] < 32 and r["evicted_per_slot"] >= 4
    assert set(r["steady"]) == {"save_mean_run_first_half", "save_mean_run_second_half",
                                "load_mean_run_first_half", "load_mean_run_second_half"}
    assert churn_slots.run_lengths([3, 4, 5, 9, 8, 10]) == [3, 1, 1, 1]
    with pytest.raises(ValueError):
        churn_slots.simulate(40, 32)  # a store of less than two steps cannot churn


def test_churn_file_is_used_as_is(bench, tmp_path):
    """The device has no scheduler: the bench takes the churned slots from --churn-file. A file
    with a known pattern is used exactly (the engine's runs reflect it)."""
    import sys
    sys.path.insert(0, str(TOOL.parent))
    import churn_slots

    path = tmp_path / "churn.json"
    n, slots = 16, 128
    # A pattern of two ascending runs of 8: the engine moves it in copies of 8 slots.
    save = list(range(40, 48)) + list(range(100, 108))
    fake = {"save_slots": save, "load_slots": save[::-1], "warmup_steps": 99, "evicted_per_slot": 7.0,
            "save_mean_run": 8.0, "load_mean_run": 1.0, "steady": {}}
    path.write_text(json.dumps({churn_slots.key(slots, n, 0): fake}))
    out = tmp_path / "bench.json"
    assert bench.main(["--expect-platform", "cpu", *TINY, "--verify-blocks", "0", "--no-per-block",
                       "--patterns", "churned", "--churn-file", str(path), "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert row["churn"]["churned"]["warmup_steps"] == 99
    assert row["engine_churned_runs"]["save"] == [8]


def tpu_inference_per_device_shape(tp: int, num_kv_heads: int, head_dim: int, dtype: str, block_size: int,
                                   use_mla: bool = False) -> tuple[int, ...]:
    """One device's share of one block, from tpu-inference's own get_kv_cache_shape_with_mesh (and
    the runner's head padding) on a stand-in mesh of ``tp`` model shards."""
    import types

    import jax.numpy as jnp

    from tpuoffload.sim import tpu_layouts
    ti = tpu_layouts.tpu_inference()
    sizes = {"data": 1, "model": tp}
    mesh = types.SimpleNamespace(shape=sizes, axis_names=tuple(sizes))
    with tpu_layouts._model_design(False):
        heads = 1 if use_mla else ti.utils.get_padded_num_heads(num_kv_heads, tp)
        hd = head_dim if use_mla else ti.utils.get_padded_head_dim(head_dim)
        full = list(ti.kv_cache.get_kv_cache_shape_with_mesh(mesh, 7, block_size, heads, hd, jnp.dtype(dtype),
                                                             use_mla)[1:])
    if not use_mla:
        full[1] //= tp  # sharded P(BATCH, KV_CONTEXT, KV_HEAD): axis 2 over the model shards
    return tuple(full)


@pytest.mark.parametrize("name", ["gpt-oss-120b-tp8", "qwen3-coder-480b-fp8-tp16", "llama-70b-tp8",
                                  "deepseek-v3-mla-fp8"])
def test_deployment_shapes_are_tpu_inferences(bench, name):
    """per_device_block_shape of each deployment against tpu-inference's own shape."""
    d = dict(bench.DEPLOYMENTS[name])
    d.pop("layers")
    assert bench.per_device_block_shape(**d) == tpu_inference_per_device_shape(**d)


@pytest.mark.parametrize("kw", [dict(tp=4, num_kv_heads=8, head_dim=128, dtype="bfloat16", block_size=16),
                                dict(tp=2, num_kv_heads=8, head_dim=64, dtype="bfloat16", block_size=32),
                                dict(tp=4, num_kv_heads=8, head_dim=96, dtype="int8", block_size=16),
                                dict(tp=8, num_kv_heads=2, head_dim=256, dtype="float8_e4m3fn", block_size=64),
                                dict(tp=4, num_kv_heads=1, head_dim=576, dtype="bfloat16", block_size=16, use_mla=True)])
def test_shape_rule_matches_tpu_inference_beyond_the_table(bench, kw):
    """The rule, not just the table: several heads per shard, head_dim 64 and odd ones, int8."""
    assert bench.per_device_block_shape(**kw) == tpu_inference_per_device_shape(**kw)


def test_deployment_run_verifies_bytes(bench, tmp_path):
    """A real deployment's per-device layout (gpt-oss-120b, 18 arrays of (16, 1, 2, 128) bf16:
    144 KiB per chunk) through raw, floor and the engine on both patterns, bytes checked."""
    out = tmp_path / "bench.json"
    assert bench.main(["--expect-platform", "cpu", "--deployments", "gpt-oss-120b-tp8", "--sizes-mib", "2.25",
                       "--no-per-block", "--verify-blocks", "0", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert row["config"] == "gpt-oss-120b-tp8" and row["block_shape"] == [16, 1, 2, 128] and row["layers"] == 18
    assert row["block_kib"] == 144 and row["blocks"] == 16


def test_the_transfer_engine_imports_without_vllm():
    """The accelerator machine that runs the transfer benchmark has JAX and numpy only: the worker's
    transfer engine and its programs must import without vLLM (or tpu-inference)."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['vllm'] = None; sys.modules['tpu_inference'] = None; "
            "import tpuoffload.worker.transfer_engine, tpuoffload.worker.programs, tpuoffload.worker.copy_plan")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
