"""The real serving stack on CPU: ``vllm serve`` on tpu-inference's platform and its Ray executor,
over a local Ray cluster of several nodes on this one machine, driven by vLLM's own client.

What runs (all installed code, unmodified; the shims are ``tpuoffload.sim.engine_shims``):

* Ray: ``ray start --head`` and ``ray start --address`` (Ray's own multi-node support, one node per
  "host", each with ``--resources '{"TPU": N}'``), each node in its own process group with its
  environment: ``TPU_WORKER_ID`` (the host's index, as on a TPU VM), CPU JAX with N + 1 devices
  (N for the mesh, one for the attention stand-in's scratch work, engine_shims 8 and 11).
* ``vllm serve`` (``python -m tpuoffload.sim.vllm_cli serve``: vLLM's CLI after the shims): the
  OpenAI API server, ``AsyncLLM``, ``EngineCore`` in its own process, ``--async-scheduling``, with
  ``TPU_MULTIHOST_BACKEND=ray``, so tpu-inference's ``TpuPlatform`` picks its
  ``RayDistributedExecutor``: one actor per host over placement-group bundles of the ``TPU``
  resource, ``TPUWorker``/``TPUModelRunner`` in each, outputs through ``AsyncResultFuture`` and
  vLLM's ``KVOutputAggregator``. ``jax.distributed`` joins the hosts (engine_shims 11). With the
  connector: the README's ``--kv-transfer-config``.
* The client: ``vllm bench serve --backend openai --dataset-name prefix_repetition`` and plain
  OpenAI completions at temperature 0; ``POST /reset_prefix_cache`` between two rounds (vLLM's dev
  endpoint, ``VLLM_SERVER_DEV_MODE=1``); vLLM's ``/metrics``.

How the shims reach every process: the API server imports ``tpuoffload.sim.vllm_cli`` first (it
installs them); EngineCore is forked from it (or re-imports that module when spawned); the Ray
workers run ``vllm_cli.ray_worker_setup`` as Ray's ``worker_process_setup_hook``, which the
EngineCore's ``ray.init()`` adds to the job through ``RAY_RUNTIME_ENV_HOOK``.

Processes: every Ray node (``ray start --block``: its GCS, raylet and worker processes) and the
server run in their own sessions; ``stop()`` kills those process groups by id. Every process of a
run carries ``TPUOFFLOAD_SIM_SERVE_RUN=<run dir>`` in its environment (Ray's own agents do not: they
are found through the nodes' process groups, listed in ``cluster/pgids.txt``); ``run_processes()``
lists what is alive, ``sweep()`` kills it by pid (``run_child``'s outside timeout, and after every run).

Test and demo code (``tests/test_serve*.py``, ``python -m tpuoffload.demo``); product code never
imports it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from tpuoffload.sim.engine_shims import SLICE_COORDINATOR_ENV, SLICE_HOSTS_ENV
from tpuoffload.sim.real_engine import DTYPE, MODELS, QWEN3, VOCAB, TinyModel, write_tiny_model

#: Ray's driver-side hook (RAY_RUNTIME_ENV_HOOK) set for the EngineCore (tpuoffload.sim.vllm_cli,
#: named, not imported: importing it installs the shims).
RUNTIME_ENV_HOOK = "tpuoffload.sim.vllm_cli.runtime_env_hook"

BLOCK_SIZE = 16
#: How long the run's processes may take to exit once the Ray nodes are killed before they count as leaks.
LEAK_GRACE_S = 20.0
MODEL_NAME = "tiny"
# XLA on one CPU thread per op (as in real_engine: multi-threaded reductions may sum in another
# order from run to run, and a random model's near-tie argmax then flips a greedy token).
XLA_SINGLE_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_tokenizer(model_dir: str, vocab: int = VOCAB) -> None:
    """A word-level tokenizer of ``vocab`` fixed-width words (``w000`` ...), so that any token
    sequence decodes to text that encodes back to the same ids (what prefix_repetition needs)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {f"w{i:03d}": i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="w002"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(model_dir, "tokenizer.json"))
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "w000", "eos_token": "w001",
                   "model_max_length": 1024, "clean_up_tokenization_spaces": False}, f)


