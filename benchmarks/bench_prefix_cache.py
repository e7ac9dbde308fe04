"""Prefix caching on vs off: 32 requests sharing a 512-token system prompt (embedded SmolLM2 by default).

Prints mean TTFT and total time for each setting and their ratio.
Usage: python benchmarks/bench_prefix_cache.py [--model DIR|preset] [--device cpu|cuda] [--level 0]
"""

from __future__ import annotations

import argparse
import random
import time

from benchmarks.common import stamp, table
from kiln import Runtime, SamplingParams


def run(rt: Runtime, prompts: list[list[int]], max_tokens: int) -> tuple[float, float]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rt.generate([prompts[0][-8:]], SamplingParams(max_tokens=2))  # warm-up outside the shared prefix
    start = time.perf_counter()
    outs = rt.generate(prompts, params)
    total = time.perf_counter() - start
    ttft = sum(o.metrics.ttft for o in outs) / len(outs)
    return ttft, total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--level", type=int, default=0)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prefix-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--capture-sizes", type=int, nargs="*", default=None, help="CUDA graph sizes (GPU)")
    args = parser.parse_args()
    extra = {} if args.capture_sizes is None else dict(cudagraph_capture_sizes=tuple(args.capture_sizes))
    if args.device == "cuda":  # a fixed pool: the second runtime must not size itself around the first's leftovers
        extra["kv_cache_bytes"] = 8 << 30
    rows, results = [], {}
    for caching in (False, True):
        rt = Runtime(args.model, level=args.level, device=args.device, enable_prefix_caching=caching,
                     max_num_batched_tokens=2048, max_num_seqs=args.requests, **extra)
        vocab = rt.engine.loaded.spec.vocab_size
        rng = random.Random(0)
        system = [rng.randrange(100, vocab) for _ in range(args.prefix_tokens)]
        prompts = [system + [rng.randrange(100, vocab) for _ in range(rng.randint(8, 32))]
                   for _ in range(args.requests)]
        # one request first populates the cache, as a previous conversation turn would
        rt.generate([prompts[0]], SamplingParams(max_tokens=1))
        ttft, total = run(rt, prompts, args.max_tokens)
        results[caching] = (ttft, total)
        rows.append(["on" if caching else "off", ttft * 1000, total, rt.stats()["prefix_cache_hit_rate"]])
        del rt
    off, on = results[False], results[True]
    print(f"\n{args.requests} requests sharing a {args.prefix_tokens}-token prefix, {args.max_tokens} output tokens, "
          f"-O{args.level}\n{stamp()}")
    print(table(["prefix caching", "mean TTFT ms", "total s", "hit rate"], rows))
    print(f"speed-up with caching: TTFT x{off[0] / on[0]:.2f}, total x{off[1] / on[1]:.2f}")


if __name__ == "__main__":
    main()
