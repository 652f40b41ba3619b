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
    assert bench.main(["--expect-platform", "cpu", *TINY, "--verify-blocks", "0", "--json", str(out)]) == 0
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
                    "raw_save_ratio"):
            assert row[f"engine_{pat}_{key}"] > 0, (pat, key)
    # 16 blocks in one run: one copy per call; 16 of 32 slots at random: one copy per slot.
    assert row["engine_contiguous_runs"] == [16] and row["engine_scattered_runs"] == [1]
    assert row["engine_contiguous_rows_moved"] == row["engine_scattered_rows_moved"] == 16
    assert len(row["samples_ms"]["contiguous_save"]) == 7


def test_step_of_no_power_of_two_blocks_reports_the_rows_moved(bench, monkeypatch, tmp_path):
    """A 10-block step: the raw path moves 10 blocks; the engine, splitting down to single rows
    (PIECE_BYTES patched to 1 byte), moves 8 + 2 and reports 10 rows, bytes checked."""
    from tpuoffload.worker import programs

    monkeypatch.setattr(programs, "PIECE_BYTES", 1)
    out = tmp_path / "bench.json"
    argv = ["--expect-platform", "cpu", *TINY, "--no-per-block", "--json", str(out)]
    argv[argv.index("0.5")] = "0.3125"  # 10 blocks of 32 KiB
    assert bench.main(argv) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert row["blocks"] == 10
    assert row["engine_contiguous_rows_moved"] == row["engine_scattered_rows_moved"] == 10


def test_load_that_moves_nothing_fails_the_run(bench, monkeypatch, capsys):
    """Negative control: an engine whose load returns the caches untouched (and claims success)
    must be caught by the byte check, not reported as a fast load."""

    def load_nothing(self, kv_caches, block_ids, slots, save_ids):
        return list(kv_caches), []

    monkeypatch.setattr(transfer_engine.TransferEngine, "load", load_nothing)
    assert bench.main(["--expect-platform", "cpu", *TINY, "--no-per-block"]) == 1
    err = capsys.readouterr().err
    assert "VERIFY FAILED" in err and "engine contiguous" in err and "engine scattered" in err


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_refuses_a_platform_it_was_not_told(bench, platform, capsys):
    assert bench.main(["--expect-platform", platform, *TINY]) == 2
    captured = capsys.readouterr()
    assert "refusing to measure" in captured.err and "'cpu'" in captured.err
    assert "---" not in captured.out  # nothing was measured


def test_expect_platform_is_required(bench):
    with pytest.raises(SystemExit):
        bench.parse_args(TINY)
