"""Smoke test of tools/bench_scheduler.py on vLLM's real Scheduler: a tiny run of every
configuration, whose fake worker must have acknowledged the same work for both connectors, and
the same hits for the same-hits connector that the benchmark nets vLLM's cost of loads out with."""

from __future__ import annotations

import importlib.util
import itertools
import re
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "bench_scheduler.py"


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_scheduler", TOOL)
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_scheduler"] = bench  # (its dataclasses look their module up)
    spec.loader.exec_module(bench)
    return bench


@pytest.mark.parametrize("rounds, steps_per_turn", [(1, 1), (2, 3)])
def test_tiny_run_every_config_does_the_same_work(capsys, rounds, steps_per_turn):
    bench = _load_bench()
    assert bench.main(["--requests", "16", "--steps", "5", "--warmup", "2", "--rounds", str(rounds), "--fills", "",
                       "--no-hooks", "--steps-per-turn", str(steps_per_turn)]) == 0
    out = capsys.readouterr().out
    assert f"configs take turns of {steps_per_turn} step(s)" in out
    loads = dict(re.findall(r"^\s+\((b|c|e)\) .*?loads (\d+ \(\d+ blocks\))", out, re.M))
    assert set(loads) == {"b", "c", "e"}, out
    assert loads["b"] == loads["c"] == loads["e"] != "0 (0 blocks)", loads
    saved = re.findall(r"saved blocks (\d+)", out)
    assert len(saved) == 2 and saved[0] == saved[1] != "0", saved
    for phase in ("decode", "ramp", "prefill cold", "prefill+hits"):
        assert re.search(rf"^{re.escape(phase)}\s+\(e\) same hits", out, re.M), phase
    assert out.count("net of vLLM's own work in (e) same hits") == 4


def test_turns_run_each_config_steps_in_a_row_until_done():
    """--steps-per-turn N: each config runs N steps in a row (fewer when it is done), every config
    gets its turn each round, in a shuffled order, and every config runs exactly its steps."""
    bench = _load_bench()
    order = []

    class FakeSim:
        def __init__(self, name, steps):
            self.name, self.left = name, steps

        def step(self, phase):
            assert phase == "p"
            order.append(self.name)
            self.left -= 1

    sims = [FakeSim("x", 7), FakeSim("y", 5), FakeSim("z", 9)]
    bench.round_robin(sims, "p", lambda s: s.left == 0, steps_per_turn=3)
    assert sorted(order) == sorted("x" * 7 + "y" * 5 + "z" * 9)
    # Turns of 3, the last one shorter when the config is done (x 3+3+1, y 3+2, z 3+3+3): every
    # stretch of one config's steps is whole turns, except the config's last stretch; two turns
    # of one config meet only across a round boundary, so no stretch exceeds two turns.
    runs = [(name, len(list(g))) for name, g in itertools.groupby(order)]
    last = {name: i for i, (name, _) in enumerate(runs)}
    for i, (name, n) in enumerate(runs):
        assert n <= 6 and (n % 3 == 0 or i == last[name]), runs
    firsts = [order[i] for i in range(0, 9, 3)]
    assert sorted(firsts) == ["x", "y", "z"], order  # round 1: one turn each
    sims = [FakeSim("x", 2), FakeSim("y", 2)]
    bench.round_robin(sims, "p", lambda s: s.left == 0)
    assert sorted(order[21:]) == ["x", "x", "y", "y"] and order[21] != order[22], order[21:]


def test_events_mode_runs_events_off_and_on_side_by_side(capsys):
    """--events: the no-connector scheduler and TPUOffloadConnector with vLLM's KV events off and on
    (its ZMQ publisher), the same work in both connector configs, and events taken from the
    connector only when they are on."""
    bench = _load_bench()
    assert bench.main(["--events", "--requests", "16", "--steps", "5", "--warmup", "2", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    for phase in ("decode", "ramp", "prefill cold", "prefill+hits"):
        for config in ("(a) none", "(a) none, events", "(c) tpuoffload", "(c) tpuoffload, events"):
            assert re.search(rf"^{re.escape(phase)}\s+{re.escape(config)}\s+\d+ \|", out, re.M), (phase, config)
        assert re.search(rf"^{re.escape(phase)}\s+\|\s+[-+]\d", out, re.M), phase  # the events cost row
    taken = re.search(r"\(c\) tpuoffload, events: (\d+) events taken from it, (\d+) block hashes", out)
    saved = re.findall(r"saved blocks (\d+)", out)
    assert taken and int(taken.group(1)) > 0 and len(saved) == 2 and saved[0] == saved[1] != "0", out
    assert int(taken.group(2)) >= int(saved[0])  # every saved chunk announced (and some withdrawn)
