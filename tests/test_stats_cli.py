"""``tpuoffload stats`` on snapshot files written by a real run of the connector.

The module fixture drives an InProcessEngine (vLLM's real scheduler, two simulated hosts) with a
shared-prefix workload in two waves, with vLLM's prefix cache reset in between so wave 2 is served
from host RAM; every process writes its snapshot at every step (``stats_interval_s=0``). The CLI
is then run on those files, both in-process (``tpuoffload.cli.main``) and as the installed
console script, and its numbers are checked against the engine's own counters. The detection
tests edit copies of those real files.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import pytest

from tpuoffload import cli
from tpuoffload.cli import main
from tpuoffload.snapshot import SnapshotWriter, read_snapshots, write_atomic

BS = 16
PROMPTS, PREFIXES, PREFIX_LEN, SUFFIX_LEN, OUTPUT_LEN = 12, 2, 64, 16, 4
PROMPT_LEN = PREFIX_LEN + SUFFIX_LEN
# What the workload implies, per host: every unique full prompt block is saved once (the shared
# prefixes once, each prompt's own suffix block once); every wave-2 prompt loads its prefix.
EXPECT_SAVED_PER_HOST = PREFIXES * PREFIX_LEN // BS + PROMPTS * SUFFIX_LEN // BS  # 8 + 12
EXPECT_LOADED_PER_HOST = (PROMPTS - PREFIXES) * PREFIX_LEN // BS  # 10 x 4
EXPECT_HIT_TOKENS = (PROMPTS - PREFIXES) * PREFIX_LEN
EXPECT_LOOKUP_TOKENS = PROMPTS * PROMPT_LEN
GiB = float(1 << 30)

TPUOFFLOAD = shutil.which("tpuoffload", path=os.path.dirname(sys.executable))


@dataclass
class RealRun:
    eng: object
    stats_dir: str

    def refresh(self) -> None:
        """Empty engine steps, as a live engine makes: every host and the scheduler rewrite their
        snapshot (interval 0), so the files are current for the staleness check."""
        self.eng.settle()

    def host_totals(self, host: int) -> dict:
        return dict(self.eng.connectors[host].worker.totals)


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    from tpuoffload.sim.engine import EngineSpec, InProcessEngine, run_waves
    from tpuoffload.sim.workload import prefix_repetition

    stats_dir = str(tmp_path_factory.mktemp("stats"))
    eng = InProcessEngine(EngineSpec(num_hosts=2, block_size=BS, extra_config={  # 2 devices per host (SIM_LAYOUT)
        "cpu_bytes_to_use": 1 << 22, "stats_dir": stats_dir, "stats_interval_s": 0.0}))
    try:
        requests = prefix_repetition(PROMPTS, PREFIXES, PREFIX_LEN, SUFFIX_LEN, OUTPUT_LEN, seed=0, block_size=BS)
        run_waves(eng, [requests[:PREFIXES], requests[PREFIXES:]])
        assert len(eng.finished) == PROMPTS
        assert eng.mismatches() == 0
        yield RealRun(eng, stats_dir)
    finally:
        eng.close()


def run_main(capsys, *args):
    rc = main(["stats", *map(str, args)])
    out, err = capsys.readouterr()
    return rc, out, err


def run_script(*args, timeout=60):
    assert TPUOFFLOAD, f"the tpuoffload console script is not installed next to {sys.executable}"
    return subprocess.run([TPUOFFLOAD, "stats", *map(str, args)], capture_output=True, text=True, timeout=timeout)


def parse_table(text: str) -> dict[str, dict[str, str]]:
    """Rows of the rendered table by name, split at the fixed column widths of the header."""
    widths = [int(re.search(r"(\d+)", fmt).group(1)) for _, fmt in cli._COLUMNS]
    names = [name for name, _ in cli._COLUMNS]
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("name "))
    rows = {}
    for line in lines[head + 2:]:
        if line.startswith("-"):
            break
        if line.startswith("    ! "):
            continue
        cells, pos = {}, 0
        for name, w in zip(names, widths):
            cells[name] = line[pos:pos + w].strip()
            pos += w
        rows[cells["name"]] = cells
    return rows


def flags_of(text: str) -> dict[str, list[str]]:
    out, current = {}, None
    for line in text.splitlines():
        if line.startswith("    ! "):
            out.setdefault(current, []).append(line[6:])
        elif line[:1].isalpha():
            current = line[:10].strip()
    return out


# ============================================================================ real run
def test_table_matches_engine_counters(real_run, capsys):
    real_run.refresh()
    reduced = real_run.eng.stats.reduce()  # everything vLLM's stats path delivered
    # The run itself did what the workload implies, so the checks below compare real numbers.
    assert reduced["chunks_saved"] == 2 * EXPECT_SAVED_PER_HOST
    assert reduced["chunks_loaded"] == 2 * EXPECT_LOADED_PER_HOST
    assert reduced["hit_tokens"] == EXPECT_HIT_TOKENS
    assert reduced["lookup_tokens"] == EXPECT_LOOKUP_TOKENS

    rc, out, err = run_main(capsys, real_run.stats_dir)
    assert rc == 0, out + err
    rows = parse_table(out)
    assert list(rows) == ["host 0", "host 1", "scheduler"]
    for h in (0, 1):
        totals = real_run.host_totals(h)
        row = rows[f"host {h}"]
        last = real_run.eng.connectors[h].worker.digests[-1]
        assert int(row["saved"]) == totals["chunks_saved"] == EXPECT_SAVED_PER_HOST
        assert int(row["loaded"]) == totals["chunks_loaded"] == EXPECT_LOADED_PER_HOST
        assert float(row["loaded_GiB"]) == pytest.approx(totals["bytes_loaded"] / GiB, abs=6e-4)
        assert int(row["failed"]) == 0 and int(row["inflight"]) == 0
        assert int(row["step"]) == last.step and row["digest"] == last.digest[:8]
        backend = real_run.eng.connectors[h].worker.engine.tables[0]
        assert row["slots"] == f"{backend.num_used()}/{backend.num_slots}"
        assert backend.num_used() == EXPECT_SAVED_PER_HOST
    sched = real_run.eng.offload.totals
    assert int(rows["scheduler"]["saved"]) == sched["saves_issued"] == EXPECT_SAVED_PER_HOST
    assert rows["scheduler"]["slots"] == f"{len(real_run.eng.offload.index)}/{real_run.eng.offload.index.num_slots}"

    m = re.search(r"slice total: (\d+) chunks saved \(([\d.]+) GiB\), (\d+) loaded \(([\d.]+) GiB\), "
                  r"(\d+) failures, (\d+) in flight, host-RAM hit rate ([\d.]+)%", out)
    assert m, out
    assert int(m.group(1)) == reduced["chunks_saved"]
    assert int(m.group(3)) == reduced["chunks_loaded"]
    assert float(m.group(4)) == pytest.approx(reduced["bytes_loaded"] / GiB, abs=6e-4)
    assert (int(m.group(5)), int(m.group(6))) == (0, 0)
    assert float(m.group(7)) == pytest.approx(100 * EXPECT_HIT_TOKENS / EXPECT_LOOKUP_TOKENS, abs=0.05)
    assert out.rstrip().endswith("flagged: none")


def test_json_has_the_same_numbers(real_run, capsys):
    real_run.refresh()
    reduced = real_run.eng.stats.reduce()
    rc, out, _ = run_main(capsys, real_run.stats_dir, "--json")
    assert rc == 0
    rep = json.loads(out)
    assert [r["name"] for r in rep["hosts"]] == ["host 0", "host 1", "scheduler"]
    assert rep["flagged"] == []
    t = rep["total"]
    assert t["saved"] == reduced["chunks_saved"] and t["loaded"] == reduced["chunks_loaded"]
    assert t["saved_GiB"] * GiB == pytest.approx(reduced["bytes_saved"])
    assert t["loaded_GiB"] * GiB == pytest.approx(reduced["bytes_loaded"])
    assert t["hit_rate"] == pytest.approx(reduced["hit_tokens"] / reduced["lookup_tokens"])
    assert (t["failed"], t["inflight"]) == (0, 0)
    for h, row in enumerate(rep["hosts"][:2]):
        totals = real_run.host_totals(h)
        assert (row["saved"], row["loaded"]) == (totals["chunks_saved"], totals["chunks_loaded"])
        assert row["save_GiBps"] == pytest.approx(totals["bytes_saved"] / GiB / totals["save_seconds"])
        assert row["flags"] == []
    # The table and the JSON come from one report.
    rc2, table, _ = run_main(capsys, real_run.stats_dir)
    rows = parse_table(table)
    for r in rep["hosts"]:
        assert int(rows[r["name"]]["saved"]) == r["saved"] and int(rows[r["name"]]["loaded"]) == r["loaded"]


def test_console_script(real_run):
    real_run.refresh()
    reduced = real_run.eng.stats.reduce()
    p = run_script(real_run.stats_dir)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = parse_table(p.stdout)
    assert list(rows) == ["host 0", "host 1", "scheduler"]
    assert sum(int(rows[f"host {h}"]["loaded"]) for h in (0, 1)) == reduced["chunks_loaded"]
    assert sum(int(rows[f"host {h}"]["saved"]) for h in (0, 1)) == reduced["chunks_saved"]
    p = run_script(real_run.stats_dir, "--json")
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    assert rep["total"]["loaded"] == reduced["chunks_loaded"] and rep["total"]["saved"] == reduced["chunks_saved"]
    assert rep["total"]["hit_rate"] == pytest.approx(EXPECT_HIT_TOKENS / EXPECT_LOOKUP_TOKENS)


def _settled_listing(directory: str) -> list[str]:
    """The directory's files once no heartbeat is in the middle of a write (its temporary file
    exists only during one write): a temporary file that stays is a leak."""
    deadline = time.monotonic() + 5
    while True:
        names = sorted(os.listdir(directory))
        if not any(n.startswith(".tmp-") for n in names) or time.monotonic() > deadline:
            return names
        time.sleep(0.01)


def test_snapshot_files_are_complete_and_readable(real_run):
    names = _settled_listing(real_run.stats_dir)
    assert names == ["host-0.json", "host-1.json", "scheduler.json"]  # no temporary file left behind
    for name in names:
        path = os.path.join(real_run.stats_dir, name)
        # Readable by a monitoring user other than the serving one (mkstemp alone makes 0600).
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
        with open(path) as f:
            data = json.load(f)
        assert data["schema"] == 1 and data["interval_s"] == 0.0 and data["pid"] == os.getpid()
    host0 = json.load(open(os.path.join(real_run.stats_dir, "host-0.json")))
    assert host0["totals"]["chunks_loaded"] == EXPECT_LOADED_PER_HOST
    assert [d[0] for d in host0["recent_digests"]] == sorted(d[0] for d in host0["recent_digests"])
    assert host0["recent_digests"][-1] == [host0["step"], host0["digest"]]


def test_same_file_twice_counts_once(real_run, capsys):
    real_run.refresh()
    rc, out, _ = run_main(capsys, real_run.stats_dir, os.path.join(real_run.stats_dir, "host-0.json"), "--json")
    assert rc == 0
    rep = json.loads(out)
    assert [r["name"] for r in rep["hosts"]] == ["host 0", "host 1", "scheduler"]
    assert rep["total"]["loaded"] == 2 * EXPECT_LOADED_PER_HOST


# ============================================================================ atomicity
def test_reader_never_sees_a_torn_file(tmp_path):
    """A writer rewrites a ~200 KiB snapshot continuously from another thread; thousands of reads
    through the CLI's loader must each parse and be internally consistent."""
    path = str(tmp_path / "host-0.json")
    seq = [0]

    def build():
        seq[0] += 1
        size = 50_000 + (seq[0] % 7) * 25_000  # the file changes length every write
        return {"kind": "host", "host": 0, "step": seq[0], "totals": {"chunks_saved": seq[0]},
                "blob": "x" * size, "size": size}

    writer = SnapshotWriter(str(tmp_path), "host-0.json", 0.0, build, heartbeat=False)
    writer.maybe_write(force=True)
    stop = threading.Event()

    def write_forever():
        while not stop.is_set():
            assert writer.maybe_write()

    t = threading.Thread(target=write_forever)
    t.start()
    reads, seen, bad = 0, set(), []
    try:
        deadline = time.monotonic() + 20
        while (reads < 3000 or len(seen) < 50) and time.monotonic() < deadline:
            try:
                snap = cli._load(path)
            except cli.StatsInputError as e:
                bad.append(str(e))
                continue
            finally:
                reads += 1
            d = snap.data
            if len(d["blob"]) != d["size"] or d["totals"]["chunks_saved"] != d["step"]:
                bad.append(f"inconsistent snapshot at step {d['step']}")
            seen.add(d["step"])
    finally:
        stop.set()
        t.join()
    assert not bad, bad[:3]
    assert reads >= 3000 and len(seen) >= 50, (reads, len(seen))  # the reads really raced the writes
    assert writer.failures == 0
    assert os.listdir(tmp_path) == ["host-0.json"]  # every temporary file was renamed or removed


