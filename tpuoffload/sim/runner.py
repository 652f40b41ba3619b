"""A synthetic model runner: a real sharded JAX KV cache and a jitted step, no model weights.

It stands in for tpu-inference's runner in tests and in the demo, on caches tpu-inference's own
``create_kv_caches`` allocated (``tpuoffload.sim.tpu_layouts``).

The model sees the KV it reads, as a transformer does. Every step, for every scheduled request, it
reads the request's whole context (every position before the step's first token, every layer) and
folds what it read into a per-request digest (``_step_programs``); the KV the step writes depends
on that digest, and the sampled token does too. With the right context the digest is neutral and
every value is a deterministic function of (layer, position in the token's slice of the block, hash
of the token ids up to that position), exact in the cache's dtype, so any block, whether computed,
taken from vLLM's prefix cache or loaded from host RAM, can be checked exactly. A wrong read
changes the digest: what that request writes afterwards and every token it samples are wrong, so
a wrong read spreads to every later check (another request reading those blocks from HBM or host
RAM, the request's own later steps, its output tokens) instead of staying where it happened.
``stats.mismatches`` counts every wrong position read, every step.

It drives the connector's worker half in the order vLLM's KVConnectorModelRunnerMixin does.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

_MASK = 0x7FFFFFFF


def prefix_hashes(tokens: Sequence[int], start_hash: int = 0) -> list[int]:
    """Rolling hash of the token ids up to and including each position."""
    out, h = [], start_hash
    for t in tokens:
        h = (h * 1000003 + int(t) + 1) & _MASK
        out.append(h)
    return out


def exact_mask(dtype) -> int:
    """Largest all-ones integer every value of which ``dtype`` represents exactly."""
    dtype = np.dtype(dtype)
    if np.issubdtype(dtype, np.integer):
        return (1 << (8 * dtype.itemsize - 1)) - 1
    return (1 << min(jnp.finfo(dtype).nmant + 1, 20)) - 1


def kv_values(hashes, layer: int, rest: tuple[int, ...], dtype):
    """(tokens, *rest) values of one layer, exact in ``dtype``: a function of the token's prefix
    hash, the layer and the position within the token's slice of the block."""
    size = int(np.prod(rest))
    x = jnp.asarray(hashes, jnp.uint32)[:, None] * jnp.uint32(2654435761)
    x = x + jnp.uint32(layer * 7919) + jnp.arange(size, dtype=jnp.uint32)[None, :] * jnp.uint32(131)
    v = (x >> 8) & jnp.uint32(exact_mask(dtype))
    return v.astype(jnp.float32).astype(dtype).reshape(-1, *rest)


def sample(prefix_hash: int, vocab: int) -> int:
    return (prefix_hash * 48271 + 11) % vocab


def _bucket(n: int) -> int:
    return max(16, 1 << (max(n, 1) - 1).bit_length())


def _words(values, rows: int):
    """One uint32 word per row of ``values`` (rows, ...): a position-weighted sum of the values'
    float32 bits (exact for every cache dtype), so any change of a value changes it."""
    bits = jax.lax.bitcast_convert_type(values.reshape(rows, -1).astype(jnp.float32), jnp.uint32)
    weights = jnp.arange(bits.shape[1], dtype=jnp.uint32) * jnp.uint32(2654435761) + jnp.uint32(40503)
    return jnp.sum(bits * weights[None, :], axis=1, dtype=jnp.uint32)


_POISON = 0x9E3779B1


def poisoned(hashes, digest):
    """The hash a value is computed from once a request's reads left ``digest`` (0: all reads
    were right, the hash is unchanged): uint32 arrays in the jitted step, Python ints on the host."""
    if isinstance(hashes, int):
        return hashes ^ ((digest * _POISON) & 0xFFFFFFFF)
    return hashes ^ (digest * jnp.uint32(_POISON))


