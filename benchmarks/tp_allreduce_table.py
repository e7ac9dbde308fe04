"""bench_tp part 1: all-reduce variants by message size (2 ranks), eager and from CUDA graphs, vs NCCL.

Every variant is timed on rank 0 after a barrier; its result is first compared with NCCL's on the same
inputs (max |diff|, 0 expected: a two-rank bf16 sum is rounded once whichever kernel computes it). On CPU
(smoke run) only the gloo functional all-reduce and the fused op's fallback run.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from benchmarks.common import table

SIZES_BYTES = [8 << 10, 16 << 10, 32 << 10, 64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20]
VARIANTS = ("nccl", "one_shot", "two_shot")
FUSED_SHAPES = [(1, 4096), (8, 4096), (64, 4096), (1, 8192), (8, 8192), (64, 8192)]  # tokens x hidden
CALLS_PER_GRAPH = 10


def _timed_eager(fn: Callable[[], Any], device: str) -> float:
    repeats = 50 if device == "cuda" else 3
    fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / repeats


def _timed_graph(fn: Callable[[], Any], repeats: int = 30) -> float:
    """Per-call time of CALLS_PER_GRAPH calls captured in one CUDA graph, replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up on the capture stream
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(CALLS_PER_GRAPH):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats / CALLS_PER_GRAPH


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _rank(rank: int, port: int, device_kind: str, out_path: str) -> None:
    from kiln.models.allreduce import AllReducePolicy, P2PAllReduce

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    on_gpu = device_kind == "cuda"
    if on_gpu:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if on_gpu else torch.device("cpu")
    dist.init_process_group("nccl" if on_gpu else "gloo", rank=rank, world_size=2,
                            device_id=device if on_gpu else None)
    name = dist.group.WORLD.group_name
    dtype = torch.bfloat16 if on_gpu else torch.float32
    comm = P2PAllReduce(dist.group.WORLD, AllReducePolicy("one_shot", max(SIZES_BYTES), max(SIZES_BYTES)),
                        device) if on_gpu else None
    smoke = slice(None) if on_gpu else slice(2)  # CPU: a smoke run of the first sizes only
    rows = [_size_row(nbytes, rank, device, dtype, name, comm) for nbytes in SIZES_BYTES[smoke]]
    policy_comm = None
    if on_gpu:
        from kiln.models import allreduce

        policy_comm = allreduce.setup_p2p_all_reduce(dist.group.WORLD, device)  # the default policy
    fused_rows = [_fused_row(tokens, hidden, rank, device, dtype, name) for tokens, hidden in FUSED_SHAPES[smoke]]
    if rank == 0:
        name_ = torch.cuda.get_device_name() if on_gpu else "cpu"
        with open(out_path, "w") as f:
            json.dump({"device": name_, "rows": rows, "fused": fused_rows,
                       "policy": repr(policy_comm.policy) if policy_comm else None}, f, indent=1)
    dist.barrier()
    os._exit(0)  # no destroy_process_group: its teardown is not what is measured, and may wait


