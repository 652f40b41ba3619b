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

What runs is a plan (``PLANS``: each shape's server without, then with the connector; ``issue33``,
the suite's, several servers on one Ray cluster), each server a ``ServerRun``: its rounds, and the
fault cases: a host whose loads all fail for some rounds (engine_shims 12), under the README's
``kv_load_failure_policy: recompute`` or vLLM's default ``fail``; a host's Ray worker killed mid-run
(``kill_host_mid_run``).

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

from tpuoffload.sim.engine_shims import LOAD_FAULT_FLAG_ENV, LOAD_FAULT_HOST_ENV, SLICE_COORDINATOR_ENV, SLICE_HOSTS_ENV
from tpuoffload.sim.real_engine import DTYPE, MODELS, QWEN3, VOCAB, TinyModel, write_tiny_model
from tpuoffload.snapshot import read_snapshots

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


def _live_processes():
    """(pid, the fields of ``/proc/<pid>/stat`` after the command name, argv) of every live
    (not zombie) process."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if fields[0] != "Z":
            yield int(name), fields, argv


def _in_groups(groups: set[int]) -> list[tuple[int, str]]:
    return [(pid, " ".join(argv)[:200]) for pid, fields, argv in _live_processes() if int(fields[2]) in groups]


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


def _processes_mentioning(needle: str) -> list[tuple[int, str]]:
    """(pid, command line) of every process whose environment contains ``needle`` (a run's marker,
    ``NAME=value\\0``)."""
    found = []
    for pid, _, argv in _live_processes():
        if pid == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().decode(errors="replace")
        except OSError:
            continue
        if needle in env + "\0":
            found.append((pid, " ".join(argv)[:200]))
    return found


#: What ``ray start`` says when its raylet did not register with the GCS within the 30 s that
#: ray/_private/node.py hard-codes (``raylet_start_wait_time_s``); on a 2-core machine under load that
#: happens (docs/real-engine.md), and such a worker node is started again, at most twice, and counted.
RAY_START_TIMEOUT = "The current node timed out during startup"



def plan_compile_cache(plan_workdir: str) -> dict[str, str]:
    """One persistent JAX compile cache for every process of a run, as a deployment keeps its
    cache across restarts: later servers load the programs the first compiled. Set on the Ray
    nodes too, so their workers start with it. JAX reads its cache directory once, at a process's
    first compile, which on CPU comes before tpu-inference's CompilationManager sets it from
    ``VLLM_XLA_CACHE_PATH`` and before vLLM's executor copies any variable into a worker: both name
    the same directory. Every program is kept (JAX keeps only compiles over 1 s by default); a size
    limit turns on JAX's file lock, so no process reads an entry another is writing."""
    path = os.path.join(plan_workdir, "xla_cache")
    return {"JAX_COMPILATION_CACHE_DIR": path, "VLLM_XLA_CACHE_PATH": path,
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_COMPILATION_CACHE_MAX_SIZE": str(8 << 30)}


@dataclass
class RayHosts:
    """A local Ray cluster: one ``ray start --block`` node per host, each in its own session."""

    workdir: str
    hosts: int
    devices_per_host: int
    procs: list[subprocess.Popen] = field(default_factory=list)
    gcs_port: int = 0
    #: nodes started again after Ray's own start-up timeout (``RAY_START_TIMEOUT``), by host
    restarts: list[int] = field(default_factory=list)
    _launch: list[tuple[list[str], dict[str, str]]] = field(default_factory=list)

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
                       RAY_USAGE_STATS_ENABLED="0", **plan_compile_cache(os.path.dirname(self.workdir.rstrip("/"))),
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
            self._launch.append((args, env))
            self.procs.append(self._popen(host))
            if host == 0:
                self._wait_nodes(1, timeout_s)
        self._wait_nodes(self.hosts, timeout_s)

    def _popen(self, host: int) -> subprocess.Popen:
        args, env = self._launch[host]
        log = open(os.path.join(self.workdir, f"ray-node{host}.log"), "a")
        proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        with open(os.path.join(self.workdir, "pgids.txt"), "a") as f:
            f.write(f"{proc.pid}\n")
        return proc

    def _wait_nodes(self, n: int, timeout_s: float) -> None:
        """Until the first ``n`` nodes said "Ray runtime started." (``ray start`` prints it once its
        raylet is registered), then, once all are, until ``ray status`` lists ``n`` active nodes."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for i, p in enumerate(self.procs):
                if p.poll() is None:
                    continue
                with open(os.path.join(self.workdir, f"ray-node{i}.log"), errors="replace") as f:
                    timed_out = RAY_START_TIMEOUT in f.read()
                if not (timed_out and i > 0 and self.restarts.count(i) < 2):  # a worker node only: the GCS is on 0
                    raise RuntimeError(f"ray node {i} exited {p.returncode}; see {self.workdir}/ray-node{i}.log")
                self.restarts.append(i)
                self.procs[i] = self._popen(i)
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
    "attndp2-2hosts": Shape("attndp2-2hosts", hosts=2, devices_per_host=1, tp=2,
                            sharding=(("enable_dp_attention", True), ("attn_dp_size", 2)),
                            env=(("NEW_MODEL_DESIGN", "1"),)),
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


@dataclass(frozen=True)
class ServerRun:
    """One server of a run: its shape, with or without the connector, and what is done to it.

    ``rounds``: each round sends the equality completions and (``bench``) ``vllm bench serve``;
    ``/reset_prefix_cache`` before every round after the first. ``fault_rounds``: the rounds during
    which host ``fault_host``'s worker half fails every load (engine_shims 12). ``kill_host``: after
    the rounds, that host's Ray worker is killed with requests in flight. ``persist``: warm restart
    on, with the ``persist_path`` every such server of the run shares, so a later server restores
    what an earlier one checkpointed. ``checkpoint_round``: the operator's checkpoint
    (``tpuoffload checkpoint DIR --wait``) asked before that round's requests are sent (an idle
    vLLM engine runs no step, so reads no request) and waited for after it.
    ``baseline``: the run (without the connector) whose greedy tokens this one's must equal."""

    name: str
    shape: str
    connector: bool
    load_failure_policy: str = "recompute"  # kv_transfer_config's kv_load_failure_policy (the README's)
    rounds: int = 2
    bench: bool = True
    fault_rounds: tuple[int, ...] = ()
    fault_host: int = 1
    kill_host: int | None = None
    persist: bool = False
    checkpoint_round: int | None = None
    baseline: str | None = "baseline"


def shape_plan(shape: str) -> tuple[ServerRun, ...]:
    """A shape's own comparison: the server without, then with the connector."""
    return (ServerRun("baseline", shape, False, baseline=None), ServerRun("connector", shape, True))


#: What runs together on one Ray cluster (every shape of a plan that uses Ray has the same hosts and
#: devices). ``issue33``, the suite's run: (a) TP 2 without and with the connector, the latter with a
#: third round in which host 1 fails every load (the README's kv_load_failure_policy ``recompute``:
#: every host recomputes, the tokens stay those of the run without the connector); (b) attention DP
#: through DPScheduler with the connector, its tokens compared with (a)'s run without it (the
#: attention-DP engine without the connector gives the same tokens: docs/real-engine.md); then the
#: load fault's negative control, vLLM's default policy ``fail``, under which the same fault fails
#: requests (completions only), with warm restart on: after its rounds the operator's checkpoint,
#: then host 1's Ray worker killed mid-run; last, the same engine started again on that
#: ``persist_path`` (the warm start after a killed host): its first round loads what was restored.
PLANS: dict[str, tuple[ServerRun, ...]] = {
    **{name: shape_plan(name) for name in SHAPES},
    "issue33": (
        ServerRun("baseline", "tp2-2hosts", False, baseline=None),
        ServerRun("connector", "tp2-2hosts", True, rounds=3, fault_rounds=(3,)),
        ServerRun("attndp-connector", "attndp2-2hosts", True),
        ServerRun("fail-policy", "tp2-2hosts", True, load_failure_policy="fail", bench=False, fault_rounds=(2,),
                  kill_host=1, persist=True, checkpoint_round=2),
        ServerRun("warm-start", "tp2-2hosts", True, rounds=1, bench=False, persist=True),
    ),
}


def kv_transfer_config(stats_dir: str, cpu_bytes: int, load_failure_policy: str = "recompute",
                       persist_path: str | None = None) -> dict[str, Any]:
    """The README's config (``cpu_bytes_to_use`` scaled to this machine), with per-host snapshots,
    and warm restart when ``persist_path`` is given."""
    extra: dict[str, Any] = {"cpu_bytes_to_use": cpu_bytes, "lazy_offload": False, "stats_dir": stats_dir,
                             "stats_interval_s": 0}
    if persist_path is not None:
        extra.update(persist_path=persist_path)
    return {"kv_connector": "TPUOffloadConnector", "kv_connector_module_path": "tpuoffload.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": load_failure_policy,
            "kv_connector_extra_config": extra}


class Server:
    """``vllm serve`` (through ``tpuoffload.sim.vllm_cli``) in its own session."""

    def __init__(self, workdir: str, run: ServerRun, model_dir: str, workload: Workload,
                 ray: RayHosts | None) -> None:
        self.workdir, self.run, self.shape, self.model_dir, self.workload = workdir, run, SHAPES[run.shape], model_dir, workload
        self.connector, self.ray = run.connector, ray
        #: while this file exists, host ``run.fault_host`` fails every load (engine_shims 12)
        self.fault_flag = os.path.join(workdir, "faults", f"load-host{run.fault_host}") if run.fault_rounds else None
        self.port = free_port()
        self.stats_dir = os.path.join(workdir, "stats") if run.connector else None
        # shared by the run's ``persist`` servers: a later one restores what an earlier one wrote
        self.persist_path = os.path.join(os.path.dirname(workdir.rstrip("/")), "persist") if run.persist else None
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
            cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config(self.stats_dir, w.cpu_bytes,
                                                                          self.run.load_failure_policy,
                                                                          self.persist_path))]
        return cmd

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_SERVER_DEV_MODE="1",
                   MODEL_IMPL_TYPE=MODELS[self.shape.model].impl, VLLM_LOGGING_LEVEL="INFO",
                   **plan_compile_cache(os.path.dirname(self.workdir.rstrip("/"))),
                   RAY_USAGE_STATS_ENABLED="0",
                   XLA_FLAGS=f"--xla_force_host_platform_device_count={self.shape.devices_per_host * max(self.shape.dp, 1) + 1} "
                             f"{XLA_SINGLE_THREAD}")
        env.pop("VLLM_TARGET_DEVICE", None)
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the real server: EngineCore in its own process
        if self.ray is not None:
            env.update(TPU_MULTIHOST_BACKEND="ray", RAY_ADDRESS=self.ray.address, RAY_RUNTIME_ENV_HOOK=RUNTIME_ENV_HOOK,
                       TPU_WORKER_ID="0", **{SLICE_COORDINATOR_ENV: f"127.0.0.1:{free_port()}",
                                             SLICE_HOSTS_ENV: str(self.ray.hosts)},
                       # the executor copies these to its workers (vLLM's own list: VLLM_RAY_EXTRA_ENV_VARS_TO_COPY)
                       VLLM_RAY_EXTRA_ENV_VARS_TO_COPY=f"{SLICE_COORDINATOR_ENV},{SLICE_HOSTS_ENV},"
                                                       f"{LOAD_FAULT_FLAG_ENV},{LOAD_FAULT_HOST_ENV}")
        if self.fault_flag is not None:
            os.makedirs(os.path.dirname(self.fault_flag), exist_ok=True)
            env.update({LOAD_FAULT_FLAG_ENV: self.fault_flag, LOAD_FAULT_HOST_ENV: str(self.run.fault_host)})
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

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: _completion(server, p, max_tokens), prompts))


