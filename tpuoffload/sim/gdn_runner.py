"""A synthetic runner for a GDN (Gated DeltaNet) hybrid's cache as tpu-inference 0.32 allocates it
(``tpuoffload.sim.gdn_layout``): ``SyntheticRunner`` over the attention arrays plus a synthetic
recurrent state in the (conv, ssm) arrays of every GDN layer.

``kv_caches`` keeps tpu-inference's runner structure: a list whose GDN positions hold (conv, ssm)
tuples of M-row arrays (the compact mamba pool) and whose attention positions hold KV arrays. The
connector's worker half reads it and assigns the same structure back after a load.

The state models what the GDN kernel does in vLLM's mamba cache mode "align"
(layers/vllm/custom_ops/gdn_attention_op.py): a request's step reads its state from the row at mamba
block-table column ``(num_computed - 1) // mamba_block_size`` and writes the state after the step to
the row at column ``(seq_len - 1) // mamba_block_size`` (``gdn_layout.state_block_column``). Here the
state after ``n`` tokens is, in every state array, a deterministic function of (array, element
index, prefix hash of the first ``n`` tokens), exact in the array's dtype. Every step reads, for
each scheduled request with ``num_computed > 0``, the row the kernel reads and checks it (a state
that was never computed, was overwritten or was loaded wrong is counted in ``stats``), then writes
the state after the step; as in the attention layers (runner.py), what a step read wrong poisons
the state it writes, the attention KV it writes and the token it samples.

All mamba groups carry the same block ids (tpu-inference's hybrid coordinator mirrors the primary
group's); the runner asserts it and uses the first mamba group's table.

This module is simulation support: product code never imports it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

from typing_extensions import override
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tpuoffload.sim.runner import RunnerStats, SyntheticRunner, _bucket, _words, kv_values, poisoned, prefix_hashes

#: A state array: (index in ``kv_caches``, 0 for conv / 1 for ssm).
StateSlot = tuple[int, int]


@dataclass
class GdnRunnerStats(RunnerStats):
    """``RunnerStats`` (the attention arrays) plus the state rows: one row is one state array of
    one request."""

    states_written: int = 0  # rows written (every state array, every scheduled request, every step)
    states_verified: int = 0  # rows checked (every step of a request with num_computed > 0)
    state_mismatches: int = 0  # of those, rows not holding the state of the request's prefix
    state_mismatched_requests: set[str] = field(default_factory=set)


def state_salt(slot: StateSlot) -> int:
    """The per-array term of the state value (distinct for every state array of the runner)."""
    index, part = slot
    return 2 * index + part


@functools.lru_cache(maxsize=8)
def _state_program(rests, dtypes, salts, shardings, mesh):
    """Read, then write, one row of every state array per request, as the GDN kernel reads the old
    state before it writes the new one (the two rows coincide inside an unaligned block). Entry
    ``k`` of every argument is one scheduled request: ``r_row``/``r_ok``/``r_hash``: the row it
    reads, whether it reads one, the prefix hash the row must hold; ``w_row``/``w_hash``: the row
    it writes and the hash of the state after the step (out-of-range rows are padding, dropped).
    Returns the new arrays (the old are donated), ``bad[k, a]`` (request ``k`` read array ``a``
    wrong) and each request's digest of what it read wrong (the written state is poisoned by it)."""

    def step(states, r_row, r_ok, r_hash, w_row, w_hash):
        rows = r_row.shape[0]
        bad, digest = [], jnp.zeros(rows, jnp.uint32)
        for arr, rest, dtype, salt in zip(states, rests, dtypes, salts):
            got = arr[r_row]
            want = kv_values(r_hash, salt, rest, dtype)
            wrong = r_ok & (got.reshape(rows, -1) != want.reshape(rows, -1)).any(axis=1)
            bad.append(wrong)
            digest = digest + jnp.where(r_ok, _words(got, rows) - _words(want, rows), jnp.uint32(0))
            digest = digest | wrong.astype(jnp.uint32)
        out = [arr.at[w_row].set(kv_values(poisoned(w_hash, digest), salt, rest, dtype), mode="drop")
               for arr, rest, dtype, salt in zip(states, rests, dtypes, salts)]
        return tuple(out), jnp.stack(bad, axis=1), digest

    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.jit(step, donate_argnums=0, out_shardings=(shardings, replicated, replicated))


@dataclass
class _StatePlan:
    """One step's state rows, one entry per scheduled request: the row it reads (``r_ok``: it reads
    one) and the prefix hash that row must hold, the row it writes and the hash written."""

    req: list[str] = field(default_factory=list)
    r_row: list[int] = field(default_factory=list)
    r_ok: list[bool] = field(default_factory=list)
    r_hash: list[int] = field(default_factory=list)
    w_row: list[int] = field(default_factory=list)
    w_hash: list[int] = field(default_factory=list)


