"""tpuoffload: KV-cache offload from accelerator memory to host RAM for vLLM on multi-host JAX slices."""

__version__ = "0.1.0"
