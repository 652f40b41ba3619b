#!/usr/bin/env python
"""Host-RAM hit rates of two host stores side by side, on vLLM's real Scheduler (CPU, no model).

Each workload is a fixed, seeded list of requests (token for token the same for every store). It
runs through vLLM 0.32's real ``Scheduler`` with ``TPUOffloadConnector`` (scheduler role) at one
byte budget (``--cpu-chunks`` chunks of host RAM; vLLM's HBM prefix cache of ``--hbm-blocks``
blocks in front of it, as in a serving engine), closed loop (``--concurrency`` requests in the
engine; the next one is added when one finishes), with a fake worker that confirms every save and
load in the step that asked for it (tools/bench_scheduler.py's ``Sim``). What differs between the
runs is only the host store the connector's code is taken from:

  lru        the connector of git revision ``--old-rev`` (exported with ``git archive`` into a
             temporary directory, first on that run's ``sys.path``): per-chunk LRU
  extents    the same revision with this tree's host store (``STORE_FILES``: manager/index.py,
             eviction by extent, and its parts) in place of its own; ``--extents`` runs it with
             ``index.EXTENT_SLOTS`` set to each value (1: per-chunk LRU, which must equal lru)
             (without ``--old-rev``: this tree as it is)

Each store runs in its own process. The hit rate is the prompt blocks loaded from host RAM over the
prompt blocks of the requests after the first ``--warmup`` ones (vLLM's own HBM hits are shown
beside it: they come first and are the same for every store to within the timing of finishes).

Workloads (``--workloads``; sizes in blocks of ``--block-size`` tokens):

  prefix-repetition      vLLM's PrefixRepetitionRandomDataset shape: ``--prefixes`` shared prefixes
                         of 64 blocks, each request one of them (uniform) plus a fresh suffix of
                         4-12 blocks; the prefixes together exceed host RAM
  prefix-zipf            the same, prefixes drawn Zipf(1.1): a few hot ones, a long tail
  multi-turn             conversations (vLLM's benchmarks/multi_turn shape): a returning
                         conversation sends its whole history (earlier prompts and answers) plus
                         a new user turn of 4-32 blocks; a new one a first turn of 8-64 blocks;
                         returning conversations drawn uniformly among the last 256
  multi-turn-recent      the same, the returning conversation drawn with a geometric preference
                         for the most recent (tools/churn_slots.py's default workload)

    python tools/replay_hit_rates.py --old-rev 3548214 --extents 1 16 32 64

Exit status 0; the table goes to stdout (and ``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# This tree's host store: what the 'extents' runs take from it (the rest of the connector: --old-rev's).
STORE_FILES = ("tpuoffload/manager/index.py", "tpuoffload/manager/recency.py", "tpuoffload/manager/slot_pool.py",
               "tpuoffload/manager/kernels.py", "tpuoffload/manager/hash_table.py")
WORKLOADS = ("prefix-repetition", "prefix-zipf", "multi-turn", "multi-turn-recent")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--old-rev", default=None, help="git revision whose connector is the 'lru' store")
    p.add_argument("--extents", type=int, nargs="+", default=[32], help="EXTENT_SLOTS values for this tree")
    p.add_argument("--cpu-chunks", type=int, default=4096, help="host RAM, in chunks (one block of every layer)")
    p.add_argument("--hbm-blocks", type=int, default=1536, help="vLLM's KV blocks (its HBM prefix cache)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--requests", type=int, default=2500)
    p.add_argument("--warmup", type=int, default=500, help="requests not counted (host RAM fills meanwhile)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-batched-tokens", type=int, default=8192)
    p.add_argument("--prefixes", type=int, default=96, help="prefix-repetition: shared prefixes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH")
    # internal: one store's run (a child process)
    p.add_argument("--run-store", help=argparse.SUPPRESS)
    p.add_argument("--tree", help=argparse.SUPPRESS)
    p.add_argument("--extent", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------- workloads
def make_workload(name: str, a) -> list[tuple[list[int], int]]:
    """(prompt tokens, max_tokens) of every request, in order."""
    rng = random.Random(f"{name}/{a.seed}")
    bs = a.block_size
    out = []

    def toks(blocks: int) -> list[int]:
        return [rng.randrange(3, 30000) for _ in range(blocks * bs)]

    if name.startswith("prefix"):
        prefixes = [toks(64) for _ in range(a.prefixes)]
        if name == "prefix-zipf":
            weights = [1.0 / (i + 1) ** 1.1 for i in range(a.prefixes)]
        for _ in range(a.requests):
            i = rng.randrange(a.prefixes) if name == "prefix-repetition" else \
                rng.choices(range(a.prefixes), weights)[0]
            out.append((prefixes[i] + toks(rng.randint(4, 12)) + [rng.randrange(3, 30000)], 4))
        return out
    # multi-turn: a conversation's history grows by (user turn + answer); one ends at the model length
    convs: list[list[int]] = []
    max_blocks = 480
    for _ in range(a.requests):
        c = -1
        if convs and rng.random() < 0.6:
            back = rng.randrange(min(256, len(convs))) if name == "multi-turn" else \
                min(int(rng.expovariate(0.02)), len(convs) - 1)
            c = len(convs) - 1 - back
            if len(convs[c]) // bs > max_blocks - 48:  # too long: a new conversation instead
                c = -1
        if c < 0:
            convs.append([])
            c = len(convs) - 1
            prompt = toks(rng.randint(8, 64))
        else:
            prompt = convs[c] + toks(rng.randint(4, 32))
        out.append((prompt + [rng.randrange(3, 30000)], 4))
        convs[c] = prompt + toks(rng.randint(1, 8))  # the answer is part of what the next turn sends
    return out


# ---------------------------------------------------------------------------------------- one store
def run_store(a) -> dict:
    if a.tree:
        sys.path.insert(0, a.tree)
    sys.path.insert(1 if a.tree else 0, ROOT)
    sys.path.insert(0, HERE)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import tpuoffload
    from tpuoffload.manager import index as index_mod
    from tpuoffload.manager.topology import host_chunk_bytes
    from tpuoffload.sim.vllm_setup import make_kv_cache_config, make_request, make_scheduler

    import bench_scheduler  # tools/: its fake worker

    if a.extent is not None:
        index_mod.EXTENT_SLOTS = a.extent
    chunk_bytes = host_chunk_bytes(make_kv_cache_config(1, a.block_size), 1)
    out = {"store": a.run_store, "tpuoffload": os.path.dirname(tpuoffload.__file__), "workloads": {}}
    for name in a.workloads:
        reqs = make_workload(name, a)
        sched = make_scheduler(
            num_blocks=a.hbm_blocks, block_size=a.block_size, max_num_seqs=a.concurrency,
            max_num_batched_tokens=a.max_batched_tokens, max_model_len=8192,
            kv_connector_extra_config={"cpu_bytes_to_use": a.cpu_chunks * chunk_bytes,
                                       "num_staging_blocks": 2 * a.max_batched_tokens // a.block_size})
        ix = sched.connector.scheduler.index
        sim = bench_scheduler.Sim(name=name, kind="tpu", sched=sched)
        loaded: dict[str, int] = {}
        orig_ack = sim._ack_tpu

        def ack(meta, _orig=orig_ack):
            for load in meta.loads:
                loaded[load.req_id] = loaded.get(load.req_id, 0) + len(load.block_ids)
            return _orig(meta)

        sim._ack_tpu = ack
        computed: dict[str, int] = {}  # tokens vLLM found computed (its HBM hit + host RAM) at admission
        orig_emulate = sim.emulate

        def emulate(so, _orig=orig_emulate):
            for nr in so.scheduled_new_reqs:
                computed.setdefault(nr.req_id, nr.num_computed_tokens)
            return _orig(so)

        sim.emulate = emulate
        nxt = 0
        t0 = time.perf_counter()
        steps = 0
        while nxt < len(reqs) or sched.has_requests():
            while nxt < len(reqs) and len(sched.requests) < a.concurrency:
                prompt, max_tokens = reqs[nxt]
                r = make_request(f"r{nxt}", prompt, max_tokens=max_tokens, block_size=a.block_size)
                sched.add_request(r)
                nxt += 1
            sim.step(None)
            steps += 1
        measured = [f"r{i}" for i in range(a.warmup, len(reqs))]
        prompt_blocks = sum(len(reqs[i][0]) // a.block_size for i in range(a.warmup, len(reqs)))
        host = sum(loaded.get(r, 0) for r in measured)
        hbm = sum(max(0, computed.get(r, 0) // a.block_size - loaded.get(r, 0)) for r in measured)
        extent = ix.extent_of_pool(0) if hasattr(ix, "extent_of_pool") else 1
        out["workloads"][name] = {
            "prompt_blocks": prompt_blocks, "host_hit_blocks": host, "hbm_hit_blocks": hbm,
            "host_hit_rate": host / prompt_blocks, "hbm_hit_rate": hbm / prompt_blocks, "steps": steps,
            "wall_s": round(time.perf_counter() - t0, 1), "extent": extent,
            "num_slots": ix.num_slots, "saves": sim.acked["saves"]}
        print(f"  {a.run_store} {name}: host {host / prompt_blocks:.4f} hbm {hbm / prompt_blocks:.4f} "
              f"({steps} steps, {time.perf_counter() - t0:.1f} s, extent {extent})", file=sys.stderr, flush=True)
    return out


# ---------------------------------------------------------------------------------------- driver
def child(a, store: str, tree: str | None, extent: int | None) -> dict:
    argv = [sys.executable, os.path.abspath(__file__), "--run-store", store, "--workloads", *a.workloads,
            "--cpu-chunks", str(a.cpu_chunks), "--hbm-blocks", str(a.hbm_blocks), "--block-size", str(a.block_size),
            "--requests", str(a.requests), "--warmup", str(a.warmup), "--concurrency", str(a.concurrency),
            "--max-batched-tokens", str(a.max_batched_tokens), "--prefixes", str(a.prefixes), "--seed", str(a.seed)]
    if tree:
        argv += ["--tree", tree]
    if extent is not None:
        argv += ["--extent", str(extent)]
    env = dict(os.environ, PYTHONHASHSEED="0")  # set and dict orders alike in every store's run
    res = subprocess.run(argv, stdout=subprocess.PIPE, text=True, check=True, env=env)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.run_store:
        print(json.dumps(run_store(a)), flush=True)
        return 0
    runs = []
    with tempfile.TemporaryDirectory(prefix="replay-") as tmp:
        old = new = None  # None: this tree as it is
        if a.old_rev:
            # The old revision as it was, and the same revision with this tree's host-store modules
            # (STORE_FILES) in place of its own: the two runs differ in the store alone.
            old, new = os.path.join(tmp, "old"), os.path.join(tmp, "new")
            archive = subprocess.run(["git", "-C", ROOT, "archive", a.old_rev, "tpuoffload"], check=True,
                                     stdout=subprocess.PIPE).stdout
            for d in (old, new):
                os.makedirs(d)
                subprocess.run(["tar", "-x", "-C", d], input=archive, check=True)
            for f in STORE_FILES:
                shutil.copy(os.path.join(ROOT, f), os.path.join(new, f))
            runs.append(child(a, f"lru@{a.old_rev}", old, None))
        for e in a.extents:
            runs.append(child(a, f"extents<={e}", new, e))
    print(f"\nhost-RAM hit rate (prompt blocks loaded from host RAM / prompt blocks), {a.cpu_chunks} chunks of host RAM, "
          f"{a.hbm_blocks} HBM blocks, {a.requests - a.warmup} requests measured after {a.warmup}")
    head = f"{'workload':<20} {'HBM hits':>9} " + " ".join(f"{r['store']:>16}" for r in runs)
    print(head)
    for name in a.workloads:
        hbm = runs[0]["workloads"][name]["hbm_hit_rate"]
        cells = " ".join(f"{100 * r['workloads'][name]['host_hit_rate']:>13.2f}%" +
                         f"{'':>1}{r['workloads'][name]['extent']:>2}" for r in runs)
        print(f"{name:<20} {100 * hbm:>8.2f}% {cells}")
    print("(the number after each rate: the extent in slots the store used)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"argv": sys.argv if argv is None else argv, "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
