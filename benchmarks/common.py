"""Small helpers shared by the benchmark scripts: tables, environment stamp."""

from __future__ import annotations

import datetime
import platform
import random
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kiln import SamplingParams


def stamp() -> str:
    """Date, device and commit, printed above every table so results can be filed as measured."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=False).stdout.strip() or "?"
    except OSError:
        commit = "?"
    if torch.cuda.is_available():
        device = torch.cuda.get_device_name()
    else:
        device = f"CPU ({platform.processor() or 'x86_64'}, {torch.get_num_threads()} threads)"
    return f"{datetime.date.today().isoformat()} | {device} | torch {torch.__version__} | commit {commit}"


def start_decoding(engine: Any, batch: int, prompt_len: int, max_tokens: int) -> None:
    """Queue `batch` random prompts of `prompt_len` tokens (seeded by the batch size), greedy with EOS
    ignored, and step until every one has prefilled: the engine's next steps are pure decode."""
    vocab, rng = engine.loaded.spec.vocab_size, random.Random(batch)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request([rng.randrange(vocab) for _ in range(prompt_len)], params)
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in engine.scheduler.running):
        engine.step()


def decode_step_seconds(engine: Any, batch: int, prompt_len: int = 128, steps: int = 32) -> float:
    """Mean time of one engine step while `batch` requests decode (random prompts of `prompt_len` tokens)."""
    start_decoding(engine, batch, prompt_len, max_tokens=steps + 12)
    # Mean over back-to-back steps, synchronised only around the whole run: a sync before every step would
    # hide what overlapped scheduling overlaps (the host work of one step with the GPU work of the last).
    for _ in range(2):
        engine.step()
    _synchronize(engine.device)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _synchronize(engine.device)
    elapsed = time.perf_counter() - start
    while engine.has_unfinished():
        engine.step()
    return elapsed / steps


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def graphed_microseconds(fn: Callable[[int], object], calls: int = 10, replays: int = 3) -> float:
    """GPU time of one fn(i) call, i = 0..calls-1 captured into one CUDA graph and replayed: what the call costs
    inside kiln's graphed steps, without the host's launch overhead. fn(0) runs first (compiles, allocations)."""
    fn(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    del graph
    return start.elapsed_time(end) * 1e3 / (calls * replays)
