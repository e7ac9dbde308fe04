"""The projection GEMMs of a decode step, one GEMM shape at a time, each timed inside a CUDA graph whose calls
rotate over more weight than L2 holds (50 MB on an H200), as in a decode step where every layer has its own.

Two parts:
- `small-m` (M = 1..64, the decode batches): bf16 torch.mm (cuBLAS), `torch._scaled_mm` (row-wise FP8), kiln's
  Triton FP8 GEMM at the heuristic's config and at every swept tile config, and the same kernel on the bf16
  weight; floors are the weight bytes at the copy bandwidth measured in the same run. Prints the per-(projection,
  M) summary, the per-step totals and a suggested `TUNED` table for kiln/models/quant/fp8_kernel.py (all rows in
  the JSON; --table-out adds the winners to a KILN_GEMM_CONFIGS table, which the runtime then picks them from).
  On the CPU the Triton kernel runs under the interpreter and times are wall clock (a dry run).
- `mid-m` (M = 64..256, an offline run's decode steps): cuBLAS against the best Triton kernel Inductor's
  max-autotune finds per projection (Triton templates only, persistent TMA templates on, static shapes; its
  choice is in the log as "AUTOTUNE mm").

    python -m benchmarks.bench_gemm --part small-m --tp 2 --json gemm.json           # H200: ~2 min
    python -m benchmarks.bench_gemm --preset qwen3-30b-a3b --projections qkv o --m 1 8 --json gemm.json
    python -m benchmarks.bench_gemm --part mid-m --m 256 128 192 64 --json mid.json   # H200: ~5 min
    python -m benchmarks.bench_gemm --preset tiny-llama --device cpu --m 1 16 --json /tmp/gemm.json  # CPU dry run
- `gemv-stream` (M = 1, e4m3 weights): the MMA kernel at its shipped tiles against the one-token streaming
  matrix-vector kernel (kiln/models/gemv_stream.py) at its rule's config and at each swept one, x the bytes floor.

    python -m benchmarks.bench_gemm --part gemv-stream --json gemv_stream.json          # H100: < 1 min
- `host` (the M of every CUDA-graph capture size): the host's microseconds per `kiln::dense_gemm` call (torch.mm
  above M = 16, the Triton kernel below) at the 8B projection shapes, eager and under a graph capture, at a shape
  the process has not run before and at one it has: a warm start's capture phase spent ~0.2 ms a call there.

    python -m benchmarks.bench_gemm --part host --json host.json                       # H200: < 1 min
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import measure_ceilings, stamp, table
from kiln.models.loader.presets import PRESETS
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

    # 64x256 six stages and 32x256 eight keep more weight bytes in flight per program (deeper pipelines): at one
    # token Qwen3-30B-A3B's attention projections streamed at ~55% of the copy bandwidth on the best of the others
    # (docs/moe.md). The narrow ones (16 and 32 weight rows, two warps, the whole K of a small model's projection
    # in flight) spread a small weight over more SMs: SmolLM2-135M's projections took ~3.3 us at one token on the
    # others, with 9 to 48 programs streaming 0.7-3.5 MB, a DRAM round trip or two behind each other.
    return [Fp8GemmConfig(64, 256, 1, 4, 4), Fp8GemmConfig(64, 128, 1, 4, 6), Fp8GemmConfig(128, 256, 1, 4, 3),
            Fp8GemmConfig(128, 128, 1, 8, 4), Fp8GemmConfig(32, 256, 1, 4, 4), Fp8GemmConfig(64, 256, 1, 4, 6),
            Fp8GemmConfig(32, 256, 1, 4, 8), Fp8GemmConfig(16, 128, 1, 2, 10), Fp8GemmConfig(32, 128, 1, 2, 8),
            Fp8GemmConfig(16, 256, 1, 2, 6)]


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
    every other benchmark uses (common.measure_ceilings; a graphed uint8 copy read 2.7 TB/s on the H200
    where that bf16 copy reads 4.25), on the CPU dry run a wall-clock copy."""
    if device == "cuda":
        return measure_ceilings().copy_bytes_per_s / 1e9
    size = 64 << 20
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = graph_time_us([lambda: dst.copy_(src)], device)
    return 2 * size / us / 1e3


