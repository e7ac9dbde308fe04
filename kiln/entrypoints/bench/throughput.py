"""`kiln bench throughput`: offline throughput through Runtime.generate (no HTTP), all requests at once."""

from __future__ import annotations

import time
from typing import Any

from kiln.entrypoints.bench.datasets import BenchRequest


def run_throughput(runtime: Any, requests: list[BenchRequest], *, temperature: float = 1.0,
                   ignore_eos: bool = True, seed: int = 0) -> dict[str, Any]:
    """Fixed output lengths (ignore_eos) by default, as vLLM's throughput benchmark does."""
    from kiln import SamplingParams

    params = [SamplingParams(max_tokens=r.output_len, temperature=temperature, ignore_eos=ignore_eos,
                             seed=seed + i if temperature > 0 else None) for i, r in enumerate(requests)]
    # one short request first: first-step costs (allocations, lazy initialisation) are not throughput
    runtime.generate([requests[0].prompt], SamplingParams(max_tokens=2, ignore_eos=True))
    start = time.perf_counter()
    outputs = runtime.generate([r.prompt for r in requests], params)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(o.num_prompt_tokens for o in outputs)
    output_tokens = sum(o.num_completion_tokens for o in outputs)
    return {
        "num_requests": len(outputs), "elapsed_s": elapsed, "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens, "request_throughput": len(outputs) / elapsed,
        "total_token_throughput": (prompt_tokens + output_tokens) / elapsed,
        "output_throughput": output_tokens / elapsed,
        "preemptions": runtime.engine.scheduler.num_preemptions,
    }


def format_result(result: dict[str, Any]) -> str:
    width = 50
    rows = [("Requests:", result["num_requests"]), ("Elapsed (s):", result["elapsed_s"]),
            ("Prompt tokens:", result["prompt_tokens"]), ("Output tokens:", result["output_tokens"]),
            ("Request throughput (req/s):", result["request_throughput"]),
            ("Total token throughput (tok/s):", result["total_token_throughput"]),
            ("Output token throughput (tok/s):", result["output_throughput"]),
            ("Preemptions:", result["preemptions"])]
    lines = [" Offline Throughput Result ".center(width, "=")]
    for name, value in rows:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{name:<40}{text:>10}")
    lines.append("=" * width)
    return "\n".join(lines)
