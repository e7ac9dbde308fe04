"""/metrics parses with prometheus-client's own parser, and the counters move with the traffic."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.entrypoints.server.conftest import MODEL, Served

pytestmark = pytest.mark.slow


def scrape(served: Served) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    resp = httpx.get(f"{served.url}/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(resp.text) for s in family.samples}


def value(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return samples[(name, frozenset({"model_name": MODEL, **labels}.items()))]


def test_metrics_parse_and_move(served: Served) -> None:
    before = scrape(served)
    for name in ("kiln:num_requests_running", "kiln:num_requests_waiting", "kiln:kv_cache_usage_perc",
                 "kiln:num_preemptions_total", "kiln:prefix_cache_hit_rate", "kiln:prefix_cache_queries_total",
                 "kiln:compile_dynamo_traces_total", "kiln:compile_inductor_compiles_total",
                 "kiln:compile_inductor_seconds_total", "kiln:compile_compiles_after_warmup_total",
                 "kiln:compile_traces_after_warmup_total", "kiln:time_to_first_token_seconds_count"):
        assert (name, frozenset({"model_name": MODEL}.items())) in before, name
    assert value(before, "kiln:cudagraph_replays_total", mode="FULL") == 0

    client = served.openai()
    out = client.completions.create(model=MODEL, prompt="Counting: one, two,", max_tokens=3, temperature=0,
                                    extra_body={"ignore_eos": True})
    list(client.completions.create(model=MODEL, prompt="Counting: one, two,", max_tokens=3, temperature=0,
                                   stream=True, extra_body={"ignore_eos": True}))
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", temperature=-1)
    served.wait_idle()
    after = scrape(served)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("kiln:request_success_total", finished_reason="length") == 2
    assert moved("kiln:request_success_total", finished_reason="abort") == 0
    assert moved("kiln:time_to_first_token_seconds_count") == 2
    assert moved("kiln:inter_token_latency_seconds_count") == 4  # 3 tokens: 2 gaps, per request
    assert moved("kiln:e2e_request_latency_seconds_count") == 2
    assert moved("kiln:generation_tokens_total") == 6
    assert moved("kiln:prompt_tokens_total") == 2 * out.usage.prompt_tokens
    assert moved("kiln:prefix_cache_queries_total") == 2 * out.usage.prompt_tokens
    assert moved("kiln:http_errors_total", status="400") == 1
    assert value(after, "kiln:num_requests_running") == 0 and value(after, "kiln:num_requests_waiting") == 0
    assert 0.0 <= value(after, "kiln:kv_cache_usage_perc") <= 1.0
    assert 0.0 <= value(after, "kiln:prefix_cache_hit_rate") <= 1.0
    assert value(after, "kiln:kv_cache_free_blocks") == value(after, "kiln:kv_cache_total_blocks")


def test_engine_counters_are_read_at_scrape_time(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    """Preemptions, compile statistics and graph replays come from the engine whenever it exposes them."""
    from kiln.compiler.stats import CompileStats

    engine = served.engine
    monkeypatch.setattr(engine.scheduler, "num_preemptions", 7)
    stats = CompileStats(level=2, dynamo_traces=1, inductor_compiles=5, compile_seconds=12.5,
                         compiles_after_warmup=2)
    monkeypatch.setattr(engine, "compile_stats", stats, raising=False)
    monkeypatch.setattr(type(engine), "graph_replays", property(lambda self: {"FULL": 40, "PIECEWISE": 3}))
    samples = scrape(served)
    assert value(samples, "kiln:num_preemptions_total") == 7
    assert value(samples, "kiln:compile_dynamo_traces_total") == 1
    assert value(samples, "kiln:compile_inductor_compiles_total") == 5
    assert value(samples, "kiln:compile_inductor_seconds_total") == 12.5
    assert value(samples, "kiln:compile_compiles_after_warmup_total") == 2
    assert value(samples, "kiln:cudagraph_replays_total", mode="FULL") == 40
    assert value(samples, "kiln:cudagraph_replays_total", mode="PIECEWISE") == 3


def test_start_up_phases_and_pending_background_compiles(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    """The start-up gauges are the engine's own record (as in `Runtime.compile_stats.startup`), and the
    pending background-compile gauge is read from the live compile statistics at each scrape."""
    from kiln.runtime.startup import PHASES

    engine = served.engine
    times = engine.startup_times
    samples = scrape(served)
    for phase in (*PHASES, "other"):
        assert value(samples, "kiln:startup_seconds", phase=phase) == pytest.approx(getattr(times, phase))
    assert value(samples, "kiln:startup_total_seconds") == pytest.approx(times.total)
    phases = [value(samples, "kiln:startup_seconds", phase=p) for p in (*PHASES, "other")]
    assert sum(phases) == pytest.approx(times.total)
    assert value(samples, "kiln:startup_seconds", phase="load") >= engine.loaded.load_seconds > 0
    assert engine.worker.compile_stats.startup == pytest.approx(times.as_dict())
    # a start with background compiles: pending until the step-boundary swap sets it to 0 (background.py)
    stats = engine.worker.compile_stats
    assert value(samples, "kiln:background_compiles_pending") == stats.background_pending == 0
    monkeypatch.setattr(stats, "background_pending", 3)
    assert value(scrape(served), "kiln:background_compiles_pending") == 3
    monkeypatch.setattr(stats, "background_pending", 0)
    monkeypatch.setattr(stats, "background_swapped", 3)
    after = scrape(served)
    assert value(after, "kiln:background_compiles_pending") == 0
    assert value(after, "kiln:background_compiles_swapped_total") == 3
    assert value(after, "kiln:background_compiles_failed_total") == 0


def test_speculative_decoding_counters() -> None:
    """vLLM's spec-decode counters, read from the engine's speculation stats (zeros without speculation)."""
    from types import SimpleNamespace

    from kiln.entrypoints.server.metrics import _spec_decode_metrics
    from kiln.runtime.spec_decode.decoder import SpecDecodeStats

    def samples(engine) -> dict:
        return {(s.name, frozenset(s.labels.items())): s.value
                for family in _spec_decode_metrics(engine, MODEL) for s in family.samples}

    stats = SpecDecodeStats(num_drafts=3, num_draft_tokens=12, num_accepted_tokens=7, accepted_per_pos=[3, 2, 1, 1])
    got = samples(SimpleNamespace(speculation=SimpleNamespace(stats=stats)))
    assert value(got, "kiln:spec_decode_num_draft_tokens_total") == 12
    assert value(got, "kiln:spec_decode_num_accepted_tokens_total") == 7
    assert [value(got, "kiln:spec_decode_num_accepted_tokens_per_pos_total", position=str(j)) for j in range(4)] == \
        [3, 2, 1, 1]
    assert value(samples(SimpleNamespace(speculation=None)), "kiln:spec_decode_num_draft_tokens_total") == 0
