"""The main job, end to end: ``python -m tpuoffload.demo --podslice`` starts a 2-host pod slice (one JAX
process per host), serves a prefix_repetition workload in two waves through vLLM's scheduler, and
prints the per-host stats table read back from the snapshot files the hosts wrote."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from tpuoffload.cli import main as cli_main

pytestmark = pytest.mark.slow  # the demo starts a pod slice of JAX processes

PROMPTS, PREFIXES, PREFIX_LEN, SUFFIX_LEN, BS = 12, 2, 64, 16, 16  # suffix and block size: demo defaults
HOSTS = 2
LOADED_PER_HOST = (PROMPTS - PREFIXES) * PREFIX_LEN // BS
SAVED_PER_HOST = PREFIXES * PREFIX_LEN // BS + PROMPTS * SUFFIX_LEN // BS
HIT_RATE = (PROMPTS - PREFIXES) * PREFIX_LEN / (PROMPTS * (PREFIX_LEN + SUFFIX_LEN))


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    stats_dir = tmp_path_factory.mktemp("demo-stats")
    cmd = [sys.executable, "-m", "tpuoffload.demo", "--podslice", "--prompts", str(PROMPTS), "--prefixes", str(PREFIXES),
           "--prefix-len", str(PREFIX_LEN), "--stats-dir", str(stats_dir)]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the slice sets its own per host
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the demo and the host processes it started
        out, err = proc.communicate()
        pytest.fail(f"demo did not finish in 300 s\nstdout:\n{out}\nstderr:\n{err[-4000:]}")
    return proc.returncode, out, err, stats_dir


def test_demo_succeeds(demo):
    rc, out, err, _ = demo
    assert rc == 0, f"stdout:\n{out}\nstderr:\n{err[-4000:]}"
    assert f"requests finished:   {PROMPTS}/{PROMPTS}" in out
    assert re.search(r"KV verified:\s+[1-9]\d* context positions checked, 0 mismatches", out), out
    assert re.search(rf"dispatch digests:\s+identical on all {HOSTS} hosts at every one of [1-9]\d* steps", out), out


def test_demo_table(demo):
    _, out, _, _ = demo
    rows = {m.group(1): m for m in re.finditer(
        r"^(host \d+|scheduler)\s+(\d+)\s+([0-9a-f]{8})?\s+(\d+)\s+[\d.]+\s+(\d+)\s+[\d.]+\s+(\d+)", out, re.M)}
    assert list(rows) == ["host 0", "host 1", "scheduler"], out
    for h in range(HOSTS):
        row = rows[f"host {h}"]
        assert (int(row.group(4)), int(row.group(5)), int(row.group(6))) == (SAVED_PER_HOST, LOADED_PER_HOST, 0)
    assert rows["host 0"].group(3) == rows["host 1"].group(3)  # same digest at the same last step
    assert rows["host 0"].group(2) == rows["host 1"].group(2)
    assert re.search(r"^flagged: none$", out, re.M)
    m = re.search(r"host-RAM hit rate:\s+([\d.]+)% of prompt tokens", out)
    assert m and float(m.group(1)) > 0
    assert float(m.group(1)) == pytest.approx(100 * HIT_RATE, abs=0.05)
    assert f"({HOSTS * SAVED_PER_HOST} chunks saved, {HOSTS * LOADED_PER_HOST} loaded, all hosts)" in out


def test_demo_snapshots_read_back(demo, capsys):
    """The files the slice's host processes left behind give the same table to ``tpuoffload stats``."""
    _, out, _, stats_dir = demo
    assert sorted(n for n in os.listdir(stats_dir) if n.endswith(".json")) == \
        ["host-0.json", "host-1.json", "scheduler.json"]
    assert cli_main(["stats", str(stats_dir), "--json", "--stale-after", "3600"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["total"]["saved"] == HOSTS * SAVED_PER_HOST and rep["total"]["loaded"] == HOSTS * LOADED_PER_HOST
    assert rep["total"]["hit_rate"] == pytest.approx(HIT_RATE)
    pids = {json.load(open(os.path.join(stats_dir, f"host-{h}.json")))["pid"] for h in range(HOSTS)}
    assert len(pids) == HOSTS and os.getpid() not in pids  # written by separate host processes


def test_the_main_job_is_the_serving_stack(capsys):
    """``bash scripts/demo.sh`` with no flag runs the real serving stack (tpuoffload.sim.serve_stack),
    not our own pod-slice driver (``--podslice``)."""
    from tpuoffload.demo import main

    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "--plan" in out and "--prefix-len" not in out
    with pytest.raises(SystemExit):
        main(["--podslice", "--help"])
    assert "--prefix-len" in capsys.readouterr().out
