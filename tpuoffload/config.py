"""Connector configuration: parsed from ``kv_connector_extra_config``, validated key by key.

tpu-inference's ``TPU_OFFLOAD_*`` environment variables are honoured as fallbacks, so an existing
deployment can switch ``kv_connector_module_path`` and keep its settings. An explicit
``kv_connector_extra_config`` key always wins over the environment.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_TIB = 1 << 40
MEMORY_KINDS = ("pinned_host", "unpinned_host")


@dataclass(frozen=True)
class OffloadConfig:
    """``kv_connector_extra_config`` parsed and validated (``parse_config``); every field below is a
    key of it, with its default."""

    # Host RAM per host for offloaded KV, in bytes (exact: whole chunks that fit, never more).
    cpu_bytes_to_use: int | None = None
    # Alternative to cpu_bytes_to_use, in chunks (tpu-inference's TPU_OFFLOAD_NUM_CPU_CHUNKS).
    num_cpu_chunks: int | None = None
    # False: save full blocks as they are computed. True: save a request's blocks only when it
    # finishes or is preempted.
    lazy_offload: bool = False
    # Bytes of saves in flight (issued, not yet confirmed by every host) per host.
    staging_bytes: int | None = None
    # Alternative to staging_bytes, in blocks (TPU_OFFLOAD_NUM_STAGING_BLOCKS).
    num_staging_blocks: int = 256
    save_threads: int = 4
    # Accelerator bytes one gathered (or to-be-scattered) batch may take on a host; larger plans
    # move in consecutive pieces.
    transfer_buffer_bytes: int = 256 << 20
    host_memory_kind: str = "pinned_host"
    # Also save blocks filled by generated (decode) tokens, not only prompt blocks.
    save_decode_blocks: bool = False
    # A load waits at most this long for a local save of the same slot still in flight.
    load_wait_timeout_s: float = 10.0
    # A save not confirmed by every host within this time is dropped (never loadable).
    save_timeout_s: float = 120.0
    # Worker processes that report each step (one per host with tpu-inference). None: detected from
    # vLLM's executor (tpuoffload.manager.topology); set it only if the detection is wrong.
    num_hosts: int | None = None
    # Directory for per-host stats snapshots (None: off) and how often to write them.
    stats_dir: str | None = None
    stats_interval_s: float = 5.0
    # Warm restart (docs/persistence.md): directory of the multi-host checkpoints, seen by every
    # host (None: off). A checkpoint is written at clean shutdown, on an operator request and every
    # persist_interval_s seconds (0: no periodic checkpoints); the newest complete one that matches
    # this deployment is restored at start-up.
    persist_path: str | None = None
    persist_interval_s: float = 0.0
    # How long the hosts wait for each other while writing or agreeing on a checkpoint.
    persist_timeout_s: float = 300.0
    # The disk tier below host RAM (None: off): a directory on a local disk of each host ("{host}"
    # is replaced by the host's index) and the bytes of chunk files it may hold (exact; with a GDN
    # state pool split between the pools as host RAM is: disk_pool_bytes).
    disk_path: str | None = None
    disk_bytes_to_use: int | None = None
    # GDN/mamba hybrids (Qwen3.5): the share of host RAM that holds state chunks (one state row of
    # every GDN layer), beside the KV chunks of the attention layers (manager/kv_groups.py).
    state_ram_fraction: float = 0.25
    # The shared KV tier (docs/design.md, "The shared tier"): one store every replica reads and
    # writes, named by a URL: "file:///mnt/lustre/kv" (a shared POSIX directory) or
    # "redis://host:6379" (Valkey/Redis), with optional query parameters
    # (backend/shared_store.py:SharedURL). None: off.
    shared_url: str | None = None

    # ---- derived sizes (need the size of one chunk on one host) ----
    def host_bytes(self, chunk_bytes: int) -> int:
        if self.cpu_bytes_to_use is not None:
            return self.cpu_bytes_to_use
        return self.num_cpu_chunks * chunk_bytes

    def pool_bytes(self, chunk_bytes: int, pools: int) -> tuple[int, ...]:
        """Host bytes of each slot pool, from the bytes of a KV chunk: one pool takes
        ``host_bytes(chunk_bytes)``; with a state pool (GDN/mamba layers, a second pool) that pool
        takes ``state_ram_fraction`` of them. Both halves split alike, each with its own chunk sizes."""
        total = self.host_bytes(chunk_bytes)
        if pools == 1:
            return (total,)
        state = int(total * self.state_ram_fraction)
        return (total - state, state)

    def disk_pool_bytes(self, pools: int) -> tuple[int, ...]:
        """Disk bytes of each slot pool's chunk files (``disk_bytes_to_use`` split as host RAM is:
        with a state pool, ``state_ram_fraction`` of them hold state chunk files, in a directory
        of their own: worker/disk_stage.py). Each pool's budget is exact on its own; both halves
        split alike."""
        total = self.disk_bytes_to_use or 0
        if pools == 1:
            return (total,)
        state = int(total * self.state_ram_fraction)
        return (total - state, state)

    def staging_capacity(self, chunk_bytes: int) -> int:
        if self.staging_bytes is not None:
            return self.staging_bytes
        return self.num_staging_blocks * chunk_bytes

    def summary(self) -> str:
        return ", ".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))


# key -> environment variable honoured as a fallback
_ENV_FALLBACKS = {
    "num_cpu_chunks": "TPU_OFFLOAD_NUM_CPU_CHUNKS",
    "num_staging_blocks": "TPU_OFFLOAD_NUM_STAGING_BLOCKS",
    "save_threads": "TPU_OFFLOAD_SAVE_THREADS",
    "save_decode_blocks": "TPU_OFFLOAD_DECODE_SAVE",
    "host_memory_kind": "TPU_OFFLOAD_USE_UNPINNED_HOST",
}
KNOWN_KEYS = tuple(f.name for f in dataclasses.fields(OffloadConfig))


def _as_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return value.strip().lower() in ("1", "true", "yes", "on")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ValueError(f"kv_connector_extra_config[{key!r}] must be a boolean, got {value!r}")


def _as_int(key: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"kv_connector_extra_config[{key!r}] must be an integer, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"kv_connector_extra_config[{key!r}]={value} is outside {low}..{high}")
    return value


def _as_float(key: str, value: Any, low: float, high: float, low_ok: bool = False) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"kv_connector_extra_config[{key!r}] must be a number, got {value!r}") from None
    if isinstance(value, bool) or not (low <= out if low_ok else low < out) or not out <= high:
        raise ValueError(f"kv_connector_extra_config[{key!r}]={value!r} is outside {'[' if low_ok else '('}{low}, {high}]")
    return out


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_fits_in_ram(nbytes: int, what: str = "cpu_bytes_to_use") -> None:
    ram = _physical_memory()
    if ram is not None and nbytes > ram:
        raise ValueError(f"{what}={nbytes} exceeds this host's physical memory ({ram} bytes)")


def parse_config(extra: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None) -> OffloadConfig:
    """Build an OffloadConfig from ``kv_connector_extra_config`` (falling back to the environment).

    Raises ValueError naming the offending key for unknown keys, wrong types, and values that are
    zero, negative or absurd. (Whether the host really has that much RAM is checked by the worker
    when it allocates, on the host concerned: see ``check_fits_in_ram``.)
    """
    extra = dict(extra or {})
    environ = os.environ if environ is None else environ
    unknown = sorted(set(extra) - set(KNOWN_KEYS))
    if unknown:
        raise ValueError(f"unknown kv_connector_extra_config keys {unknown}; known keys: {list(KNOWN_KEYS)}")
    for key, env in _ENV_FALLBACKS.items():
        if key not in extra and env in environ:
            value = environ[env]
            if key == "host_memory_kind":
                value = "unpinned_host" if _as_bool(env, value) else "pinned_host"
            extra[key] = value

    out: dict[str, Any] = {}
    ram = 64 * _TIB  # beyond any host
    if extra.get("cpu_bytes_to_use") is not None:
        out["cpu_bytes_to_use"] = _as_int("cpu_bytes_to_use", extra["cpu_bytes_to_use"], 1, ram)
    if extra.get("num_cpu_chunks") is not None:
        out["num_cpu_chunks"] = _as_int("num_cpu_chunks", extra["num_cpu_chunks"], 1, 1 << 32)
    if "cpu_bytes_to_use" not in out and "num_cpu_chunks" not in out:
        raise ValueError(
            "kv_connector_extra_config must set 'cpu_bytes_to_use' (host RAM per host, in bytes) "
            "or 'num_cpu_chunks' (or the TPU_OFFLOAD_NUM_CPU_CHUNKS environment variable)"
        )
    if "cpu_bytes_to_use" in out and "num_cpu_chunks" in out:
        out.pop("num_cpu_chunks")  # explicit bytes win; chunks may come from an old environment
    if extra.get("staging_bytes") is not None:
        out["staging_bytes"] = _as_int("staging_bytes", extra["staging_bytes"], 1, ram)
    if extra.get("transfer_buffer_bytes") is not None:
        out["transfer_buffer_bytes"] = _as_int("transfer_buffer_bytes", extra["transfer_buffer_bytes"], 1, ram)
    for key in ("num_staging_blocks",):
        if key in extra:
            out[key] = _as_int(key, extra[key], 1, 1 << 24)
    if "save_threads" in extra:
        out["save_threads"] = _as_int("save_threads", extra["save_threads"], 1, 256)
    if extra.get("num_hosts") is not None:
        out["num_hosts"] = _as_int("num_hosts", extra["num_hosts"], 1, 1 << 16)
    for key in ("lazy_offload", "save_decode_blocks"):
        if key in extra:
            out[key] = _as_bool(key, extra[key])
    if "host_memory_kind" in extra:
        if extra["host_memory_kind"] not in MEMORY_KINDS:
            raise ValueError(
                f"kv_connector_extra_config['host_memory_kind'] must be one of {MEMORY_KINDS}, "
                f"got {extra['host_memory_kind']!r}"
            )
        out["host_memory_kind"] = extra["host_memory_kind"]
    for key, high in (("load_wait_timeout_s", 3600.0), ("save_timeout_s", 86400.0), ("stats_interval_s", 3600.0)):
        if key in extra:
            # stats_interval_s=0: a snapshot at every step
            out[key] = _as_float(key, extra[key], 0.0, high, low_ok=key == "stats_interval_s")
    for key in ("stats_dir", "persist_path", "disk_path"):
        if extra.get(key) is not None:
            if not isinstance(extra[key], str) or not extra[key]:
                raise ValueError(f"kv_connector_extra_config[{key!r}] must be a directory path, got {extra[key]!r}")
            out[key] = extra[key]
    if "state_ram_fraction" in extra:
        out["state_ram_fraction"] = _as_float("state_ram_fraction", extra["state_ram_fraction"], 0.0, 1.0)
        if not 0.0 < out["state_ram_fraction"] < 1.0:
            raise ValueError("kv_connector_extra_config['state_ram_fraction'] must be between 0 and 1 (exclusive), "
                             f"got {out['state_ram_fraction']!r}")
    for key, high in (("persist_interval_s", 7 * 86400.0), ("persist_timeout_s", 86400.0)):
        if key in extra:
            out[key] = _as_float(key, extra[key], 0.0, high, low_ok=key == "persist_interval_s")
    if extra.get("shared_url") is not None:
        from tpuoffload.backend.shared_store import SharedURL

        SharedURL.parse(extra["shared_url"])  # ValueError naming what is wrong
        out["shared_url"] = extra["shared_url"]
    if extra.get("disk_bytes_to_use") is not None:
        out["disk_bytes_to_use"] = _as_int("disk_bytes_to_use", extra["disk_bytes_to_use"], 1, 1 << 60)
    if ("disk_path" in out) != ("disk_bytes_to_use" in out):
        raise ValueError("kv_connector_extra_config['disk_path'] and 'disk_bytes_to_use' go together")
    if out.get("persist_interval_s") and "persist_path" not in out:
        raise ValueError("kv_connector_extra_config['persist_interval_s'] needs 'persist_path'")
    return OffloadConfig(**out)


ENGINE_DIRS = ("stats_dir", "persist_path", "disk_path")


def per_engine(config: OffloadConfig, parallel_config) -> OffloadConfig:
    """``vllm serve --data-parallel-size N`` on tpu-inference without attention DP runs N separate
    engines sharing the hosts (``TPU_MULTIPROCESS_DP=1``): each engine keeps its stats snapshots,
    checkpoints and disk files under its own ``engine-dp<i>`` subdirectory, so no two engines on a
    host write the same file. (Each engine also takes its own ``cpu_bytes_to_use`` on each host.)

    vLLM 0.32's engine process of a dense (non-MoE) model rewrites its parallel config as an
    independent DP 1 engine (``ParallelConfig.reconfigure_for_independent_dp_rank``) and keeps only
    ``data_parallel_index``: so engine ``i > 0`` is known by its index alone, and engine 0 keeps the
    paths as given (beside the others' subdirectories; nothing of it lists subdirectories but the
    disk tier's ``rank-<r>``). A MoE model's engines keep ``data_parallel_size``: every one, 0
    included, gets its subdirectory. Both halves read the same pickled config, so they agree."""
    index = getattr(parallel_config, "data_parallel_index", 0)
    if getattr(parallel_config, "data_parallel_size", 1) <= 1 and index == 0:
        return config
    tag = f"engine-dp{index}"
    moved = {key: os.path.join(getattr(config, key), tag) for key in ENGINE_DIRS if getattr(config, key)}
    return dataclasses.replace(config, **moved)
