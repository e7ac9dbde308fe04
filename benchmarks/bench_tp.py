"""Tensor parallelism on one host: the all-reduce kernels, then decode at default settings, TP=1 against TP=N.

    python -m benchmarks.bench_tp --json tp.json                        # 2 GPUs (H200 x2): ~12 min cold
    python -m benchmarks.bench_tp --parts decode --configs llama3-8b:1 llama3-8b:2 --json tp.json
    python -m benchmarks.bench_tp --parts decode --configs qwen3-30b-a3b:1 qwen3-30b-a3b:2 qwen3-30b-a3b:2:ep \
        --batches 1 64 --json tp_moe.json                                # a mixture of experts, :ep expert-parallel
    python -m benchmarks.bench_tp --device cpu --configs tiny-llama:1 tiny-llama:2 --batches 1 2 \
        --json /tmp/tp.json                                              # CPU dry run (gloo)

Part `allreduce` (2 ranks): for bf16 messages of 8 KB .. 1 MB, NCCL (torch's functional all-reduce) against
one-shot and two-shot over torch symmetric memory (P2P, no multicast), each eagerly and replayed from a CUDA
graph, with ratios against NCCL; every variant's sum is checked against NCCL's. Then the all-reduce +
residual add + RMSNorm at decode shapes: NCCL or kiln's all-reduce followed by Inductor's add + norm, against
the one kernel at every shape (its bound, AllReducePolicy.fused_norm_max_bytes, is what that row decides).
The table ends with the thresholds it suggests for AllReducePolicy.

Part `decode`: one process per MODEL:TP[:ep] configuration (fresh NCCL state; a hang or crash costs one row; ":ep":
`enable_expert_parallel`, whole experts per GPU), random
weights at default settings with CUDA graphs at the capture sizes given; decode step time at each batch, sync
then async on the same runtime, next to the per-GPU floor (this rank's weight + KV bytes at the copy bandwidth
measured in the same process) and the speed-up over TP=1 of the same model; then start-up and shutdown times.
Every part runs under a time limit; the parent kills its process group on expiry. An A/B of the all-reduce
choice runs the same command with KILN_TP_ALLREDUCE=nccl in the environment.

Multi-GPU runs set NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 (NVLink
multicast can take a shared host's GPUs down); this script sets them for its children.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from benchmarks.common import decode_floor_seconds, decode_step_seconds, eager_seconds, measure_ceilings, stamp, table

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(MULTICAST_OFF)
DEFAULT_CONFIGS = ["llama3-8b:1", "llama3-8b:2", "llama3-70b:2"]
PROMPT_LEN = 128


# -- orchestration ---------------------------------------------------------------------------------------
def run_part(args: list[str], timeout_s: float) -> dict[str, Any]:
    """Run `python -m benchmarks.bench_tp <args> --out F` in its own process group; -> its JSON or the failure."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = Path(f.name)
    cmd = [sys.executable, "-m", "benchmarks.bench_tp", *args, "--out", str(out)]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env={**os.environ, **MULTICAST_OFF}, start_new_session=True)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    seconds = round(time.perf_counter() - start, 1)
    try:
        result = json.loads(out.read_text())
    except (OSError, ValueError):
        result = {"error": f"exit code {proc.returncode} after {seconds}s (no result)"}
    finally:
        out.unlink(missing_ok=True)
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # a worker left behind by a child that exited without shutdown
    except ProcessLookupError:
        pass
    result["wall_s"] = seconds
    return result


# -- decode ------------------------------------------------------------------------------------------------
def decode_child(args: argparse.Namespace) -> dict[str, Any]:
    """One MODEL:TP configuration: build the runtime, measure each batch sync then async, time the shutdown."""
    from kiln import Runtime

    model, tp, *mode = args.config.split(":")
    if mode not in ([], ["ep"]):
        raise ValueError(f"config {args.config!r}: MODEL:TP or MODEL:TP:ep")
    out: dict[str, Any] = dict(model=model, tp=int(tp), expert_parallel=bool(mode), rows=[], errors=[])
    on_gpu = args.device == "cuda"
    kwargs: dict[str, Any] = dict(device=args.device, load_format="dummy", tensor_parallel_size=int(tp),
                                  enable_expert_parallel=bool(mode), max_num_seqs=max(args.batches))
    if on_gpu:
        kwargs.update(attention_backend="triton", cudagraph_capture_sizes=tuple(args.capture_sizes))
    ceil = measure_ceilings() if on_gpu else None
    start = time.perf_counter()
    rt = Runtime(model, **kwargs)
    out["build_s"] = time.perf_counter() - start
    engine = rt.engine
    out["cudagraph_mode"] = str(engine.worker.compilation.cudagraph_mode)
    try:
        for batch in args.batches:
            for mode in ("sync", "async"):
                engine.async_scheduling = mode == "async"
                try:
                    step = decode_step_seconds(engine, batch, PROMPT_LEN if on_gpu else 16, args.steps)
                except Exception as exc:  # recorded, the other measurements still run
                    out["errors"].append(f"batch {batch} {mode}: {exc!r}")
                    continue
                row = dict(batch=batch, mode=mode, step_ms=step * 1e3, tokens_per_s=batch / step)
                if ceil is not None:
                    floor = max(decode_floor_seconds(rt, batch, ceil))
                    row.update(floor_ms=floor * 1e3, x_floor=step / floor)
                out["rows"].append(row)
                print(json.dumps(row), flush=True)
    finally:
        procs = list(engine.tp.procs) if engine.tp is not None else []  # one rank: no workers
        start = time.perf_counter()
        engine.shutdown()
        out["shutdown_s"] = time.perf_counter() - start
        out["worker_exit_codes"] = [p.exitcode for p in procs]
    return out


