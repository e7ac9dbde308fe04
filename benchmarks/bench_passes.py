"""Each compiler pass on vs off: decode and prefill step time at real shapes (random weights, -O2).

For every pass configuration the model is compiled afresh (-O2, the decode batches as compile and CUDA
graph capture sizes), then timed in the same process: the median engine step while `batch` requests
decode, and the median step that prefills one `prefill`-token prompt (prefix caching off). Ratios are
against passes disabled. The rewrite counts (summed over compiles: distinct pieces x ranges/sizes, plus
the graph-level stage) show whether a pass applied at all: rope_kv needs a backend that attends from the
cache alone (flashinfer or torch, not triton).

    python -m benchmarks.bench_passes --preset smollm2-135m                 # GPU, bf16
    python -m benchmarks.bench_passes --preset llama3-8b --prefill 2048
    python -m benchmarks.bench_passes --preset tiny-llama --device cpu --steps 4 --prefill 64   # smoke
    python -m benchmarks.bench_passes --kernels smollm2-135m llama3-8b qwen3-8b   # rope_kv kernels alone
    python -m benchmarks.bench_passes --silu-quant-kernels 14336                  # silu_mul_quant's kernels alone
    python -m benchmarks.bench_passes --preset llama3-8b --quantization fp8 --configs off silu_mul_quant \
        --batches 1 64 --prefill 1024                                            # the FP8 fusion

Writes a JSON of all rows to --json when given.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from typing import Any

import torch

from benchmarks.common import stamp, start_decoding, table
from kiln import Runtime, SamplingParams
from kiln.passes import ALL_PASSES, LEVEL_DEFAULTS, pass_manager_of

PROMPT_LEN = 128


def configurations(names: list[str]) -> dict[str, dict[str, Any]]:
    """label -> Runtime options: off, default (the level's set), all, one pass alone or several joined by "+",
    "default+" and passes (the level's set and those)."""
    known = {"off": {"enable_passes": False}, "default": {"passes": LEVEL_DEFAULTS[2]},
             "all": {"passes": ALL_PASSES},
             # Inductor's horizontal fusion of independent kernels (RoPE of q and k, v's copy: one launch),
             # the GPU default at -O2 since 2026-11-30
             "combo_kernels": {"inductor_options": {"combo_kernels": True}},
             "no_combo_kernels": {"inductor_options": {"combo_kernels": False}}}
    out = {}
    for name in names:
        extra = name.removeprefix("default+").split("+")  # a pass, or several by "+"
        if name in known:
            out[name] = known[name]
        elif all(part.partition("<=")[0] in ALL_PASSES for part in extra):
            out[name] = {"passes": (*(LEVEL_DEFAULTS[2] if name.startswith("default+") else ()), *extra)}
        else:
            raise SystemExit(f"unknown configuration {name!r}: {', '.join(known)} or a pass ({', '.join(ALL_PASSES)})")
    return out


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed_step(rt: Runtime, device: str) -> float:
    sync(device)
    start = time.perf_counter()
    rt.engine.step()
    sync(device)
    return time.perf_counter() - start


def decode_ms(rt: Runtime, batch: int, steps: int, device: str) -> float:
    """Median engine step while `batch` requests of PROMPT_LEN-token prompts decode."""
    engine = rt.engine
    start_decoding(engine, batch, PROMPT_LEN, max_tokens=steps + 4)
    times = [timed_step(rt, device) for _ in range(steps)]
    while engine.has_unfinished():
        engine.step()
    return statistics.median(times) * 1e3


def prefill_ms(rt: Runtime, tokens: int, steps: int, device: str) -> float:
    """Median step that prefills one fresh `tokens`-token prompt (a new random prompt every time)."""
    engine = rt.engine
    vocab, rng = engine.loaded.spec.vocab_size, random.Random(tokens)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times = []
    for _ in range(steps + 1):  # the first one warms caches and allocator
        engine.add_request([rng.randrange(vocab) for _ in range(tokens)], params)
        times.append(timed_step(rt, device))
        while engine.has_unfinished():
            engine.step()
    return statistics.median(times[1:]) * 1e3


def measure(label: str, options: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    start = time.perf_counter()
    sizes = tuple(sorted(set(args.batches)))
    rt = Runtime(args.preset, device=args.device, dtype=args.dtype, load_format="dummy", level=2,
                 attention_backend=args.backend, max_num_seqs=max(sizes), enable_prefix_caching=False,
                 max_num_batched_tokens=max(args.prefill, max(sizes)), compile_sizes=sizes,
                 cudagraph_capture_sizes=sizes if args.device == "cuda" else None,
                 gpu_memory_utilization=args.gpu_memory_utilization, quantization=args.quantization, **options)
    startup = time.perf_counter() - start
    manager = pass_manager_of(rt.engine.worker.compiled)
    row: dict[str, Any] = {"config": label, "startup_s": round(startup, 1),
                           "rewrites": manager.summary() if manager else "-"}
    for batch in args.batches:
        row[f"decode_b{batch}_ms"] = decode_ms(rt, batch, args.steps, args.device)
    row[f"prefill_{args.prefill}_ms"] = prefill_ms(rt, args.prefill, max(3, args.steps // 4), args.device)
    del rt, manager
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return row


def kernel_rows(preset: str, token_counts: list[int]) -> list[list[Any]]:
    """rope_kv at kernel level (CUDA graphs, so launch gaps count as in FULL-graph decode): the fused
    RoPE + cache write against what it replaces, Inductor's RoPE kernel (with the V copy the model makes)
    plus the backends' K/V write kernel."""
    from kiln.models.loader.presets import PRESETS

    cfg = PRESETS[preset]
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    dim = cfg.get("head_dim", cfg["hidden_size"] // hq)
    qk_norm = cfg["architectures"][0] == "Qwen3ForCausalLM"
    rows = []
    for tokens in token_counts:
        before, after = _time_rope_kv(hq, hkv, dim, qk_norm, tokens)
        rows.append([preset + (" (q/k norm)" if qk_norm else ""), tokens, before, after, before / after])
    return rows


def _time_rope_kv(hq: int, hkv: int, dim: int, qk_norm: bool, tokens: int) -> tuple[float, float]:
    """-> (unfused, fused) microseconds."""
    from triton.testing import do_bench_cudagraph

    from kiln.attention.triton_backend import reshape_and_cache
    from kiln.passes.kernels import norm_rope_triton
    from kiln.passes.ops import norm_rope_ref

    dev, bf16 = "cuda", torch.bfloat16
    qkv = torch.randn(tokens, (hq + 2 * hkv) * dim, device=dev, dtype=bf16)
    q, k, v = (t.view(tokens, -1, dim) for t in qkv.split([hq * dim, hkv * dim, hkv * dim], -1))
    pos = torch.randint(0, 4096, (tokens,), device=dev)
    cos_sin = torch.randn(4096, dim, device=dev)
    cache = torch.zeros(tokens // 16 + 2, 2, 16, hkv, dim, device=dev, dtype=bf16)
    slots = torch.randperm(cache.shape[0] * 16, device=dev)[:tokens]
    w = (torch.ones(dim, device=dev, dtype=bf16),) * 2 if qk_norm else (None, None)
    rope = torch.compile(lambda q, k, v: (*norm_rope_ref(q, k, pos, cos_sin, *w, 1e-6), v.contiguous()),
                         dynamic=False)

    def unfused() -> None:
        _, k_rot, v_c = rope(q, k, v)
        reshape_and_cache(k_rot, v_c, cache, slots)

    def fused() -> None:
        norm_rope_triton(q, k, pos, cos_sin, *w, 1e-6, v=v, kv_cache=cache, slot_mapping=slots)

    unfused()
    return do_bench_cudagraph(unfused) * 1e3, do_bench_cudagraph(fused) * 1e3


def silu_quant_rows(n: int, token_counts: list[int]) -> list[list[Any]]:
    """silu_mul_quant at kernel level (CUDA graphs): Inductor's kernel for the unfused SiLU-mul + per-token
    quantization (compiled per row count) against kiln's one-program-a-row kernel (kiln/passes/kernels.py)."""
    from triton.testing import do_bench_cudagraph

    from kiln.passes.kernels import silu_mul_quant_triton
    from kiln.passes.ops import silu_mul_quant_ref

    rows = []
    for tokens in token_counts:
        torch._dynamo.reset()  # a compile per row count: past Dynamo's recompile limit it would run eagerly
        inductor = torch.compile(silu_mul_quant_ref, dynamic=False)
        x = torch.randn(tokens, 2 * n, device="cuda", dtype=torch.bfloat16)
        inductor(x)
        before = do_bench_cudagraph(lambda x=x, f=inductor: f(x)) * 1e3
        after = do_bench_cudagraph(lambda x=x: silu_mul_quant_triton(x)) * 1e3
        rows.append([n, tokens, before, after, before / after])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="smollm2-135m")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bf16 on GPU, fp32 on CPU")
    parser.add_argument("--backend", default="auto", help="attention backend (auto, flashinfer, triton, torch)")
    parser.add_argument("--configs", nargs="+", default=["off", "default", *ALL_PASSES, "all"])
    parser.add_argument("--batches", type=int, nargs="+", default=None, help="decode batch sizes")
    parser.add_argument("--prefill", type=int, default=None, help="prefill prompt tokens")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps per batch size")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--quantization", default=None, choices=["fp8"], help="an FP8 model (silu_mul_quant)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--kernels", nargs="*", default=None, metavar="PRESET",
                        help="only the rope_kv kernel micro-benchmark (CUDA), for these presets")
    parser.add_argument("--silu-quant-kernels", type=int, nargs="*", default=None, metavar="N",
                        help="only the silu_mul_quant kernel micro-benchmark (CUDA) at these widths (8B's 14336)")
    args = parser.parse_args()
    if args.silu_quant_kernels is not None:
        rows = [r for n in (args.silu_quant_kernels or [14336])
                for r in silu_quant_rows(n, [1, 8, 16, 32, 64, 128, 256, 1024, 4096])]
        print(f"\nsilu_mul_quant kernels (us) | {stamp()}\n")
        print(table(["N", "tokens", "Inductor us", "kiln us", "Inductor / kiln"], rows))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"stamp": stamp(), "silu_quant_kernels": rows}, f, indent=1)
        return
    if args.kernels is not None:
        rows = [r for p in (args.kernels or [args.preset]) for r in kernel_rows(p, [1, 32, 256, 2048])]
        print(f"\nrope_kv kernels | {stamp()}\n")
        print(table(["shapes", "tokens", "unfused us", "fused us", "x"], rows))
        return
    on_gpu = args.device == "cuda"
    args.dtype = args.dtype or ("bf16" if on_gpu else "fp32")
    args.batches = args.batches or ([1, 16, 64] if on_gpu else [1, 4])
    args.prefill = args.prefill or (1024 if on_gpu else 64)
    configs = configurations(args.configs)

    rows = [measure(label, options, args) for label, options in configs.items()]
    base = next((r for r in rows if r["config"] == "off"), rows[0])
    metrics = [k for k in rows[0] if k.endswith("_ms")]
    headers = ["config", *[m.removesuffix("_ms") + " ms" for m in metrics], *[f"x {m.removesuffix('_ms')}"
                                                                           for m in metrics], "startup s", "rewrites"]
    body = [[r["config"], *[r[m] for m in metrics], *[base[m] / r[m] for m in metrics], r["startup_s"],
             r["rewrites"]] for r in rows]
    print(f"\nbench_passes: {args.preset} ({args.dtype}, {args.backend} attention) | {stamp()}")
    print(f"x = speed-up against {base['config']} (> 1 is faster); decode batches of "
          f"{PROMPT_LEN}-token prompts, prefill of one {args.prefill}-token prompt\n")
    print(table(headers, body))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"stamp": stamp(), "preset": args.preset, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
