"""Prometheus metrics through vLLM's own KVConnectorProm (and PrometheusStatLogger), fed with the
stats vLLM's scheduler delivered during a real run of the connector.

The module fixture runs an InProcessEngine (vLLM's real scheduler, two simulated hosts) with a
shared-prefix workload, and records the ``SchedulerStats`` that ``Scheduler.update_from_output``
returned at every step, exactly what vLLM's stat loggers receive. The metric values read back from
prometheus_client's REGISTRY are compared with each host's and the scheduler's own counters.
"""

from __future__ import annotations

import json

import pytest
from prometheus_client import REGISTRY, generate_latest

from tpuoffload import counters as C
from tpuoffload.cli import main as cli_main
from tpuoffload.prom import OffloadPromMetrics, metric_name
from tpuoffload.worker.faults import FaultInjector, FaultPoint

BS = 16
PROMPTS, PREFIXES, PREFIX_LEN, SUFFIX_LEN, OUTPUT_LEN = 12, 2, 64, 16, 4
EXPECT_LOADED_PER_HOST = (PROMPTS - PREFIXES) * PREFIX_LEN // BS
EXPECT_SAVED_PER_HOST = PREFIXES * PREFIX_LEN // BS + PROMPTS * SUFFIX_LEN // BS
LABELNAMES = ["model_name", "engine"]


class Recorded:
    def __init__(self, eng, per_step):
        self.eng = eng
        self.per_step = per_step  # SchedulerStats of every step that carried connector stats
        self.vllm_config = eng.scheduler.vllm_config
        self.model = self.vllm_config.model_config.served_model_name

    def host_totals(self, host):
        return self.eng.connectors[host].worker.totals

    def labels(self, host, engine="0"):
        return {"model_name": self.model, "engine": engine, "host": str(host)}


def run_recorded(faults=None, stats_dir=None):
    from tpuoffload.sim.engine import EngineSpec, InProcessEngine, run_waves
    from tpuoffload.sim.workload import prefix_repetition

    eng = InProcessEngine(EngineSpec(num_hosts=2, block_size=BS,
                                     extra_config={"cpu_bytes_to_use": 1 << 22, "stats_dir": stats_dir,
                                                   "stats_interval_s": 0.0}), faults=faults)
    per_step = []
    update = eng.scheduler.update_from_output

    def recording_update(scheduler_output, model_runner_output):
        outputs = update(scheduler_output, model_runner_output)
        for eco in outputs.values():
            if eco.scheduler_stats is not None and eco.scheduler_stats.kv_connector_stats:
                per_step.append(eco.scheduler_stats)
        return outputs

    eng.scheduler.update_from_output = recording_update
    requests = prefix_repetition(PROMPTS, PREFIXES, PREFIX_LEN, SUFFIX_LEN, OUTPUT_LEN, seed=1, block_size=BS)
    run_waves(eng, [requests[:PREFIXES], requests[PREFIXES:]])
    assert len(eng.finished) == PROMPTS and eng.mismatches() == 0
    return Recorded(eng, per_step)


@pytest.fixture(scope="module")
def recorded():
    rec = run_recorded()
    try:
        yield rec
    finally:
        rec.eng.close()


def _unregister_vllm_collectors():
    for collector in list(REGISTRY._collector_to_names):
        if getattr(collector, "_name", "").startswith("vllm:"):
            REGISTRY.unregister(collector)


@pytest.fixture
def clean_registry():
    """Every test registers vLLM metrics in the process-wide REGISTRY: start clean, and remove
    them afterwards so the next test (or another test file) can register them again."""
    _unregister_vllm_collectors()
    yield REGISTRY
    _unregister_vllm_collectors()


def make_prom(rec, engines=(0,)):
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

    return KVConnectorProm(rec.vllm_config, LABELNAMES, {e: [rec.model, str(e)] for e in engines})


def value(name, labels):
    return REGISTRY.get_sample_value(name, labels)