def print_decode(results: list[dict]) -> None:
    base = {(r["model"], row["batch"], row["mode"]): row["step_ms"] for r in results if r.get("tp") == 1
            for row in r.get("rows", [])}
    rows = []
    for r in results:
        for row in r.get("rows", []):
            ref = base.get((r["model"], row["batch"], row["mode"]))
            tp = f"{r['tp']} ep" if r.get("expert_parallel") else r["tp"]
            rows.append([r["model"], tp, r.get("cudagraph_mode"), row["batch"], row["mode"], row["step_ms"],
                         row["tokens_per_s"], row.get("floor_ms", "-"), row.get("x_floor", "-"),
                         ref / row["step_ms"] if ref else "-"])
    print(table(["model", "TP", "graphs", "batch", "sched", "step ms", "tok/s", "floor ms/GPU", "x floor",
                 "speed-up vs TP=1"], rows))
    print(table(["config", "build s", "shutdown s", "worker exit codes", "errors"],
                [[r.get("config"), r.get("build_s", "-"), r.get("shutdown_s", "-"), r.get("worker_exit_codes", "-"),
                  r.get("error", "") or "; ".join(r.get("errors", []))[:200]] for r in results]))


# -- allreduce ---------------------------------------------------------------------------------------------
SIZES_BYTES = [8 << 10, 16 << 10, 32 << 10, 64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20]
VARIANTS = ("nccl", "one_shot", "two_shot")
FUSED_SHAPES = [(1, 4096), (8, 4096), (64, 4096), (1, 8192), (8, 8192), (64, 8192)]  # tokens x hidden
CALLS_PER_GRAPH = 10


def _timed_eager(fn: Callable[[], Any], device: str) -> float:
    return eager_seconds(fn, 50 if device == "cuda" else 3, device=device)


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
    largest = max(max(SIZES_BYTES), max(t * h for t, h in FUSED_SHAPES) * torch.tensor([], dtype=dtype).element_size())
    comm = P2PAllReduce(dist.group.WORLD, AllReducePolicy("one_shot", largest, largest, largest),
                        device) if on_gpu else None
    smoke = slice(None) if on_gpu else slice(2)  # CPU: a smoke run of the first sizes only
    rows = [_size_row(nbytes, rank, device, dtype, name, comm) for nbytes in SIZES_BYTES[smoke]]
    policy_comm = None
    if on_gpu:
        from kiln.models import allreduce

        policy_comm = allreduce.setup_p2p_all_reduce(dist.group.WORLD, device)  # the default policy
    fi_norm = None
    if on_gpu:
        from kiln.models.allreduce import flashinfer_norm

        fi_norm = flashinfer_norm(dist.group.WORLD, AllReducePolicy(fused_norm_max_bytes=largest,
                                                                   fused_norm_kernel="flashinfer"), device)
    fused_rows = [_fused_row(tokens, hidden, rank, device, dtype, name, comm, fi_norm)
                  for tokens, hidden in FUSED_SHAPES[smoke]]
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


