"""The prefix_repetition workload, shaped like vLLM's benchmark of that name
(vllm/benchmarks/datasets: PrefixRepetitionRandomDataset) and scaled down for CPU, plus a driver
that runs it in waves on a PodSlice.

``num_prefixes`` random prefixes, each shared by ``num_requests // num_prefixes`` prompts with a
random suffix, shuffled. Every wave uses the same prefixes with fresh suffixes; between waves the
HBM prefix cache is reset (``reset_prefix_cache``), so the later waves can only find the prefixes
in host RAM. Within a wave a GPU block pool smaller than the working set evicts prefixes from HBM,
so even the first wave loads from host RAM.

The driver also checks every generated token: the synthetic runner samples a deterministic
function of the whole prefix, so the expected output of every request is known here.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tpuoffload.sim.runner import prefix_hashes, sample

if TYPE_CHECKING:
    from tpuoffload.sim.podslice import PodSlice


@dataclass
class PrefixRepetition:
    """Simulation only: a seeded prefix-repetition workload (shared prefixes, random suffixes and
    output lengths, several waves)."""

    num_prefixes: int = 4
    prefix_blocks: int = 12  # prefix length in blocks (block_size tokens each)
    suffix_len: tuple[int, int] = (8, 16)  # inclusive range
    output_len: tuple[int, int] = (4, 8)  # inclusive range
    num_requests: int = 32  # per wave
    waves: int = 2
    arrivals_per_step: int = 4  # requests added per engine step (0: the whole wave at once)
    seed: int = 0
    vocab: int = 32000


@dataclass
class WaveRequest:
    """Simulation only: one request of a wave: id, prompt tokens, output length."""

    req_id: str
    prompt: list[int]
    max_tokens: int


def prefix_repetition(num_prompts: int, num_prefixes: int, prefix_len: int, suffix_len: int, output_len: int,
                      seed: int = 0, id_prefix: str = "req", block_size: int | None = None):
    """One wave as vLLM Requests, for engines driven by hand: ``num_prefixes`` shared prefixes of
    ``prefix_len`` tokens, round-robin, each with a random suffix of ``suffix_len`` tokens."""
    from tpuoffload.sim.vllm_setup import make_request

    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 30000) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    return [
        make_request(f"{id_prefix}{i}", prefixes[i % num_prefixes] + [rng.randrange(3, 30000) for _ in range(suffix_len)],
                     max_tokens=output_len, block_size=block_size)
        for i in range(num_prompts)
    ]


def make_waves(w: PrefixRepetition, block_size: int) -> list[list[WaveRequest]]:
    rng = random.Random(w.seed)
    # Token ids 3.. avoid the EOS id (2); requests run with ignore_eos anyway.
    prefixes = [[rng.randrange(3, w.vocab) for _ in range(w.prefix_blocks * block_size)]
                for _ in range(w.num_prefixes)]
    per_prefix = w.num_requests // w.num_prefixes
    if per_prefix == 0:
        raise ValueError(f"num_requests ({w.num_requests}) must be >= num_prefixes ({w.num_prefixes})")
    waves = []
    for wave in range(w.waves):
        reqs = []
        for p, prefix in enumerate(prefixes):
            for _ in range(per_prefix):
                suffix = [rng.randrange(3, w.vocab) for _ in range(rng.randint(*w.suffix_len))]
                reqs.append(WaveRequest("", prefix + suffix, rng.randint(*w.output_len)))
        rng.shuffle(reqs)
        for i, r in enumerate(reqs):
            r.req_id = f"w{wave}-r{i:03d}"
        waves.append(reqs)
    return waves


def expected_output(prompt: list[int], max_tokens: int, vocab: int) -> list[int]:
    """What the synthetic runner samples for this prompt (a pure function of the prefix)."""
    h = prefix_hashes(prompt)[-1]
    out = []
    for _ in range(max_tokens):
        tok = sample(h, vocab)
        out.append(tok)
        h = (h * 1000003 + tok + 1) & 0x7FFFFFFF
    return out


@dataclass
class WorkloadResult:
    """Simulation only: what a workload run produced: requests finished and aborted, steps, wrong
    outputs, the run's stats and the tokens loaded per wave."""

    requests: int = 0
    finished: int = 0
    aborted: int = 0
    steps: int = 0
    waves: int = 0
    wall_s: float = 0.0
    wrong_outputs: list[str] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)  # OffloadStats.reduce() of the whole run
    per_wave_loaded: list[int] = field(default_factory=list)


def run_prefix_repetition(pod: "PodSlice", w: PrefixRepetition, *, on_step=None,
                          settle_timeout_s: float = 60.0) -> WorkloadResult:
    """Run every wave to completion on ``pod``; reset the HBM prefix cache between waves."""
    t0 = time.monotonic()
    res = WorkloadResult()
    steps0 = pod.steps
    waves = make_waves(w, pod.spec.block_size)
    by_id: dict[str, WaveRequest] = {}
    for wave_no, wave in enumerate(waves):
        if wave_no:
            if not pod.scheduler.reset_prefix_cache():
                raise AssertionError("reset_prefix_cache() failed: blocks still in use between waves")
        loaded_before = pod.stats.totals()["chunks_loaded"]
        queue = list(wave)
        by_id.update((r.req_id, r) for r in wave)
        res.requests += len(wave)
        while queue or pod.scheduler.has_requests():
            take = len(queue) if w.arrivals_per_step <= 0 else w.arrivals_per_step
            for r in queue[:take]:
                pod.add_request(pod.make_request(r.req_id, r.prompt, max_tokens=r.max_tokens))
            del queue[:take]
            pod.step()
            if on_step is not None:
                on_step(pod)
        if not pod.settle(settle_timeout_s):
            raise AssertionError(f"saves still unresolved {settle_timeout_s} s after wave {wave_no}: "
                                 f"{pod.offload.leak_report()}")
        res.per_wave_loaded.append(pod.stats.totals()["chunks_loaded"] - loaded_before)
        res.waves += 1
    for req_id, r in by_id.items():
        want = expected_output(r.prompt, r.max_tokens, w.vocab)
        got = pod.outputs.get(req_id, [])
        if req_id in pod.aborted:
            ok = got == want[:len(got)]
        else:
            ok = got == want and req_id in pod.finished
        if not ok:
            res.wrong_outputs.append(req_id)
    res.finished = len(pod.finished & by_id.keys())
    res.aborted = len(pod.aborted & by_id.keys())
    res.steps = pod.steps - steps0
    res.wall_s = time.monotonic() - t0
    res.stats = pod.stats.reduce()
    return res
