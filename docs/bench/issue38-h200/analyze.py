#!/usr/bin/env python
"""The issue-38 table from the run*_<deployment>.json files beside this script: per deployment and
step, each slot pattern's save and load as % of raw (run 1 / run 2), save() main-thread ms against
raw's dispatch, and the copies one save / one load issued.

    python docs/bench/issue38-h200/analyze.py
"""
import glob
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
DEPS = ("gpt-oss-120b-tp8", "qwen3-coder-480b-fp8-tp16", "llama-70b-tp8", "deepseek-v3-mla-fp8")


def rows(path):
    with open(path) as f:
        d = json.load(f)
    assert d["verified"] and not d["failures"], path
    return d["results"]


runs = {}
for p in sorted(glob.glob(os.path.join(HERE, "run*_*.json"))):
    run, dep = os.path.basename(p)[3:-5].split("_", 1)
    runs.setdefault(dep, {})[run] = rows(p)
print("| deployment | MiB | slots | save % raw (run 1 / 2) | load % raw (run 1 / 2) | save() ms (raw dispatch), run 1 / 2 "
      "| mean run save / load | copies save / load |")
print("|---|---|---|---|---|---|---|---|")
for dep in DEPS:
    r1, r2 = runs[dep]["1"], runs[dep]["2"]
    for a, b in zip(r1, r2):
        for pat in a["patterns"]:
            e = f"engine_{pat}"
            mr = a["churn"].get(pat)
            cp = a[f"{e}_copies"]
            print(f"| {dep} | {a['step_mib']:.0f} | {pat.replace('churned-', 'churned ')} "
                  f"| {100 * a[f'{e}_raw_save_ratio']:.1f} / {100 * b[f'{e}_raw_save_ratio']:.1f} "
                  f"| {100 * a[f'{e}_raw_load_ratio']:.1f} / {100 * b[f'{e}_raw_load_ratio']:.1f} "
                  f"| {a[f'{e}_save_main_ms']:.2f} ({a['raw_save_main_ms']:.2f}) / {b[f'{e}_save_main_ms']:.2f} "
                  f"({b['raw_save_main_ms']:.2f}) "
                  f"| {'%.1f / %.1f' % (mr['save_mean_run'], mr['load_mean_run']) if mr else '-'} "
                  f"| {cp['save']} / {cp['load']} |")
