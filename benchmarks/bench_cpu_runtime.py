"""kiln Runtime.generate vs transformers generate on the embedded SmolLM2 (CPU, fp32, greedy).

Batch 1 and 16 concurrent requests, output tokens/s, all in one process. Every engine runs once per round,
interleaved, and the table keeps each one's best round (the spread shows how noisy the machine was).
The default row is `Runtime()` with nothing but device and dtype set: the settings a user gets.

Usage: python -m benchmarks.bench_cpu_runtime [--rounds 3] [--max-tokens 64] [--level 0 ...] [--async-ab]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from benchmarks.common import stamp, table
from kiln import Runtime, SamplingParams

PROMPTS = ["Explain how a steam engine works.", "Write a short poem about autumn leaves.",
           "What are the main causes of inflation?", "Describe the water cycle for a child.",
           "Give three tips for learning a new language.", "Why is the sky blue?",
           "Summarise the plot of Romeo and Juliet.", "How do vaccines train the immune system?"]
BATCHES = (1, 16)


def kiln_tps(rt: Runtime, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = rt.generate(prompts, params)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def hf_tps(model, tok, prompts: list[list[int]], max_tokens: int) -> float:
    width = max(len(p) for p in prompts)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left-padded
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kwargs = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=pad)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, **kwargs)
    return (out.shape[1] - width) * len(prompts) / (time.perf_counter() - start)


def kiln_engine(rt: Runtime, async_scheduling: bool | None = None) -> Callable[[list[list[int]], int], float]:
    """Runs `rt`, with async scheduling switched for the run when asked (the engine allows it between steps)."""
    def run(prompts: list[list[int]], max_tokens: int) -> float:
        engine = rt.engine
        default = engine.async_scheduling
        engine.async_scheduling = default if async_scheduling is None else async_scheduling
        try:
            return kiln_tps(rt, prompts, max_tokens)
        finally:
            engine.async_scheduling = default
    return run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--level", type=int, nargs="*", default=[], help="extra kiln rows at these -O levels")
    parser.add_argument("--async-ab", action="store_true", help="extra default-settings row with async "
                        "scheduling switched the other way")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    rt = Runtime(None, device="cpu", dtype="fp32")  # the defaults: -O2, the config's scheduling
    async_default = rt.engine.async_scheduling
    engines: dict[str, Callable[[list[list[int]], int], float]] = {
        f"kiln defaults (-O{rt.engine.config.compilation.level}, async {'on' if async_default else 'off'})":
            kiln_engine(rt)}
    if args.async_ab:
        engines[f"kiln defaults, async {'off' if async_default else 'on'}"] = kiln_engine(rt, not async_default)
    for level in args.level:
        engines[f"kiln -O{level}"] = kiln_engine(Runtime(None, level=level, device="cpu", dtype="fp32"))
    tok = rt.tokenizer
    prompts = [rt.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    batches = {b: (prompts * 2)[:b] for b in BATCHES}
    hf = AutoModelForCausalLM.from_pretrained(rt.engine.loaded.model_dir, dtype=torch.float32).eval()
    engines["transformers generate (left-padded)"] = lambda ps, n: hf_tps(hf, tok, ps, n)
    for run in engines.values():  # warm-up: first-call costs are not a round's
        run(prompts[:1], 4)
    results: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for batch, ps in batches.items():
            for name, run in engines.items():
                results.setdefault((name, batch), []).append(run(ps, args.max_tokens))
    hf_name = "transformers generate (left-padded)"
    rows = []
    for (name, batch), tps in results.items():
        rows.append([name, batch, max(tps), min(tps), max(tps) / max(results[(hf_name, batch)])])
    rows.sort(key=lambda r: (r[1], r[0] == hf_name))
    print(f"\nembedded SmolLM2-135M, fp32, greedy, {args.max_tokens} output tokens/request, best of "
          f"{args.rounds} interleaved rounds\n{stamp()}")
    print(table(["engine", "batch", "best tok/s", "worst tok/s", "x transformers (best)"], rows))


if __name__ == "__main__":
    main()