def test_a_listing_during_a_write_reads_whole_snapshots_only(tmp_path, monkeypatch):
    """A reader that lists ``*.json`` (``read_snapshots``, the serving stack's, an operator's
    ``ls``) while a snapshot is being written must find only whole files. The writer is stopped
    after its JSON is written and before the rename, and the directory is read there: with a
    temporary file named ``*.json`` (as before this test), the reader opened the unflushed
    temporary file and failed on it, as one CI run did."""
    stats = str(tmp_path)
    write_atomic(os.path.join(stats, "host-0.json"), {"kind": "host", "host": 0, "step": 1})
    real_dump, read_mid_write = json.dump, []

    def dump_then_read(obj, f, **kw):
        real_dump(obj, f, **kw)
        read_mid_write.append(read_snapshots(stats))
    monkeypatch.setattr(json, "dump", dump_then_read)
    write_atomic(os.path.join(stats, "host-0.json"), {"kind": "host", "host": 0, "step": 2})
    monkeypatch.undo()
    assert read_mid_write == [{"host-0.json": {"kind": "host", "host": 0, "step": 1}}]
    assert read_snapshots(stats) == {"host-0.json": {"kind": "host", "host": 0, "step": 2}}


def test_torn_file_control(tmp_path):
    """Negative control for the test above: the same reader catches a writer that rewrites the
    file in place, so a clean run of the atomic writer means something."""
    path = str(tmp_path / "host-0.json")
    write_atomic(path, {"kind": "host", "host": 0, "time": time.time(), "blob": "x" * 200_000})
    stop = threading.Event()

    def write_in_place():
        while not stop.is_set():
            with open(path, "w") as f:
                text = json.dumps({"kind": "host", "host": 0, "time": time.time(), "blob": "y" * 200_000})
                for i in range(0, len(text), 4096):
                    f.write(text[i:i + 4096])
                    f.flush()

    t = threading.Thread(target=write_in_place)
    t.start()
    torn = 0
    try:
        deadline = time.monotonic() + 20
        while torn == 0 and time.monotonic() < deadline:
            try:
                cli._load(path)
            except cli.StatsInputError as e:
                assert "host-0.json" in str(e)
                torn += 1
    finally:
        stop.set()
        t.join()
    assert torn > 0


