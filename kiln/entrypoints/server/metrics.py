"""Prometheus metrics for `/metrics`: latency histograms observed per request, engine state read per scrape.

Each server gets its own registry (several servers can live in one process, e.g. in tests). Engine
counters (preemptions, prefix-cache lookups, compile statistics, graph replays) are owned by the engine
and read at scrape time by a custom collector, so the engine needs no knowledge of Prometheus.
Reading them from the HTTP thread while the engine thread writes is safe: only ints and lengths are read.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kiln.runtime.engine import Engine

# Latency buckets (seconds) follow vLLM's, so dashboards built for it read kiln's the same way.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "error")

# kiln.compiler.stats.CompileStats field -> (metric, kind, help); absent stats (eager, or an engine that does
# not expose them yet) read as zeros so dashboards and alerts need no special case.
COMPILE_FIELDS = {
    "dynamo_traces": ("kiln:compile_dynamo_traces", "counter", "Dynamo traces of the model"),
    "inductor_compiles": ("kiln:compile_inductor_compiles", "counter", "Inductor compiles of graph pieces"),
    "trace_seconds": ("kiln:compile_trace_seconds", "counter", "Seconds spent in Dynamo tracing"),
    "compile_seconds": ("kiln:compile_inductor_seconds", "counter", "Seconds spent in Inductor compiles"),
    "warmup_seconds": ("kiln:compile_warmup_seconds", "gauge", "Seconds of the start-up compile phase"),
    "traces_after_warmup": ("kiln:compile_traces_after_warmup", "counter",
                            "Dynamo traces after warm-up (a recompile while serving: should stay 0)"),
    "compiles_after_warmup": ("kiln:compile_compiles_after_warmup", "counter",
                              "Inductor compiles after warm-up (compiling while serving: should stay 0)"),
    # serve first, tune in the background (kiln/compiler/background.py): pending drops to 0 at the swap
    "background_pending": ("kiln:background_compiles_pending", "gauge",
                           "Background compiles not yet swapped in (finished or still compiling)"),
    "background_swapped": ("kiln:background_compiles_swapped", "counter", "Background compiles swapped in"),
    "background_failed": ("kiln:background_compiles_failed", "counter",
                          "Background compiles that failed (those sizes stay on their ranges)"),
}


def _compile_stats(engine: Any) -> Any:
    stats = getattr(engine, "compile_stats", None)
    if stats is None:  # until the engine re-exports it, the worker that compiled holds it
        stats = getattr(getattr(engine, "worker", None), "compile_stats", None)
    return stats


def compile_stat(engine: Any, name: str) -> float:
    stats = _compile_stats(engine)
    value = stats.get(name) if isinstance(stats, Mapping) else getattr(stats, name, None)
    return float(value) if isinstance(value, (int, float)) else 0.0


def graph_replays(engine: Any) -> dict[str, float]:
    """Replays by CUDA-graph mode, from engine.graph_replays or engine.compile_stats.graph_replays."""
    replays = getattr(engine, "graph_replays", None)
    if replays is None:
        stats = _compile_stats(engine)
        replays = stats.get("graph_replays") if isinstance(stats, Mapping) else getattr(stats, "graph_replays", None)
    if not isinstance(replays, Mapping):
        return {}
    return {str(mode): float(count) for mode, count in dict(replays).items()}


def _spec_decode_metrics(engine: Any, model_name: str) -> Iterator[Any]:
    """vLLM's speculative-decoding counters (zeros without speculation), accepted tokens also per position."""
    from prometheus_client.core import CounterMetricFamily

    spec = getattr(engine, "speculation", None)
    stats = spec.stats.as_dict() if spec is not None else {}
    for key, doc in (("spec_decode_num_drafts", "Verify steps of requests with proposals"),
                     ("spec_decode_num_draft_tokens", "Speculative tokens proposed"),
                     ("spec_decode_num_accepted_tokens", "Speculative tokens accepted")):
        family = CounterMetricFamily(f"kiln:{key}", doc, labels=["model_name"])
        family.add_metric([model_name], float(stats.get(key, 0)))
        yield family
    per_pos = CounterMetricFamily("kiln:spec_decode_num_accepted_tokens_per_pos",
                                  "Speculative tokens accepted, by position in the proposal",
                                  labels=["model_name", "position"])
    for position, count in enumerate(stats.get("spec_decode_num_accepted_tokens_per_pos", [])):
        per_pos.add_metric([model_name, str(position)], float(count))
    yield per_pos