# ============================================================================ values
def test_per_step_stats_match_every_host(recorded, clean_registry):
    prom = make_prom(recorded)
    assert isinstance(prom.prom_metrics, OffloadPromMetrics)  # vLLM asked the connector class
    assert len(recorded.per_step) >= 4  # stats arrived over several steps, not in one lump
    for stats in recorded.per_step:
        prom.observe(stats.kv_connector_stats, 0)

    for host in (0, 1):
        totals = recorded.host_totals(host)
        labels = recorded.labels(host)
        assert value("vllm:tpuoffload_chunks_loaded_total", labels) == totals["chunks_loaded"] == EXPECT_LOADED_PER_HOST
        assert value("vllm:tpuoffload_chunks_saved_total", labels) == totals["chunks_saved"] == EXPECT_SAVED_PER_HOST
        assert value("vllm:tpuoffload_loaded_bytes_total", labels) == totals["bytes_loaded"] > 0
        assert value("vllm:tpuoffload_saved_bytes_total", labels) == totals["bytes_saved"] > 0
        assert value("vllm:tpuoffload_save_seconds_total", labels) == pytest.approx(totals["save_seconds"])
        assert value("vllm:tpuoffload_load_seconds_total", labels) == pytest.approx(totals["load_seconds"])
        assert value("vllm:tpuoffload_save_failures_total", labels) is None  # never incremented
        # A worker only reports what it did: no scheduler counter under a host label.
        assert value("vllm:tpuoffload_hit_tokens_total", labels) is None

    sched = recorded.eng.offload.totals
    labels = recorded.labels("sched")
    assert value("vllm:tpuoffload_hit_tokens_total", labels) == sched["hit_tokens"] == EXPECT_LOADED_PER_HOST * BS
    assert value("vllm:tpuoffload_lookup_tokens_total", labels) == sched["lookup_tokens"] == PROMPTS * (PREFIX_LEN + SUFFIX_LEN)
    assert value("vllm:tpuoffload_saves_issued_total", labels) == sched["saves_issued"] == EXPECT_SAVED_PER_HOST
    assert value("vllm:tpuoffload_ledger_confirmed_total", labels) == sched["ledger_confirmed"] == EXPECT_SAVED_PER_HOST
    assert value("vllm:tpuoffload_chunks_loaded_total", labels) is None

    # And the slice-wide sum is what vLLM's own merged stats say.
    reduced = recorded.eng.stats.reduce()
    for counter in ("chunks_loaded", "chunks_saved", "bytes_loaded", "bytes_saved"):
        assert sum(value(metric_name(counter), recorded.labels(h)) for h in (0, 1)) == reduced[counter]


def test_merged_stats_give_the_same_values(recorded, clean_registry):
    """The stats merged over the run (KVConnectorLogging's accumulation) observed once equal the
    per-step observations: each report is counted exactly once either way."""
    prom = make_prom(recorded, engines=(0, 1))
    for stats in recorded.per_step:
        prom.observe(stats.kv_connector_stats, 0)
    prom.observe(recorded.eng.stats.data, 1)
    for counter in ("chunks_loaded", "bytes_saved", "save_seconds"):
        for host in (0, 1):
            v0 = value(metric_name(counter), recorded.labels(host, engine="0"))
            v1 = value(metric_name(counter), recorded.labels(host, engine="1"))
            assert v0 == pytest.approx(v1) and v0 > 0
    assert value("vllm:tpuoffload_hit_tokens_total", recorded.labels("sched", engine="1")) == \
        recorded.eng.offload.totals["hit_tokens"]


def test_through_vllm_prometheus_stat_logger(recorded, clean_registry):
    """vLLM's PrometheusStatLogger.record, as the engine calls it, ends in the same series."""
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    logger = PrometheusStatLogger(recorded.vllm_config, [0])
    for stats in recorded.per_step:
        logger.record(scheduler_stats=stats, iteration_stats=None, engine_idx=0)
    for host in (0, 1):
        assert value("vllm:tpuoffload_chunks_loaded_total", recorded.labels(host)) == \
            recorded.host_totals(host)["chunks_loaded"]
    assert value("vllm:tpuoffload_hit_tokens_total", recorded.labels("sched")) == \
        recorded.eng.offload.totals["hit_tokens"]
    text = generate_latest(REGISTRY).decode()
    line = (f'vllm:tpuoffload_chunks_loaded_total{{engine="0",host="0",model_name="{recorded.model}"}} '
            f'{float(EXPECT_LOADED_PER_HOST)}')
    assert line in text.splitlines()