def test_write_failure_never_raises(tmp_path, caplog):
    """The writer runs on the engine's step path: a vanished stats directory is logged, not raised."""
    d = tmp_path / "stats"
    w = SnapshotWriter(str(d), "host-0.json", 0.0, lambda: {"kind": "host", "host": 0}, heartbeat=False)
    assert w.maybe_write()
    shutil.rmtree(d)
    with caplog.at_level("WARNING", logger="tpuoffload.snapshot"):
        assert w.maybe_write() is False
        assert w.maybe_write() is False
    assert w.failures == 2
    assert sum("cannot write stats snapshot" in r.getMessage() for r in caplog.records) == 1
    d.mkdir()
    assert w.maybe_write()
    assert json.load(open(d / "host-0.json"))["host"] == 0


# ============================================================================ detection
@pytest.fixture
def copies(real_run, tmp_path):
    """Copies of the real run's snapshots with ``time`` set to now (a live slice); ``edit`` changes one."""
    d = tmp_path / "copy"
    d.mkdir()
    now = time.time()
    for name in os.listdir(real_run.stats_dir):
        if name.startswith(".tmp-"):  # a snapshot being written (a temp file, then a rename): not one yet
            continue
        data = json.load(open(os.path.join(real_run.stats_dir, name)))
        data["time"] = now
        (d / name).write_text(json.dumps(data))

    class Copies:
        path = str(d)

        @staticmethod
        def load(name):
            return json.loads((d / name).read_text())

        @staticmethod
        def write(name, data):
            (d / name).write_text(json.dumps(data))

        @staticmethod
        def edit(name, **changes):
            data = json.loads((d / name).read_text())
            data.update(changes)
            (d / name).write_text(json.dumps(data))
            return data
    return Copies


