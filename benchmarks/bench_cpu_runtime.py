"""kiln Runtime.generate vs transformers generate on the embedded SmolLM2 (CPU, fp32, greedy).

Batch 1 and 16 concurrent requests; output tokens/s for both, measured in the same process.
Usage: python benchmarks/bench_cpu_runtime.py [--level 0] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import stamp, table
from kiln import Runtime, SamplingParams

PROMPTS = ["Explain how a steam engine works.", "Write a short poem about autumn leaves.",
           "What are the main causes of inflation?", "Describe the water cycle for a child.",
           "Give three tips for learning a new language.", "Why is the sky blue?",
           "Summarise the plot of Romeo and Juliet.", "How do vaccines train the immune system?"]


def kiln_tps(rt: Runtime, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rt.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    start = time.perf_counter()
    outs = rt.generate(prompts, params)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def hf_tps(model, tok, prompts: list[list[int]], max_tokens: int) -> float:
    tok.padding_side = "left"
    width = max(len(p) for p in prompts)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kwargs = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=pad)
    model.generate(ids[:1, -4:], attention_mask=mask[:1, -4:], max_new_tokens=2, do_sample=False, pad_token_id=pad)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, **kwargs)
    return (out.shape[1] - width) * len(prompts) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--level", type=int, nargs="+", default=[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    rows = []
    hf_rt = None
    for level in args.level:
        rt = Runtime(None, level=level, device="cpu", dtype="fp32")
        tok = rt.tokenizer
        prompts = [rt.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
        batches = {1: prompts[:1], 16: (prompts * 2)[:16]}
        for batch, ps in batches.items():
            rows.append([f"kiln -O{level}", batch, kiln_tps(rt, ps, args.max_tokens)])
        hf_rt = hf_rt or (rt.engine.loaded.model_dir, tok, batches)
    model_dir, tok, batches = hf_rt
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf_rows = {b: hf_tps(hf, tok, ps, args.max_tokens) for b, ps in batches.items()}
    rows += [["transformers generate", b, t] for b, t in hf_rows.items()]
    for row in rows:
        row.append(row[2] / hf_rows[row[1]])
    print(f"\nembedded SmolLM2-135M, fp32, greedy, {args.max_tokens} output tokens/request\n{stamp()}")
    print(table(["engine", "batch", "output tok/s", "x transformers"], rows))


if __name__ == "__main__":
    main()
