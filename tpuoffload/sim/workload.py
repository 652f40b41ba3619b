"""Workloads shaped like vLLM's benchmarks, scaled to CPU."""

from __future__ import annotations

import random

from tpuoffload.sim.vllm_setup import make_request


def prefix_repetition(num_prompts: int, num_prefixes: int, prefix_len: int, suffix_len: int, output_len: int,
                      seed: int = 0, id_prefix: str = "req", block_size: int | None = None):
    """Like ``vllm bench serve --dataset-name prefix_repetition``: ``num_prefixes`` shared prefixes,
    each prompt one of them plus a random suffix. Returns vLLM Requests, prefixes round-robin."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 30000) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    return [
        make_request(f"{id_prefix}{i}", prefixes[i % num_prefixes] + [rng.randrange(3, 30000) for _ in range(suffix_len)],
                     max_tokens=output_len, block_size=block_size)
        for i in range(num_prompts)
    ]