def write_serve_model(model_dir: str, model: TinyModel = QWEN3) -> str:
    write_tiny_model(model_dir, model)
    write_tokenizer(model_dir)
    return model_dir


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the process group of ``proc`` (its own session), SIGKILL it after ``grace_s``."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:  # the group may outlive its leader (Ray's raylet and workers)
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


#: Every process the launcher starts (Ray nodes and whatever they fork, the server, its EngineCore)
#: carries this variable, set to its run's directory: how ``leaks()`` and ``sweep()`` find them.
MARKER_ENV = "TPUOFFLOAD_SIM_SERVE_RUN"


def marker(workdir: str) -> str:
    """The marker of a run: its top directory (the parent of ``cluster/``, ``baseline/``...)."""
    return f"{MARKER_ENV}={os.path.abspath(os.path.dirname(workdir.rstrip('/')))}\0"


def _groups_of(run_dir: str) -> set[int]:
    """The process groups of this run's Ray nodes (``RayHosts.start`` lists them): Ray starts some
    helpers (its dashboard and runtime-env agents) with an environment of its own, without the marker."""
    try:
        with open(os.path.join(run_dir, "cluster", "pgids.txt")) as f:
            return {int(x) for x in f.read().split()}
    except OSError:
        return set()


def _in_groups(groups: set[int]) -> list[tuple[int, str]]:
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z" and int(fields[2]) in groups:
            found.append((int(name), cmd[:200]))
    return found


def run_processes(run_dir: str) -> list[tuple[int, str]]:
    """Every live process of this run: those carrying its marker and those in its Ray nodes' groups."""
    found = dict(_processes_mentioning(marker(os.path.join(run_dir, "x"))))
    found.update(_in_groups(_groups_of(run_dir)))
    return sorted(found.items())


