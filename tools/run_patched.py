#!/usr/bin/env python
"""Run tools/bench_transfer.py with module constants of tpuoffload.worker patched:
``python tools/run_patched.py [MODULE.]NAME=VALUE ... -- <bench_transfer args>``, MODULE one of
tpuoffload.worker's modules (default ``programs``), e.g. ``copy_plan.COUNT_STEPS=8`` (an experiment aid)."""
import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import importlib  # noqa: E402

split = sys.argv.index("--")
for kv in sys.argv[1:split]:
    k, v = kv.split("=")
    module, _, name = k.rpartition(".")
    target = importlib.import_module(f"tpuoffload.worker.{module or 'programs'}")
    setattr(target, name, int(v))
    print(f"patched {target.__name__}.{name} = {v}", flush=True)
sys.argv = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_transfer.py")] + sys.argv[split + 1:]
runpy.run_path(sys.argv[0], run_name="__main__")