def _fused_row(tokens: int, hidden: int, rank: int, device: torch.device, dtype: torch.dtype, name: str,
               fused_comm: Any, fi_norm: Any = None) -> dict:
    """The all-reduce + add + RMSNorm three or four ways: NCCL then Inductor's add + norm, kiln's all-reduce
    (the default policy's kind for the size) then the same, the one kernel (p2p_norm.py, from `fused_comm`,
    whose fused bound covers every shape) and FlashInfer's (flashinfer_norm.py) when it is installed."""
    from kiln.models.allreduce import all_reduce_impl, nccl_all_reduce
    from kiln.passes.ops import all_reduce_add_rms_norm, rms_norm_ref

    on_gpu = device.type == "cuda"
    gen = torch.Generator(device=device).manual_seed(rank + tokens)
    partial = torch.randn(tokens, hidden, device=device, dtype=dtype, generator=gen)
    residual = torch.randn(tokens, hidden, device=device, dtype=dtype, generator=gen)
    weight = torch.ones(hidden, device=device, dtype=dtype)

    def add_norm(s: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rms_norm_ref(s + r, weight, 1e-5), s + r

    compiled = torch.compile(add_norm, dynamic=False) if on_gpu else add_norm
    arms: dict[str, Callable[[], Any]] = {
        "nccl": lambda: compiled(nccl_all_reduce(partial, name), residual),
        "kiln": lambda: compiled(all_reduce_impl(partial, name), residual),
        "fused": (lambda: fused_comm.add_rms_norm(partial, residual, weight, 1e-5)) if fused_comm is not None
        else (lambda: all_reduce_add_rms_norm(partial, residual, weight, 1e-5, name)),
    }
    if fi_norm is not None:
        arms["flashinfer"] = lambda: fi_norm(partial, residual, weight, 1e-5)
    row: dict[str, Any] = {"tokens": tokens, "hidden": hidden, "bytes": tokens * hidden * partial.element_size()}
    try:
        fused = arms["fused"]()
        if fused is None:
            raise ValueError("the fused kernel does not take this shape")
        row["max_diff"] = max((a.float() - b.float()).abs().max().item() for a, b in zip(fused, arms["nccl"]()))
        if "flashinfer" in arms:
            row["flashinfer_max_diff"] = max((a.float() - b.float()).abs().max().item()
                                             for a, b in zip(arms["flashinfer"](), arms["nccl"]()))
        for label, fn in arms.items():
            dist.barrier()
            row[f"{label}_{'graph' if on_gpu else 'eager'}_us"] = \
                (_timed_graph(fn) if on_gpu else _timed_eager(fn, device.type)) * 1e6
    except Exception as exc:  # noqa: BLE001
        row["error"] = f"{type(exc).__name__}: {exc}"[:200]
    dist.barrier()
    return row


def allreduce_child(device: str, out_path: str) -> None:
    """The all-reduce table's child: two ranks spawned, rank 0 writes the JSON."""
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
        print(f"\nall-reduce + add + RMSNorm ({key}): NCCL or kiln's all-reduce (the default policy's kind), then "
              "Inductor's add + norm, against the one kernel (p2p_norm.py); x = kiln's two steps / the kernel\n")
        print(table(["tokens", "hidden", "KB", "NCCL + add/norm us", "kiln + add/norm us", "one kernel us", "x",
                     "max diff", "FlashInfer us", "x FlashInfer / one kernel", "FlashInfer max diff"],
                    [[r["tokens"], r["hidden"], r["bytes"] >> 10, r.get(f"nccl_{key}_us", r.get("error", "-")),
                      r.get(f"kiln_{key}_us", "-"), r.get(f"fused_{key}_us", "-"),
                      r[f"kiln_{key}_us"] / r[f"fused_{key}_us"] if f"fused_{key}_us" in r else float("nan"),
                      r.get("max_diff", "-"), r.get(f"flashinfer_{key}_us", "-"),
                      r[f"fused_{key}_us"] / r[f"flashinfer_{key}_us"] if f"flashinfer_{key}_us" in r
                      else float("nan"), r.get("flashinfer_max_diff", "-")] for r in fused]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=["allreduce", "decode"], choices=["allreduce", "decode"])
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, help="MODEL:TP pairs, one process each")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--capture-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--config-timeout", type=float, default=600, help="seconds a configuration may take")
    parser.add_argument("--budget-s", type=float, default=1500, help="no new part is started after this")
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # "allreduce" or MODEL:TP
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "allreduce":
        return allreduce_child(args.device, args.out)
    if args.child:
        args.config = args.child
        Path(args.out).write_text(json.dumps(decode_child(args)))
        os._exit(0)  # a TP shutdown that left threads behind must not hold the parent's wait
    print(stamp(), flush=True)
    start = time.perf_counter()
    report: dict[str, Any] = {"stamp": stamp(), "env": MULTICAST_OFF, "allreduce": None, "decode": []}

    def save() -> None:  # after every part: a caller's time limit that ends this process keeps what ran
        report["total_s"] = round(time.perf_counter() - start, 1)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))

    if "allreduce" in args.parts:
        report["allreduce"] = run_part(["--child", "allreduce", "--device", args.device],
                                       timeout_s=120 if args.device == "cuda" else 300)
        print_allreduce(report["allreduce"])
        save()
    if "decode" in args.parts:
        common = ["--device", args.device, "--steps", str(args.steps), "--batches", *map(str, args.batches),
                  "--capture-sizes", *map(str, args.capture_sizes)]
        for config in args.configs:
            left = args.budget_s - (time.perf_counter() - start)
            if left < 30:
                report["decode"].append({"config": config, "error": f"skipped: budget {args.budget_s}s spent"})
                continue
            print(f"== {config}", flush=True)
            result = run_part(["--child", config, *common], timeout_s=min(left, args.config_timeout))
            result.setdefault("config", config)
            report["decode"].append(result)
            save()
        print_decode(report["decode"])
    save()
    if args.json:
        print(f"wrote {args.json} ({report['total_s']} s)")


if __name__ == "__main__":
    main()
