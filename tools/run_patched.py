#!/usr/bin/env python
"""Run tools/bench_transfer.py with module constants of tpuoffload.worker.programs patched:
``python tools/run_patched.py NAME=VALUE ... -- <bench_transfer args>`` (an experiment aid)."""
import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tpuoffload.worker import programs  # noqa: E402

split = sys.argv.index("--")
for kv in sys.argv[1:split]:
    k, v = kv.split("=")
    setattr(programs, k, int(v))
    print(f"patched programs.{k} = {v}", flush=True)
sys.argv = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_transfer.py")] + sys.argv[split + 1:]
runpy.run_path(sys.argv[0], run_name="__main__")
