"""The table of docs/performance.md ("save()'s main thread", issue 38 second session) from this
folder's JSON files: per deployment, step and slot pattern, the old tree's and the new tree's
save / load as % of raw and save() main-thread ms against raw's dispatch, runs 1 / 2; then the
probe's split of save()."""
import json
import os
import sys

here = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
DEPS = ["gpt-oss-120b-tp8", "qwen3-coder-480b-fp8-tp16", "llama-70b-tp8", "deepseek-v3-mla-fp8"]


def rows(run, tree, dep):
    path = os.path.join(here, f"run{run}_{tree}_{dep}.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        data = json.load(f)
    assert data["verified"] and data["platform"] == "gpu", path
    return {(r["step_mib"], p): (r, p) for r in data["results"] for p in r["patterns"]}


def cell(run, tree, dep, key):
    r = rows(run, tree, dep).get(key)
    if r is None:
        return None
    r, p = r
    e = f"engine_{p}"
    return (100 * r[f"{e}_raw_save_ratio"], 100 * r[f"{e}_raw_load_ratio"], r[f"{e}_save_main_ms"], r["raw_save_main_ms"])


print("| deployment | MiB | slots | save % raw, old / new (run 1; run 2) | load % raw, old / new (run 1; run 2) "
      "| save() ms (raw dispatch), old / new, run 1; run 2 |")
print("|---|---|---|---|---|---|")
for dep in DEPS:
    for key in sorted(rows(1, "new", dep)):
        c = {(run, tree): cell(run, tree, dep, key) for run in (1, 2) for tree in ("old", "new")}

        def pair(i, fmt="{:.1f}"):
            return "; ".join(" / ".join(fmt.format(c[(run, t)][i]) if c[(run, t)] else "-" for t in ("old", "new"))
                             for run in (1, 2))

        main = "; ".join(" / ".join(f"{c[(run, t)][2]:.2f} ({c[(run, t)][3]:.2f})" if c[(run, t)] else "-"
                                    for t in ("old", "new")) for run in (1, 2))
        print(f"| {dep} | {key[0]:.0f} | {key[1]} | {pair(0)} | {pair(1)} | {main} |")

print()
for tree in ("old", "new"):
    path = os.path.join(here, f"probe_{tree}.json")
    if not os.path.exists(path):
        continue
    with open(path) as f:
        data = json.load(f)
    print(f"probe ({tree}): save() = jit + engine, ms, medians of 15 (warm)")
    print("| deployment | MiB | slots | save() | jit | engine | raw dispatch | engine's largest parts |")
    print("|---|---|---|---|---|---|---|---|")
    for r in data["rows"]:
        ph = sorted(r.get("phases_ms", {}).items(), key=lambda kv: -kv[1])[:3]
        print(f"| {r['config']} | {r['step_mib']:.0f} | {r['slots']} | {r['save_ms']:.3f} | {r['jit_ms']:.3f} | "
              f"{r['engine_ms']:.3f} | {r['raw_dispatch_ms']:.3f} | " + ", ".join(f"{k} {v:.3f}" for k, v in ph) + " |")

print()
print("two H200s (--devices 2, the new tree): save / load % of raw, save() ms (raw dispatch)")
print("| deployment | MiB | slots | save % raw | load % raw | save() ms (raw dispatch) |")
print("|---|---|---|---|---|---|")
for dep in DEPS:
    path = os.path.join(here, f"x2_{dep}.json")
    if not os.path.exists(path):
        continue
    with open(path) as f:
        data = json.load(f)
    assert data["verified"] and data["platform"] == "gpu" and data["devices"] == 2, path
    for r in data["results"]:
        for p in r["patterns"]:
            e = f"engine_{p}"
            print(f"| {dep} | {r['step_mib']:.0f} | {p} | {100 * r[f'{e}_raw_save_ratio']:.1f} | "
                  f"{100 * r[f'{e}_raw_load_ratio']:.1f} | {r[f'{e}_save_main_ms']:.2f} ({r['raw_save_main_ms']:.2f}) |")
