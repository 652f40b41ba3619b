"""The soak (tools/soak.py) in CI: a few seeded chaos runs of each mode must pass, and the soak must
report what it exists to catch (negative controls), with the seed and a replay command that
reproduces the failure.

Every soak runs as a subprocess under an outside timeout in its own session; each one carries a
unique environment tag, and afterwards no process with that tag (the soak, its child, pod-slice
workers) may be left.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOAK = os.path.join(REPO, "tools", "soak.py")
TABLE_ROWS = ("runs", "steps", "requests", "chunks moved", "mismatches", "hangs", "leaks", "failed seeds")

pytestmark = pytest.mark.slow  # soaks run as subprocesses, pod slices included


def _tagged(tag: str) -> list[int]:
    """Pids of live processes whose environment carries ``tag``."""
    needle = f"TPUOFFLOAD_SOAK_TEST_TAG={tag}".encode()
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    pids.append(int(name))
        except OSError:
            continue
    return pids


def soak(tmp_path, *args: str, timeout: float = 600) -> tuple[int, str, dict]:
    """Run tools/soak.py; returns (exit status, stdout, summary JSON). Kills its session on timeout
    and checks that nothing it started outlives it."""
    tag = uuid.uuid4().hex
    summary = tmp_path / f"summary-{tag}.json"
    env = dict(os.environ, TPUOFFLOAD_SOAK_TEST_TAG=tag)
    proc = subprocess.Popen([sys.executable, SOAK, "--log-dir", str(tmp_path / f"logs-{tag}"),
                             "--summary-json", str(summary), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in [proc.pid] + _tagged(tag):
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        out, _ = proc.communicate()
        pytest.fail(f"the soak ran past {timeout} s:\n{out[-5000:]}")
    deadline = time.monotonic() + 15  # children notice their parent is gone within a second or two
    while _tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _tagged(tag)
    for pid in left:  # with its process group: a redis-server's title hides its environment from _tagged
        try:
            group = os.getpgid(pid)
            if group != os.getpgrp():
                os.killpg(group, signal.SIGKILL)
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    assert not left, f"processes left behind by the soak: {left}\n{out[-3000:]}"
    data = json.loads(summary.read_text()) if summary.exists() else {}
    return proc.returncode, out, data


def table(out: str) -> dict[str, str]:
    """The final table's rows, by name."""
    lines = out[out.rindex("\nsoak --mode"):].splitlines()[3:]
    return {line[:15].strip(): line[15:].strip() for line in lines if line.strip()}


def _check_clean(rc: int, out: str, data: dict, runs: int) -> None:
    assert rc == 0, out[-6000:]
    rows = table(out)
    for name in TABLE_ROWS:
        assert name in rows, (name, rows)
    assert rows["runs"] == f"{runs} ({runs} passed, 0 failed)"
    assert rows["hangs"] == "0" and rows["leaks"] == "0" and rows["failed seeds"] == "none"
    assert rows["mismatches"].startswith("0 runs (0 context positions, 0 wrong outputs)"), rows["mismatches"]
    results = data["results"]
    assert len(results) == runs and all(r["kind"] == "ok" for r in results)
    assert all(r["mismatches"] == 0 and r["wrong_outputs"] == 0 and not r["leaks"] for r in results)
    # The runs did real work: requests finished, chunks moved both ways, on every run's slice.
    assert sum(r["finished"] for r in results) > 0
    assert sum(r["chunks_saved"] for r in results) > 0 and sum(r["chunks_loaded"] for r in results) > 0
    assert int(rows["steps"]) == sum(r["steps"] for r in results) > 0
    for r in results:
        assert re.search(rf"seed {r['seed']}\s+ok ", out), f"seed {r['seed']} not printed"


@pytest.mark.timeout(900)
def test_fast_soak_few_seeds(tmp_path):
    # --runs-per-child 2: the 3 runs go through two fresh child processes (regression: a child that
    # ran ~320 runs exhausted its memory mappings, and its runs read as hangs).
    rc, out, data = soak(tmp_path, "--mode", "fast", "--hosts", "2", "--runs", "3", "--seed", "9000",
                         "--runs-per-child", "2")
    _check_clean(rc, out, data, 3)
    logs = next(p for p in tmp_path.iterdir() if p.name.startswith("logs-"))
    assert sorted(f.name for f in logs.glob("child-*.log")) == ["child-0.log", "child-1.log"]


@pytest.mark.timeout(900)
def test_dp_soak_preemption_storm(tmp_path):
    """Under tpu-inference's DPScheduler a storm seed preempts (counted by the connector: the
    DPScheduler's combined output leaves preemptions out) and still ends clean."""
    rc, out, data = soak(tmp_path, "--mode", "fast", "--dp", "any", "--runs", "1", "--seed", "7032")
    _check_clean(rc, out, data, 1)
    assert data["results"][0]["preemptions"] > 0, data["results"][0]


