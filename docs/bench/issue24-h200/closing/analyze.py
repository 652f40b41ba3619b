#!/usr/bin/env python3
"""Tables of the closing measurement (issue 24) from the JSON files beside this script.

Per row: % of raw / floor (runs 1 and 2), save() main ms against raw's dispatch, the copies and
rows each program moved, and the model limit of run 1
    T = floor_ms * rows / blocks + (raw_ms - floor_ms) + (copies - 1) * c
(the rows the plan moves at the floor's bandwidth, the raw path's own gather / scatter once, and
each copy beyond the first at c, the per-copy device cost tools/probe_copies.py measured on the
same layout and step: ``probes/``, the slope between its fewest- and most-copy structures of the
same rows; where that slope is not resolved, 0 or the 512 MiB probe's, as printed).
Best % of raw = raw_ms / T, best % of floor = floor_ms / T; "rest" = measured - T.
"""
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
DEPS = {"gpt-oss-120b-tp8": "gpt", "qwen3-coder-480b-fp8-tp16": "qwen", "llama-70b-tp8": "llama",
        "deepseek-v3-mla-fp8": "ds"}


def per_copy(probe, op):
    """(us per copy on the device, us per copy on the dispatching thread, fewest, most copies) or None."""
    s = [v for k, v in probe["structures"].items() if k.startswith(op + " ")]
    lo, hi = min(s, key=lambda v: v["copies"]), max(s, key=lambda v: v["copies"])
    if hi["copies"] == lo["copies"]:
        return None
    dn = hi["copies"] - lo["copies"]
    return ((hi["median_ms"] - lo["median_ms"]) / dn * 1e3, (hi["dispatch_ms"] - lo["dispatch_ms"]) / dn * 1e3,
            lo["copies"], hi["copies"])


def rows_of(structs):
    return sum(int(w) * int(c) for s in structs for part in s.split("+") for w, c in [part.split("x")])


def load(path):
    with open(os.path.join(HERE, path)) as f:
        return json.load(f)


print("per-copy cost (probes/): us device / us dispatching thread, (fewest..most copies)")
costs = {}
for dep, short in DEPS.items():
    for mib in (64, 512):
        p = load(f"probes/{short}_{mib}.json")
        for op in ("save", "load"):
            c = per_copy(p, op)
            costs[dep, mib, op] = c
            print(f"  {dep:27s} {mib:4d} {op}: " + ("n/a (one structure's copies)" if c is None else
                  f"{c[0]:6.2f} / {c[1]:5.2f} ({c[2]}..{c[3]} copies over {p['rows']} rows)"))
print()
details = []
print("| deployment | MiB | slots | save % raw r1 / r2 | load % raw r1 / r2 | save % floor r1 / r2 | load % floor r1 / r2 "
      "| save() ms r1 / r2 (raw dispatch r1 / r2) | copies s/l (rows s/l of blocks) | model best % raw s/l | model best % floor s/l |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for dep in DEPS:
    r1s, r2s = load(f"{dep}.json")["results"], load(f"run2_{dep}.json")["results"]
    for r1, r2 in zip(r1s, r2s):
        mib = 64 if r1["step_mib"] < 100 else 512
        n = r1["blocks"]
        for pat in ("contiguous", "churned"):
            e = f"engine_{pat}_"
            f2 = lambda k, s=1: f"{r1[e + k] * s:.1f} / {r2[e + k] * s:.1f}"
            cp = r1[e + "copies"]
            assert cp == r2[e + "copies"]
            rs, rl = rows_of(cp["save_structure"]), rows_of(cp["load_structure"])
            bound = []
            for op, rows in (("save", rs), ("load", rl)):
                c = costs[dep, mib, op]
                if c is None or c[0] <= 0:  # unresolved: the same layout's 512 MiB slope, else 0
                    c = costs[dep, 512, op]
                cu = 0.0 if c is None else max(c[0], 0.0)
                fl, raw = r1[f"floor_{op}_ms"], r1[f"raw_{op}_ms"]
                t = fl * rows / n + (raw - fl) + (cp[op] - 1) * cu / 1e3
                bound.append((100 * raw / t, 100 * fl / t))
                meas = r1[e + op + "_ms"]
                main = (f"save() - raw dispatch {r1[e + 'save_main_ms'] - r1['raw_save_main_ms']:+.2f}" if op == "save"
                        else f"load() main {r1[e + 'load_main_ms']:.2f}")
                details.append(f"  {dep:27s} {mib:4d} {pat:10s} {op}: measured {meas:.2f} ms, T {t:.2f} "
                               f"(rows {fl * rows / n:.2f} + raw-floor {raw - fl:.2f} + copies {(cp[op] - 1) * cu / 1e3:.2f} at {cu:.2f} us), "
                               f"best {100 * raw / t:.0f}% raw / {100 * fl / t:.0f}% floor, rest {meas - t:+.2f}; {main}")
            print(f"| {dep} | {r1['step_mib']:.0f} | {pat} | {f2('raw_save_ratio', 100)} | {f2('raw_load_ratio', 100)} "
                  f"| {f2('floor_save_ratio', 100)} | {f2('floor_load_ratio', 100)} "
                  f"| {r1[e + 'save_main_ms']:.2f} / {r2[e + 'save_main_ms']:.2f} ({r1['raw_save_main_ms']:.2f} / {r2['raw_save_main_ms']:.2f}) "
                  f"| {cp['save']}/{cp['load']} ({rs}/{rl} of {n}) | {bound[0][0]:.0f} / {bound[1][0]:.0f} | {bound[0][1]:.0f} / {bound[1][1]:.0f} |")
print()
print("model T of run 1 per row and op (ms)")
print("\n".join(details))
print()
print("ms, run 1 (run 2): raw, floor, engine, per op and pattern; load main ms")
for dep in DEPS:
    r1s, r2s = load(f"{dep}.json")["results"], load(f"run2_{dep}.json")["results"]
    for r1, r2 in zip(r1s, r2s):
        for op in ("save", "load"):
            print(f"  {dep:27s} {r1['step_mib']:6.0f} {op}: raw {r1[f'raw_{op}_ms']:.2f} ({r2[f'raw_{op}_ms']:.2f}) "
                  f"floor {r1[f'floor_{op}_ms']:.2f} ({r2[f'floor_{op}_ms']:.2f}) "
                  + " ".join(f"{p} {r1[f'engine_{p}_{op}_ms']:.2f} ({r2[f'engine_{p}_{op}_ms']:.2f})" for p in ("contiguous", "churned"))
                  + ("" if op == "save" else " main " + " ".join(
                      f"{r1[f'engine_{p}_load_main_ms']:.2f} ({r2[f'engine_{p}_load_main_ms']:.2f})" for p in ("contiguous", "churned"))))
print()
print("probe save path (64 MiB contiguous, ms) and churned 64 MiB load() phases (ms, median)")
for dep, short in DEPS.items():
    p = load(f"probes/{short}_64.json")
    sp = p["save_path"]
    print(f"  {dep:27s} " + ", ".join(f"{k} {v['median_ms']:.2f}" for k, v in sp.items() if isinstance(v, dict)))
    print(f"  {'':27s} load {p['load_phases']['structure']}: " + ", ".join(f"{k} {v:.2f}" for k, v in p["load_phases"]["median_ms"].items()))
