"""Issue 21, GDN hybrids: ``GdnRunner`` (tpuoffload.sim.gdn_runner), a synthetic runner over the
cache tpu-inference 0.32 allocates for a Qwen3.5-like model, driven by vLLM's real scheduler with
tpu-inference's hybrid coordinator (``tpuoffload.sim.gdn_layout``): its state rows land where the
GDN kernel writes them, a local prefix-cache hit reads a verified state, and a corrupted state row
is caught and spreads: what the step that read it writes and samples is wrong too."""

from __future__ import annotations

import dataclasses
import random

import jax
import numpy as np
import pytest

from tpuoffload.sim import gdn_layout as gl
from tpuoffload.sim.gdn_runner import GdnRunner, StateSlot

SPEC = gl.QWEN35_LIKE
BS = SPEC.block_size
PROMPT = 5 * BS + 7


@pytest.fixture(scope="module")
def layout():
    return gl.build(SPEC)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 30000) for _ in range(n)]


def _step(sched, runner: GdnRunner, so=None):
    """One engine step: schedule (unless ``so`` is given), run, report back."""
    so = so if so is not None else sched.schedule()
    sched.update_from_output(so, runner.execute(so))
    return so


def _drain(sched, runner: GdnRunner, max_steps: int = 30) -> None:
    for _ in range(max_steps):
        if not sched.requests:
            return
        _step(sched, runner)
    assert not sched.requests


def _admit_b_after_a(layout, seed: int):
    """Run A (5 blocks + 7 tokens) to completion, then schedule B, which shares A's 5 full blocks.
    Returns (scheduler, runner, B's scheduled step, B's prompt)."""
    sched, installed = gl.make_scheduler(layout)
    assert installed
    runner = GdnRunner.of(layout)
    rng = random.Random(seed)
    prompt_a = _tokens(rng, PROMPT)
    sched.add_request(gl.make_request(layout, "a", prompt_a, max_tokens=3))
    _drain(sched, runner)
    st = runner.stats
    assert st.states_written > 0 and st.states_verified > 0 and (st.state_mismatches, st.mismatches) == (0, 0)
    prompt_b = prompt_a[:5 * BS] + _tokens(rng, 9)
    sched.add_request(gl.make_request(layout, "b", prompt_b, max_tokens=2))
    return sched, runner, sched.schedule(), prompt_b


def _set_row(runner: GdnRunner, slot: StateSlot, row: int, value: np.ndarray) -> None:
    index, part = slot
    parts = list(runner.kv_caches[index])
    parts[part] = jax.device_put(parts[part].at[row].set(value), parts[part].sharding)
    runner.kv_caches[index] = tuple(parts)


def test_local_prefix_hit_reads_a_verified_state(layout):
    sched, runner, so, _ = _admit_b_after_a(layout, seed=5)
    (new,) = so.scheduled_new_reqs
    hit = new.num_computed_tokens
    print(f"B's local prefix-cache hit: {hit} tokens")
    # Align mode: the hit ends where A's state was kept, the end of A's first (5-block) chunk.
    assert hit == 5 * BS
    st = runner.stats
    rows, positions = st.states_verified, st.positions_verified
    _step(sched, runner, so)
    # B's first step read its hit row in every state array and the attention group's 5 blocks.
    assert (st.states_verified - rows, st.positions_verified - positions) == (len(runner.state_slots), hit)
    assert len(runner.state_slots) == 12  # conv and ssm of 6 GDN layers
    _drain(sched, runner)
    assert (st.state_mismatches, st.state_mismatched_requests, st.mismatches, st.poisoned_steps) == (0, set(), 0, 0)
    # tpu-inference's structure survives the donating steps: tuples stay tuples, shardings as allocated.
    for fresh, now in zip(layout.kv_caches, runner.kv_caches):
        assert isinstance(now, tuple) == isinstance(fresh, tuple)
        for a, b in zip(fresh if isinstance(fresh, tuple) else (fresh,), now if isinstance(now, tuple) else (now,)):
            assert (a.shape, a.dtype, a.sharding) == (b.shape, b.dtype, b.sharding)


