"""`kiln bench serve`: a load generator for any OpenAI-compatible endpoint, reporting latency percentiles.

Requests are streamed (SSE) so each content chunk is timed as it arrives: TTFT is the wait for the first
non-empty chunk, ITL the gaps between chunks, TPOT a request's (latency - TTFT) / (output tokens - 1).
Token counts come from the server's usage (stream_options.include_usage), else from the chunk count.
Arrivals are a Poisson process at --request-rate (or all at once), optionally capped by --max-concurrency.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

from kiln.entrypoints.bench.datasets import BenchRequest


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)


def _payload(req: BenchRequest, model: str, chat: bool, ignore_eos: bool, temperature: float,
             extra: dict[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "stream": True, "stream_options": {"include_usage": True},
                            "temperature": temperature}
    if chat:
        body["messages"] = [{"role": "user", "content": req.prompt}]
        body["max_completion_tokens"] = req.output_len
    else:
        body["prompt"] = req.prompt
        body["max_tokens"] = req.output_len
    if ignore_eos:
        body["ignore_eos"] = True  # a vLLM/kiln extension: fixed output lengths make runs comparable
    return {**body, **extra}


async def send_request(client: Any, url: str, payload: dict[str, Any], chat: bool,
                       headers: dict[str, str]) -> RequestResult:
    result = RequestResult()
    start = last = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {body[:300]}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if event.get("error"):
                    result.error = str(event["error"].get("message", event["error"]))
                    return result
                if event.get("usage"):
                    result.prompt_tokens = int(event["usage"].get("prompt_tokens") or 0)
                    result.output_tokens = int(event["usage"].get("completion_tokens") or 0)
                for choice in event.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    if text:
                        now = time.perf_counter()
                        if chunks == 0:
                            result.ttft = now - start
                        else:
                            result.itl.append(now - last)
                        last = now
                        chunks += 1
        result.latency = time.perf_counter() - start
        result.output_tokens = result.output_tokens or chunks
        result.ok = chunks > 0
        if not result.ok:
            result.error = "no content in the response"
    except Exception as exc:  # a failed request is a data point, not the end of the benchmark
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run_benchmark(base_url: str, endpoint: str, model: str | None, requests: list[BenchRequest], *,
                        request_rate: float = math.inf, max_concurrency: int | None = None,
                        api_key: str | None = None, ignore_eos: bool = False, temperature: float = 0.0,
                        seed: int = 0, progress: bool = True,
                        extra_body: dict[str, Any] | None = None) -> tuple[list[RequestResult], float, str]:
    """-> (per-request results in request order, benchmark seconds, model name used)."""
    import httpx
    from tqdm import tqdm

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    base = base_url.rstrip("/")
    chat = endpoint.rstrip("/").endswith("chat/completions")
    limit = max_concurrency or len(requests)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0, connect=30.0), limits=limits) as client:
        if model is None:
            try:
                listing = await client.get(f"{base}/v1/models", headers=headers)
                listing.raise_for_status()
            except httpx.HTTPError as exc:  # the CLI prints an OSError as one line
                raise OSError(f"could not list the models at {base}/v1/models: {exc or type(exc).__name__}") from exc
            model = str(listing.json()["data"][0]["id"])
        semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        bar = tqdm(total=len(requests), desc="requests", unit="req", disable=not progress)
        url = f"{base}{endpoint}"

        async def one(req: BenchRequest) -> RequestResult:
            payload = _payload(req, model or "", chat, ignore_eos, temperature, extra_body or {})
            if semaphore is None:
                result = await send_request(client, url, payload, chat, headers)
            else:
                async with semaphore:
                    result = await send_request(client, url, payload, chat, headers)
            if not result.prompt_tokens:
                result.prompt_tokens = req.prompt_len
            bar.update(1)
            return result

        rng = random.Random(seed)
        start = time.perf_counter()
        tasks = []
        for req in requests:
            tasks.append(asyncio.create_task(one(req)))
            if math.isfinite(request_rate):
                await asyncio.sleep(rng.expovariate(request_rate))  # Poisson arrivals
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
        bar.close()
    return results, duration, model


def _stats(values: list[float]) -> dict[str, float]:
    import numpy as np

    if not values:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0}
    ms = np.asarray(values) * 1000.0
    return {"mean": float(ms.mean()), "median": float(np.percentile(ms, 50)),
            "p90": float(np.percentile(ms, 90)), "p99": float(np.percentile(ms, 99))}


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    errors = sorted({r.error for r in results if not r.ok})
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "errors": errors[:5],
        "duration_s": duration, "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": total_out / duration if duration else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration else 0.0,
        "ttft_ms": _stats([r.ttft for r in ok]), "tpot_ms": _stats(tpot),
        "itl_ms": _stats([x for r in ok for x in r.itl]), "e2el_ms": _stats([r.latency for r in ok]),
    }


def format_table(summary: dict[str, Any], title: str = "Serving Benchmark Result") -> str:
    width = 50
    lines = [f" {title} ".center(width, "=")]

    def row(name: str, value: Any) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{name:<40}{text:>10}")

    row("Successful requests:", summary["completed"])
    row("Failed requests:", summary["failed"])
    row("Benchmark duration (s):", summary["duration_s"])
    row("Total input tokens:", summary["total_input_tokens"])
    row("Total generated tokens:", summary["total_output_tokens"])
    row("Request throughput (req/s):", summary["request_throughput"])
    row("Output token throughput (tok/s):", summary["output_throughput"])
    row("Total token throughput (tok/s):", summary["total_token_throughput"])
    for key, label, short in (("ttft_ms", "Time to First Token", "TTFT"), ("tpot_ms", "Time per Output Token "
                              "(excl. 1st token)", "TPOT"), ("itl_ms", "Inter-token Latency", "ITL"),
                              ("e2el_ms", "End-to-end Latency", "E2EL")):
        lines.append(f" {label} ".center(width, "-"))
        stats = summary[key]
        row(f"Mean {short} (ms):", stats["mean"])
        row(f"Median {short} (ms):", stats["median"])
        row(f"P90 {short} (ms):", stats["p90"])
        row(f"P99 {short} (ms):", stats["p99"])
    lines.append("=" * width)
    for error in summary.get("errors", []):
        lines.append(f"error: {error}")
    return "\n".join(lines)