def test_copies_are_healthy(copies, capsys):
    rc, out, _ = run_main(capsys, copies.path)
    assert rc == 0 and out.rstrip().endswith("flagged: none")


def test_diverged_host_flagged_majority_not(copies, capsys):
    host1 = copies.load("host-1.json")
    copies.write("host-2.json", {**host1, "host": 2})  # a third host, agreeing with hosts 0 and 1
    steps = [s for s, _ in host1["recent_digests"]]
    bad_step = steps[len(steps) // 2]
    copies.edit("host-1.json", recent_digests=[[s, "f" * 32 if s == bad_step else d]
                                               for s, d in host1["recent_digests"]])
    rc, out, _ = run_main(capsys, copies.path)
    assert rc == 1
    assert flags_of(out) == {"host 1": [f"DIVERGED (dispatch digest differs at step {bad_step})"]}
    assert "flagged: host 1" in out
    rc, out, _ = run_main(capsys, copies.path, "--json")
    rep = json.loads(out)
    assert rc == 1 and rep["flagged"] == ["host 1"]
    assert {r["name"]: r["flags"] for r in rep["hosts"]}["host 0"] == []


def test_diverged_two_hosts_without_majority_flags_both(copies, capsys):
    host1 = copies.load("host-1.json")
    step, digest = host1["recent_digests"][-1]
    copies.edit("host-1.json", digest="0" * 32, recent_digests=host1["recent_digests"][:-1] + [[step, "0" * 32]])
    rc, out, _ = run_main(capsys, copies.path)
    assert rc == 1
    flag = f"DIVERGED (dispatch digest differs at step {step}, no majority)"
    assert flags_of(out) == {"host 0": [flag], "host 1": [flag]}


def test_stopped_host(copies, capsys):
    copies.edit("host-0.json", time=time.time() - 600)
    rc, out, _ = run_main(capsys, copies.path)
    assert rc == 1
    flags = flags_of(out)
    assert list(flags) == ["host 0"] and len(flags["host 0"]) == 1
    assert re.fullmatch(r"STOPPED \(last report 60\ds ago\)", flags["host 0"][0]), flags
    rc, out, _ = run_main(capsys, copies.path, "--stale-after", "3600")
    assert rc == 0


def test_stopped_scheduler(copies, capsys):
    copies.edit("scheduler.json", time=time.time() - 100)
    rc, out, _ = run_main(capsys, copies.path, "--json")
    assert rc == 1 and json.loads(out)["flagged"] == ["scheduler"]


def test_stuck_save(copies, capsys):
    copies.edit("host-1.json", inflight_chunks=3, staging_bytes=3 * 8192, oldest_inflight_age_s=125.0)
    rc, out, _ = run_main(capsys, copies.path)
    assert rc == 1
    assert flags_of(out) == {"host 1": ["STUCK (save in flight for 125s)"]}
    assert parse_table(out)["host 1"]["inflight"] == "3"
    rc, out, _ = run_main(capsys, copies.path, "--inflight-age", "300")
    assert rc == 0


def test_lagging_host(copies, capsys):
    host0 = copies.load("host-0.json")
    copies.edit("host-0.json", step=host0["step"] + 100,
                recent_digests=[[s + 100, d] for s, d in host0["recent_digests"]])
    rc, out, _ = run_main(capsys, copies.path)
    assert rc == 1
    assert flags_of(out) == {"host 1": ["LAGGING (100 steps behind)"]}
    rc, out, _ = run_main(capsys, copies.path, "--max-step-lag", "200")
    assert rc == 0


# ============================================================================ heartbeat
def _flags(capsys, *args) -> tuple[int, dict[str, list[str]]]:
    rc, out, _ = run_main(capsys, *args, "--json")
    return rc, {r["name"]: r["flags"] for r in json.loads(out)["hosts"]}


def test_idle_engine_heartbeats(real_run, tmp_path, capsys):
    """The real engine, idle since its last step: no hook runs, yet every snapshot stays fresh,
    so no host is STOPPED. Control: a writer without a heartbeat, last written at the same
    moment, is flagged after the same wait (the wait really was long enough)."""
    real_run.refresh()  # a last step, then idle
    control = SnapshotWriter(real_run.stats_dir, "host-7.json", 0.0,
                             lambda: {"kind": "host", "host": 7, "step": -1}, heartbeat=False)
    try:
        assert control.maybe_write()
        last_step = time.time()
        time.sleep(4.5)
        rc, flags = _flags(capsys, real_run.stats_dir, "--stale-after", "3", "--max-step-lag", "1000000")
        assert rc == 1
        assert flags["host 0"] == flags["host 1"] == flags["scheduler"] == []
        assert len(flags["host 7"]) == 1 and flags["host 7"][0].startswith("STOPPED (last report"), flags
        for name in ("host-0.json", "host-1.json", "scheduler.json"):
            data = json.load(open(os.path.join(real_run.stats_dir, name)))
            assert data["time"] > last_step + 1.5, (name, data["time"] - last_step)  # rewritten while idle
            assert data["busy_s"] == 0.0 and data["heartbeat_s"] == 1.0
    finally:
        os.unlink(control.path)


class _SlowReads:
    """A FaultInjector whose next LOAD_SLOT_CHECK (inside the worker's bind) blocks for ``block_s``."""

    def __init__(self) -> None:
        self.block_s = 0.0
        self.blocked = threading.Event()

    def hit(self, point, n: int) -> set[int]:
        if point.name == "LOAD_SLOT_CHECK" and self.block_s:
            self.blocked.set()
            time.sleep(self.block_s)
            self.block_s = 0.0
        return set()


@pytest.mark.timeout(300)
def test_worker_stuck_in_a_step_is_flagged(tmp_path):
    """The real worker brackets its steps for the heartbeat: while host 0 is stuck inside a step
    (a load whose slot read blocks), its file stays fresh but reports the step's age, and the CLI
    flags it hung; host 1, between steps, and the scheduler are not flagged; afterwards neither is."""
    from tpuoffload.sim.engine import EngineSpec, InProcessEngine, run_waves
    from tpuoffload.sim.workload import prefix_repetition

    slow = _SlowReads()
    stats_dir = str(tmp_path / "stats")
    eng = InProcessEngine(EngineSpec(num_hosts=2, block_size=BS, extra_config={
        "cpu_bytes_to_use": 1 << 22, "stats_dir": stats_dir, "stats_interval_s": 0.0}), faults=[slow, None])
    seen: dict[str, list[str]] = {}

    def look():
        assert slow.blocked.wait(120)
        time.sleep(2.5)
        snaps = cli.load_snapshots([stats_dir])
        cli.analyse(snaps, now=time.time(), stale_after_s=None, inflight_age_s=60, max_step_lag=1000,
                    hung_after_s=1.5)
        seen.update({s.name: s.flags for s in snaps})

    watcher = threading.Thread(target=look)
    try:
        requests = prefix_repetition(4, 1, 64, 16, 2, seed=1, block_size=BS)
        run_waves(eng, [requests[:1]])
        slow.block_s = 5.0
        watcher.start()
        run_waves(eng, [[], requests[1:]])  # reset, then loads from host RAM: host 0 blocks in one
        watcher.join(timeout=120)
        assert slow.blocked.is_set() and eng.stats.totals()["chunks_loaded"] > 0
        assert seen["host 1"] == [] and seen["scheduler"] == [], seen
        assert len(seen["host 0"]) == 1 and seen["host 0"][0].startswith("STOPPED (hung: one step running for"), seen
        time.sleep(1.5)  # idle again: fresh files, no open step
        snaps = cli.load_snapshots([stats_dir])
        cli.analyse(snaps, now=time.time(), stale_after_s=None, inflight_age_s=60, max_step_lag=1000,
                    hung_after_s=1.5)
        assert {s.name: s.flags for s in snaps} == {"host 0": [], "host 1": [], "scheduler": []}
    finally:
        eng.close()


_HOST_SCRIPT = """
import sys, time
from tpuoffload.snapshot import SnapshotWriter
step = [-1]
w = SnapshotWriter(sys.argv[1], "host-0.json", 0.2,
                   lambda: {"kind": "host", "host": 0, "step": step[0], "totals": {}}, heartbeat_s=0.3,
                   build_when_idle=True)
for _ in range(3):
    w.step_begin()
    step[0] += 1
    w.step_end()
if sys.argv[2] == "hung":
    w.step_begin()  # a step that never ends, as a host stuck in a collective or a wait
print("ready", flush=True)
time.sleep(600)
"""


@pytest.fixture
def host_process(tmp_path):
    """Start a process that writes host-0.json like a worker, then idles (or hangs in a step)."""
    procs = []

    def start(mode: str):
        proc = subprocess.Popen([sys.executable, "-c", _HOST_SCRIPT, str(tmp_path), mode], stdout=subprocess.PIPE,
                                text=True, start_new_session=True)
        procs.append(proc)
        assert proc.stdout.readline().strip() == "ready"
        return proc

    yield start
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)