def sweep(run_dir: str) -> list[tuple[int, str]]:
    """SIGKILL every process of this run still alive (``run_processes``, killed by pid); returns them."""
    left = run_processes(run_dir)
    for pid, _ in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _processes_mentioning(needle: str) -> list[tuple[int, str]]:
    """(pid, command line) of every process whose environment contains ``needle`` (a run's marker,
    ``NAME=value\\0``)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read().decode(errors="replace")
        except OSError:
            continue
        if needle in env + "\0" and not _zombie(int(name)):
            found.append((int(name), cmd[:200]))
    return found


@dataclass
class RayHosts:
    """A local Ray cluster: one ``ray start --block`` node per host, each in its own session."""

    workdir: str
    hosts: int
    devices_per_host: int
    procs: list[subprocess.Popen] = field(default_factory=list)
    gcs_port: int = 0

    @property
    def temp_dir(self) -> str:
        """Ray's session directory: short (its socket paths must fit AF_UNIX's 107 bytes), one per run."""
        import hashlib

        return f"/tmp/tpo-ray-{hashlib.blake2b(os.path.abspath(self.workdir).encode(), digest_size=5).hexdigest()}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    def start(self, timeout_s: float = 300.0) -> None:
        os.makedirs(self.workdir, exist_ok=True)
        os.makedirs(self.temp_dir, exist_ok=True)
        self.gcs_port = free_port()
        ray = os.path.join(os.path.dirname(sys.executable), "ray")
        for host in range(self.hosts):
            env = dict(os.environ)
            env[MARKER_ENV] = marker(self.workdir)[len(MARKER_ENV) + 1:-1]
            env.update(TPU_WORKER_ID=str(host), JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                       RAY_USAGE_STATS_ENABLED="0",
                       XLA_FLAGS=f"--xla_force_host_platform_device_count={self.devices_per_host + 1} "
                                 f"{XLA_SINGLE_THREAD}")
            env.pop("VLLM_TARGET_DEVICE", None)
            env.pop("RAY_ADDRESS", None)
            common = ["--block", "--node-ip-address", "127.0.0.1", "--num-cpus", "1",
                      "--resources", json.dumps({"TPU": self.devices_per_host}),
                      "--object-store-memory", str(100 << 20), "--disable-usage-stats",
                      "--node-manager-port", str(free_port()), "--object-manager-port", str(free_port()),
                      "--dashboard-agent-listen-port", str(free_port()),
                      "--dashboard-agent-grpc-port", str(free_port()),
                      "--metrics-export-port", str(free_port()), "--runtime-env-agent-port", str(free_port())]
            if host == 0:
                args = [ray, "start", "--head", "--port", str(self.gcs_port), "--include-dashboard", "false",
                        "--temp-dir", self.temp_dir, *common]
            else:
                args = [ray, "start", "--address", self.address, *common]
            log = open(os.path.join(self.workdir, f"ray-node{host}.log"), "w")
            self.procs.append(subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT,
                                               start_new_session=True))
            with open(os.path.join(self.workdir, "pgids.txt"), "a") as f:
                f.write(f"{self.procs[-1].pid}\n")
            if host == 0:
                self._wait_nodes(1, timeout_s)
        self._wait_nodes(self.hosts, timeout_s)

    def _wait_nodes(self, n: int, timeout_s: float) -> None:
        """Until the first ``n`` nodes said "Ray runtime started." (``ray start`` prints it once its
        raylet is registered), then, once all are, until ``ray status`` lists ``n`` active nodes."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for i, p in enumerate(self.procs):
                if p.poll() is not None:
                    raise RuntimeError(f"ray node {i} exited {p.returncode}; see {self.workdir}/ray-node{i}.log")
            started = 0
            for i in range(n):
                with open(os.path.join(self.workdir, f"ray-node{i}.log"), errors="replace") as f:
                    started += "Ray runtime started." in f.read()
            if started == n:
                break
            time.sleep(0.5)
        else:
            raise RuntimeError(f"{n} ray nodes not started after {timeout_s} s")
        if n < self.hosts:
            return
        ray = os.path.join(os.path.dirname(sys.executable), "ray")
        while time.monotonic() < deadline:
            out = subprocess.run([ray, "status", "--address", self.address], capture_output=True, text=True,
                                 timeout=120)
            if out.returncode == 0 and out.stdout.split("Pending:")[0].count("node_") >= n:
                return
            time.sleep(1.0)
        raise RuntimeError(f"{n} ray nodes not active after {timeout_s} s")

    def stop(self) -> None:
        for p in reversed(self.procs):
            _kill_group(p)
        self.procs = []
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def wait_gone(self, grace_s: float) -> list[tuple[int, str]]:
        """After ``stop()``: the run's processes still alive ``grace_s`` later (Ray's workers exit on
        their own once their raylet is gone); the leaks."""
        deadline = time.monotonic() + grace_s
        while (left := self.leaks()) and time.monotonic() < deadline:
            time.sleep(0.5)
        return left

    def leaks(self) -> list[tuple[int, str]]:
        return run_processes(os.path.dirname(self.workdir.rstrip("/")))


@dataclass(frozen=True)
class Shape:
    """One serving shape: ``hosts`` Ray nodes (0: one host, no Ray: tpu-inference's uni executor),
    ``devices_per_host`` mesh devices on each, vLLM's parallel sizes."""

    name: str
    hosts: int
    devices_per_host: int
    tp: int = 1
    dp: int = 1
    model: str = QWEN3.name
    env: tuple[tuple[str, str], ...] = ()
    extra_args: tuple[str, ...] = ()
    sharding: tuple[tuple[str, Any], ...] = ()  # more of tpu-inference's sharding_strategy (additional_config)

    @property
    def about(self) -> str:
        return (f"{self.name}: {max(self.hosts, 1)} host(s) x {self.devices_per_host} CPU device(s), TP {self.tp}, "
                f"DP {self.dp}, model {self.model}")