class GdnRunner(SyntheticRunner):
    """One host's runner for a GDN hybrid. ``kv_caches``: tpu-inference's structure (module doc),
    replaced after every donating update."""

    def __init__(self, kv_caches: Sequence, mesh: Mesh, *, kv_cache_config,
                 layer_name_to_kvcache_index: dict[str, int], vocab: int = 32000, dp_ranks: int = 1) -> None:
        """``kv_caches``: a (conv, ssm) tuple at every GDN layer's index, a KV array at every
        attention layer's; ``kv_cache_config``: vLLM's (its groups say which layer, so which array,
        is attention or state, and the block sizes); ``layer_name_to_kvcache_index``: the runner's
        map from layer name to ``kv_caches`` index (the connector's worker half reads it too).
        ``dp_ranks``: under DPScheduler each rank's block ids are its own, as tpu-inference's runner
        reads them inside its shard of axis 0: rank r's attention block b is the array's block
        r * (blocks / ranks) + b, its state row b the state arrays' row r * (M / ranks) + b."""
        from vllm.v1.kv_cache_interface import MambaSpec

        groups = kv_cache_config.kv_cache_groups
        self.mamba_groups = [g for g, grp in enumerate(groups) if isinstance(grp.kv_cache_spec, MambaSpec)]
        assert self.mamba_groups, "no mamba group: use SyntheticRunner"
        attention = [g for g in range(len(groups)) if g not in self.mamba_groups]
        self.mamba_block_size = groups[self.mamba_groups[0]].kv_cache_spec.block_size
        assert {groups[g].kv_cache_spec.block_size for g in self.mamba_groups} == {self.mamba_block_size}
        index = layer_name_to_kvcache_index
        # Attention arrays, each serving its group's layer (salt: its kv_caches index).
        self._attn_index = [index[name] for g in attention for name in groups[g].layer_names]
        serves = [((g, index[name]),) for g in attention for name in groups[g].layer_names]
        windows = [getattr(grp.kv_cache_spec, "sliding_window", None) for grp in groups]
        assert all(not isinstance(kv_caches[i], tuple) for i in self._attn_index)
        super().__init__([kv_caches[i] for i in self._attn_index], mesh,
                         block_size=groups[attention[0]].kv_cache_spec.block_size, vocab=vocab,
                         serves=serves, windows=windows, dp_ranks=dp_ranks)
        self.kv_caches: list = list(kv_caches)
        self.layer_name_to_kvcache_index = dict(index)
        self.state_slots: list[StateSlot] = [(i, part) for i, c in enumerate(kv_caches) if isinstance(c, tuple)
                                             for part in range(len(c))]
        assert {self._state_array(s).shape[0] for s in self.state_slots} == {self.num_state_rows}
        self.rows_per_rank = tuple(self.num_state_rows // dp_ranks if g in self.mamba_groups else self.blocks_per_rank
                                   for g in range(len(groups)))
        self.stats = GdnRunnerStats()
        arrays = [self._state_array(s) for s in self.state_slots]
        self._state_fn = _state_program(tuple(tuple(a.shape[1:]) for a in arrays), tuple(a.dtype for a in arrays),
                                        tuple(map(state_salt, self.state_slots)),
                                        tuple(a.sharding for a in arrays), mesh)

    @classmethod
    def of(cls, layout, *, vocab: int = 32000, fresh: bool = True) -> GdnRunner:
        """A runner on zeroed arrays of ``layout``'s (a ``gdn_layout.GdnLayout``) shapes, dtypes and
        shardings, so the layout's own arrays are left alone (the runner donates its arrays); with
        ``fresh=False`` on the layout's own arrays (a pod-slice host, whose arrays span processes)."""

        def zeros(a: jax.Array) -> jax.Array:
            return jax.device_put(np.zeros(a.shape, a.dtype), a.sharding)

        caches = layout.kv_caches if not fresh else \
            [tuple(map(zeros, c)) if isinstance(c, tuple) else zeros(c) for c in layout.kv_caches]
        return cls(caches, layout.mesh, kv_cache_config=layout.kv_cache_config,
                   layer_name_to_kvcache_index=layout.layer_name_to_kvcache_index, vocab=vocab,
                   dp_ranks=layout.spec.dp)

    @property
    def num_state_rows(self) -> int:
        """M: rows of every state array (the compact mamba pool)."""
        return self._state_array(self.state_slots[0]).shape[0]

    def _state_array(self, slot: StateSlot) -> jax.Array:
        index, part = slot
        return self.kv_caches[index][part]

    # ------------------------------------------------------------------ SyntheticRunner hooks
    @override
    def _kv_arrays(self) -> list[jax.Array]:
        return [self.kv_caches[i] for i in self._attn_index]

    @override
    def _store_kv_arrays(self, arrays: Sequence[jax.Array]) -> None:
        caches = list(self.kv_caches)
        for i, a in zip(self._attn_index, arrays):
            caches[i] = a
        self.kv_caches = caches

    @override
    def _forward(self, so, digests: dict[str, int] | None = None) -> dict[str, int]:
        # The state layers first (before the attention step advances num_computed): what they
        # read wrong poisons what the attention layers write and the sampled tokens.
        return super()._forward(so, self._run_states(self._state_plan(so)))

    # ------------------------------------------------------------------ the state
    def state_row(self, req_id: str, num_tokens: int) -> int:
        """The row holding request ``req_id``'s state after ``num_tokens`` tokens, per the block
        table this runner holds for it (the first mamba group's; the others carry the same ids)."""
        tables = self._reqs[req_id].block_ids
        primary = tables[self.mamba_groups[0]]
        assert all(tables[g] == primary for g in self.mamba_groups), f"{req_id}: mamba groups differ"
        return primary[max(num_tokens - 1, 0) // self.mamba_block_size]

    def _state_plan(self, so) -> _StatePlan:
        """The rows this step reads (every request with num_computed > 0: the row the kernel reads)
        and writes (every scheduled request: the row at the step's end column)."""
        plan = _StatePlan()
        for req_id, n in so.num_scheduled_tokens.items():
            req = self._reqs[req_id]
            start, end = req.num_computed, req.num_computed + n
            assert end <= len(req.hashes), f"{req_id}: {end} tokens scheduled, {len(req.hashes)} known"
            plan.req.append(req_id)
            plan.r_ok.append(start > 0)
            plan.r_row.append(self.state_row(req_id, start) if start else 0)
            plan.r_hash.append(req.hashes[start - 1] if start else 0)
            row = self.state_row(req_id, end)
            assert row != 0, f"{req_id}: the state after {end} tokens would go to the null block"
            plan.w_row.append(row)
            plan.w_hash.append(req.hashes[end - 1])
        return plan

    def _run_states(self, plan: _StatePlan) -> dict[str, int]:
        """Run the step's state reads and writes; returns the digest each request's reads left."""
        n = len(plan.req)
        pad = _bucket(n) - n
        states, bad, digest = self._state_fn(
            tuple(self._state_array(s) for s in self.state_slots),
            np.array(plan.r_row + [0] * pad, np.int32), np.array(plan.r_ok + [False] * pad, bool),
            np.array(plan.r_hash + [0] * pad, np.uint32),
            np.array(plan.w_row + [self.num_state_rows] * pad, np.int32),
            np.array(plan.w_hash + [0] * pad, np.uint32))
        self._store_states(states)
        self.stats.states_written += n * len(self.state_slots)
        self.stats.states_verified += sum(plan.r_ok) * len(self.state_slots)
        bad, digest = np.asarray(bad)[:n], np.asarray(digest)[:n]
        if bad.any():
            self.stats.state_mismatches += int(bad.sum())
            self.stats.state_mismatched_requests.update(plan.req[i] for i in np.nonzero(bad.any(axis=1))[0])
        return {req_id: int(d) for req_id, d in zip(plan.req, digest) if d}

    def _store_states(self, states: Sequence[jax.Array]) -> None:
        """Rebuild ``kv_caches`` with new state arrays: tuples stay tuples, as tpu-inference holds them."""
        caches = list(self.kv_caches)
        for (index, part), a in zip(self.state_slots, states):
            parts = list(caches[index])
            parts[part] = a
            caches[index] = tuple(parts)
        self.kv_caches = caches

    @override
    def wrong_reads(self) -> int:
        """Wrong attention positions and wrong state rows read so far."""
        return self.stats.mismatches + self.stats.state_mismatches

    def expected_state(self, tokens: Sequence[int], num_tokens: int, array: StateSlot) -> np.ndarray:
        """What state array ``array`` (``(kv_caches index, 0 conv / 1 ssm)``) must hold in a row
        holding the state of a request with these token ids after its first ``num_tokens`` tokens:
        the row's shape (the array's shape without axis 0)."""
        a = self._state_array(array)
        h = prefix_hashes(tokens[:num_tokens])[-1]
        return np.asarray(kv_values(np.array([h], np.uint32), state_salt(array), tuple(a.shape[1:]), a.dtype))[0]