def test_corrupted_state_row_is_caught_and_spreads(layout):
    """Negative control: B's hit row loses its state in two arrays (one zeroed, one holding the
    state one token short) before B's first step; the attention blocks stay intact. The model sees
    what it read: B's first step reads 2 wrong rows, and everything B computes afterwards is
    wrong (its next state rows, its attention KV, its tokens), so later checks catch it too."""
    sched, runner, so, prompt_b = _admit_b_after_a(layout, seed=6)
    (new,) = so.scheduled_new_reqs
    hit = new.num_computed_tokens
    assert hit == 5 * BS
    row = new.block_ids[layout.mamba_groups()[0]][gl.state_block_column(hit, BS)]
    first, last = runner.state_slots[0], runner.state_slots[-1]
    np.testing.assert_array_equal(np.asarray(runner.kv_caches[first[0]][first[1]][row]),
                                  runner.expected_state(prompt_b, hit, first))  # intact until now
    _set_row(runner, first, row, np.zeros_like(runner.expected_state(prompt_b, hit, first)))
    _set_row(runner, last, row, runner.expected_state(prompt_b, hit - 1, last))
    st = runner.stats
    _step(sched, runner, so)
    assert (st.state_mismatches, st.state_mismatched_requests, st.mismatches) == (2, {"b"}, 0)
    _drain(sched, runner)
    # The spread: B's later steps read the state and KV its first step wrote from a wrong state.
    assert st.state_mismatches > 2 and st.mismatches > 0 and st.mismatched_requests == {"b"}, st


def test_state_lands_at_the_gdn_write_column_every_chunk(layout):
    """Chunked prefill (32-token budget): every step's state lands in the row at the GDN op's write
    column of the scheduler's mamba table, and the row the next step reads still holds its state."""
    chunked = gl.build(dataclasses.replace(SPEC, max_num_batched_tokens=2 * BS))
    sched, _ = gl.make_scheduler(chunked)
    runner = GdnRunner.of(chunked)
    primary = chunked.mamba_groups()[0]
    sched.add_request(gl.make_request(chunked, "c", _tokens(random.Random(7), PROMPT), max_tokens=3))
    ends, held = [], []
    while sched.requests:
        start = sched.requests["c"].num_computed_tokens
        so = sched.schedule()
        req = sched.requests["c"]
        tokens, end = list(req.all_token_ids), req.num_computed_tokens
        tables = gl.block_table(sched, "c")
        assert all(tables[g] == tables[primary] for g in chunked.mamba_groups())
        mamba = tables[primary]
        if start:  # what the kernel reads: the state the previous step wrote, still in place
            _assert_state(runner, mamba[gl.state_block_column(start, BS)], tokens, start)
        out = runner.execute(so)
        row = mamba[gl.state_block_column(end, BS)]
        assert row == runner.state_row("c", end) != 0
        _assert_state(runner, row, tokens, end)
        ends.append(end)
        held.append([col for col, b in enumerate(mamba) if b])
        sched.update_from_output(so, out)
    print("step ends:", ends, "non-null mamba columns at each step:", held)
    # Align mode splits the prompt at block boundaries: 32, 64, 80, then the 7-token tail, then decode.
    assert ends == [2 * BS, 4 * BS, 5 * BS, PROMPT, PROMPT + 1, PROMPT + 2]
    # A step holds the row it reads and the row it writes; the older one is freed at the next
    # schedule() (vLLM's MambaManager.remove_skipped_blocks), so at most two non-null columns.
    assert held == [[1], [1, 3], [3, 4], [4, 5], [5], [5]]
    st = runner.stats
    assert st.states_written == len(ends) * len(runner.state_slots)
    # Every step after the first read the row the step before wrote: all right.
    assert st.states_verified == (len(ends) - 1) * len(runner.state_slots)
    assert (st.state_mismatches, st.mismatches, st.poisoned_steps) == (0, 0, 0)


def _assert_state(runner: GdnRunner, row: int, tokens: list[int], num_tokens: int) -> None:
    for index, part in runner.state_slots:
        np.testing.assert_array_equal(np.asarray(runner.kv_caches[index][part][row]),
                                      runner.expected_state(tokens, num_tokens, (index, part)))