def _size_row(nbytes: int, rank: int, device: torch.device, dtype: torch.dtype, name: str, comm: Any) -> dict:
    from kiln.models.allreduce import nccl_all_reduce

    gen = torch.Generator(device=device).manual_seed(1000 * rank + nbytes)
    x = torch.randn(nbytes // torch.tensor([], dtype=dtype).element_size(), device=device, dtype=dtype, generator=gen)
    expected = nccl_all_reduce(x, name)
    row: dict[str, Any] = {"bytes": nbytes}
    for variant in VARIANTS if comm is not None else ("nccl",):
        def call(variant: str = variant) -> torch.Tensor:
            return nccl_all_reduce(x, name) if variant == "nccl" else comm.run(x, variant)

        try:
            row[f"{variant}_max_diff"] = (call().float() - expected.float()).abs().max().item()
            dist.barrier()
            row[f"{variant}_eager_us"] = _timed_eager(call, device.type) * 1e6
            dist.barrier()
            if device.type == "cuda":
                row[f"{variant}_graph_us"] = _timed_graph(call) * 1e6
        except Exception as exc:  # noqa: BLE001 - a failing variant is a row entry, not a crash
            row[f"{variant}_error"] = f"{type(exc).__name__}: {exc}"[:200]
        dist.barrier()
    return row


def _fused_row(tokens: int, hidden: int, rank: int, device: torch.device, dtype: torch.dtype, name: str) -> dict:
    from kiln.models.allreduce import nccl_all_reduce
    from kiln.passes.ops import all_reduce_add_rms_norm, rms_norm_ref

    on_gpu = device.type == "cuda"
    gen = torch.Generator(device=device).manual_seed(rank + tokens)
    partial = torch.randn(tokens, hidden, device=device, dtype=dtype, generator=gen)
    residual = torch.randn(tokens, hidden, device=device, dtype=dtype, generator=gen)
    weight = torch.ones(hidden, device=device, dtype=dtype)

    def add_norm(s: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rms_norm_ref(s + r, weight, 1e-5), s + r

    compiled = torch.compile(add_norm, dynamic=False) if on_gpu else add_norm

    def unfused() -> tuple[torch.Tensor, torch.Tensor]:
        return compiled(nccl_all_reduce(partial, name), residual)

    def fused() -> tuple[torch.Tensor, torch.Tensor]:
        return all_reduce_add_rms_norm(partial, residual, weight, 1e-5, name)

    row: dict[str, Any] = {"tokens": tokens, "hidden": hidden, "bytes": tokens * hidden * partial.element_size()}
    try:
        row["max_diff"] = max((a.float() - b.float()).abs().max().item() for a, b in zip(fused(), unfused()))
        for label, fn in (("unfused", unfused), ("fused", fused)):
            dist.barrier()
            row[f"{label}_{'graph' if on_gpu else 'eager'}_us"] = \
                (_timed_graph(fn) if on_gpu else _timed_eager(fn, device.type)) * 1e6
    except Exception as exc:  # noqa: BLE001
        row["error"] = f"{type(exc).__name__}: {exc}"[:200]
    dist.barrier()
    return row


def allreduce_child(device: str, out_path: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp.spawn(_rank, args=(port, device, out_path), nprocs=2)


def _suggest(rows: list[dict]) -> dict[str, int]:
    """Per kind, the largest size at which it is the fastest from a graph (and exact): the thresholds for
    AllReducePolicy (one_shot_max_bytes, two_shot_max_bytes), read off this run."""
    best: dict[str, int] = {"one_shot": 0, "two_shot": 0}
    for row in rows:
        times = {v: row[f"{v}_graph_us"] for v in VARIANTS
                 if f"{v}_graph_us" in row and row.get(f"{v}_max_diff", 1) == 0}
        if times:
            winner = min(times, key=times.__getitem__)
            if winner in best:
                best[winner] = row["bytes"]
    best["two_shot"] = max(best["two_shot"], best["one_shot"])  # nothing between one-shot and two-shot
    return best


def print_allreduce(result: dict) -> None:
    if "rows" not in result:
        print(f"all-reduce table failed: {result}")
        return
    rows = result["rows"]
    mode = "graph" if any("nccl_graph_us" in r for r in rows) else "eager"
    headers = ["KB", *[f"{v} {m} us" for v in VARIANTS for m in ("eager", "graph")],
               "x one_shot (graph)", "x two_shot (graph)", "max diff vs nccl"]
    body = []
    for r in rows:
        ratio = [r["nccl_graph_us"] / r[f"{v}_graph_us"] if f"{v}_graph_us" in r and "nccl_graph_us" in r
                 else float("nan") for v in ("one_shot", "two_shot")]
        diffs = max((r.get(f"{v}_max_diff", 0.0) for v in VARIANTS), default=0.0)
        body.append([r["bytes"] >> 10, *[r.get(f"{v}_{m}_us", r.get(f"{v}_error", "-")) for v in VARIANTS
                                         for m in ("eager", "graph")], *ratio, diffs])
    print(f"\nall-reduce, 2 ranks, {result.get('device')} ({mode}); x = NCCL time / variant time (> 1: faster)\n")
    print(table(headers, body))
    if mode == "graph":
        suggested = _suggest(rows)
        print(f"suggested: one_shot up to {suggested['one_shot']} B, two_shot up to {suggested['two_shot']} B "
              f"(then NCCL); default policy: {result.get('policy')}")
    fused = result.get("fused", [])
    if fused:
        key = "graph" if any("fused_graph_us" in r for r in fused) else "eager"
        print(f"\nall-reduce + add + RMSNorm: NCCL + Inductor add/norm vs kiln::all_reduce_add_rms_norm ({key})\n")
        print(table(["tokens", "hidden", "KB", "unfused us", "fused us", "x", "max diff"],
                    [[r["tokens"], r["hidden"], r["bytes"] >> 10, r.get(f"unfused_{key}_us", r.get("error", "-")),
                      r.get(f"fused_{key}_us", "-"),
                      r[f"unfused_{key}_us"] / r[f"fused_{key}_us"] if f"fused_{key}_us" in r else float("nan"),
                      r.get("max_diff", "-")] for r in fused]))
