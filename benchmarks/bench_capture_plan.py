"""Do PIECEWISE CUDA graphs above 256 tokens pay for their capture? (issue 14: start-up)

-O2 captures every size in default_capture_sizes(512): 35 sizes up to 256 (decode batches: FULL and
PIECEWISE) and 16 more from 272 to 512 that only mixed batches (prefill chunks) use, each one PIECEWISE
capture per compiled piece. This builds one runtime at the default (512) and, in the same process, times
a mixed forward of T tokens (one request of T tokens, the capture dummy) replayed from its PIECEWISE
graphs and run from the compiled pieces without graphs (the dispatcher swapped for one whose largest
size is 256), with a device sync around each call, which charges the host's launches in full (in
serving, async scheduling overlaps them with the previous step). Also reported: the capture time and
graph memory of the whole plan, and the share of captures above 256.

    python -m benchmarks.bench_capture_plan --model llama3-8b --sizes 272 384 512 --json capture_plan.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from benchmarks.common import stamp, table


def time_forward(runner, size: int, repeats: int) -> float:
    """Median ms of one forward of the capture dummy of `size` tokens, synchronised."""
    samples = []
    for _ in range(repeats + 2):
        batch = runner.to_device(runner.dummy_shape(size, decode=False), [])
        torch.cuda.synchronize()
        start = time.perf_counter()
        runner.run_model(batch)
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--sizes", type=int, nargs="+", default=[272, 384, 512])
    parser.add_argument("--limit", type=int, default=256, help="the largest capture size of the alternative")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from kiln import Runtime
    from kiln.compiler.cuda_graphs import GraphDispatcher

    start = time.perf_counter()
    rt = Runtime(args.model, device="cuda", dtype="bf16", load_format="dummy", attention_backend="triton")
    build_s = time.perf_counter() - start
    worker = rt.engine.worker
    runner, pool = worker.runner, worker.graph_pool
    graphs = runner.graphs
    sizes = graphs.capture_sizes
    above = [s for s in sizes if s > args.limit]
    limited = GraphDispatcher(graphs.mode, [s for s in sizes if s <= args.limit], type(runner.backend).graph_support,
                              graphs.piecewise, runner.max_num_seqs)
    rows, result = [], {"stamp": stamp(), "model": args.model, "build_s": build_s, "capture_sizes": list(sizes),
                        "captures": dict(pool.stats.captures), "capture_s": pool.stats.capture_seconds,
                        "graph_memory_mib": pool.stats.memory_bytes / 2**20, "sizes_above_limit": above, "rows": []}
    for size in args.sizes:
        with torch.inference_mode():
            runner.graphs = graphs
            graphed = time_forward(runner, size, args.repeats)
            runner.graphs = limited
            plain = time_forward(runner, size, args.repeats)
            runner.graphs = graphs
        result["rows"].append({"tokens": size, "piecewise_ms": graphed, "no_graph_ms": plain})
        rows.append([size, graphed, plain, plain / graphed])
    print(f"{stamp()}\n{args.model}: {len(sizes)} capture sizes, {len(above)} above {args.limit}; captures "
          f"{dict(pool.stats.captures)} in {pool.stats.capture_seconds:.1f} s, {result['graph_memory_mib']:.0f} MiB")
    print(table(["tokens (mixed)", "PIECEWISE graph ms", "no graph ms", "no graph / graph"], rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    rt.engine.shutdown()


if __name__ == "__main__":
    main()
