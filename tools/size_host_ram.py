"""How much host RAM tpuoffload takes per host for a model, and what ``cpu_bytes_to_use`` gives.

Computed with the connector's own code: the scheduler half's chunk size is
``manager/topology.py:host_chunk_bytes`` on vLLM's own ``FullAttentionSpec`` pages (what the running
connector computes from vLLM's KV cache config), and the worker half's is one block of every layer
as tpu-inference lays out one device's share (``tools/bench_transfer.py:per_device_block_shape``)
times the devices of a host. They must agree (a padded layout makes the worker's larger; the tool
says so). Nothing runs on an accelerator::

    python tools/size_host_ram.py --layers 80 --kv-heads 8 --head-dim 128 --dtype bfloat16 \\
        --block-size 32 --tp 8 --hosts 2 --cpu-gib 600
"""
from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_transfer

GiB = 1 << 30


def sizes(layers: int, kv_heads: int, head_dim: int, dtype: str, block_size: int, tp: int, hosts: int) -> dict:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from bench_transfer import per_device_block_shape
    from tpuoffload.manager.topology import host_chunk_bytes

    if tp % hosts:
        raise SystemExit(f"--tp {tp} does not split over {hosts} hosts")
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=kv_heads, head_size=head_dim,
                             dtype=getattr(torch, dtype))
    config = KVCacheConfig(num_blocks=1, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec([f"layers.{i}" for i in range(layers)], spec)])
    chunk = host_chunk_bytes(config, hosts)  # the scheduler half's bytes per chunk per host
    import jax.numpy as jnp

    tile = per_device_block_shape(tp=tp, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, block_size=block_size)
    worker = layers * math.prod(tile) * jnp.dtype(dtype).itemsize * (tp // hosts)
    return {"chunk": chunk, "worker_chunk": worker, "per_token": chunk // block_size,
            "tile": tile}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--kv-heads", type=int, required=True)
    p.add_argument("--head-dim", type=int, required=True)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float8_e4m3fn"))
    p.add_argument("--block-size", type=int, required=True, help="tokens per KV block (vLLM's block_size)")
    p.add_argument("--tp", type=int, required=True, help="tensor-parallel size (devices holding the heads)")
    p.add_argument("--hosts", type=int, required=True, help="hosts the TP group spans")
    p.add_argument("--cpu-gib", type=float, required=True, help="host RAM to give the offload, GiB per host")
    a = p.parse_args(argv)
    s = sizes(a.layers, a.kv_heads, a.head_dim, a.dtype, a.block_size, a.tp, a.hosts)
    cpu = int(a.cpu_gib * GiB)
    chunk = max(s["chunk"], s["worker_chunk"])
    chunks = cpu // chunk
    print(f"KV per token per host:      {s['per_token']:,} bytes ({s['per_token'] / 1024:.0f} KiB)")
    print(f"chunk (one block of every layer) per host: {s['chunk']:,} bytes ({s['chunk'] / (1 << 20):.2f} MiB); "
          f"tpu-inference's per-device block {s['tile']}: {s['worker_chunk']:,} bytes per host"
          + ("" if s["worker_chunk"] == s["chunk"] else "  (PADDED: the workers store the larger)"))
    print(f"cpu_bytes_to_use = {cpu} ({a.cpu_gib:g} GiB per host): {chunks:,} chunks = "
          f"{chunks * a.block_size:,} tokens of KV, {chunks * chunk / GiB:.1f} GiB used per host")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