@pytest.mark.timeout(120)
def test_stopped_process_flagged_idle_one_not(host_process, tmp_path, capsys):
    proc = host_process("idle")
    time.sleep(2.5)  # idle well past --stale-after: only the heartbeat keeps it fresh
    assert _flags(capsys, tmp_path, "--stale-after", "2") == (0, {"host 0": []})
    os.kill(proc.pid, signal.SIGSTOP)  # the process freezes: nothing writes any more
    try:
        time.sleep(2.5)
        rc, flags = _flags(capsys, tmp_path, "--stale-after", "2")
        assert rc == 1 and len(flags["host 0"]) == 1
        assert re.fullmatch(r"STOPPED \(last report \d+s ago\)", flags["host 0"][0]), flags
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    time.sleep(1.0)  # heartbeating again
    assert _flags(capsys, tmp_path, "--stale-after", "2") == (0, {"host 0": []})
    proc.kill()  # a host that died
    proc.wait(timeout=30)
    time.sleep(2.5)
    rc, flags = _flags(capsys, tmp_path, "--stale-after", "2")
    assert rc == 1 and flags["host 0"][0].startswith("STOPPED (last report")


@pytest.mark.timeout(120)
def test_hung_step_flagged(host_process, tmp_path, capsys):
    """A process stuck inside a step keeps heartbeating (its file stays fresh) but reports how long
    the step has been running: STOPPED (hung) past --hung-after, not before."""
    host_process("hung")
    time.sleep(1.5)
    assert _flags(capsys, tmp_path, "--stale-after", "2", "--hung-after", "30") == (0, {"host 0": []})
    time.sleep(1.5)
    rc, flags = _flags(capsys, tmp_path, "--stale-after", "2", "--hung-after", "2")
    assert rc == 1 and len(flags["host 0"]) == 1
    assert re.fullmatch(r"STOPPED \(hung: one step running for \ds, still heartbeating\)", flags["host 0"][0]), flags
    data = json.load(open(tmp_path / "host-0.json"))
    assert time.time() - data["time"] < 1.5 and data["busy_s"] > 1.5  # fresh file, long step