class _EngineCollector:
    def __init__(self, engine: Engine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        from kiln.runtime.startup import PHASES

        engine, labels = self.engine, [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        scheduler, kv, pool = engine.scheduler, engine.kv, engine.pool
        yield gauge("kiln:num_requests_running", "Sequences in the running batch", len(scheduler.running))
        yield gauge("kiln:num_requests_waiting", "Sequences waiting to be scheduled", len(scheduler.waiting))
        yield gauge("kiln:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full)", pool.usage())
        yield gauge("kiln:kv_cache_free_blocks", "Free KV blocks (cached prefixes included)", pool.num_free)
        yield gauge("kiln:kv_cache_total_blocks", "Usable KV blocks", pool.num_usable)
        yield counter("kiln:num_preemptions", "Preemptions (recompute)", scheduler.num_preemptions)
        yield counter("kiln:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", kv.queries)
        yield counter("kiln:prefix_cache_hits", "Prompt tokens found in the prefix cache", kv.hits)
        yield gauge("kiln:prefix_cache_hit_rate", "Prefix-cache hits / queries (tokens, since start)",
                    kv.hits / kv.queries if kv.queries else 0.0)
        stats = engine.stats
        yield counter("kiln:prompt_tokens", "Prompt tokens admitted", stats.prompt_tokens)
        yield counter("kiln:generation_tokens", "Tokens generated", stats.generation_tokens)
        yield counter("kiln:engine_steps", "Engine steps run", stats.steps)
        yield from _spec_decode_metrics(engine, self.model_name)
        for field_name, (metric, kind, doc) in COMPILE_FIELDS.items():
            make = counter if kind == "counter" else gauge
            yield make(metric, doc, compile_stat(engine, field_name))
        times = getattr(engine, "startup_times", None)
        if times is not None:  # fixed once the engine is ready: gauges, so a restart is a new value, not a reset
            phases = GaugeMetricFamily("kiln:startup_seconds", "Seconds of each start-up phase, engine start to ready",
                                       labels=["model_name", "phase"])
            for phase in (*PHASES, "other"):  # `other`: what no phase covers, so they sum to the total
                phases.add_metric([self.model_name, phase], float(getattr(times, phase)))
            yield phases
            yield gauge("kiln:startup_total_seconds", "Seconds from the engine's start to ready (the phases' sum)",
                        float(times.total))
        replays = CounterMetricFamily("kiln:cudagraph_replays", "CUDA graph replays by mode",
                                      labels=["model_name", "mode"])
        for mode, count in sorted({"FULL": 0.0, "PIECEWISE": 0.0, "NONE": 0.0, **graph_replays(engine)}.items()):
            replays.add_metric([self.model_name, mode], count)
        yield replays


class ServerMetrics:
    def __init__(self, engine: Engine, model_name: str) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        label = ["model_name"]
        self._finished = Counter("kiln:request_success", "Finished completions by reason",
                                 ["model_name", "finished_reason"], registry=self.registry)
        for reason in FINISH_REASONS:  # export zeros so rate() works before the first event
            self._finished.labels(model_name, reason)
        self._ttft = Histogram("kiln:time_to_first_token_seconds", "Arrival to first token",
                               label, buckets=TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self._itl = Histogram("kiln:inter_token_latency_seconds", "Time between consecutive outputs",
                              label, buckets=ITL_BUCKETS, registry=self.registry).labels(model_name)
        self._e2e = Histogram("kiln:e2e_request_latency_seconds", "Arrival to finish",
                              label, buckets=E2E_BUCKETS, registry=self.registry).labels(model_name)
        self._http_errors = Counter("kiln:http_errors", "Requests answered with an error, by status",
                                    ["model_name", "status"], registry=self.registry)
        for status in ("400", "401", "404", "500", "503"):
            self._http_errors.labels(model_name, status)
        self.registry.register(_EngineCollector(engine, model_name))

    # called from the engine thread (prometheus_client metrics are thread-safe)
    def observe_ttft(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        self._itl.observe(seconds)

    def observe_finished(self, reasons: list[str], e2e_seconds: float) -> None:
        for reason in reasons:
            self._finished.labels(self.model_name, reason).inc()
        self._e2e.observe(e2e_seconds)

    def observe_error(self, status: int) -> None:
        self._http_errors.labels(self.model_name, str(status)).inc()

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