def _completion(server: Server, prompt: str, max_tokens: int, timeout: float = 300.0) -> dict[str, Any]:
    """One OpenAI completion at temperature 0: ``ok`` and its text, or what went wrong."""
    t = time.monotonic()
    try:
        status, body = server.post("/v1/completions", {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
                                                       "temperature": 0.0, "ignore_eos": True}, timeout=timeout)
    except (OSError, ValueError) as e:  # connection refused or reset, timed out: the server is gone
        return {"ok": False, "error": repr(e)[:500], "after_s": round(time.monotonic() - t, 1)}
    if status != 200:
        return {"ok": False, "error": f"{status}: {body[:500]}", "after_s": round(time.monotonic() - t, 1)}
    choice = json.loads(body)["choices"][0]
    # vLLM answers a request it finished with an error (kv_load_failure_policy fail) with 200 and this reason
    return {"ok": choice.get("finish_reason") != "error", "text": choice["text"], "finish_reason": choice.get("finish_reason")}


def _vllm_cli(argv: list[str], env: dict[str, str], log_path: str) -> None:
    """The ``vllm`` console script's ``main`` with ``argv``, in a child forked from the launcher
    (``bench``): its output to ``log_path``, its exit status the script's."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.clear()
    os.environ.update(env)
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *argv]
    sys.exit(main())


def bench(server: Server, workload: Workload, tag: str, timeout_s: float = 600.0) -> dict[str, Any]:
    """``vllm bench serve --backend openai --dataset-name prefix_repetition`` (vLLM's own client:
    the ``vllm`` console script's ``main`` with these arguments; it needs no shim) against
    ``server``. Each run is a child forked from this launcher, which imported vLLM's CLI once: a
    fresh ``vllm`` process spends about 28 s importing on this 2-core machine, and a plan runs seven
    benches. The child runs under ``timeout_s`` and is killed past it."""
    import importlib
    import multiprocessing

    importlib.import_module("vllm.entrypoints.cli.main")  # once here, inherited by every forked bench

    w = workload
    result_dir = os.path.join(server.workdir, "bench")
    os.makedirs(result_dir, exist_ok=True)
    argv = ["bench", "serve", "--backend", "openai",
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
    proc = multiprocessing.get_context("fork").Process(target=_vllm_cli, args=(argv, env, log_path), daemon=True)
    proc.start()
    proc.join(timeout_s)
    if proc.is_alive():
        proc.kill()
        proc.join()
        raise RuntimeError(f"vllm bench serve ran past {timeout_s} s; log {log_path}")
    if proc.exitcode != 0:
        with open(log_path) as f:
            raise RuntimeError(f"vllm bench serve exited {proc.exitcode}:\n{f.read()[-4000:]}")
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


def run_server(workdir: str, run: ServerRun, model_dir: str, workload: Workload, ray: RayHosts | None) -> dict[str, Any]:
    """Start one server, run its rounds (completions, then ``vllm bench serve``; ``/reset_prefix_cache``
    before every round after the first; host ``run.fault_host`` failing every load in ``run.fault_rounds``),
    read its metrics and snapshots, kill a host's Ray worker mid-run if asked, stop it. Returns what it saw."""
    server = Server(workdir, run, model_dir, workload, ray)
    prompts = equality_prompts(workload)
    report: dict[str, Any] = {"connector": run.connector, "shape": run.shape, "run": run.__dict__, "rounds": []}
    t0 = time.monotonic()
    try:
        server.start()
        report["startup_s"] = round(time.monotonic() - t0, 1)
        for rnd in range(1, run.rounds + 1):
            if rnd > 1:
                status, body = server.post("/reset_prefix_cache")
                report.setdefault("resets", []).append([status, body[:200]])
                report["reset"] = report["resets"][0]
            faulted = rnd in run.fault_rounds
            if faulted:
                with open(server.fault_flag, "w"):
                    pass
            asked = OperatorCheckpoint(server.persist_path) if rnd == run.checkpoint_round else None
            before = _external(server)
            outs = completions(server, prompts, workload.output_len)
            b = bench(server, workload, f"round{rnd}-{run.name}") if run.bench and not faulted else None
            after = _external(server)
            entry = {"round": rnd, "completions": outs, "bench": b, "external": {k: after[k] - before[k] for k in EXTERNAL}}
            if faulted:
                os.unlink(server.fault_flag)
                entry["failed_loads"] = _failed_loads(server.fault_flag)
            if asked is not None:
                report["checkpoint"] = asked.answer()
            report["rounds"].append(entry)
        metrics = server.metrics()
        report["tpuoffload_series"] = sorted(k for k in metrics if k.startswith("vllm:tpuoffload_"))
        if run.connector:
            time.sleep(3.0)  # a heartbeat: the hosts' snapshots rebuilt while idle
            report["snapshots"] = read_snapshots(server.stats_dir)
            report["stats_table"] = stats_table(server.stats_dir)[0]
        if run.kill_host is not None:
            report["kill"] = kill_host_mid_run(server, run.kill_host, prompts)
    finally:
        server.stop()
        report["server_log"] = server.log_path
        with open(server.log_path, errors="replace") as f:
            log = f.read()
        report["classes"] = engine_classes(log)
        report["wall_s"] = round(time.monotonic() - t0, 1)
    return report


class OperatorCheckpoint:
    """What an operator runs before maintenance (docs/persistence.md): ``tpuoffload checkpoint
    persist_path --wait`` (the installed CLI), started now in the launcher's own process group (so
    ``run_child``'s timeout kills it with the launcher); ``answer`` waits for it and returns its
    exit status, output and the engine's answer (``CHECKPOINT_DONE``)."""

    def __init__(self, persist_path: str, wait_s: float = 240.0) -> None:
        from tpuoffload.persist.request import POLL_INTERVAL_S

        self.persist_path, self.wait_s, self.t0 = persist_path, wait_s, time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "tpuoffload.cli", "checkpoint", persist_path,
                                      "--wait", str(wait_s)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        # Returns once the request is on disk and the idle engine's next step will read it (it reads
        # the file at most once a poll interval): the round's first step plans the checkpoint, and
        # the engine steps until every host answered (has_pending_push_work), however short the
        # round. Without this the round could end before the CLI (a fresh interpreter) wrote it.
        self.first_line = self.proc.stdout.readline() if self.proc.stdout else ""
        time.sleep(POLL_INTERVAL_S)

    def answer(self) -> dict[str, Any]:
        from tpuoffload.persist.request import read_done

        try:
            output, _ = self.proc.communicate(timeout=self.wait_s + 60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            output, _ = self.proc.communicate()
        output = self.first_line + output
        done = read_done(self.persist_path)
        return {"rc": self.proc.returncode, "after_s": round(time.monotonic() - self.t0, 1), "output": output[-1000:],
                "done": None if done is None else done.__dict__}


def _failed_loads(flag: str) -> list[int]:
    """The loads (their chunk counts) the faulted host failed (engine_shims.FlaggedLoadFaults)."""
    try:
        with open(flag + ".hits") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def host_worker_pids(cluster_dir: str, host: int) -> list[int]:
    """The Ray actor processes (``ray::RayWorkerProc``: tpu-inference's TPUWorker of one host) of
    ``host``'s Ray node: its processes are in that node's session (``RayHosts.start`` starts node
    ``host`` as the ``host``-th line of ``pgids.txt``, in a session of its own)."""
    with open(os.path.join(cluster_dir, "pgids.txt")) as f:
        session = int(f.read().split()[host])
    return [pid for pid, fields, argv in _live_processes()
            if int(fields[3]) == session and argv[0].startswith("ray::RayWorkerProc")]


def kill_host_mid_run(server: Server, host: int, prompts: list[str], bound_s: float = 180.0) -> dict[str, Any]:
    """A host lost mid-run: completions in flight (64 tokens each), and once the engine runs them,
    SIGKILL ``host``'s Ray worker (``host_worker_pids``). Then, within ``bound_s``: every request
    returns (its status), the server stops answering ``/health`` with 200 or exits, and
    ``tpuoffload stats`` on its snapshots (once the killed host's heartbeat is stale) says what it
    flags. Returns what was seen, with times from the kill."""
    from concurrent.futures import ThreadPoolExecutor

    assert server.ray is not None and server.proc is not None
    pids = host_worker_pids(server.ray.workdir, host)
    out: dict[str, Any] = {"host": host, "worker_pids": pids}
    pool = ThreadPoolExecutor(len(prompts))
    futures = [pool.submit(_completion, server, p, 64, bound_s) for p in prompts]
    deadline = time.monotonic() + 120.0
    while server.metrics().get("vllm:num_requests_running", 0.0) < 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    out["running_at_kill"] = server.metrics().get("vllm:num_requests_running", 0.0)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    t_kill = time.monotonic()
    unhealthy = exited = None
    while time.monotonic() - t_kill < bound_s and (unhealthy is None or exited is None):
        if exited is None and server.proc.poll() is not None:
            exited = round(time.monotonic() - t_kill, 1)
            unhealthy = unhealthy if unhealthy is not None else exited
        if unhealthy is None:
            try:
                if server.get("/health", timeout=5)[0] != 200:
                    unhealthy = round(time.monotonic() - t_kill, 1)
            except (OSError, ValueError):
                unhealthy = round(time.monotonic() - t_kill, 1)
        if unhealthy is not None and all(f.done() for f in futures) and exited is None \
                and time.monotonic() - t_kill > 60.0:
            break  # unhealthy and every request answered; waiting a minute for an exit is enough
        time.sleep(0.5)
    out.update(unhealthy_after_s=unhealthy, exited_after_s=exited, server_returncode=server.proc.poll())
    out["requests"] = [f.result() if f.done() else {"ok": False, "error": "no answer", "hung": True} for f in futures]
    out["answered_after_s"] = round(time.monotonic() - t_kill, 1)
    pool.shutdown(wait=False, cancel_futures=True)
    if server.stats_dir:
        snaps = read_snapshots(server.stats_dir)
        hb = max(float(x.get("interval_s", 5.0)), float(x.get("heartbeat_s", 0.0))) if (x := snaps.get(f"host-{host}.json")) else 5.0
        time.sleep(max(0.0, t_kill + hb + 7.0 - time.monotonic()))  # past the stale limit (cli.stale_limit)
        out["stats_table"], out["stats_rc"] = stats_table(server.stats_dir)
    return out


def stats_table(stats_dir: str) -> tuple[str, int]:
    """``tpuoffload stats`` on the server's snapshots (the operator's per-host table) and its exit
    status (0 healthy, 1 some host flagged)."""
    out = subprocess.run([sys.executable, "-m", "tpuoffload.cli", "stats", stats_dir], capture_output=True,
                         text=True, timeout=60)
    return out.stdout + out.stderr, out.returncode


def run_plan(workdir: str, plan: str, workload: Workload = Workload(), only: str | None = None) -> dict[str, Any]:
    """The servers of ``PLANS[plan]`` (or those named in ``only``, comma-separated) one after
    another, those that use Ray on one Ray cluster; the cluster stopped and the run's leftovers listed."""
    runs = [r for r in PLANS[plan] if only is None or r.name in only.split(",")]
    if only is not None and {r.name for r in runs} != set(only.split(",")):
        raise ValueError(f"--only {only}: plan {plan} has {[r.name for r in PLANS[plan]]}")
    os.makedirs(workdir, exist_ok=True)
    ray_shapes = {(SHAPES[r.shape].hosts, SHAPES[r.shape].devices_per_host) for r in runs if SHAPES[r.shape].hosts}
    assert len(ray_shapes) <= 1, f"one Ray cluster per plan: {ray_shapes}"
    ray = RayHosts(os.path.join(workdir, "cluster"), *ray_shapes.pop()) if ray_shapes else None
    report: dict[str, Any] = {"plan": plan, "shapes": {r.shape: SHAPES[r.shape].about for r in runs},
                              "workload": workload.__dict__, "runs": {}}
    try:
        if ray is not None:
            t = time.monotonic()
            ray.start()
            report["ray_start_s"] = round(time.monotonic() - t, 1)
            report["ray_node_restarts"] = ray.restarts
        for run in runs:
            model = MODELS[SHAPES[run.shape].model]
            model_dir = os.path.join(workdir, f"model-{model.name}")
            if not os.path.exists(model_dir):
                write_serve_model(model_dir, model)
            report["runs"][run.name] = run_server(os.path.join(workdir, run.name), run, model_dir, workload, ray)
    finally:
        if ray is not None:
            ray.stop()
        deadline = time.monotonic() + LEAK_GRACE_S  # Ray's workers exit on their own once their raylet is gone
        while (left := run_processes(workdir)) and time.monotonic() < deadline:
            time.sleep(0.5)
        report["leaks"] = left
    return report


def run_child(workdir: str, plan: str, timeout_s: float, only: str | None = None) -> dict[str, Any]:
    """``run_plan`` in a child process (``python -m tpuoffload.sim.serve_stack``) under an outside
    timeout: past it the child's group is killed and then every process of the run (Ray nodes,
    their workers, the server, its EngineCore: found by the run's marker, killed by pid). Whatever
    the outcome, the processes of the run still alive afterwards are listed in ``left_after``."""
    os.makedirs(workdir, exist_ok=True)
    out_json, log_path = os.path.join(workdir, "report.json"), os.path.join(workdir, "launcher.log")
    cmd = [sys.executable, "-m", "tpuoffload.sim.serve_stack", "--plan", plan, "--workdir", workdir,
           "--json", out_json] + (["--only", only] if only else [])
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc, grace_s=30.0)
            killed = sweep(workdir)
            raise RuntimeError(f"serve_stack {plan} ran past {timeout_s} s; killed {killed}; log {log_path}")
        except BaseException:  # interrupted (a test runner's own timeout, ^C): nothing may outlive it
            _kill_group(proc, grace_s=5.0)
            sweep(workdir)
            raise
    time.sleep(2.0)
    left = sweep(workdir)
    if rc != 0:
        with open(log_path, errors="replace") as f:
            raise RuntimeError(f"serve_stack {plan} exited {rc} (left {left}):\n{f.read()[-6000:]}")
    with open(out_json) as f:
        report = json.load(f)
    report["left_after"] = left
    return report


def texts(rnd: dict[str, Any]) -> list[str | None]:
    """A round's completion texts (None for a request that failed)."""
    return [c.get("text") if c["ok"] else None for c in rnd["completions"]]


def requests_ok_failed(rnd: dict[str, Any]) -> tuple[int, int]:
    b = rnd["bench"] or {"completed": 0, "failed": 0}
    return b["completed"] + sum(c["ok"] for c in rnd["completions"]), b["failed"] + sum(not c["ok"] for c in rnd["completions"])


def summary(report: dict[str, Any]) -> str:
    """What a user compares, from a ``run_plan`` report: per server and round, requests ok/failed,
    TTFT p50/p99 and throughput (with/without tpuoffload as ratios: this is a CPU), vLLM's external
    prefix cache hits, token equality with the run without the connector; the fault cases; the
    per-host ``tpuoffload stats`` table."""
    runs = report["runs"]
    lines = [f"plan {report['plan']}: " + "; ".join(report["shapes"].values())]
    for name, run in runs.items():
        lines.append(f"  {name} ({run['shape']}, connector {run['connector']}): executor "
                     f"{run['classes'].get('executor', '?')}, scheduler {run['classes'].get('scheduler', '?')} "
                     f"(rank scheduler {run['classes'].get('rank_scheduler', '-')}); start {run.get('startup_s')} s")
    lines.append(f"  {'round':<7}{'run':<18}{'ok/failed':>10}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}{'req/s':>8}"
                 f"{'ext. hits/queries':>19}  tokens = baseline")
    p50 = lambda x: x.get("p50_ttft_ms", x.get("median_ttft_ms", 0.0))  # noqa: E731
    for name, run in runs.items():
        base = runs.get(run["run"]["baseline"] or "")
        for r in run["rounds"]:
            b, e = r["bench"] or {}, r["external"]
            ok, failed = requests_ok_failed(r)
            equal = texts(r) == texts(base["rounds"][0]) if base else "-"
            fault = f"  host {run['run']['fault_host']} failed {len(r['failed_loads'])} loads" if "failed_loads" in r else ""
            lines.append(f"  {r['round']:<7}{name:<18}{f'{ok}/{failed}':>10}{p50(b):>13.0f}{b.get('p99_ttft_ms', 0):>13.0f}"
                         f"{b.get('request_throughput', 0):>8.2f}{int(e[EXTERNAL[0]]):>10}/{int(e[EXTERNAL[1]]):<8}  "
                         f"{equal}{fault}")
    for name, run in runs.items():
        base = runs.get(run["run"]["baseline"] or "")
        if not (base and run["connector"]):
            continue
        for r, rb in zip(run["rounds"], base["rounds"]):
            if r["bench"] and rb["bench"]:
                e = r["external"]
                rate = e[EXTERNAL[0]] / e[EXTERNAL[1]] if e[EXTERNAL[1]] else 0.0
                lines.append(f"  {name} round {r['round']} with/without tpuoffload ({base['shape']}): TTFT p50 "
                             f"x{p50(r['bench']) / p50(rb['bench']):.2f}, p99 x{r['bench']['p99_ttft_ms'] / rb['bench']['p99_ttft_ms']:.2f}, "
                             f"throughput x{r['bench']['request_throughput'] / rb['bench']['request_throughput']:.2f}; "
                             f"external prefix cache hit rate {rate:.0%}")
    for name, run in runs.items():
        if "kill" in run:
            k = run["kill"]
            states = [("ok" if c["ok"] else ("hung" if c.get("hung") else "failed")) for c in k["requests"]]
            lines.append(f"  {name}: host {k['host']}'s Ray worker {k['worker_pids']} killed with "
                         f"{k['running_at_kill']:.0f} requests running: server unhealthy after {k['unhealthy_after_s']} s, "
                         f"exited after {k['exited_after_s']} s (rc {k['server_returncode']}); requests {states}; "
                         f"tpuoffload stats exit {k.get('stats_rc')}")
    for name, run in runs.items():
        if "checkpoint" in run:
            c = run["checkpoint"]
            lines.append(f"  {name}: operator checkpoint exit {c['rc']} after {c['after_s']} s: {c['done']}")
        if run["run"].get("persist") and "snapshots" in run:
            totals = [x["totals"] for x in run["snapshots"].values() if x.get("kind") == "scheduler"]
            lines.append(f"  {name}: chunks restored and loadable {[t.get('restored_ready', 0) for t in totals]}, "
                         f"dropped {[t.get('restored_dropped', 0) for t in totals]}")
    for name, run in runs.items():
        if run.get("stats_table"):
            lines.append(f"tpuoffload stats, {name} (per host, at the end):")
            lines += ["  " + x for x in run["stats_table"].splitlines()]
    lines.append(f"processes of the run left: {report.get('leaks', [])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m tpuoffload.sim.serve_stack", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", choices=sorted(PLANS), default="tp2-2hosts",
                    help="a shape (its server without, then with the connector) or a plan of several servers")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--only", default=None, help="run only the servers of these names (comma-separated)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import tempfile

    workdir = args.workdir or tempfile.mkdtemp(prefix="tpuoffload-serve-")
    # SIGTERM (an outside timeout, an operator's kill) ends the run as Ctrl-C does: run_plan's
    # cleanup stops the Ray nodes, which live in sessions of their own and would outlive it
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    report = run_plan(workdir, args.plan, only=args.only)
    text = json.dumps(report, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    else:
        print(text)
    return 0


def demo(argv: list[str] | None = None) -> int:
    """``python -m tpuoffload.demo [--plan P]``: the serving stack, without then with
    tpuoffload, and what a user compares."""
    import argparse
    import tempfile

    ap = argparse.ArgumentParser(prog="python -m tpuoffload.demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", choices=sorted(PLANS), default="tp2-2hosts")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--timeout", type=float, default=1500.0)
    args = ap.parse_args(argv)
    workdir = args.workdir or tempfile.mkdtemp(prefix="tpuoffload-serve-")
    shapes = "; ".join(sorted({SHAPES[r.shape].about for r in PLANS[args.plan]}))
    print(f"vllm serve on tpu-inference's platform ({shapes}); vllm bench serve --dataset-name prefix_repetition "
          f"{Workload()}; logs under {workdir}", flush=True)
    t0 = time.monotonic()
    report = run_child(workdir, args.plan, args.timeout)
    print(summary(report))
    print(f"{time.monotonic() - t0:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
