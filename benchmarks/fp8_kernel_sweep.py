"""The FP8 kernel table of bench_fp8 (`--parts kernels`): bf16 torch.mm, `_scaled_mm` and kiln's Triton FP8 GEMM
at a handful of tile configs, per projection and decode M, against the weight-bytes floor at the copy
bandwidth measured in the same run. The lead picks `fp8_kernel.TUNED` from one H200 run of it.

Timing: each measurement is one CUDA graph of GRAPH_CALLS GEMMs, replayed REPLAYS times (launch overhead
out of the way, as in the CUDA-graphed decode step). The calls rotate over enough copies of the weight to
exceed L2 (50 MB on an H200), so no GEMM finds its weight cached, as in a decode step where each layer has
its own. On CPU (the dry run) the Triton kernel runs under the interpreter and times are wall clock.
"""

from __future__ import annotations

import math
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from kiln.models.quant.fp8 import quantize_per_token, quantize_weight
from kiln.models.quant.fp8_gemm import scaled_mm

KERNEL_M = (1, 2, 4, 8, 16, 32, 64)
GRAPH_CALLS = 24
REPLAYS = 8
ROTATE_BYTES = 256 << 20  # > L2, so each call streams its weight from HBM
SPLITS = (1, 2, 4, 8)


def candidate_tiles() -> list[Any]:
    """(block_n, block_k, num_warps, num_stages) tiles of the sweep; each is tried at every split in SPLITS."""
    from kiln.models.quant.fp8_kernel import Fp8GemmConfig

    return [Fp8GemmConfig(64, 256, 1, 4, 4), Fp8GemmConfig(64, 128, 1, 4, 6), Fp8GemmConfig(128, 256, 1, 4, 3),
            Fp8GemmConfig(128, 128, 1, 8, 4), Fp8GemmConfig(32, 256, 1, 4, 4)]


def graph_time_us(calls: list[Callable[[], Any]], device: str) -> float:
    """Mean microseconds per call, the calls run in turn inside one replayed CUDA graph (CPU: wall clock)."""
    for fn in calls:  # warm-up: compiles Triton kernels, picks cuBLAS algorithms
        fn()
    if device != "cuda":
        start = time.perf_counter()
        for fn in calls:
            fn()
        return (time.perf_counter() - start) / len(calls) * 1e6
    n = len(calls) * math.ceil(GRAPH_CALLS / len(calls))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(n):
            calls[i % len(calls)]()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    us = start.elapsed_time(end) * 1e3 / (REPLAYS * n)
    del graph
    return us


def copy_gb_per_s(device: str) -> float:
    """Device-to-device copy bandwidth (read + write bytes per second), the floor's yardstick: on a GPU the one
    every other benchmark uses (bench_gpu.measure_ceilings; a graphed uint8 copy read 2.7 TB/s on the H200
    where that bf16 copy reads 4.25), on the CPU dry run a wall-clock copy."""
    if device == "cuda":
        from benchmarks.bench_gpu import measure_ceilings

        return measure_ceilings().copy_bytes_per_s / 1e9
    size = 64 << 20
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = graph_time_us([lambda: dst.copy_(src)], device)
    return 2 * size / us / 1e3