def candidate_bf16_tiles() -> list[Any]:
    """The 16-bit operand tiles: the FP8 ones with half the K tile (the same bytes per pipeline step)."""
    return [type(t)(t.block_n, t.block_k // 2, 1, t.num_warps, t.num_stages) for t in candidate_tiles()]


def sweep_configs(m: int, n: int, k: int, tiles_of: Callable[[], list[Any]] = candidate_tiles,
                  promotes: tuple[int, ...] = (128,)) -> list[Any]:
    """Every candidate tile at every split that leaves each split a few K steps and the grid not absurd, at each
    fp32 promotion interval of `promotes` (`Fp8GemmConfig.promote`, at most the tile's K step; e4m3 operands only)."""
    from kiln.models.quant.fp8_kernel import block_m_for

    configs = []
    for tile in tiles_of():
        tiles = math.ceil(n / tile.block_n) * math.ceil(m / block_m_for(m))
        distinct: dict[int, int] = {}  # the interval the kernel runs (at most the K step) -> the first given for it
        for promote in promotes:
            distinct.setdefault(min(promote, tile.block_k), promote)
        for split in SPLITS:
            if split == 1 or (k // split >= 2 * tile.block_k and tiles * split <= 8 * 132):
                configs += [type(tile)(tile.block_n, tile.block_k, split, tile.num_warps, tile.num_stages, promote)
                            for promote in distinct.values()]
    return configs


@dataclass(frozen=True)
class Sweep:
    """What the small-M sweep tries besides each tile and split: the FP8 kernel's fp32 promotion intervals, and
    whether the 16-bit kernel's tiles are swept too (cuBLAS's bf16 is always timed)."""

    promotes: tuple[int, ...] = (128,)
    bf16: bool = True


def shape_rows(proj: str, n: int, k: int, device: str, floor_bw: float, ms: tuple[int, ...],
               errors: dict[str, str], fp8: bool = True, sweep: Sweep = Sweep()) -> list[dict]:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    copies = max(1, math.ceil(ROTATE_BYTES / (n * k))) if device == "cuda" else 1
    w = [torch.randn(n, k, device=device, dtype=dtype) * 0.02 for _ in range(min(copies, 2))]
    w = [w[i % len(w)].clone() for i in range(copies)]  # distinct storage; content need not differ
    quant = [quantize_weight(t) for t in w] if fp8 else []
    rows: list[dict] = []
    for m in ms:
        rows += m_rows(proj, m, w, quant, floor_bw, errors, sweep)
        print(f"  {proj} M={m}: {len(rows)} rows", flush=True)
    return rows


def m_rows(proj: str, m: int, w: list[torch.Tensor], quant: list[tuple[torch.Tensor, torch.Tensor]],
           floor_bw: float, errors: dict[str, str], sweep: Sweep = Sweep()) -> list[dict]:
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
        for config in [auto, *sweep_configs(m, n, k, promotes=sweep.promotes)]:
            label = "triton_auto" if config is auto else "triton"
            record(label, asdict(config),
                   [lambda q=q, c=config: fp8_gemm_triton(xq, q[0], xs, q[1], dtype, c) for q in quant], n * k)
    if device == "cuda" and sweep.bf16:  # the same kernel on the bf16 weight against cuBLAS (the interpreter: no bf16)
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


def table_entries(best: list[dict]) -> dict[str, list[dict]]:
    """The sweep's winners as KILN_GEMM_CONFIGS entries (kiln/models/quant/fp8_kernel.py, `swept_tables`): FP8 per
    swept M; 16-bit M = 1's winner for every M <= 16 (greedy tokens must not depend on M there)."""
    fp8 = [dict(N=r["N"], K=r["K"], max_m=r["M"], config=r["best_config"]) for r in best if r["best_config"]]
    bf16 = [dict(N=r["N"], K=r["K"], max_m=16, config=r["bf16_triton_best_config"])
            for r in best if r["bf16_triton_best_config"] and r["M"] == 1]
    return {"fp8": fp8, "16bit": bf16}


def suggested_tuned(best: list[dict]) -> str:
    """The sweep's winners (table_entries) as `TUNED` and `TUNED_16BIT` literals for kiln/models/quant/fp8_kernel.py."""

    def lines(entries: list[dict]) -> str:
        rows = []
        for e in sorted(entries, key=lambda e: (e["N"], e["K"], e["max_m"])):
            c = e["config"]
            rows.append(f"    ({e['N']}, {e['K']}, {e['max_m']}): Fp8GemmConfig({c['block_n']}, {c['block_k']}, "
                        f"{c['split_k']}, {c['num_warps']}, {c['num_stages']}"
                        + (f", {c['promote']}" if c.get("promote", 128) != 128 else "") + "),")
        return "\n".join(rows)

    entries = table_entries(best)
    return "TUNED = {\n" + lines(entries["fp8"]) + "\n}\nTUNED_16BIT = {\n" + lines(entries["16bit"]) + "\n}"


def write_table(path: str, entries: dict[str, list[dict]]) -> None:
    """Adds the entries to the table at `path` (made if missing): a swept (N, K) replaces that shape's entries
    there, other shapes' stay, so sweeps of several presets build one table."""
    old = json.loads(Path(path).read_text()) if Path(path).is_file() else {}
    out = {}
    for kind in ("fp8", "16bit"):
        swept = {(e["N"], e["K"]) for e in entries[kind]}
        out[kind] = [e for e in old.get(kind, []) if (e["N"], e["K"]) not in swept] + entries[kind]
    Path(path).write_text(json.dumps(out, indent=1))


def kernel_table(shapes: dict[str, tuple[int, int]], device: str, ms: tuple[int, ...], budget_s: float,
                 errors: dict[str, str], sweep: Sweep = Sweep()) -> dict[str, Any]:
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
            rows += shape_rows(proj, n, k, device, bw, ms, errors, fp8="/tp" not in proj, sweep=sweep)
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


def projection_shapes(preset: str, tp: int = 1) -> dict[str, tuple[int, int]]:
    """name -> (K, N) of the preset's four projections; with tp > 1 also one rank's shards ("qkv/tp2": column
    parallel projections split N, row parallel ones K)."""
    cfg = PRESETS[preset]
    h, inter, heads = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"]
    d = cfg.get("head_dim", h // heads)
    kv = cfg["num_key_value_heads"]
    full = {"qkv": (h, (heads + 2 * kv) * d), "o": (heads * d, h), "gate_up": (h, 2 * inter), "down": (inter, h)}
    if tp > 1:
        full |= {f"{name}/tp{tp}": (k // tp, n) if name in ("o", "down") else (k, n // tp)
                 for name, (k, n) in list(full.items())}
    return full


def weights(n: int, k: int, device: str) -> list[torch.Tensor]:
    copies = max(1, math.ceil(ROTATE_BYTES / (2 * n * k))) if device == "cuda" else 1
    base = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
    return [base.clone() for _ in range(copies)]


def autotuned_mm():
    import torch._inductor.config as inductor_config

    inductor_config.max_autotune_gemm_backends = "TRITON"
    inductor_config.triton.enable_persistent_tma_matmul = True
    torch._dynamo.config.cache_size_limit = 64  # one compile per (projection, M)
    torch._dynamo.config.accumulated_cache_size_limit = 256

    def mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x @ w.t()

    return torch.compile(mm, mode="max-autotune-no-cudagraphs", dynamic=False)


def print_kernels(kernels: dict[str, Any]) -> None:
    print(f"copy bandwidth {kernels['copy_gb_per_s']:.0f} GB/s; sweep {kernels['seconds']:.0f} s"
          + (f"; skipped (budget): {kernels['skipped']}" if kernels["skipped"] else ""))
    cfg = (lambda c: f"{c['block_n']}x{c['block_k']} s{c['split_k']} w{c['num_warps']} st{c['num_stages']}"
           + (f" p{c['promote']}" if c.get("promote", 128) != 128 else "")
           if c else "-")
    print(table(["proj", "M", "bf16 us", "_scaled_mm us", "triton auto us", "triton best us", "best config",
                 "best GB/s", "fp8 floor us", "best x floor", "_scaled_mm / best", "auto / best"],
                [[r["proj"], r["M"], r["bf16_us"], r["scaled_mm_us"], r["auto_us"], r["best_us"],
                  cfg(r["best_config"]), r["best_gb_per_s"], r["fp8_floor_us"], r["best_us"] / r["fp8_floor_us"],
                  r["scaled_mm_us"] / r["best_us"], r["auto_us"] / r["best_us"]] for r in kernels["summary"]]))
    print(table(["proj", "M", "cuBLAS bf16 us", "triton bf16 auto us", "triton bf16 best us", "best config",
                 "cuBLAS / best"],
                [[r["proj"], r["M"], r["bf16_us"], r["bf16_triton_auto_us"], r["bf16_triton_best_us"],
                  cfg(r["bf16_triton_best_config"]), r["bf16_us"] / r["bf16_triton_best_us"]]
                 for r in kernels["summary"]]))
    print(table(["shard", "M", "projections", "bf16 ms/step", "triton bf16 auto", "triton bf16 best",
                 "_scaled_mm ms/step", "triton auto ms/step", "triton best ms/step", "fp8 floor ms/step"],
                [[r["shard"], r["M"], r["projections"], r["bf16_ms"], r["bf16_triton_auto_ms"],
                  r["bf16_triton_best_ms"], r["scaled_mm_ms"], r["auto_ms"], r["best_ms"], r["fp8_floor_ms"]]
                 for r in kernels["step_totals"]]))
    print(kernels["suggested_tuned"])


@contextlib.contextmanager
def interpreted_on_cpu(device: str) -> Iterator[None]:
    """On the CPU, Triton's kernels run under the interpreter inside the block (set for a part only)."""
    previous = os.environ.get("TRITON_INTERPRET")
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous


def chosen_shapes(args: argparse.Namespace, tp: int = 1) -> dict[str, tuple[int, int]]:
    """The preset's projection shapes (and one rank's shards at `tp`), only --projections' where given (e.g. a MoE
    preset's attention projections alone)."""
    shapes = projection_shapes(args.preset, tp)
    if args.projections:
        shapes = {name: shape for name, shape in shapes.items() if name.partition("/")[0] in args.projections}
    return shapes


def small_m(args: argparse.Namespace, errors: dict[str, str]) -> dict[str, Any]:
    """The small-M table."""
    ms = tuple(args.m or KERNEL_M)
    shapes = chosen_shapes(args, args.tp)
    with interpreted_on_cpu(args.device):
        result = kernel_table(shapes, args.device, ms, args.budget_s, errors,
                              Sweep(tuple(args.promote), not args.no_bf16_sweep))
    result["step_totals"] = step_totals(result["summary"], PRESETS[args.preset]["num_hidden_layers"])
    return result


def stream_candidates() -> list[Any]:
    """The streaming matrix-vector kernel's swept configs as (rows, weight bytes a K step, warps, stages): 4, 8 and
    16 KB steps, rows 1 to 16."""
    return [(2, 4096, 4, 3), (4, 4096, 4, 3), (8, 4096, 4, 3), (16, 4096, 4, 3), (8, 4096, 4, 1), (4, 4096, 4, 1),
            (1, 4096, 4, 3), (4, 8192, 4, 3), (8, 8192, 4, 3), (16, 8192, 4, 3), (8, 16384, 8, 3),
            (16, 16384, 8, 3), (4, 16384, 8, 3), (2, 8192, 4, 3), (4, 8192, 8, 3), (2, 16384, 8, 3)]


def gemv_stream_table(args: argparse.Namespace, errors: dict[str, str]) -> dict[str, Any]:
    """One token's e4m3 projections: the MMA kernel at its shipped config against the streaming matrix-vector kernel
    (kiln/models/gemv_stream.py) at its rule's config and at every swept one, us and x the bytes floor, and the
    step's projections x layers."""
    import triton

    from kiln.models.gemv_stream import GemvStreamConfig, gemv_stream, pick_config
    from kiln.models.quant.fp8_kernel import fp8_gemm_triton, num_sms
    from kiln.models.quant.fp8_kernel import pick_config as mma_config

    device = args.device
    bw = copy_gb_per_s(device) * 1e9
    shapes = chosen_shapes(args)
    rows = []
    for proj, (k, n) in shapes.items():
        copies = max(1, math.ceil(ROTATE_BYTES / (n * k))) if device == "cuda" else 1
        (wq, ws), (xq, xs) = quantize_weight(torch.randn(n, k, device=device) * 0.02), \
            quantize_per_token(torch.randn(1, k, device=device))
        weights_ = [wq.clone() for _ in range(copies)]
        flat = (xs.reshape(-1).float(), ws.reshape(-1).float())
        mma = mma_config(1, n, k, num_sms(xq.device))  # explicit: the MMA kernel even where the stream one is on
        floor_us = n * k / bw * 1e6
        rule = pick_config(n, k, num_sms(xq.device))
        arms = [("mma", None, [partial(fp8_gemm_triton, xq, q, xs, ws, torch.bfloat16, mma) for q in weights_])]
        swept = [GemvStreamConfig(r, min(step // r, triton.next_power_of_2(k)), warps, stages)
                 for r, step, warps, stages in stream_candidates()]
        for config in [rule, *swept]:
            arms.append(("stream_rule" if config is rule else "stream", asdict(config),
                         [partial(gemv_stream, xq, q, flat, torch.bfloat16, config=config) for q in weights_]))
        for kernel, config, fns in arms:
            try:
                us = graph_time_us(fns, device)
            except Exception:
                errors[f"{proj} {kernel} {config}"] = traceback.format_exc(limit=4)
                continue
            rows.append(dict(proj=proj, N=n, K=k, kernel=kernel, config=config, us=us, x_floor=us / floor_us,
                             floor_us=floor_us))
        print(f"  {proj}: {len(rows)} rows", flush=True)
        del weights_, arms
    summary = []
    for proj in dict.fromkeys(r["proj"] for r in rows):
        sel = [r for r in rows if r["proj"] == proj]
        by = {r["kernel"]: r for r in sel if r["kernel"] != "stream"}
        if "mma" not in by or "stream_rule" not in by:
            continue
        best = min((r for r in sel if r["kernel"].startswith("stream")), key=lambda r: r["us"])
        summary.append(dict(proj=proj, floor_us=sel[0]["floor_us"], mma_us=by["mma"]["us"],
                            rule_us=by["stream_rule"]["us"], rule_config=by["stream_rule"]["config"],
                            best_us=best["us"], best_config=best["config"]))
    layers = PRESETS[args.preset]["num_hidden_layers"]
    totals = {key: sum(r[key] for r in summary) * layers / 1e3 for key in ("floor_us", "mma_us", "rule_us", "best_us")}
    cfg = (lambda c: f"{c['rows']}x{c['block_k']} w{c['num_warps']} st{c['num_stages']}")
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    print(table(["proj", "floor us", "MMA us", "stream rule us", "rule config", "stream best us", "best config",
                 "MMA x floor", "best x floor"],
                [[r["proj"], r["floor_us"], r["mma_us"], r["rule_us"], cfg(r["rule_config"]), r["best_us"],
                  cfg(r["best_config"]), r["mma_us"] / r["floor_us"], r["best_us"] / r["floor_us"]] for r in summary]))
    print("a step's projections, ms: " + ", ".join(f"{k.replace('_us', '')} {v:.3f}" for k, v in totals.items()))
    return dict(copy_gb_per_s=bw / 1e9, rows=rows, summary=summary, step_ms=totals)


def mid_m(args: argparse.Namespace) -> dict[str, Any]:
    shapes = projection_shapes(args.preset, args.tp)
    shapes["lm_head"] = (PRESETS[args.preset]["hidden_size"], PRESETS[args.preset]["vocab_size"])
    layers = PRESETS[args.preset]["num_hidden_layers"]
    peak = measure_ceilings().matmul_flops_per_s if args.device == "cuda" else None
    ms = args.m or [256, 128, 192, 64]
    compiled = autotuned_mm()
    start, rows = time.perf_counter(), []
    for m in ms:
        for name, (k, n) in shapes.items():
            ws = weights(n, k, args.device)
            x = torch.randn(m, k, device=args.device, dtype=torch.bfloat16)
            row = {"proj": name, "M": m, "N": n, "K": k,
                   "cublas_us": graph_time_us([lambda w=w, x=x: torch.mm(x, w.t()) for w in ws], args.device)}
            if time.perf_counter() - start < args.budget_s:
                try:
                    row["triton_us"] = graph_time_us([lambda w=w, x=x: compiled(x, w) for w in ws], args.device)
                except Exception as exc:  # noqa: BLE001 - one shape's failure must not lose the table
                    row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            if peak:
                row["floor_us"] = 2 * m * n * k / peak * 1e6
            rows.append(row)
            print(row, flush=True)
            del ws
        torch.cuda.empty_cache() if args.device == "cuda" else None
    out = []
    for m in ms:
        mrows = [r for r in rows if r["M"] == m]
        for r in mrows:
            per_step = 1 if r["proj"] == "lm_head" else layers
            triton_us = r.get("triton_us", float("nan"))
            out.append([r["proj"], m, r["cublas_us"] * per_step / 1e3, triton_us * per_step / 1e3,
                        r["cublas_us"] / triton_us,
                        r.get("floor_us", float("nan")) / r["cublas_us"]])
    print(table(["proj", "M", "cuBLAS ms/step", "Triton ms/step", "cuBLAS / Triton", "cuBLAS of peak"], out))
    return {"matmul_flops_per_s": peak, "rows": rows}


def host_cost(args: argparse.Namespace) -> dict[str, Any]:
    """Host microseconds per kiln::dense_gemm call: (eager | captured) x (a shape new to the process | seen).
    Each timed batch of calls starts on an idle device and queues far fewer launches than the device's queue
    holds, so the time is the host's own (not waiting for the device)."""
    import kiln.models.dense_gemm  # noqa: F401 - registers kiln::dense_gemm
    from kiln.config import default_capture_sizes

    device = args.device
    ms = args.m or list(default_capture_sizes(256))
    shapes = projection_shapes(args.preset, args.tp)
    ws = {proj: torch.randn(n, k, dtype=torch.bfloat16, device=device) / k ** 0.5 for proj, (n, k) in shapes.items()}
    xs = {m: {proj: torch.randn(m, k, dtype=torch.bfloat16, device=device) for proj, (_, k) in shapes.items()}
          for m in ms}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def calls(m: int, eager: bool = True) -> float:  # one call per projection at this M: host us per call
        if eager:  # (a capture may not synchronise)
            sync()
        start = time.perf_counter()
        for proj, w in ws.items():
            torch.ops.kiln.dense_gemm(xs[m][proj], w)
        return (time.perf_counter() - start) / len(ws) * 1e6

    rows = []
    for m in ms:  # eager: the first calls at this M, then the same again
        rows.append({"m": m, "eager_new_us": calls(m), "eager_seen_us": calls(m)})
    if device == "cuda":
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        graphs = []  # alive to the end: a shared pool is released when its last graph goes, and then unusable
        for row in rows:  # captured: seen eagerly above but new to capture, then once more in a second graph
            for key in ("captured_first_us", "captured_again_us"):
                graph = torch.cuda.CUDAGraph()
                graphs.append(graph)
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    graph.capture_begin(pool)
                    row[key] = calls(row["m"], eager=False)
                    graph.capture_end()
    columns = ["m", "eager_new_us", "eager_seen_us", "captured_first_us", "captured_again_us"]
    print(table(columns, [[row.get(c, float("nan")) for c in columns] for row in rows]))
    return {"shapes": shapes, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["small-m", "mid-m", "host", "gemv-stream"], default="small-m")
    parser.add_argument("--preset", default="llama3-8b")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--m", type=int, nargs="+", default=None,
                        help="token counts (default: 1..64 for small-m, 256 128 192 64 for mid-m)")
    parser.add_argument("--tp", type=int, default=1, help="also one rank's shards at this TP (small-m: bf16 only)")
    parser.add_argument("--projections", nargs="+", choices=["qkv", "o", "gate_up", "down"], default=None,
                        help="small-m / gemv-stream: only these projections")
    parser.add_argument("--promote", type=int, nargs="+", default=[128],
                        help="small-m: the FP8 kernel's fp32 promotion intervals to sweep (0: Triton's default)")
    parser.add_argument("--no-bf16-sweep", action="store_true", help="small-m: no 16-bit kernel tiles (cuBLAS only)")
    parser.add_argument("--budget-s", type=float, default=300.0, help="no new shape or autotune after this")
    parser.add_argument("--json", default=None)
    parser.add_argument("--table-out", default=None,
                        help="small-m: add the winners to this KILN_GEMM_CONFIGS table (made if missing)")
    args = parser.parse_args()
    print(stamp(), flush=True)
    errors: dict[str, str] = {}
    result: dict[str, Any] = {"stamp": stamp(), "args": vars(args), "errors": errors}
    if args.part == "small-m":
        result["small_m"] = small_m(args, errors)
        print_kernels(result["small_m"])
        if args.table_out:
            write_table(args.table_out, table_entries(result["small_m"]["summary"]))
    elif args.part == "host":
        result["host"] = host_cost(args)
    elif args.part == "gemv-stream":
        with interpreted_on_cpu(args.device):
            result["gemv_stream"] = gemv_stream_table(args, errors)
    else:
        result["mid_m"] = mid_m(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if errors:
        print("errors in: " + ", ".join(errors))


if __name__ == "__main__":
    main()
