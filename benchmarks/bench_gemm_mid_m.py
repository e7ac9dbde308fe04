"""The 16-bit GEMMs of a decode step at M = 64..256 (issue 16's offline phase with 129-256 running): cuBLAS
against the best Triton kernel Inductor's max-autotune finds, per projection, inside CUDA graphs.

Why: mid-run the offline workload's decode step is GEMM ~6.8 ms + attention ~6.1 ms; the attention reads KV
at ~91% of copy bandwidth, and the GEMMs at M=256 run at ~71% of the measured bf16 matmul rate. The small
projections leave most of 132 SMs idle at that M (o_proj at 128x256 tiles is 32 tiles), so a kernel with
better SM coverage (persistent, smaller tiles, split-K) may beat cuBLAS's pick. This measures whether one
exists before any kernel is written.

Each measurement is one CUDA graph of GEMMs that rotate over more weight than L2 holds
(fp8_kernel_sweep.graph_time_us). The Triton column compiles `x @ w.T` with max-autotune (Triton templates
only, persistent TMA templates on), static shapes; its choice is in the log ("AUTOTUNE mm").

    python -m benchmarks.bench_gemm_mid_m --m 256 128 192 64 --json gemm.json [--budget-s 300]
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from benchmarks.bench_fp8 import projection_shapes
from benchmarks.common import stamp, table
from benchmarks.fp8_kernel_sweep import ROTATE_BYTES, graph_time_us


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama3-8b")
    parser.add_argument("--m", type=int, nargs="+", default=[256, 128, 192, 64])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--budget-s", type=float, default=300.0, help="stop starting new autotunes after this")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from kiln.models.loader.presets import PRESETS

    shapes = projection_shapes(args.preset)
    shapes["lm_head"] = (PRESETS[args.preset]["hidden_size"], PRESETS[args.preset]["vocab_size"])
    layers = PRESETS[args.preset]["num_hidden_layers"]
    peak = None
    if args.device == "cuda":
        from benchmarks.bench_gpu import measure_ceilings

        peak = measure_ceilings().matmul_flops_per_s
    compiled = autotuned_mm()
    start, rows = time.perf_counter(), []
    for m in args.m:
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
    for m in args.m:
        mrows = [r for r in rows if r["M"] == m]
        for r in mrows:
            per_step = 1 if r["proj"] == "lm_head" else layers
            triton_us = r.get("triton_us", float("nan"))
            out.append([r["proj"], m, r["cublas_us"] * per_step / 1e3, triton_us * per_step / 1e3,
                        r["cublas_us"] / triton_us,
                        r.get("floor_us", float("nan")) / r["cublas_us"]])
    print(stamp())
    print(table(["proj", "M", "cuBLAS ms/step", "Triton ms/step", "cuBLAS / Triton", "cuBLAS of peak"], out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"stamp": stamp(), "matmul_flops_per_s": peak, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