def candidate_bf16_tiles() -> list[Any]:
    """The 16-bit operand tiles: the FP8 ones with half the K tile (the same bytes per pipeline step)."""
    return [type(t)(t.block_n, t.block_k // 2, 1, t.num_warps, t.num_stages) for t in candidate_tiles()]


def sweep_configs(m: int, n: int, k: int, tiles_of: Callable[[], list[Any]] = candidate_tiles) -> list[Any]:
    """Every candidate tile at every split that leaves each split a few K steps and the grid not absurd."""
    from kiln.models.quant.fp8_kernel import block_m_for

    configs = []
    for tile in tiles_of():
        tiles = math.ceil(n / tile.block_n) * math.ceil(m / block_m_for(m))
        for split in SPLITS:
            if split == 1 or (k // split >= 2 * tile.block_k and tiles * split <= 8 * 132):
                configs.append(type(tile)(tile.block_n, tile.block_k, split, tile.num_warps, tile.num_stages))
    return configs


def shape_rows(proj: str, n: int, k: int, device: str, floor_bw: float, ms: tuple[int, ...],
               errors: dict[str, str], fp8: bool = True) -> list[dict]:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    copies = max(1, math.ceil(ROTATE_BYTES / (n * k))) if device == "cuda" else 1
    w = [torch.randn(n, k, device=device, dtype=dtype) * 0.02 for _ in range(min(copies, 2))]
    w = [w[i % len(w)].clone() for i in range(copies)]  # distinct storage; content need not differ
    quant = [quantize_weight(t) for t in w] if fp8 else []
    rows: list[dict] = []
    for m in ms:
        rows += m_rows(proj, m, w, quant, floor_bw, errors)
        print(f"  {proj} M={m}: {len(rows)} rows", flush=True)
    return rows


def m_rows(proj: str, m: int, w: list[torch.Tensor], quant: list[tuple[torch.Tensor, torch.Tensor]],
           floor_bw: float, errors: dict[str, str]) -> list[dict]:
    """One projection at M tokens: bf16, _scaled_mm, the heuristic's Triton config and every swept one."""
    from kiln.models.quant.fp8_kernel import bf16_gemm_triton, fp8_gemm_triton, num_sms, pick_config

    (n, k), dtype, device = w[0].shape, w[0].dtype, w[0].device.type
    x = torch.randn(m, k, device=device, dtype=dtype)
    xq, xs = quantize_per_token(x)
    rows = []

    def record(kernel: str, config: dict | None, fns: list[Callable[[], Any]], weight_bytes: int) -> None:
        try:
            us = graph_time_us(fns, device)
        except Exception:
            errors[f"{proj} M={m} {kernel} {config}"] = traceback.format_exc(limit=4)
            return
        floor_us = weight_bytes / floor_bw * 1e6
        rows.append(dict(proj=proj, N=n, K=k, M=m, kernel=kernel, config=config, us=us,
                         gb_per_s=weight_bytes / us / 1e3, floor_us=floor_us, x_floor=us / floor_us))

    record("bf16_mm", None, [lambda t=t: torch.mm(x, t.t()) for t in w], 2 * n * k)
    if quant:
        record("scaled_mm", None, [lambda q=q: scaled_mm(xq, q[0], xs, q[1], dtype) for q in quant], n * k)
        auto = pick_config(m, n, k, num_sms(xq.device))
        for config in [auto, *sweep_configs(m, n, k)]:
            label = "triton_auto" if config is auto else "triton"
            record(label, asdict(config),
                   [lambda q=q, c=config: fp8_gemm_triton(xq, q[0], xs, q[1], dtype, c) for q in quant], n * k)
    if device == "cuda":  # the same kernel on the bf16 weight, against cuBLAS's bf16 (the interpreter: no bf16)
        auto = pick_config(m, n, k, num_sms(x.device), 2)
        for config in [auto, *sweep_configs(m, n, k, candidate_bf16_tiles)]:
            label = "bf16triton_auto" if config is auto else "bf16triton"
            record(label, asdict(config), [lambda t=t, c=config: bf16_gemm_triton(x, t, c) for t in w], 2 * n * k)
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Per (proj, M): bf16, _scaled_mm, the heuristic's and the best swept Triton config."""
    out = []
    for key in sorted({(r["proj"], r["M"]) for r in rows}, key=lambda pm: (pm[0], pm[1])):
        sel = [r for r in rows if (r["proj"], r["M"]) == key]
        by = {r["kernel"]: r for r in sel if r["kernel"] not in ("triton", "bf16triton")}
        swept = [r for r in sel if r["kernel"].startswith("triton")]
        best = min(swept, key=lambda r: r["us"]) if swept else None
        swept16 = [r for r in sel if r["kernel"].startswith("bf16triton")]
        best16 = min(swept16, key=lambda r: r["us"]) if swept16 else None
        nan = float("nan")
        out.append(dict(proj=key[0], M=key[1], bf16_us=by.get("bf16_mm", {}).get("us", nan),
                        bf16_triton_auto_us=by.get("bf16triton_auto", {}).get("us", nan),
                        bf16_triton_best_us=best16["us"] if best16 else nan,
                        bf16_triton_best_config=best16["config"] if best16 else None,
                        scaled_mm_us=by.get("scaled_mm", {}).get("us", nan),
                        auto_us=by.get("triton_auto", {}).get("us", nan),
                        best_us=best["us"] if best else nan, best_config=best["config"] if best else None,
                        best_gb_per_s=best["gb_per_s"] if best else nan,
                        fp8_floor_us=next((r["floor_us"] for r in sel if r["kernel"] != "bf16_mm"), nan),
                        N=sel[0]["N"], K=sel[0]["K"]))
    return out


def suggested_tuned(best: list[dict]) -> str:
    """The sweep's winners as a `TUNED` literal for kiln/models/quant/fp8_kernel.py."""
    lines = []
    for r in sorted(best, key=lambda r: (r["N"], r["K"], r["M"])):
        c = r["best_config"]
        if c:
            lines.append(f"    ({r['N']}, {r['K']}, {r['M']}): Fp8GemmConfig({c['block_n']}, {c['block_k']}, "
                         f"{c['split_k']}, {c['num_warps']}, {c['num_stages']}),")
    return "TUNED = {\n" + "\n".join(lines) + "\n}"


def kernel_table(shapes: dict[str, tuple[int, int]], device: str, ms: tuple[int, ...], budget_s: float,
                 errors: dict[str, str]) -> dict[str, Any]:
    """shapes: proj -> (K, N). Stops starting new shapes once budget_s has passed (recorded as skipped)."""
    start = time.perf_counter()
    bw = copy_gb_per_s(device) * 1e9
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    rows, skipped = [], []
    for proj, (k, n) in shapes.items():
        if time.perf_counter() - start > budget_s:
            skipped.append(proj)
            continue
        try:  # tensor-parallel shards ("/tp2"): the bf16 comparison only
            rows += shape_rows(proj, n, k, device, bw, ms, errors, fp8="/tp" not in proj)
        except Exception:
            errors[f"kernels {proj}"] = traceback.format_exc(limit=6)
            print(errors[f"kernels {proj}"], flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    best = summary(rows)
    return dict(copy_gb_per_s=bw / 1e9, rows=rows, summary=best, skipped=skipped, seconds=time.perf_counter() - start,
                suggested_tuned=suggested_tuned(best))


def step_totals(best: list[dict], layers: int) -> list[dict]:
    """The four projections x layers per decode step, ms, per M (and per shard set: "" or "/tp2"): what the
    GEMMs of one step would take."""
    out = []
    for shard in sorted({r["proj"].partition("/")[2] for r in best}):
        for m in sorted({r["M"] for r in best}):
            sel = [r for r in best if r["M"] == m and r["proj"].partition("/")[2] == shard]
            total = {key: sum(r[key] for r in sel) * layers / 1e3
                     for key in ("bf16_us", "bf16_triton_auto_us", "bf16_triton_best_us", "scaled_mm_us", "auto_us",
                                 "best_us", "fp8_floor_us")}
            out.append(dict(shard=shard or "tp1", M=m, projections=len(sel),
                            **{k.replace("_us", "_ms"): v for k, v in total.items()}))
    return out
