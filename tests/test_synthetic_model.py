"""The synthetic model sees the KV it reads (tpuoffload/sim/runner.py): a wrong read taints
everything computed after it, so every later check catches it, not only the read itself.

Issue 35: with a model whose written KV and sampled tokens depended on the token ids only, a wrong
read showed once, at the step that made it; what that step computed on top (saved, confirmed and
offered to every rank through host RAM) was right by construction, and "wrong outputs 0" said
nothing about KV correctness. These tests corrupt one block in HBM, let a request read it once,
put the right bytes back, and require the damage to show downstream: in the request's later
reads of KV it wrote itself, and in its tokens. With the old model both would be clean."""

from __future__ import annotations

import random

import jax
import numpy as np

from tpuoffload.sim.engine import EngineSpec, InProcessEngine
from tpuoffload.sim.vllm_setup import make_request
from tpuoffload.sim.workload import expected_output

BS = 16


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 30000) for _ in range(n)]


def _set_block(runner, block: int, values: list[np.ndarray]) -> None:
    runner.kv_caches = [jax.device_put(a.at[block].set(v), a.sharding) for a, v in zip(runner.kv_caches, values)]


def _run_with_one_wrong_read(corrupt: bool):
    """Request "a" (3 blocks + 5 tokens) runs its prefill; block 1 of its prefix is zeroed in HBM
    (``corrupt``), "b" shares that prefix (a local prefix-cache hit) and runs its first step, which
    reads the zeroed block; then the block's right bytes go back and both run to the end."""
    eng = InProcessEngine(EngineSpec(extra_config={"cpu_bytes_to_use": 1 << 22}))
    prompt_a = _tokens(1, 3 * BS + 5)
    prompt_b = prompt_a[:3 * BS] + _tokens(2, 7)
    eng.add_request(make_request("a", prompt_a, max_tokens=6))
    eng.step()  # a's prefill, first token
    runner = eng.runners[0]
    block = runner._reqs["a"].block_ids[0][1]
    right = [np.asarray(a[block]) for a in runner.kv_caches]
    if corrupt:
        _set_block(runner, block, [np.zeros_like(r) for r in right])
    eng.add_request(make_request("b", prompt_b, max_tokens=6))
    eng.step()  # b's first step (its hit on a's 3 blocks) and a's decode read the block
    first = runner.stats.mismatches
    _set_block(runner, block, right)
    eng.run()
    return eng, runner, first, (prompt_a, prompt_b)


def test_a_wrong_read_spreads_to_what_the_request_computes_after_it():
    eng, runner, first, (prompt_a, prompt_b) = _run_with_one_wrong_read(corrupt=True)
    # The step after the corruption read 16 wrong positions for each of the two requests.
    assert first == 2 * BS, first
    # The block is right again, yet the later steps read wrong KV: what a and b wrote after their
    # wrong read (their own decode positions, b's prompt tail) came from a wrong context.
    assert runner.stats.mismatches > first, runner.stats
    assert runner.stats.mismatched_requests == {"a", "b"}
    assert runner.stats.poisoned_steps >= 2
    # And their tokens: b's first token already came from the wrong context.
    assert eng.outputs["b"][0] != expected_output(prompt_b, 6, runner.vocab)[0]
    assert eng.outputs["a"][1:] != expected_output(prompt_a, 6, runner.vocab)[1:]


def test_without_a_wrong_read_every_read_and_token_is_right():
    """The control: the same run without the corruption reads everything right, every step, and
    samples the tokens the prefixes imply (what the spread test's figures are measured against)."""
    eng, runner, first, (prompt_a, prompt_b) = _run_with_one_wrong_read(corrupt=False)
    assert (first, runner.stats.mismatches, runner.stats.poisoned_steps) == (0, 0, 0)
    assert runner.stats.positions_verified > 0
    assert eng.outputs["a"] == expected_output(prompt_a, 6, runner.vocab)
    assert eng.outputs["b"] == expected_output(prompt_b, 6, runner.vocab)