#: The shapes of issue 33: (a) tensor parallel across 2 hosts (the model axis spans them); (b) data
#: parallel through tpu-inference's DPScheduler on 2 hosts: attention DP (``enable_dp_attention``, TP 4
#: over 2 KV heads: 2 attention-DP ranks of TP 2), the way `vllm serve` reaches DPScheduler (with
#: ``--data-parallel-size 2`` and TPU_MULTIPROCESS_DP=0 the API server folds DP into one engine of DP 1,
#: and the EngineCore's second config pass, after its handshake, then finds DP 1: see docs);
#: (c) the hybrid sliding-window + full-attention model, tensor parallel across 2 hosts; (d) `vllm
#: serve --data-parallel-size 2` without attention DP on one host, which tpu-inference runs as 2
#: engines (TPU_MULTIPROCESS_DP=1, its default for serving; no Ray: the uni executor per engine).
SHAPES = {
    "tp2-2hosts": Shape("tp2-2hosts", hosts=2, devices_per_host=1, tp=2),
    "attndp2-2hosts": Shape("attndp2-2hosts", hosts=2, devices_per_host=2, tp=4,
                            sharding=(("enable_dp_attention", True),)),
    "hybrid-tp2-2hosts": Shape("hybrid-tp2-2hosts", hosts=2, devices_per_host=1, tp=2, model="hybrid"),
    "dp2-1host-engines": Shape("dp2-1host-engines", hosts=0, devices_per_host=1, tp=1, dp=2,
                               env=(("TPU_MULTIPROCESS_DP", "1"),)),
}


@dataclass(frozen=True)
class Workload:
    """vLLM's prefix_repetition benchmark scaled to CPU, and the HBM it runs in."""

    prefix_len: int = 192
    suffix_len: int = 16
    num_prefixes: int = 4
    output_len: int = 4
    num_prompts: int = 8
    concurrency: int = 4
    num_gpu_blocks: int = 48  # fewer than the prefixes' blocks: HBM evicts them
    max_num_seqs: int = 4
    equality_prompts: int = 4  # plain completions at temperature 0, per round
    cpu_bytes: int = 64 << 20

    @property
    def max_model_len(self) -> int:
        # twice the longest request: vLLM refuses a prompt of more than 4 characters per token of
        # max_model_len before tokenizing, and a word of this tokenizer takes 5 with its space
        return 2 * (self.prefix_len + self.suffix_len + self.output_len)


def kv_transfer_config(stats_dir: str, cpu_bytes: int) -> dict[str, Any]:
    """The README's config (``cpu_bytes_to_use`` scaled to this machine), with per-host snapshots."""
    return {"kv_connector": "TPUOffloadConnector", "kv_connector_module_path": "tpuoffload.connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": cpu_bytes, "lazy_offload": False,
                                          "stats_dir": stats_dir, "stats_interval_s": 0}}


