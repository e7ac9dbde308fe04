"""All-reduce latency between the GPUs of this host, eager and replayed from a CUDA graph (NCCL).

Tensor-parallel decode does two all-reduces per layer on a few KB, so their latency, not bandwidth,
bounds TP decode at small batches. Run with NCCL_DEBUG=INFO to see which transport NCCL chose.

    python -m benchmarks.bench_allreduce [--world 2] [--sizes 4096 262144]
"""

from __future__ import annotations

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

REPEATS = 50


def _timed(fn, repeats: int = REPEATS) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def _rank(rank: int, world: int, port: int, sizes: list[int]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    rows = []
    for numel in sizes:
        x = torch.ones(numel, dtype=torch.bfloat16, device="cuda")
        eager = _timed(lambda x=x: dist.all_reduce(x))
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            dist.all_reduce(x)  # warm-up on the capture stream
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(10):
                dist.all_reduce(x)
        replay = _timed(graph.replay) / 10
        rows.append((numel * 2, eager * 1e6, replay * 1e6))
    if rank == 0:
        print(f"{'bytes':>10} {'eager us':>10} {'graph us':>10}   ({world} GPUs, {torch.cuda.get_device_name()})")
        for nbytes, eager_us, graph_us in rows:
            print(f"{nbytes:>10} {eager_us:>10.1f} {graph_us:>10.1f}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192, 262144], help="bf16 elements")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp.spawn(_rank, args=(args.world, port, args.sizes), nprocs=args.world)


if __name__ == "__main__":
    main()