def _bracketing_owner(writer, state, seconds: float, bracket: bool) -> None:
    """An engine main thread: each step changes ``state`` (what build() reads) in two halves that
    are only consistent together; with ``bracket`` inside step_begin()/step_end()."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if bracket:
            writer.step_begin()
        state["a"] += 1
        time.sleep(0.0005)
        state["b"] += 1
        if bracket:
            writer.step_end(write=False)
        time.sleep(0.002)  # idle between steps: the heartbeat may build now


@pytest.mark.parametrize("bracket", [True, False], ids=["bracketed", "control-unbracketed"])
def test_heartbeat_builds_only_between_steps(tmp_path, bracket):
    """build_when_idle: the heartbeat builds fresh data only while no step is open, so it never
    sees a half-done step. Control: an owner that does not bracket its steps is caught."""
    state = {"a": 0, "b": 0}
    torn, builds = [], [0]

    def build():
        builds[0] += 1
        if state["a"] != state["b"]:
            torn.append(dict(state))
        return {"kind": "host", "host": 0, "step": state["a"]}

    writer = SnapshotWriter(str(tmp_path), "host-0.json", 3600.0, build, heartbeat_s=0.005, build_when_idle=True)
    try:
        writer.maybe_write(force=True)
        _bracketing_owner(writer, state, 3.0, bracket)
        time.sleep(0.2)  # idle now: the heartbeat brings the file up to the last step
    finally:
        writer.close()
    assert builds[0] > 50, builds  # the heartbeat really built, many times, while the owner ran
    if bracket:
        assert torn == [], torn[:3]
    else:
        assert torn, "the unbracketed control never caught the heartbeat mid-step"
    assert json.load(open(tmp_path / "host-0.json"))["step"] == state["a"]


def test_heartbeat_restamps_without_building(tmp_path):
    """Without build_when_idle the heartbeat never calls build(): it rewrites the last data with a
    fresh time (what the scheduler half, whose state changes outside steps, needs)."""
    builds = [0]

    def build():
        builds[0] += 1
        return {"kind": "scheduler", "step": builds[0]}

    writer = SnapshotWriter(str(tmp_path), "scheduler.json", 3600.0, build, heartbeat_s=0.1)
    try:
        assert writer.maybe_write()
        first = json.load(open(tmp_path / "scheduler.json"))
        time.sleep(0.6)
        later = json.load(open(tmp_path / "scheduler.json"))
    finally:
        writer.close()
    assert builds[0] == 1
    assert later["time"] > first["time"] and later["built"] == first["built"] and later["step"] == 1


# ============================================================================ malformed input
def test_missing_path(tmp_path, capsys):
    missing = tmp_path / "nope"
    rc, out, err = run_main(capsys, missing)
    assert rc == 2 and out == ""
    assert f"{missing}: no such file or directory" in err


def test_directory_without_snapshots(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("hello")
    rc, _, err = run_main(capsys, tmp_path)
    assert rc == 2
    assert f"{tmp_path}: no host-*.json or scheduler.json snapshots" in err


@pytest.mark.parametrize("content, why", [
    ("{not json", "not a readable tpuoffload snapshot"),
    ("", "not a readable tpuoffload snapshot"),
    (b"\xff\xfe\x00garbage", "not a readable tpuoffload snapshot"),
    ("[1, 2, 3]", "not a tpuoffload snapshot"),
    ('{"hello": "world"}', "not a tpuoffload snapshot"),
    ('{"kind": "host", "time": 1}', "host snapshot without an integer 'host'"),
    ('{"kind": "host", "host": "0", "time": 1}', "host snapshot without an integer 'host'"),
    ('{"kind": "host", "host": 0, "time": "yesterday"}', "'time' is 'yesterday', not a number"),
    ('{"kind": "host", "host": 0, "time": 1, "step": null}', "'step' is None, not an integer"),
    ('{"kind": "host", "host": 0, "time": 1, "totals": [1]}', "'totals' is not a mapping"),
    ('{"kind": "host", "host": 0, "time": 1, "recent_digests": [[1]]}', "'recent_digests' is not a list"),
], ids=["bad-json", "empty", "binary", "list", "foreign", "no-host", "str-host", "str-time", "null-step",
        "list-totals", "bad-digests"])
def test_malformed_file_named(real_run, tmp_path, capsys, content, why):
    shutil.copy(os.path.join(real_run.stats_dir, "host-0.json"), tmp_path / "host-0.json")
    bad = tmp_path / "host-1.json"
    bad.write_bytes(content if isinstance(content, bytes) else content.encode())
    for args in ([tmp_path], [bad]):  # found in a directory, or named
        rc, out, err = run_main(capsys, *args)
        assert rc == 2 and out == ""
        assert err.startswith(f"tpuoffload stats: {bad}: ") and why in err, err


def test_torn_copy_of_a_real_file(real_run, tmp_path, capsys):
    text = open(os.path.join(real_run.stats_dir, "host-1.json")).read()
    (tmp_path / "host-1.json").write_text(text[: len(text) // 2])
    rc, _, err = run_main(capsys, tmp_path)
    assert rc == 2 and f"{tmp_path / 'host-1.json'}: not a readable tpuoffload snapshot" in err


def test_same_host_in_two_directories(real_run, tmp_path, capsys):
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        shutil.copy(os.path.join(real_run.stats_dir, "host-0.json"), tmp_path / d / "host-0.json")
    rc, _, err = run_main(capsys, tmp_path / "a", tmp_path / "b")
    assert rc == 2
    assert f"{tmp_path / 'b' / 'host-0.json'}: host 0 is also reported by {tmp_path / 'a' / 'host-0.json'}" in err


def test_console_script_malformed(tmp_path):
    (tmp_path / "scheduler.json").write_text('{"kind": "scheduler"}')
    p = run_script(tmp_path)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip() == f"tpuoffload stats: {tmp_path / 'scheduler.json'}: not a tpuoffload snapshot (missing 'kind' or 'time')"
    p = run_script(tmp_path / "missing")
    assert p.returncode == 2 and "Traceback" not in p.stderr and str(tmp_path / "missing") in p.stderr


# ============================================================================ --watch
def watch(args, seconds, during=None):
    assert TPUOFFLOAD
    proc = subprocess.Popen([TPUOFFLOAD, "stats", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        if during is not None:
            time.sleep(seconds / 3)
            during()
            time.sleep(seconds * 2 / 3)
        else:
            time.sleep(seconds)
        assert proc.poll() is None, proc.communicate()  # still watching
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    out, err = proc.communicate(timeout=30)
    return out, err


def test_watch_refreshes(copies):
    out, err = watch([copies.path, "--watch", "0.2"], 1.5)
    assert out.count("\x1b[H\x1b[2J") >= 2, out
    assert out.count("slice total: ") >= 2
    frames = [f for f in out.split("\x1b[H\x1b[2J") if f.strip()]
    assert len(frames) >= 2
    for frame in frames[:-1]:  # the last one may be cut by the kill
        assert list(parse_table(frame)) == ["host 0", "host 1", "scheduler"]
        assert f"{2 * EXPECT_LOADED_PER_HOST} loaded" in frame


def test_watch_json_lines(copies):
    out, _ = watch([copies.path, "--watch", "0.2", "--json"], 1.2)
    assert "\x1b" not in out
    docs = [json.loads(line) for line in out.splitlines()]
    assert len(docs) >= 2
    assert all(d["total"]["loaded"] == 2 * EXPECT_LOADED_PER_HOST for d in docs)
    assert docs[1]["time"] > docs[0]["time"]


def test_watch_waits_for_first_snapshot(copies, tmp_path):
    """Watching a directory before the hosts wrote anything shows the problem and keeps going."""
    d = tmp_path / "later"
    d.mkdir()
    out, _ = watch([d, "--watch", "0.2"], 2.4,
                   during=lambda: [shutil.copy(os.path.join(copies.path, n), d / n) for n in os.listdir(copies.path)])
    assert "no host-*.json or scheduler.json snapshots" in out
    assert out.count("slice total: ") >= 2


def test_scheduler_half_writes_its_last_state_at_shutdown(tmp_path):
    """The scheduler half's snapshot is written at most once per interval while serving; when vLLM
    shuts the scheduler down (``Scheduler.shutdown`` -> the connector's ``shutdown``) it is written
    once more with the final state: every request released, every gauge zero. (DP ranks' halves
    live in DPScheduler's forked processes: that last file is the only view of their end state.)"""
    from tpuoffload.sim.engine import EngineSpec, InProcessEngine
    from tpuoffload.sim.workload import prefix_repetition

    engine = InProcessEngine(EngineSpec(num_hosts=1, num_blocks=64, extra_config={
        "num_cpu_chunks": 32, "stats_dir": str(tmp_path), "stats_interval_s": 3600}))
    for r in prefix_repetition(4, 2, 64, 16, 4, seed=1, block_size=16):
        engine.add_request(r)
    engine.run()
    engine.settle()
    path = tmp_path / "scheduler.json"
    first = json.loads(path.read_text())  # written at the first step only (the interval is an hour)
    assert first["step"] == 0 and first["requests"] > 0
    engine.scheduler.shutdown()
    last = json.loads(path.read_text())
    assert last["step"] > 0 and last["totals"]["saves_issued"] > 0
    assert last["leak_gauges"] and all(last[k] == 0 for k in last["leak_gauges"]), last
    engine.close()


def test_separate_dp_engines_get_a_table_each(copies, tmp_path, capsys):
    """``vllm serve --data-parallel-size 2`` without attention DP: engine 1 writes under
    ``engine-dp1`` of the stats directory (config.per_engine). Each engine is its own deployment
    (its own host 0): one table each, a stopped host of engine 1 flagged under engine 1 only, the
    exit status that of the worst engine. Before, the table showed engine 0 alone."""
    import shutil

    root = tmp_path / "stats"
    shutil.copytree(copies.path, root)
    shutil.copytree(copies.path, root / "engine-dp1")
    rc, out, _ = run_main(capsys, root)
    assert rc == 0, out
    assert out.startswith(f"engine 0 ({root}):\n") and f"\nengine 1 ({root / 'engine-dp1'}):\n" in out, out
    assert out.count("flagged: none") == 2, out
    host0 = json.loads((root / "engine-dp1" / "host-0.json").read_text())
    host0["time"] -= 3600  # engine 1's host 0 stopped writing an hour ago
    (root / "engine-dp1" / "host-0.json").write_text(json.dumps(host0))
    rc, out, _ = run_main(capsys, root)
    first, second = out.split(f"\nengine 1 ({root / 'engine-dp1'}):\n")
    assert rc == 1 and first.rstrip().endswith("flagged: none") and "flagged: host 0" in second, out
    rc, out, _ = run_main(capsys, root, "--json")
    doc = json.loads(out)
    assert sorted(doc["engines"]) == [f"engine 0 ({root})", f"engine 1 ({root / 'engine-dp1'})"], doc.keys()