class Server:
    """``vllm serve`` (through ``tpuoffload.sim.vllm_cli``) in its own session."""

    def __init__(self, workdir: str, shape: Shape, model_dir: str, workload: Workload, connector: bool,
                 ray: RayHosts | None) -> None:
        self.workdir, self.shape, self.model_dir, self.workload = workdir, shape, model_dir, workload
        self.connector, self.ray = connector, ray
        self.port = free_port()
        self.stats_dir = os.path.join(workdir, "stats") if connector else None
        self.log_path = os.path.join(workdir, "server.log")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        w, s = self.workload, self.shape
        cmd = [sys.executable, "-m", "tpuoffload.sim.vllm_cli", "serve", self.model_dir,
               "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(self.port),
               "--tensor-parallel-size", str(s.tp), "--data-parallel-size", str(s.dp),
               "--async-scheduling", "--enable-prefix-caching", "--block-size", str(BLOCK_SIZE),
               "--num-gpu-blocks-override", str(w.num_gpu_blocks), "--max-model-len", str(w.max_model_len),
               "--max-num-seqs", str(w.max_num_seqs), "--max-num-batched-tokens", "512", "--dtype", DTYPE,
               "--enforce-eager", "--gpu-memory-utilization", "0.5", "--seed", "0",
               # the runner's explicit device order (CPU devices have no TPU coordinates to sort by; on
               # several hosts engine_shims 11 hands the worker the slice's devices, kept in this order)
               "--additional-config", json.dumps({"sharding": {"sharding_strategy": {
                   "device_indexes": list(range(s.devices_per_host * max(s.hosts, 1))), **dict(s.sharding)}}}),
               *s.extra_args]
        if self.connector:
            cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config(self.stats_dir, w.cpu_bytes))]
        return cmd

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_SERVER_DEV_MODE="1",
                   MODEL_IMPL_TYPE=MODELS[self.shape.model].impl, VLLM_LOGGING_LEVEL="INFO",
                   VLLM_XLA_CACHE_PATH=os.path.join(self.workdir, "xla_cache"), RAY_USAGE_STATS_ENABLED="0",
                   XLA_FLAGS=f"--xla_force_host_platform_device_count={self.shape.devices_per_host * max(self.shape.dp, 1) + 1} "
                             f"{XLA_SINGLE_THREAD}")
        env.pop("VLLM_TARGET_DEVICE", None)
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the real server: EngineCore in its own process
        if self.ray is not None:
            env.update(TPU_MULTIHOST_BACKEND="ray", RAY_ADDRESS=self.ray.address, RAY_RUNTIME_ENV_HOOK=RUNTIME_ENV_HOOK,
                       TPU_WORKER_ID="0", **{SLICE_COORDINATOR_ENV: f"127.0.0.1:{free_port()}",
                                             SLICE_HOSTS_ENV: str(self.ray.hosts)},
                       # the executor copies these to its workers (vLLM's own list: VLLM_RAY_EXTRA_ENV_VARS_TO_COPY)
                       VLLM_RAY_EXTRA_ENV_VARS_TO_COPY=f"{SLICE_COORDINATOR_ENV},{SLICE_HOSTS_ENV}")
        env.update(dict(self.shape.env))
        env[MARKER_ENV] = marker(self.workdir)[len(MARKER_ENV) + 1:-1]
        return env

    def start(self, timeout_s: float = 900.0) -> None:
        os.makedirs(self.workdir, exist_ok=True)
        log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.command(), env=self.env(), stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True, cwd=self.workdir)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if self.get("/health", timeout=5)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(2.0)
        raise RuntimeError(f"vllm serve not healthy after {timeout_s} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 8000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]

    def get(self, path: str, timeout: float = 30.0) -> tuple[int, str]:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            return r.status, r.read().decode()

    def post(self, path: str, body: dict | None = None, timeout: float = 300.0) -> tuple[int, str]:
        data = json.dumps(body).encode() if body is not None else b""
        req = urllib.request.Request(self.url + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")

    def metrics(self) -> dict[str, float]:
        """vLLM's /metrics: every sample summed over its labels, by series name."""
        out: dict[str, float] = {}
        for line in self.get("/metrics")[1].splitlines():
            if not line or line.startswith("#"):
                continue
            name_labels, _, value = line.rpartition(" ")
            name = name_labels.split("{")[0]
            try:
                out[name] = out.get(name, 0.0) + float(value)
            except ValueError:
                continue
        return out

    def stop(self) -> None:
        if self.proc is not None:
            _kill_group(self.proc, grace_s=20.0)


def equality_prompts(workload: Workload, seed: int = 1) -> list[str]:
    """Prompts for token equality, in the benchmark's shape: ``num_prefixes`` shared prefixes."""
    import random

    rng = random.Random(seed)
    words = lambda n: " ".join(f"w{rng.randrange(2, VOCAB):03d}" for _ in range(n))  # noqa: E731
    prefixes = [words(workload.prefix_len) for _ in range(workload.num_prefixes)]
    return [prefixes[i % len(prefixes)] + " " + words(workload.suffix_len) for i in range(workload.equality_prompts)]


def completions(server: Server, prompts: list[str], max_tokens: int) -> list[dict[str, Any]]:
    """One OpenAI completion per prompt at temperature 0, all in flight together."""
    from concurrent.futures import ThreadPoolExecutor

    def one(prompt: str) -> dict[str, Any]:
        status, body = server.post("/v1/completions", {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
                                                       "temperature": 0.0, "ignore_eos": True})
        if status != 200:
            return {"ok": False, "error": f"{status}: {body[:500]}"}
        return {"ok": True, "text": json.loads(body)["choices"][0]["text"]}

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def bench(server: Server, workload: Workload, tag: str, timeout_s: float = 600.0) -> dict[str, Any]:
    """``vllm bench serve --backend openai --dataset-name prefix_repetition`` (vLLM's own client,
    run as this machine's plain ``vllm`` CLI: it needs no shim) against ``server``."""
    w = workload
    result_dir = os.path.join(server.workdir, "bench")
    os.makedirs(result_dir, exist_ok=True)
    cmd = [os.path.join(os.path.dirname(sys.executable), "vllm"), "bench", "serve", "--backend", "openai",
           "--base-url", server.url, "--model", MODEL_NAME, "--tokenizer", server.model_dir,
           "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(w.prefix_len),
           "--prefix-repetition-suffix-len", str(w.suffix_len), "--prefix-repetition-num-prefixes",
           str(w.num_prefixes), "--prefix-repetition-output-len", str(w.output_len), "--num-prompts",
           str(w.num_prompts), "--max-concurrency", str(w.concurrency), "--ignore-eos", "--temperature", "0",
           "--seed", "0", "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,99",
           "--disable-tqdm", "--save-result", "--result-dir", result_dir, "--result-filename", f"{tag}.json"]
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", JAX_PLATFORMS="cpu")
    env.pop("VLLM_TARGET_DEVICE", None)
    log_path = os.path.join(result_dir, f"{tag}.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc, 1.0)
            raise RuntimeError(f"vllm bench serve ran past {timeout_s} s; log {log_path}")
    if rc != 0:
        with open(log_path) as f:
            raise RuntimeError(f"vllm bench serve exited {rc}:\n{f.read()[-4000:]}")
    with open(os.path.join(result_dir, f"{tag}.json")) as f:
        res = json.load(f)
    keep = ("completed", "failed", "duration", "request_throughput", "output_throughput", "total_token_throughput",
            "median_ttft_ms", "p50_ttft_ms", "p99_ttft_ms", "mean_ttft_ms", "p50_e2el_ms", "p99_e2el_ms")
    return {k: res[k] for k in keep if k in res}


EXTERNAL = ("vllm:external_prefix_cache_hits_total", "vllm:external_prefix_cache_queries_total")


def _external(server: Server) -> dict[str, float]:
    m = server.metrics()
    return {k: m.get(k, 0.0) for k in EXTERNAL}


def engine_classes(log: str) -> dict[str, str]:
    """The executor and scheduler classes as the running EngineCore printed them (the line
    ``tpuoffload.sim.vllm_cli`` logs once the EngineCore is built)."""
    out: dict[str, str] = {}
    for line in log.splitlines():
        if "tpuoffload-serve engine classes:" in line:
            for part in line.split("tpuoffload-serve engine classes:", 1)[1].split():
                key, _, value = part.partition("=")
                out[key] = value
    return out


def run_server(workdir: str, shape: Shape, model_dir: str, workload: Workload, connector: bool,
               ray: RayHosts | None) -> dict[str, Any]:
    """Start one server, run two rounds (bench + completions; ``/reset_prefix_cache`` between them),
    read its metrics and snapshots, stop it. Returns what it saw."""
    server = Server(workdir, shape, model_dir, workload, connector, ray)
    prompts = equality_prompts(workload)
    report: dict[str, Any] = {"connector": connector, "shape": shape.name, "rounds": []}
    t0 = time.monotonic()
    try:
        server.start()
        report["startup_s"] = round(time.monotonic() - t0, 1)
        for rnd in (1, 2):
            if rnd == 2:
                status, body = server.post("/reset_prefix_cache")
                report["reset"] = [status, body[:200]]
            before = _external(server)
            outs = completions(server, prompts, workload.output_len)
            b = bench(server, workload, f"round{rnd}-{'connector' if connector else 'baseline'}")
            after = _external(server)
            report["rounds"].append({"round": rnd, "completions": outs, "bench": b,
                                     "external": {k: after[k] - before[k] for k in EXTERNAL}})
        metrics = server.metrics()
        report["tpuoffload_series"] = sorted(k for k in metrics if k.startswith("vllm:tpuoffload_"))
        if connector:
            time.sleep(3.0)  # a heartbeat: the hosts' snapshots rebuilt while idle
            report["snapshots"] = read_snapshots(server.stats_dir)
            report["stats_table"] = stats_table(server.stats_dir)
    finally:
        server.stop()
        report["server_log"] = server.log_path
        with open(server.log_path, errors="replace") as f:
            log = f.read()
        report["classes"] = engine_classes(log)
        report["wall_s"] = round(time.monotonic() - t0, 1)
    return report


def read_snapshots(stats_dir: str) -> dict[str, Any]:
    out = {}
    for name in sorted(os.listdir(stats_dir)):
        if name.endswith(".json"):
            with open(os.path.join(stats_dir, name)) as f:
                out[name] = json.load(f)
    return out


def stats_table(stats_dir: str) -> str:
    """``tpuoffload stats`` on the server's snapshots (the operator's per-host table)."""
    out = subprocess.run([sys.executable, "-m", "tpuoffload.cli", "stats", stats_dir], capture_output=True,
                         text=True, timeout=60)
    return out.stdout + out.stderr


def run_shape(workdir: str, shape: Shape, workload: Workload = Workload(), timeout_s: float = 1500.0,
              connectors: tuple[bool, ...] = (False, True)) -> dict[str, Any]:
    """One Ray cluster for ``shape``, the server without then with the connector on it, the
    cluster stopped and its leftovers listed."""
    os.makedirs(workdir, exist_ok=True)
    model_dir = write_serve_model(os.path.join(workdir, "model"), MODELS[shape.model])
    ray = RayHosts(os.path.join(workdir, "cluster"), shape.hosts, shape.devices_per_host) if shape.hosts else None
    report: dict[str, Any] = {"shape": shape.about, "workload": workload.__dict__, "runs": {}}
    try:
        if ray is not None:
            t = time.monotonic()
            ray.start()
            report["ray_start_s"] = round(time.monotonic() - t, 1)
        for connector in connectors:
            name = "connector" if connector else "baseline"
            report["runs"][name] = run_server(os.path.join(workdir, name), shape, model_dir, workload, connector, ray)
    finally:
        if ray is not None:
            ray.stop()
            report["leaks"] = ray.wait_gone(LEAK_GRACE_S)
    return report


def run_child(workdir: str, shape: str, timeout_s: float, only: str | None = None) -> dict[str, Any]:
    """``run_shape`` in a child process (``python -m tpuoffload.sim.serve_stack``) under an outside
    timeout: past it the child's group is killed and then every process of the run (Ray nodes,
    their workers, the server, its EngineCore: found by the run's marker, killed by pid). Whatever
    the outcome, the processes of the run still alive afterwards are listed in ``left_after``."""
    os.makedirs(workdir, exist_ok=True)
    out_json, log_path = os.path.join(workdir, "report.json"), os.path.join(workdir, "launcher.log")
    cmd = [sys.executable, "-m", "tpuoffload.sim.serve_stack", "--shape", shape, "--workdir", workdir,
           "--json", out_json] + (["--only", only] if only else [])
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc, grace_s=30.0)
            killed = sweep(workdir)
            raise RuntimeError(f"serve_stack {shape} ran past {timeout_s} s; killed {killed}; log {log_path}")
        except BaseException:  # interrupted (a test runner's own timeout, ^C): nothing may outlive it
            _kill_group(proc, grace_s=5.0)
            sweep(workdir)
            raise
    time.sleep(2.0)
    left = sweep(workdir)
    if rc != 0:
        with open(log_path, errors="replace") as f:
            raise RuntimeError(f"serve_stack {shape} exited {rc} (left {left}):\n{f.read()[-6000:]}")
    with open(out_json) as f:
        report = json.load(f)
    report["left_after"] = left
    return report


def summary(report: dict[str, Any]) -> str:
    """What a user compares, from a ``run_shape`` report: requests ok/failed, TTFT p50/p99 and
    throughput with/without tpuoffload (as ratios: this is a CPU), vLLM's external prefix cache hit
    rate, token equality, the per-host ``tpuoffload stats`` table."""
    base, conn = report["runs"].get("baseline"), report["runs"].get("connector")
    lines = [f"shape: {report['shape']}"]
    for name, run in report["runs"].items():
        lines.append(f"  {name}: executor {run['classes'].get('executor', '?')}, scheduler "
                     f"{run['classes'].get('scheduler', '?')} (rank scheduler {run['classes'].get('rank_scheduler', '-')})")
    lines.append(f"  {'round':<8}{'run':<11}{'ok/failed':>10}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}{'req/s':>8}"
                 f"{'ext. hits/queries':>19}")
    for rnd in (0, 1):
        for name, run in report["runs"].items():
            r = run["rounds"][rnd]
            b, e = r["bench"], r["external"]
            ok = b["completed"] + sum(c["ok"] for c in r["completions"])
            failed = b["failed"] + sum(not c["ok"] for c in r["completions"])
            lines.append(f"  {rnd + 1:<8}{name:<11}{f'{ok}/{failed}':>10}{b.get('p50_ttft_ms', b.get('median_ttft_ms', 0)):>13.0f}"
                         f"{b.get('p99_ttft_ms', 0):>13.0f}{b['request_throughput']:>8.2f}"
                         f"{int(e[EXTERNAL[0]]):>10}/{int(e[EXTERNAL[1]]):<8}")
    if base and conn:
        for rnd in (0, 1):
            b, c = base["rounds"][rnd]["bench"], conn["rounds"][rnd]["bench"]
            p50 = lambda x: x.get("p50_ttft_ms", x.get("median_ttft_ms"))  # noqa: E731
            equal = [x["text"] for x in base["rounds"][rnd]["completions"]] == \
                [x["text"] for x in conn["rounds"][rnd]["completions"]]
            e = conn["rounds"][rnd]["external"]
            rate = e[EXTERNAL[0]] / e[EXTERNAL[1]] if e[EXTERNAL[1]] else 0.0
            lines.append(f"  round {rnd + 1} with/without tpuoffload: TTFT p50 x{p50(c) / p50(b):.2f}, p99 "
                         f"x{c['p99_ttft_ms'] / b['p99_ttft_ms']:.2f}, throughput x"
                         f"{c['request_throughput'] / b['request_throughput']:.2f}; external prefix cache hit rate "
                         f"{rate:.0%}; greedy tokens equal: {equal}")
    if conn and conn.get("stats_table"):
        lines.append("tpuoffload stats (per host, at the end):")
        lines += ["  " + x for x in conn["stats_table"].splitlines()]
    lines.append(f"Ray/worker processes left: {report.get('leaks', [])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m tpuoffload.sim.serve_stack", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tp2-2hosts")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--only", choices=("baseline", "connector"), default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import tempfile

    workdir = args.workdir or tempfile.mkdtemp(prefix="tpuoffload-serve-")
    connectors = (False, True) if args.only is None else (args.only == "connector",)
    report = run_shape(workdir, SHAPES[args.shape], connectors=connectors)
    text = json.dumps(report, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    else:
        print(text)
    return 0


def demo(argv: list[str] | None = None) -> int:
    """``python -m tpuoffload.demo --serve``: the 2-host serving stack, without then with
    tpuoffload, and what a user compares."""
    import argparse
    import tempfile

    ap = argparse.ArgumentParser(prog="python -m tpuoffload.demo --serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tp2-2hosts")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--timeout", type=float, default=1500.0)
    args = ap.parse_args(argv)
    workdir = args.workdir or tempfile.mkdtemp(prefix="tpuoffload-serve-")
    print(f"vllm serve on tpu-inference's Ray executor over a local Ray cluster ({SHAPES[args.shape].about}); "
          f"vllm bench serve --dataset-name prefix_repetition {Workload()}; logs under {workdir}", flush=True)
    t0 = time.monotonic()
    report = run_child(workdir, args.shape, args.timeout)
    print(summary(report))
    print(f"{time.monotonic() - t0:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
