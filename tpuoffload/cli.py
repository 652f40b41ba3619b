"""``tpuoffload stats``: read per-host snapshots, print a per-host table and the slice total, and
flag hosts that diverge, stall or stopped reporting. An idle engine keeps its snapshots fresh with
a heartbeat (tpuoffload.snapshot), so STOPPED means a process that died or froze, or one that
keeps heartbeating from inside a step that has run for longer than --hung-after.

    tpuoffload stats /var/run/tpuoffload [more dirs or files] [--watch 2] [--json]

Exit status: 0 healthy, 1 some host flagged, 2 unreadable input (a file named in the message).
With --watch it runs until interrupted; unreadable input is shown and retried at each refresh, and
--json prints one JSON document per line.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

GiB = float(1 << 30)


class StatsInputError(Exception):
    """Unreadable or inconsistent snapshot input; ``tpuoffload stats`` exits with status 2."""


@dataclass
class Snapshot:
    """One per-host or per-scheduler stats file read by ``tpuoffload stats``: its path, its JSON and
    the flags (DIVERGED, LAGGING, STUCK, STOPPED) the checks put on it."""

    path: str
    data: dict[str, Any]
    flags: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        if self.data.get("kind") == "host":
            return f"host {self.data['host']}"
        rank = self.data.get("dp_rank")
        return "scheduler" if rank in (None, 0) and "scheduler-dp" not in self.path else f"scheduler dp{rank}"


def _load(path: str) -> Snapshot:
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise StatsInputError(f"{path}: no such file") from None
    except (OSError, ValueError) as e:
        raise StatsInputError(f"{path}: not a readable tpuoffload snapshot ({e})") from None
    if not isinstance(data, dict) or data.get("kind") not in ("host", "scheduler") or "time" not in data:
        raise StatsInputError(f"{path}: not a tpuoffload snapshot (missing 'kind' or 'time')")
    if data["kind"] == "host" and not _is_int(data.get("host")):
        raise StatsInputError(f"{path}: host snapshot without an integer 'host'")
    problem = _check_fields(data)
    if problem:
        raise StatsInputError(f"{path}: not a readable tpuoffload snapshot ({problem})")
    return Snapshot(path, data)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_fields(data: dict[str, Any]) -> str | None:
    """What is wrong with the fields the table and the checks read (None: nothing), so a damaged
    or foreign file is reported by name instead of ending in a traceback."""
    if not _is_num(data["time"]):
        return f"'time' is {data['time']!r}, not a number"
    if "step" in data and not _is_int(data["step"]):
        return f"'step' is {data['step']!r}, not an integer"
    totals = data.get("totals", {})
    if not isinstance(totals, dict) or not all(_is_num(v) for v in totals.values()):
        return "'totals' is not a mapping of counter names to numbers"
    for key in ("interval_s", "heartbeat_s", "busy_s", "oldest_inflight_age_s", "slots_used", "slots_total", "staging_bytes",
                "inflight_chunks", "saving_chunks"):
        if key in data and not _is_num(data[key]):
            return f"{key!r} is {data[key]!r}, not a number"
    digests = data.get("recent_digests", [])
    if not isinstance(digests, list) or not all(
            isinstance(e, list) and len(e) == 2 and _is_int(e[0]) and isinstance(e[1], str) for e in digests):
        return "'recent_digests' is not a list of [step, digest] pairs"
    if "digest" in data and not isinstance(data["digest"], str):
        return "'digest' is not a string"
    return None


def load_snapshots(paths: list[str]) -> list[Snapshot]:
    files: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            found = sorted(glob.glob(os.path.join(p, "host-*.json")) + glob.glob(os.path.join(p, "scheduler.json"))
                           + glob.glob(os.path.join(p, "scheduler-dp*.json")))  # one per DP rank (DPScheduler)
            if not found:
                raise StatsInputError(f"{p}: no host-*.json or scheduler.json snapshots in this directory")
            files += found
        elif os.path.exists(p):
            files.append(p)
        else:
            raise StatsInputError(f"{p}: no such file or directory")
    # The same file named twice (a directory and a file in it) counts once.
    seen: set[str] = set()
    files = [f for f in files if not (os.path.realpath(f) in seen or seen.add(os.path.realpath(f)))]
    snaps = [_load(f) for f in files]
    # Two files for one host (or two scheduler files) would be added twice into the slice total:
    # most likely directories of two different runs or slices.
    owner: dict[str, str] = {}
    for s in snaps:
        if s.name in owner:
            raise StatsInputError(f"{s.path}: {s.name} is also reported by {owner[s.name]}; "
                                  "pass the snapshots of one slice only")
        owner[s.name] = s.path
    return snaps


def stale_limit(data: dict[str, Any]) -> float:
    """Seconds after its last write when a snapshot counts as stopped: three missed writes (the
    step interval or the idle heartbeat, whichever is longer) plus 5 s of slack."""
    period = max(float(data.get("interval_s", 5.0)), float(data.get("heartbeat_s", 0.0)))
    return 3 * period + 5


def analyse(snaps: list[Snapshot], *, now: float, stale_after_s: float | None, inflight_age_s: float,
            max_step_lag: int, hung_after_s: float = 600.0) -> None:
    """Attach flags: STOPPED (no snapshot lately: the process died or froze; or it keeps
    heartbeating but one step has been running for longer than ``hung_after_s``: hung), STUCK (old
    in-flight save), LAGGING (far behind the leading host's step), DIVERGED (different dispatch
    digest at a step another host also ran). An idle host heartbeats with no step open: not flagged."""
    hosts = [s for s in snaps if s.data["kind"] == "host"]
    for s in snaps:
        limit = stale_after_s if stale_after_s is not None else stale_limit(s.data)
        age = now - float(s.data["time"])
        busy = float(s.data.get("busy_s", 0.0))
        if age > limit:
            s.flags.append(f"STOPPED (last report {age:.0f}s ago)")
        elif busy and busy + age > hung_after_s:
            s.flags.append(f"STOPPED (hung: one step running for {busy + age:.0f}s, still heartbeating)")
    for s in hosts:
        age = float(s.data.get("oldest_inflight_age_s", 0.0))
        if age > inflight_age_s:
            s.flags.append(f"STUCK (save in flight for {age:.0f}s)")
    if not hosts:
        return
    lead = max(int(s.data.get("step", -1)) for s in hosts)
    for s in hosts:
        lag = lead - int(s.data.get("step", -1))
        if lag > max_step_lag:
            s.flags.append(f"LAGGING ({lag} steps behind)")
    by_step: dict[int, dict[str, list[Snapshot]]] = {}
    for s in hosts:
        for step, digest in s.data.get("recent_digests", []):
            by_step.setdefault(int(step), {}).setdefault(digest, []).append(s)
    for step in sorted(by_step):
        groups = by_step[step]
        if len(groups) > 1:
            sizes = sorted((len(m) for m in groups.values()), reverse=True)
            # Without a strict majority (two hosts that disagree) nothing says which host is right:
            # every host is flagged rather than an arbitrary one.
            majority = max(groups.values(), key=len) if sizes[0] > sizes[1] else None
            note = "" if majority is not None else ", no majority"
            for members in groups.values():
                if members is not majority:
                    for s in members:
                        if not any(f.startswith("DIVERGED") for f in s.flags):
                            s.flags.append(f"DIVERGED (dispatch digest differs at step {step}{note})")


def _row(s: Snapshot, now: float) -> dict[str, Any]:
    d, t = s.data, s.data.get("totals", {})
    if d["kind"] == "host":
        failed = t.get("save_failures", 0) + t.get("load_errors", 0)
    else:  # saves the scheduler dropped: failed on some host, or not confirmed in time
        failed = t.get("ledger_failed", 0) + t.get("ledger_expired", 0)
    return {
        "name": s.name,
        "step": d.get("step", -1),
        "digest": (d.get("digest") or "")[:8],
        "saved": int(t.get("chunks_saved", t.get("saves_issued", 0))),
        "saved_GiB": t.get("bytes_saved", 0) / GiB,
        "loaded": int(t.get("chunks_loaded", 0)),
        "loaded_GiB": t.get("bytes_loaded", 0) / GiB,
        "failed": int(failed),
        "skipped": int(t.get("skipped_no_space", 0) + t.get("skipped_staging", 0)),
        "slots": f"{d.get('slots_used', 0)}/{d.get('slots_total', 0)}",
        "staging_MiB": d.get("staging_bytes", 0) / (1 << 20),
        "inflight": int(d.get("inflight_chunks", d.get("saving_chunks", 0))),
        "oldest_s": float(d.get("oldest_inflight_age_s", 0.0)),
        "save_GiBps": t.get("bytes_saved", 0) / GiB / t["save_seconds"] if t.get("save_seconds") else 0.0,
        "load_GiBps": t.get("bytes_loaded", 0) / GiB / t["load_seconds"] if t.get("load_seconds") else 0.0,
        "age_s": now - float(d["time"]),
        "busy_s": float(d.get("busy_s", 0.0)),
        "flags": s.flags,
    }


_COLUMNS = [("name", "{:<10}"), ("step", "{:>7}"), ("digest", "{:>9}"), ("saved", "{:>8}"), ("saved_GiB", "{:>10.3f}"),
            ("loaded", "{:>8}"), ("loaded_GiB", "{:>11.3f}"), ("failed", "{:>7}"), ("skipped", "{:>8}"),
            ("slots", "{:>13}"), ("staging_MiB", "{:>12.1f}"), ("inflight", "{:>9}"), ("oldest_s", "{:>9.1f}"),
            ("save_GiBps", "{:>11.2f}"), ("load_GiBps", "{:>11.2f}"), ("age_s", "{:>6.0f}")]


def report(snaps: list[Snapshot], now: float) -> dict[str, Any]:
    rows = [_row(s, now) for s in snaps]
    hosts = [r for r, s in zip(rows, snaps) if s.data["kind"] == "host"]
    total = {k: sum(r[k] for r in hosts) for k in ("saved", "saved_GiB", "loaded", "loaded_GiB", "failed", "inflight")}
    # One scheduler half, or one per DP rank: the slice's hit rate is over all of them.
    scheds = [s.data.get("totals", {}) for s in snaps if s.data["kind"] == "scheduler"]
    lookups = sum(t.get("lookup_tokens", 0) for t in scheds)
    if lookups:
        total["hit_rate"] = sum(t.get("hit_tokens", 0) for t in scheds) / lookups
    return {"hosts": rows, "total": total, "flagged": [r["name"] for r in rows if r["flags"]]}


def render(rep: dict[str, Any]) -> str:
    head = "".join(fmt.replace(".3f", "").replace(".2f", "").replace(".1f", "").replace(".0f", "").format(name)
                   for name, fmt in _COLUMNS)
    lines = [head, "-" * len(head)]
    for r in rep["hosts"]:
        lines.append("".join(fmt.format(r[name]) for name, fmt in _COLUMNS))
        lines += [f"    ! {flag}" for flag in r["flags"]]
    t = rep["total"]
    lines.append("-" * len(head))
    summary = (f"slice total: {t['saved']} chunks saved ({t['saved_GiB']:.3f} GiB), {t['loaded']} loaded "
               f"({t['loaded_GiB']:.3f} GiB), {t['failed']} failures, {t['inflight']} in flight")
    if "hit_rate" in t:
        summary += f", host-RAM hit rate {t['hit_rate']:.1%}"
    lines.append(summary)
    lines.append("flagged: " + (", ".join(rep["flagged"]) if rep["flagged"] else "none"))
    return "\n".join(lines)


def engines(paths: list[str]) -> list[tuple[str | None, list[str]]]:
    """The deployments to report apart: ``vllm serve --data-parallel-size N`` without attention DP
    runs N separate engines, engine i > 0 writing under ``engine-dp<i>`` of the stats directory
    (config.per_engine; a MoE model's engine 0 too). One directory with such subdirectories gives
    one (label, paths) per engine; anything else is one deployment, unlabelled."""
    if len(paths) != 1 or not os.path.isdir(paths[0]):
        return [(None, paths)]
    root = paths[0]
    subdirs = sorted(glob.glob(os.path.join(root, "engine-dp*")), key=lambda d: int(d.rsplit("dp", 1)[1] or 0))
    if not subdirs:
        return [(None, paths)]
    top = [(f"engine 0 ({root})", [root])] if glob.glob(os.path.join(root, "*.json")) else []
    return top + [(f"engine {d.rsplit('dp', 1)[1]} ({d})", [d]) for d in subdirs]


def _one_report(paths: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """The report of one deployment's snapshots; ``{"error": ...}`` when they cannot be read."""
    try:
        snaps = load_snapshots(paths)
    except StatsInputError as e:
        return {"error": str(e)}
    now = time.time()
    analyse(snaps, now=now, stale_after_s=args.stale_after, inflight_age_s=args.inflight_age,
            max_step_lag=args.max_step_lag, hung_after_s=args.hung_after)
    return report(snaps, now)


def stats_main(args: argparse.Namespace) -> int:
    while True:
        reps = [(label, _one_report(paths, args)) for label, paths in engines(args.paths)]
        errors = [rep["error"] for _, rep in reps if "error" in rep]
        if errors and not args.watch:
            for e in errors:
                print(f"tpuoffload stats: {e}", file=sys.stderr)
            return 2
        # Watching: a host that has not written its first snapshot yet (or a file being replaced by
        # a restarted host) is shown and retried, not the end of the watch.
        if args.json:  # several engines: one document keyed by engine
            doc = reps[0][1] if reps[0][0] is None else {"engines": {label: rep for label, rep in reps}}
        else:
            text = "\n\n".join((f"{label}:\n" if label else "")
                                + (render(rep) if "error" not in rep else f"tpuoffload stats: {rep['error']}")
                                for label, rep in reps)
        if args.watch:
            if args.json:  # one JSON document per line, no terminal control codes
                doc["time"] = time.time()
                sys.stdout.write(json.dumps(doc) + "\n")
            else:
                sys.stdout.write("\x1b[H\x1b[2J" + time.strftime("%H:%M:%S ") + "\n" + text + "\n")
            sys.stdout.flush()
            time.sleep(args.watch)
            continue
        print(json.dumps(doc, indent=2) if args.json else text)
        return 1 if any(rep["flagged"] for _, rep in reps) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tpuoffload")
    sub = parser.add_subparsers(dest="command", required=True)
    st = sub.add_parser("stats", help="per-host table of the offload engine's snapshots")
    st.add_argument("paths", nargs="+", help="stats directories (kv_connector_extra_config stats_dir) or files")
    st.add_argument("--watch", type=float, metavar="SECONDS",
                    help="refresh in place every SECONDS (with --json: one JSON document per line)")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.add_argument("--stale-after", type=float, metavar="SECONDS",
                    help="flag a host whose snapshot is older (default: 3 x its interval or heartbeat + 5 s)")
    st.add_argument("--hung-after", type=float, default=600.0, metavar="SECONDS",
                    help="flag a host whose current step has been running longer (default 600: first-step "
                         "compiles can take minutes)")
    st.add_argument("--inflight-age", type=float, default=60.0, metavar="SECONDS",
                    help="flag saves in flight for longer (default 60)")
    st.add_argument("--max-step-lag", type=int, default=50, help="flag hosts this many steps behind (default 50)")
    ck = sub.add_parser("checkpoint", help="ask a running engine for a warm-restart checkpoint (persist_path)")
    ck.add_argument("directory", help="the deployment's persist_path")
    ck.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                    help="wait this long for every host to commit it (exit 0 committed, 1 failed, 2 no answer)")
    args = parser.parse_args(argv)
    if args.command == "checkpoint":
        from tpuoffload.persist.request import checkpoint_command

        return checkpoint_command(args.directory, args.wait)
    if args.watch is not None and args.watch <= 0:
        parser.error("--watch needs a positive number of seconds")
    try:
        return stats_main(args)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