@functools.lru_cache(maxsize=8)
def _step_programs(rests, dtypes, shardings, mesh, serves, packs):
    """The runner's two jitted programs for one cache layout, shared by every runner with that
    layout (simulated hosts and soak runs compile them once per padded size). ``serves[i]``: the
    (KV cache group, layer) pairs array i holds, each reached through its group's row of the block
    arrays.

    ``write(caches, w_blk, w_off, w_hash)``: every layer's KV at the given positions, from the
    hashes (the host poisons a request's hashes by its digest); the caches are donated.
    ``read(caches, r_blk, r_ok, r_off, r_hash)``: every layer's KV at the given positions, checked
    against what the prefix hashes imply: per position, whether it read wrong, and a word of how
    what it read differs (0 when right), summed over the layers; the host folds the words into
    each request's digest. Two programs of one size each, not one of both sizes: far fewer
    compilations as contexts grow. ``packs[i] > 1``: array i packs a block's token positions over
    axes 1 and 2 (tpu-inference's MLA latent cache, ``(blocks, ceil(block_size / p), p, dim)``):
    position t is at ``[t // p, t % p]``."""

    def at(p, blk, off):
        return (blk, off // p, off % p) if p > 1 else (blk, off)

    def write(caches, w_blk, w_off, w_hash):
        out = []
        for i, cache in enumerate(caches):
            for group, layer in serves[i]:
                cache = cache.at[at(packs[i], w_blk[group], w_off)].set(
                    kv_values(w_hash, layer, rests[i], dtypes[i]), mode="drop")
            out.append(cache)
        return tuple(out)

    def read(caches, r_blk, r_ok, r_off, r_hash):
        rows = r_blk.shape[1]
        bad = jnp.zeros(rows, jnp.bool_)
        diff = jnp.zeros(rows, jnp.uint32)
        for i, cache in enumerate(caches):
            for group, layer in serves[i]:
                got = cache[at(packs[i], r_blk[group], r_off)]
                want = kv_values(r_hash, layer, rests[i], dtypes[i])
                wrong = r_ok[group] & jnp.any(got.reshape(rows, -1) != want.reshape(rows, -1), axis=1)
                bad = bad | wrong
                # ``| wrong``: a request's digest never cancels out to 0 by accident.
                diff = diff + (jnp.where(r_ok[group], _words(got, rows) - _words(want, rows), jnp.uint32(0))
                               | wrong.astype(jnp.uint32))
        return bad, diff

    replicated = NamedSharding(mesh, PartitionSpec())
    return (jax.jit(write, donate_argnums=0, out_shardings=shardings),
            jax.jit(read, out_shardings=(replicated, replicated)))


@dataclass
class _Req:
    tokens: list[int]
    hashes: list[int]
    block_ids: list[list[int]]  # per KV cache group
    num_prompt: int
    num_computed: int = 0


@dataclass
class RunnerStats:
    """What one host's synthetic runner did and read: steps, positions written and verified, every
    wrong read (``mismatches``, by request) and the request steps computed from a wrong read."""

    steps: int = 0
    tokens_written: int = 0
    positions_verified: int = 0
    mismatches: int = 0
    mismatched_requests: set[str] = field(default_factory=set)
    poisoned_steps: int = 0  # (request, step) pairs whose reads left a digest: what they computed is wrong


class SyntheticRunner:
    """One host's runner. ``kv_caches`` is replaced after every donating update, as in tpu-inference."""

    def __init__(self, kv_caches: Sequence[jax.Array], mesh: Mesh, *, block_size: int, vocab: int = 32000,
                 dp_ranks: int = 1, serves: Sequence[Sequence[tuple[int, int]]] | None = None,
                 windows: Sequence[int | None] = (None,)) -> None:
        """``kv_caches``: the cache arrays (e.g. from tpu-inference's ``create_kv_caches``: see
        ``tpuoffload.sim.tpu_layouts``), axis 0 blocks, axis 1 at least ``block_size`` token
        positions (decode-context parallelism makes it a multiple), any shape and sharding beyond.

        Hybrid models (vLLM's KV cache groups, ``tpuoffload.sim.hybrid_layouts``): ``serves[i]`` lists
        the (KV cache group, layer) pairs array i holds, each written and read at its group's block
        ids; ``windows[g]`` is group g's sliding window in tokens (None: full attention), so a check
        reads only what that layer attends to. The default: one group, array i is layer i."""
        self.mesh = mesh
        self.block_size = block_size
        self.num_blocks = kv_caches[0].shape[0]
        # Under DPScheduler each rank's requests carry that rank's own block ids; like
        # tpu-inference's runner, rank r's block b is block r * (num_blocks / dp_ranks) + b.
        self.blocks_per_rank = self.num_blocks // dp_ranks
        self.vocab = vocab
        self.kv_caches: list[jax.Array] = list(kv_caches)
        # An axis 1 shorter than a block: token positions packed over axes 1 and 2 (MLA latent caches).
        self._packs = tuple(c.shape[2] if c.shape[1] < block_size else 1 for c in kv_caches)
        self._rests = [tuple(c.shape[3:] if p > 1 else c.shape[2:]) for c, p in zip(kv_caches, self._packs)]
        self._dtypes = [c.dtype for c in kv_caches]
        self.serves = tuple(tuple(map(tuple, s)) for s in serves) if serves is not None else \
            tuple(((0, i),) for i in range(len(kv_caches)))
        self.windows = tuple(windows)
        # Per KV cache group, the rows of its pool each DP rank owns (a GDN model's state groups
        # hold rows of another pool: gdn_runner).
        self.rows_per_rank = (self.blocks_per_rank,) * len(self.windows)
        # Groups no array serves (a GDN model's state groups: gdn_runner) are neither checked nor counted.
        self._served_groups = sorted({g for s in self.serves for g, _ in s})
        self._reqs: dict[str, _Req] = {}
        self.stats = RunnerStats()
        self._write_fn, self._read_fn = _step_programs(tuple(self._rests), tuple(self._dtypes),
                                                       tuple(c.sharding for c in self.kv_caches), mesh, self.serves,
                                                       self._packs)

    # ------------------------------------------------------------------ one engine step
    def execute(self, scheduler_output, connector=None) -> ModelRunnerOutput:
        """Run one step as KVConnectorModelRunnerMixin does around a forward."""
        self._update_requests(scheduler_output)
        kv_out = None
        if connector is not None:
            connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
            if scheduler_output.has_sync_kv_loads:
                connector.start_load_kv(None)
        sampled = self._forward(scheduler_output) if scheduler_output.total_num_scheduled_tokens else {}
        if connector is not None:
            if not scheduler_output.has_sync_kv_loads:
                connector.start_load_kv(None)
            connector.wait_for_save()
            results = connector.get_transfer_results(scheduler_output.finished_req_ids)
            kv_out = KVConnectorOutput(
                finished_sending=results.finished_sending or None,
                finished_recving=results.finished_recving or None,
                failed_recving=results.failed_recving,
                invalid_block_ids=connector.get_block_ids_with_load_errors(),
                kv_connector_stats=connector.get_kv_connector_stats(),
                kv_connector_worker_meta=connector.build_connector_worker_meta(),
            )
            connector.clear_connector_metadata()
        req_ids = list(scheduler_output.num_scheduled_tokens)
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[[sampled[r]] if r in sampled else [] for r in req_ids],
            kv_connector_output=kv_out,
        )

    def _update_requests(self, so) -> None:
        ranks = getattr(so, "assigned_dp_rank", None) or {}

        def placed(req_id: str, groups) -> list[list[int]]:
            rank = ranks.get(req_id, 0)
            return [[b + rank * rows for b in blocks] for blocks, rows in zip(groups, self.rows_per_rank)]

        for req_id in so.finished_req_ids:
            self._reqs.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            tokens = list(new.prompt_token_ids)
            self._reqs[new.req_id] = _Req(tokens, prefix_hashes(tokens), placed(new.req_id, new.block_ids),
                                          len(tokens), num_computed=new.num_computed_tokens)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            req = self._reqs[req_id] if req_id in self._reqs else None
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                tokens = list(cached.all_token_ids[req_id]) if req_id in cached.all_token_ids else req.tokens
                req = self._reqs[req_id] = _Req(tokens, prefix_hashes(tokens),
                                                placed(req_id, new_blocks) if new_blocks else
                                                [[] for _ in self.windows], req.num_prompt)
            elif new_blocks is not None:
                for mine, more in zip(req.block_ids, placed(req_id, new_blocks)):
                    mine.extend(more)
            # Output tokens vLLM discarded (it dropped a step's result for the request), as vLLM's
            # own runner does: the request goes on from the tokens vLLM kept.
            keep = req.num_prompt + cached.num_output_tokens[i]
            if keep < len(req.tokens):
                del req.tokens[keep:], req.hashes[keep:]
            req.num_computed = cached.num_computed_tokens[i]

    def _forward(self, so, digests: dict[str, int] | None = None) -> dict[str, int]:
        """One forward over the scheduled tokens: the step's new KV is written, then every
        request's whole context is read and checked (a request may read blocks another computes in
        this step, as in a real forward, where each layer's new KV is in the cache before attention
        reads it); a request whose reads left a digest has its new KV written again from hashes
        poisoned by it, and samples from a poisoned hash. ``digests``: what earlier layers already
        read wrong, per request (a subclass's state layers)."""
        bs = self.block_size
        G = len(self.windows)
        digests = dict(digests or {})
        scheduled = list(so.num_scheduled_tokens.items())
        w_blk, w_off, w_hash, w_req = [[] for _ in range(G)], [], [], []
        r_blk, r_ok, r_off, r_hash, r_req = [[] for _ in range(G)], [[] for _ in range(G)], [], [], []
        for k, (req_id, n) in enumerate(scheduled):
            req = self._reqs[req_id]
            start = req.num_computed
            if start:
                positions = range(start)
                for g, window in enumerate(self.windows):
                    # A sliding-window layer reads only the window of the next token.
                    first = 0 if window is None else max(0, start - window + 1)
                    ids = req.block_ids[g]
                    r_blk[g] += [ids[p // bs] if p >= first else 0 for p in positions]
                    r_ok[g] += [p >= first for p in positions]
                r_off += [p % bs for p in positions]
                r_hash += req.hashes[:start]
                r_req += [k] * start
            for p in range(start, min(start + n, len(req.tokens))):
                for g in range(G):
                    w_blk[g].append(req.block_ids[g][p // bs])
                w_off.append(p % bs)
                w_hash.append(req.hashes[p])
                w_req.append(k)
        n_w, n_r = len(w_off), len(r_off)
        self.stats.steps += 1
        self.stats.tokens_written += n_w
        self.stats.positions_verified += sum(sum(r_ok[g]) for g in self._served_groups) if G > 1 else n_r
        start_digest = np.array([digests.get(req_id, 0) for req_id, _ in scheduled], np.uint64)
        self._write(w_blk, w_off, [poisoned(h, int(start_digest[k])) for h, k in zip(w_hash, w_req)])
        digest = start_digest.copy()
        if n_r:
            pad = _bucket(n_r) - n_r
            bad, diff = self._read_fn(
                tuple(self._kv_arrays()),
                np.array([b + [0] * pad for b in r_blk], np.int32), np.array([k + [False] * pad for k in r_ok], bool),
                np.array(r_off + [0] * pad, np.int32), np.array(r_hash + [0] * pad, np.uint32))
            bad, diff = np.asarray(bad)[:n_r], np.asarray(diff)[:n_r]
            np.add.at(digest, np.array(r_req), diff.astype(np.uint64))
            if bad.any():
                self.stats.mismatches += int(bad.sum())
                self.stats.mismatched_requests.update(scheduled[r_req[i]][0] for i in np.nonzero(bad)[0])
        digest %= 1 << 32
        tainted = [i for i, k in enumerate(w_req) if digest[k] != start_digest[k]]
        if tainted:  # what those requests computed came from a wrong read: their KV, written again
            self._write([[b[i] for i in tainted] for b in w_blk], [w_off[i] for i in tainted],
                        [poisoned(w_hash[i], int(digest[w_req[i]])) for i in tainted])
        self.stats.poisoned_steps += int(np.count_nonzero(digest))
        sampled: dict[str, int] = {}
        for k, (req_id, n) in enumerate(scheduled):
            req = self._reqs[req_id]
            req.num_computed += n
            if req.num_computed >= len(req.tokens):  # prefill done: sample from the whole prefix and what it read
                tok = sample(poisoned(req.hashes[-1], int(digest[k])), self.vocab)
                req.tokens.append(tok)
                req.hashes.append((req.hashes[-1] * 1000003 + tok + 1) & _MASK)
                sampled[req_id] = tok
        return sampled

    def _write(self, w_blk: list[list[int]], w_off: list[int], w_hash: list[int]) -> None:
        n = len(w_off)
        pad = _bucket(n) - n
        self._store_kv_arrays(self._write_fn(
            tuple(self._kv_arrays()), np.array([b + [self.num_blocks] * pad for b in w_blk], np.int32),
            np.array(w_off + [0] * pad, np.int32), np.array(w_hash + [0] * pad, np.uint32)))

    def _kv_arrays(self) -> list[jax.Array]:
        """The arrays the step writes and checks, in ``serves`` order (a subclass may hold them
        inside a larger structure, as ``gdn_runner`` does)."""
        return self.kv_caches

    def _store_kv_arrays(self, arrays: Sequence[jax.Array]) -> None:
        """Put back what the step returned for ``_kv_arrays()`` (its inputs were donated)."""
        self.kv_caches = list(arrays)

    def wrong_reads(self) -> int:
        """Every read so far that did not hold what the synthetic model computed."""
        return self.stats.mismatches

    def expected_block(self, tokens: Sequence[int], block_index: int, array: int, kv_group: int = 0) -> np.ndarray:
        """What positions ``0..block_size-1`` of block ``block_index`` of a request with these token
        ids must hold in ``array`` for KV cache group ``kv_group``: (block_size, *rest). None when
        the array serves no layer of that group."""
        layer = next((layer for g, layer in self.serves[array] if g == kv_group), None)
        if layer is None:
            return None
        hashes = prefix_hashes(tokens)[block_index * self.block_size:(block_index + 1) * self.block_size]
        return np.asarray(kv_values(np.array(hashes, np.uint32), layer, self._rests[array], self._dtypes[array]))
