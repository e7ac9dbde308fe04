"""PyTorch TunableOp (cuBLASLt algorithm search per GEMM shape) against cuBLAS's heuristic choice, on the offline
workload at default settings, one process: a default runtime, then TunableOp enabled with tuning on while a
second default runtime builds (its warm-up and graph-capture runs meet every captured GEMM shape), tuning off
for the run itself (prefill shapes vary per step and must not tune mid-run).

    python -m benchmarks.bench_tunable --json tunable.json
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from benchmarks.bench_gpu import offline_requests, throughput_workload, timed_generate, warm_up
from benchmarks.common import stamp, table
from kiln import Runtime


def run(model: str, requests: int, tunable: bool) -> dict:
    if tunable:
        torch.cuda.tunable.enable(True)
        torch.cuda.tunable.tuning_enable(True)
        torch.cuda.tunable.set_filename("/tmp/kiln_tunableop.csv")
        torch.cuda.tunable.set_max_tuning_duration(10)
        torch.cuda.tunable.set_max_tuning_iterations(20)
    start = time.perf_counter()
    rt = Runtime(model, device="cuda", load_format="dummy", attention_backend="triton")
    build = time.perf_counter() - start
    if tunable:
        torch.cuda.tunable.tuning_enable(False)
    rng, lens = throughput_workload(requests)
    warm_up(rt, lens, rng)
    prompts, params = offline_requests(rt, lens, rng)
    timeline: dict = {}
    seconds, tokens = timed_generate(rt, prompts, params, timeline)
    row = dict(tunable=tunable, build_s=build, seconds=seconds, output_tokens_per_s=tokens / seconds,
               tuned_shapes=len(torch.cuda.tunable.get_results()) if tunable else 0, timeline=timeline)
    print(row, flush=True)
    rt.engine.shutdown()
    del rt
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = [run(args.model, args.requests, tunable) for tunable in (False, True)]
    print(stamp())
    print(table(["TunableOp", "build s", "tuned shapes", "seconds", "output tok/s", "x heuristic"],
                [[r["tunable"], r["build_s"], r["tuned_shapes"], r["seconds"], r["output_tokens_per_s"],
                  r["output_tokens_per_s"] / rows[0]["output_tokens_per_s"]] for r in rows]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"stamp": stamp(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