@pytest.mark.timeout(600)
def test_dp_soak_warm_restart_loads_restored_chunks(tmp_path):
    """Under DPScheduler a seed that draws warm restart (persist_path; the slice shut down cleanly
    before wave 1, every host checkpointing every rank's slots, and a new one started on the same
    directories): the new slice's ranks adopt what the host restored, wave 1 loads restored chunks,
    and the run ends clean over both slices' requests (outputs, leaks, wrong reads)."""
    rc, out, data = soak(tmp_path, "--mode", "fast", "--dp", "any", "--runs", "1", "--seed", "7379")
    _check_clean(rc, out, data, 1)
    r = data["results"][0]
    assert "warm restart before wave 1" in r["knobs"], r["knobs"]
    assert r["restarts"] == 1 and r["persist_saved"] > 0 and r["restored_ready"] > 0, r
    assert r["restored_loaded"] > 0, r  # wave 1 read restored host RAM (every position checked)
    assert r["finished"] + r["aborted"] == r["requests"] == 16, r  # both slices' requests, all accounted
    row = table(out)["warm restart"]
    assert re.match(r"1 runs restarted, \d+ chunks checkpointed, [1-9]\d* restored chunks adopted", row), row


@pytest.mark.timeout(600)
def test_dp_soak_shared_tier_fetches_from_redis(tmp_path):
    """Under DPScheduler a seed that draws the shared tier (the soak child's own redis-server below
    host RAM) and a cold new slice before wave 1: wave 1 fetches prefixes from the store, the run
    ends clean, and the redis-server dies with the soak (``soak`` checks that no process carrying
    the test's tag, redis included, is left)."""
    rc, out, data = soak(tmp_path, "--mode", "fast", "--dp", "any", "--runs", "1", "--seed", "8433")
    _check_clean(rc, out, data, 1)
    r = data["results"][0]
    assert "the shared tier (redis)" in r["knobs"] and r["cold_restarts"] == 1, r["knobs"]
    assert r["shared_written"] > 0 and r["shared_fetched"] > 0 and r["shared_read"] >= r["shared_fetched"], r
    assert table(out)["shared tier"].startswith("1 runs (1 with a cold new slice)"), table(out)["shared tier"]


@pytest.mark.timeout(300)
def test_dp_soak_redis_dies_with_a_killed_child(tmp_path):
    """The same seed past a 5 s deadline: the parent kills the child mid-run (a hang) and, with
    it, the child's redis-server, which runs in a process group of its own (``soak`` fails if any
    process with the test's tag, redis-server included, outlives the soak)."""
    rc, out, data = soak(tmp_path, "--mode", "fast", "--dp", "any", "--runs", "1", "--seed", "8433",
                         "--run-timeout", "5")
    assert rc == 1 and [r["kind"] for r in data["results"]] == ["hang"], out[-3000:]
    assert "run killed after 5 s" in data["results"][0]["message"]


@pytest.mark.timeout(900)
def test_podslice_soak_one_run(tmp_path):
    rc, out, data = soak(tmp_path, "--mode", "podslice", "--hosts", "2", "--runs", "1", "--seed", "9100")
    _check_clean(rc, out, data, 1)


@pytest.mark.timeout(900)
def test_soak_reports_a_divergence_with_seed_and_replay(tmp_path):
    """Negative control: a host that gathers its blocks in another order (tpuoffload.sim.broken).
    The soak must fail, name the seed and the kind, and its replay command must reproduce it."""
    rc, out, data = soak(tmp_path, "--mode", "fast", "--hosts", "2", "--runs", "1", "--seed", "9200",
                         "--broken", "host_order")
    assert rc == 1, out[-4000:]
    rows = table(out)
    assert rows["runs"] == "1 (0 passed, 1 failed)"
    assert rows["failed seeds"] == "9200 (digest)"
    assert "1 runs" in rows["mismatches"] or "digest divergences 1 runs" in rows["mismatches"]
    assert re.search(r"seed 9200\s+FAIL digest: dispatch digests diverge at step \d+", out)
    replay = rows["replay one"]
    assert replay.endswith("tools/soak.py --mode fast --hosts 2 --seed 9200 --runs 1 --broken host_order"), replay
    assert data["results"][0]["kind"] == "digest"
    # The printed command reproduces the failure (same seed, same kind).
    cmd = replay.split(" && ", 1)[1].split()
    assert cmd[1] == "tools/soak.py"
    rc2, out2, data2 = soak(tmp_path, *cmd[2:])
    assert rc2 == 1 and [r["kind"] for r in data2["results"]] == ["digest"], out2[-3000:]
    assert table(out2)["failed seeds"] == "9200 (digest)"


@pytest.mark.timeout(900)
def test_soak_kills_a_hung_run_and_goes_on(tmp_path):
    """Negative control: a host that stops answering inside a run. The run is killed at its
    deadline and counts as a hang; the next run starts in a fresh child (and hangs too)."""
    t0 = time.monotonic()
    rc, out, data = soak(tmp_path, "--mode", "fast", "--hosts", "2", "--runs", "2", "--seed", "9300",
                         "--broken", "stall", "--run-timeout", "8")
    assert rc == 1, out[-4000:]
    rows = table(out)
    assert rows["hangs"] == "2" and rows["failed seeds"] == "9300 (hang), 9301 (hang)", rows
    assert [r["kind"] for r in data["results"]] == ["hang", "hang"]
    assert all("killed after 8 s" in r["message"] for r in data["results"])
    assert len(re.findall(r"FAIL hang: run killed after 8 s", out)) == 2
    assert time.monotonic() - t0 < 600