# ============================================================================ names
def test_metric_names_follow_vllm_convention(recorded, clean_registry):
    prom = make_prom(recorded)
    for stats in recorded.per_step:
        prom.observe(stats.kv_connector_stats, 0)
    families = {f.name: f for f in REGISTRY.collect() if f.name.startswith("vllm:tpuoffload")}
    # prometheus_client names a counter family without _total; its samples carry it.
    # Each half reports only the counters the registry gives it.
    by_source: dict[str, set[str]] = {}
    for stats in recorded.per_step:
        for key in stats.kv_connector_stats:
            source, _, name = key.split("|")
            by_source.setdefault(source, set()).add(name)
    assert by_source.pop("sched") <= set(C.SCHEDULER_NAMES)
    assert by_source and all(names <= set(C.WORKER_NAMES) for names in by_source.values())
    # Every registered counter (tpuoffload.counters) is a series, with the registry's meaning.
    assert {name + "_total" for name in families} == {metric_name(c) for c in C.NAMES}
    assert len(families) == len(C.NAMES)
    assert all(families[metric_name(c)[:-len("_total")]].documentation == C.doc(c) for c in C.NAMES)
    for fam in families.values():
        assert fam.type == "counter" and fam.documentation
        for sample in fam.samples:
            assert sample.name.startswith("vllm:tpuoffload_")
            assert sample.name.endswith(("_total", "_created"))
            assert set(sample.labels) == {"model_name", "engine", "host"}
    names = {s.name for fam in families.values() for s in fam.samples if s.name.endswith("_total")}
    assert {"vllm:tpuoffload_saved_bytes_total", "vllm:tpuoffload_loaded_bytes_total",
            "vllm:tpuoffload_chunks_loaded_total", "vllm:tpuoffload_chunks_saved_total",
            "vllm:tpuoffload_save_seconds_total", "vllm:tpuoffload_hit_tokens_total"} <= names
    assert all("bytes" not in n or n.endswith("_bytes_total") for n in names)
    assert metric_name("bytes_saved") == "vllm:tpuoffload_saved_bytes_total"


def test_duplicate_registration_needs_unregister(recorded, clean_registry):
    prom = make_prom(recorded)
    prom.observe(recorded.per_step[0].kv_connector_stats, 0)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        make_prom(recorded)
    _unregister_vllm_collectors()
    make_prom(recorded)  # registers again, from zero
    assert value("vllm:tpuoffload_chunks_saved_total", recorded.labels(0)) is None


def test_observe_skips_what_it_cannot_use(recorded, clean_registry):
    """observe runs in vLLM's stats logger: odd input is ignored, never raised."""
    prom = make_prom(recorded)
    prom.observe({"0|1|chunks_loaded": 5, "garbage": 3, "0|2|not_a_counter": 4, "1|1|chunks_loaded": 0,
                  "1|2|chunks_loaded": -2, "1|3|chunks_loaded": "7", "1|4|chunks_loaded": True,
                  "sched|1|hit_tokens": 16}, 0)
    assert value("vllm:tpuoffload_chunks_loaded_total", recorded.labels(0)) == 5
    assert value("vllm:tpuoffload_chunks_loaded_total", recorded.labels(1)) is None
    assert value("vllm:tpuoffload_hit_tokens_total", recorded.labels("sched")) == 16


# ============================================================================ failures
class FailSaves(FaultInjector):
    """A host whose copies into host RAM all fail (raised on its background save thread)."""

    def hit(self, point: FaultPoint, n: int) -> set[int]:
        if point is FaultPoint.SAVE_RECORD:
            raise OSError("injected: host RAM write failed")
        return set()


def test_failed_saves_reach_prometheus_and_the_table(clean_registry, tmp_path, capsys):
    rec = run_recorded(faults=[None, FailSaves()], stats_dir=str(tmp_path))
    try:
        prom = make_prom(rec)
        for stats in rec.per_step:
            prom.observe(stats.kv_connector_stats, 0)
        sched = rec.eng.offload.totals
        issued = sched["saves_issued"]
        assert issued >= EXPECT_SAVED_PER_HOST
        # Host 1 failed every save the scheduler issued; host 0 completed them all.
        assert rec.host_totals(1)["save_failures"] == issued
        assert value("vllm:tpuoffload_save_failures_total", rec.labels(1)) == issued
        assert value("vllm:tpuoffload_chunks_saved_total", rec.labels(1)) is None
        assert value("vllm:tpuoffload_save_failures_total", rec.labels(0)) is None
        assert value("vllm:tpuoffload_chunks_saved_total", rec.labels(0)) == rec.host_totals(0)["chunks_saved"] == issued
        # So the scheduler dropped every save: none was ever loadable, nothing was loaded.
        assert value("vllm:tpuoffload_ledger_failed_total", rec.labels("sched")) == sched["ledger_failed"] == issued
        assert value("vllm:tpuoffload_hit_tokens_total", rec.labels("sched")) is None
        assert value("vllm:tpuoffload_chunks_loaded_total", rec.labels(0)) is None
        assert value("vllm:tpuoffload_lookup_tokens_total", rec.labels("sched")) == PROMPTS * (PREFIX_LEN + SUFFIX_LEN)

        # tpuoffload stats shows the same failures: host 1's failed saves, the scheduler's dropped ones.
        assert cli_main(["stats", str(tmp_path), "--json"]) == 0  # failures alone flag no host
        rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["hosts"]}
        assert (rows["host 0"]["failed"], rows["host 1"]["failed"], rows["scheduler"]["failed"]) == (0, issued, issued)
        assert (rows["host 0"]["saved"], rows["host 1"]["saved"]) == (issued, 0)
    finally:
        rec.eng.close()
