"""-O0 vs -O2 on the embedded SmolLM2 (CPU, fp32, greedy): throughput, cold compile, per-step overhead.

For each level: start-up seconds and the compile phase inside it (cold: a fresh Inductor cache dir, so
every piece is really compiled), output tokens/s at batch 1 and 16 concurrent requests (best of
--repeats rounds, levels interleaved), and where a 16-request step's time goes: the compiled pieces,
attention (eager, between the pieces), the forward's own glue (dispatch + split-graph Python), and
everything outside the forward (scheduling, input preparation, sampling, detokenizing).
Usage: python -m benchmarks.bench_compile [--levels 0 2] [--max-tokens 64] [--warm-cache]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

from benchmarks.common import stamp, table
from kiln import Runtime, SamplingParams

PROMPTS = ["Explain how a steam engine works.", "Write a short poem about autumn leaves.",
           "What are the main causes of inflation?", "Describe the water cycle for a child.",
           "Give three tips for learning a new language.", "Why is the sky blue?",
           "Summarise the plot of Romeo and Juliet.", "How do vaccines train the immune system?"]


class Timer:
    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1
        return timed


def tokens_per_second(rt: Runtime, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = rt.generate(prompts, params)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def step_breakdown(rt: Runtime, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    """Milliseconds per engine step, split by where the time went (instrumented run)."""
    engine, runner = rt.engine, rt.engine.runner
    step, forward, attention, pieces = Timer(), Timer(), Timer(), Timer()
    saved_step, saved_forward, saved_attn = engine.step, runner.forward_fn, runner.backend.forward
    compiled = engine.worker.compiled
    saved_tables = []
    if compiled is not None:
        for piece in compiled.capture.runners.values():
            saved_tables.append((piece, dict(piece.compiled)))
            piece.compiled = {key: pieces.wrap(fn) for key, fn in piece.compiled.items()}
            piece.reset_dispatch()
    engine.step, runner.forward_fn = step.wrap(saved_step), forward.wrap(saved_forward)
    runner.backend.forward = attention.wrap(saved_attn)
    try:
        rt.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    finally:
        del engine.step, runner.backend.forward
        runner.forward_fn = saved_forward
        for piece, table_ in saved_tables:
            piece.compiled = table_
            piece.reset_dispatch()
    n = max(step.calls, 1)
    ms = {name: t.seconds * 1e3 / n for name, t in
          (("step", step), ("forward", forward), ("attention", attention), ("pieces", pieces))}
    ms["glue"] = ms["forward"] - ms["attention"] - ms["pieces"] if compiled is not None else float("nan")
    ms["outside"] = ms["step"] - ms["forward"]
    return ms


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--levels", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--warm-cache", action="store_true", help="keep Inductor's on-disk cache (warm start)")
    args = parser.parse_args()
    if not args.warm_cache:  # a fresh cache dir makes the compile phase a real, cold compile
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="kiln-bench-inductor-")
    runtimes, rows = {}, {}
    for level in args.levels:  # all built first: measurements below interleave the levels
        start = time.perf_counter()
        runtimes[level] = rt = Runtime(None, level=level, device="cpu", dtype="fp32",
                                       max_num_batched_tokens=args.max_num_batched_tokens)
        stats = rt.compile_stats
        rows[level] = [f"-O{level}", time.perf_counter() - start, stats.warmup_seconds, stats.dynamo_traces,
                       stats.inductor_compiles, 0.0, 0.0]
    first = runtimes[args.levels[0]]
    prompts = [first.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    batches = {1: prompts[:1], 16: (prompts * 2)[:16]}
    for rt in runtimes.values():
        rt.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0))  # first-call effects
    # Best of --repeats rounds, levels interleaved: on a shared CPU, interference only ever slows a run down
    best_ms: dict[int, dict[str, float]] = {}
    for _ in range(args.repeats):
        for level, rt in runtimes.items():
            for col, batch in ((5, 1), (6, 16)):
                rows[level][col] = max(rows[level][col], tokens_per_second(rt, batches[batch], args.max_tokens))
            ms = step_breakdown(rt, batches[16], args.max_tokens)
            if level not in best_ms or ms["step"] < best_ms[level]["step"]:
                best_ms[level] = ms
    breakdown = [[f"-O{level}", ms["step"], ms["forward"], ms["pieces"] if level else float("nan"),
                  ms["attention"], ms["glue"], ms["outside"]] for level, ms in best_ms.items()]
    for level, rt in runtimes.items():
        if rt.compile_stats.traces_after_warmup or rt.compile_stats.compiles_after_warmup:
            print(f"WARNING: -O{level} traced/compiled after warm-up: {rt.compile_stats.summary()}")
    rows = list(rows.values())
    cache = "warm" if args.warm_cache else "cold"
    print(f"\nembedded SmolLM2-135M, fp32, greedy, {args.max_tokens} output tokens/request, "
          f"max_num_batched_tokens={args.max_num_batched_tokens}, {cache} Inductor cache\n{stamp()}")
    print(table(["level", "start-up s", "compile phase s", "traces", "compiles", "tok/s batch 1",
                 "tok/s 16 concurrent"], rows))
    base = {1: rows[0][5], 16: rows[0][6]}
    for row in rows[1:]:
        print(f"{row[0]} vs {rows[0][0]}: batch 1 x{row[5] / base[1]:.2f}, 16 concurrent x{row[6] / base[16]:.2f}")
    print("\nper engine step, 16 concurrent requests (ms; glue = forward - pieces - attention)")
    print(table(["level", "step", "forward", "compiled pieces", "attention", "forward glue",
                 "outside forward"], breakdown))


if __name__ == "__main__":
    main()
