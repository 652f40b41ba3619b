#!/usr/bin/env python
"""Host slots as the real scheduler hands them out once its store has churned: the slot pattern
of one step's saves and one step's loads in steady state, for tools/bench_transfer.py.

A fresh store hands out slots in one ascending run (``SlotPool``'s free stack), so a step's save,
and the load that later reads it back, are a few large copies. Once host RAM is full every save
takes victims instead (``ChunkIndex.allocate``): with per-chunk LRU (the store before issue 38)
slots freed one request, one touch, one eviction at a time, so a step's slots and a prefix's
slots became many short runs; with eviction by extent (manager/index.py since issue 38) they come
extent after extent. That is the pattern a long-running server moves its bytes in, and what this
module reproduces, with the scheduler's own ``ChunkIndex`` (slot pool, hash table, eviction
order) of whatever tree it runs in, driven exactly as the save
planner (``SavePlanner.plan``: ``select_and_name``, then ``allocate`` + ``add_saving`` for the
rest) and the load path (``ready_prefix_saved``, ``pin``, ``unpin``) drive it:

  workload  conversations of chunk hashes. Each step admits requests until its new chunks fill
            the step: a returning conversation (probability ``--p-return``, picked among the
            recent ones with a geometric preference for the newest) sends its whole history plus
            a new turn, loads its READY prefix (pinned for the step) and saves the rest; a new
            one sends a first turn. The step saves the first ``step_chunks`` new chunks (the
            staging budget's limit; the rest is skipped, as the planner counts it).
  confirms  a step's saves become READY (``mark_ready``: every host confirmed) and its loads'
            pins are released (``unpin``) at the start of the next step, as the ledger and the
            load completions do in the connector, one step later.
  steady    the store is full and every slot has been recycled several times: the simulation
            runs until the chunks evicted reach ``--recycle`` times the slots (and at least
            ``--min-steps`` steps), then reports the mean run length (consecutive ascending
            slots) of saves and loads over the first and second half of the last 20 steps; the
            two agree when the pattern has settled.
  measured  the next step's saves (exactly ``step_chunks`` slots, in the order the planner lists
            them) and a step's loads (returning requests' READY prefixes, in prefix order,
            concatenated as the worker concatenates a step's loads; a slot already listed is
            skipped; exactly ``step_chunks`` slots).

The scheduler needs numba (and vLLM for its message types); the device machine has neither, so
``--out`` writes the patterns as JSON for ``bench_transfer.py --churn-file``.

    python tools/churn_slots.py --steps-chunks 128 1024 --pool-steps 8 --out churn.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from dataclasses import dataclass

import numpy as np

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_lengths(slots) -> list[int]:
    """Lengths of the maximal runs of consecutive ascending slots, in order."""
    s = np.asarray(slots, np.int64)
    if not len(s):
        return []
    breaks = np.flatnonzero(s[1:] != s[:-1] + 1) + 1
    edges = np.concatenate(([0], breaks, [len(s)]))
    return np.diff(edges).tolist()


@dataclass
class ChurnParams:
    p_return: float = 0.6  # a request continues an earlier conversation
    recent: float = 0.02  # geometric preference for recent conversations (per conversation back)
    turn_max: int = 32  # a turn's new chunks: uniform 1..turn_max
    first_max: int = 64  # a new conversation's first turn: uniform 1..first_max
    recycle: float = 4.0  # steady state: evicted chunks >= recycle * slots
    min_steps: int = 40


def simulate(num_slots: int, step_chunks: int, seed: int = 0, params: ChurnParams | None = None,
             record_steps: int = 0) -> dict:
    """Drive a real ``ChunkIndex`` of ``num_slots`` slots to steady state; returns the measured
    step's ``save_slots`` and ``load_slots`` (``step_chunks`` each) and the statistics; with
    ``record_steps``, also ``steps``: the save and load slots of that many steady-state steps
    that follow (as listed, each step's loads as it made them: not topped up), for counting the
    copy structures a serving engine meets."""
    from tpuoffload import counters as C
    from tpuoffload.manager.hash_table import HashKeys, PackedHashes
    from tpuoffload.manager.index import ChunkIndex

    p = params or ChurnParams()
    if step_chunks > num_slots // 2:
        raise ValueError(f"a step of {step_chunks} chunks needs at least {2 * step_chunks} slots, not {num_slots}")
    rng = np.random.default_rng(seed)
    index = ChunkIndex(num_slots)
    next_hash = iter(range(1, 1 << 62))
    convs: list[list[bytes]] = []  # each conversation's chunk hashes, oldest first
    save_id = 0
    pending_ready: tuple[np.ndarray, np.ndarray] | None = None
    pending_pins: list[np.ndarray] = []
    history = {"save_runs": [], "load_runs": []}

    def new_hashes(k: int) -> list[bytes]:
        # Content hashes look random, as vLLM's do (the table reserves small key words as markers).
        return [hashlib.blake2b(next(next_hash).to_bytes(8, "little"), digest_size=16).digest() for _ in range(k)]

    def pick_return() -> int:
        back = min(int(rng.geometric(p.recent)) - 1, len(convs) - 1)
        return len(convs) - 1 - back

    def confirm() -> None:
        nonlocal pending_ready, pending_pins
        for pins in pending_pins:
            index.unpin(pins)
        pending_pins = []
        if pending_ready is not None:
            index.mark_ready(*pending_ready)
            pending_ready = None

    def one_step(measure: bool) -> tuple[np.ndarray, np.ndarray]:
        """One scheduler step: admit requests until the step's new chunks are filled; load their
        prefixes, save their new chunks. Returns (save slots, load slots) in listed order."""
        nonlocal save_id, pending_ready
        confirm()
        candidates: list[bytes] = []
        loads: list[np.ndarray] = []
        seen: set[int] = set()
        n_load = 0
        picked: set[int] = set()
        while len(candidates) < step_chunks or len(index.select_new(HashKeys.of(candidates))[1]) < step_chunks:
            if convs and rng.random() < p.p_return:
                c = pick_return()
                if c in picked:  # one request per conversation in a step
                    continue
                picked.add(c)
                prompt = convs[c] + new_hashes(int(rng.integers(1, p.turn_max + 1)))
                convs[c] = prompt
            else:
                prompt = new_hashes(int(rng.integers(1, p.first_max + 1)))
                convs.append(prompt)
            hit = index.ready_prefix_saved(prompt).slots
            if len(hit):
                index.pin(hit)
                pending_pins.append(hit.copy())
                fresh = [s for s in hit.tolist() if s not in seen]
                seen.update(fresh)
                loads.append(np.asarray(fresh, np.int64))
                n_load += len(fresh)
            candidates += prompt[len(hit):]
        if len(convs) > 4096:
            del convs[:len(convs) - 4096]
        # SavePlanner.plan: dedup + free slots in one call, then LRU victims for the rest.
        packed = PackedHashes.of(candidates)
        keys, keep, _, _, slots, _ = index.select_and_name(packed, step_chunks, save_id)
        granted = min(len(keep), step_chunks)
        got = len(slots)
        if got < granted:
            victims = index.allocate(granted - got)
            if len(victims):
                index.add_saving(keys.take(slice(got, got + len(victims))), victims, save_id + got)
                slots = np.concatenate((slots, victims)) if got else victims
        ids = np.arange(save_id, save_id + len(slots), dtype=np.int64)
        save_id += len(slots)
        pending_ready = (np.asarray(slots, np.int64).copy(), ids)
        load_slots = np.concatenate(loads) if loads else np.zeros(0, np.int64)
        return np.asarray(slots, np.int64), load_slots

    steps = 0
    while True:
        save_slots, load_slots = one_step(False)
        history["save_runs"].append(run_lengths(save_slots))
        history["load_runs"].append(run_lengths(load_slots))
        steps += 1
        if steps >= p.min_steps and index.counters[C.EVICTED] >= p.recycle * num_slots:
            break
        if steps > 100000:
            raise RuntimeError("no steady state after 100000 steps")
    evicted = int(index.counters[C.EVICTED])
    # The measured step: its saves; its loads topped up with more returning prefixes (lookups and
    # pins only) until they fill a step.
    save_slots, load_slots = one_step(True)
    while len(save_slots) < step_chunks:  # cannot happen in steady state (victims are unpinned READY chunks)
        raise RuntimeError(f"the measured step got {len(save_slots)} of {step_chunks} slots")
    load = list(load_slots.tolist())
    listed = set(load)
    tries = 0
    while len(load) < step_chunks and tries < 100000:
        tries += 1
        hit = index.ready_prefix_saved(convs[pick_return()]).slots.tolist()
        for s in hit:
            if s not in listed:
                listed.add(s)
                load.append(s)
    load = load[:step_chunks]
    if len(load) < step_chunks:
        raise RuntimeError(f"only {len(load)} loadable slots found for a step of {step_chunks}")
    recorded = []
    for _ in range(record_steps):
        step_save, step_load = one_step(False)
        recorded.append({"save": step_save.tolist(), "load": step_load.tolist()})

    def mean_run(runs_per_step):
        flat = [r for runs in runs_per_step for r in runs]
        return float(np.mean(flat)) if flat else 0.0

    last = 20
    h_save, h_load = history["save_runs"][-last:], history["load_runs"][-last:]
    return {
        "num_slots": num_slots, "step_chunks": step_chunks, "seed": seed, "params": vars(p),
        "warmup_steps": steps, "evicted": evicted, "evicted_per_slot": evicted / num_slots,
        "save_slots": save_slots[:step_chunks].tolist(), "load_slots": load,
        "save_mean_run": mean_run([run_lengths(save_slots[:step_chunks])]),
        "load_mean_run": mean_run([run_lengths(load)]),
        "steady": {"save_mean_run_first_half": mean_run(h_save[:last // 2]),
                   "save_mean_run_second_half": mean_run(h_save[last // 2:]),
                   "load_mean_run_first_half": mean_run(h_load[:last // 2]),
                   "load_mean_run_second_half": mean_run(h_load[last // 2:])},
        **({"steps": recorded} if record_steps else {}),
    }


def key(num_slots: int, step_chunks: int, seed: int) -> str:
    return f"{num_slots}/{step_chunks}/{seed}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps-chunks", type=int, nargs="+", required=True, help="chunks per step")
    ap.add_argument("--pool-steps", type=int, default=8, help="host slots = this many steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    out = {}
    if os.path.exists(a.out):
        with open(a.out) as f:
            out = json.load(f)
    for n in a.steps_chunks:
        r = simulate(a.pool_steps * n, n, a.seed)
        out[key(a.pool_steps * n, n, a.seed)] = r
        print(f"{n} chunks/step, {a.pool_steps * n} slots: {r['warmup_steps']} steps, "
              f"{r['evicted_per_slot']:.1f} evictions/slot; mean run save {r['save_mean_run']:.2f} "
              f"load {r['load_mean_run']:.2f}; steady {r['steady']}", flush=True)
    with open(a.out, "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
