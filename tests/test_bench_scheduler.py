"""Smoke test of tools/bench_scheduler.py on vLLM's real Scheduler: a tiny run of every
configuration, whose fake worker must have acknowledged the same work for both connectors, and
the same hits for the same-hits connector that the benchmark nets vLLM's cost of loads out with."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "bench_scheduler.py"


def test_tiny_run_every_config_does_the_same_work(capsys):
    spec = importlib.util.spec_from_file_location("bench_scheduler", TOOL)
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_scheduler"] = bench  # (its dataclasses look their module up)
    spec.loader.exec_module(bench)
    assert bench.main(["--requests", "16", "--steps", "5", "--warmup", "2", "--rounds", "1", "--fills", "",
                       "--no-hooks"]) == 0
    out = capsys.readouterr().out
    loads = dict(re.findall(r"^\s+\((b|c|e)\) .*?loads (\d+ \(\d+ blocks\))", out, re.M))
    assert set(loads) == {"b", "c", "e"}, out
    assert loads["b"] == loads["c"] == loads["e"] != "0 (0 blocks)", loads
    saved = re.findall(r"saved blocks (\d+)", out)
    assert len(saved) == 2 and saved[0] == saved[1] != "0", saved
    for phase in ("decode", "ramp", "prefill cold", "prefill+hits"):
        assert re.search(rf"^{re.escape(phase)}\s+\(e\) same hits", out, re.M), phase
    assert out.count("net of vLLM's own work in (e) same hits") == 4
