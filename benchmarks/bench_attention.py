"""Attention kernel micro-benchmark: decode and prefill time per backend at Llama-3-8B head shapes.

32 query / 8 KV heads, head_dim 128, bf16, 16-token blocks scattered over the cache. Decode is timed
eagerly (launch overhead included) and, for the graph-capable backends, as a CUDA-graph replay (kernel
time); both flush L2 between calls. Achieved bandwidth (KV read + q/out + KV write bytes) is printed
against the device-to-device copy bandwidth, and prefill FLOP/s against the bf16 matmul rate, both
measured in the same run.

    python -m benchmarks.bench_attention [--backends torch triton flashinfer] [--batches 1 8 64] [--json ab.json]
    # (decode by batch and context, prefill, and the mixed steps of --mixed, per backend)
    # the Triton decode kernel's launch configurations (every knob of SWEEP: tiles up to 64 requests and above, warps,
    # stages, split waves, split floor, merge), a long run; --vary names the knobs that matter at the batches given:
    python -m benchmarks.bench_attention --sweep --batches 1 8 64 256 --contexts 160 600 2048 --json sweep.json
    # only some knobs, the others at the default; a tensor-parallel rank's heads (70B at TP=2: 32 q / 4 kv):
    python -m benchmarks.bench_attention --sweep --vary min_tiles waves --heads 32 4 --batches 1 8
    # a knob's values given (KNOB=V,V): two tiles at three pipeline depths (BLOCK_N_WIDE: the tile above 64 requests)
    python -m benchmarks.bench_attention --sweep --vary BLOCK_N=32,64 num_stages --batches 8 64
    # mixed steps (prefill chunks beside decodes): the decodes in the varlen or the decode kernel, varlen tiles
    python -m benchmarks.bench_attention --mixed --json mixed.json [--tiles 64,64,4,2 64,32,4,2]
    # speculative verify batches (k + 1 tokens a request): the split-KV decode kernel (per token) against varlen
    python -m benchmarks.bench_attention --verify 4 15 --batches 1 8 --contexts 512 2048 [--heads 9 3 --head-dim 64]
    # an e4m3 KV cache (kv_cache_dtype="fp8") against the same shapes in bf16: run once with each
    python -m benchmarks.bench_attention --backends triton --batches 64 256 --contexts 2048 4096 --kv-cache-dtype fp8
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
from typing import Any

import torch
from triton.testing import do_bench

from benchmarks.common import measure_ceilings, stamp, table
from kiln.attention import AttentionLayout, select_backend
from kiln.attention.base import AttentionBackend, CommonAttentionMetadata, GraphSupport

HQ, HKV, D, BS = 32, 8, 128, 16
DTYPE = torch.bfloat16


def make_step(q_lens: list[int], contexts: list[int]) -> tuple[tuple[torch.Tensor, ...], CommonAttentionMetadata]:
    """Random q/k/v, a cache holding each request's context in shuffled blocks, and the step's metadata."""
    seq_lens = [c + n for c, n in zip(contexts, q_lens)]
    blocks = [-(-s // BS) for s in seq_lens]
    perm = torch.randperm(sum(blocks)) + 1
    width = max(blocks)
    tables = torch.zeros(len(q_lens), width, dtype=torch.int32)
    slots, cursor = [], 0
    for i, (n, ctx) in enumerate(zip(blocks, contexts)):
        tables[i, :n] = perm[cursor:cursor + n]
        cursor += n
        pos = torch.arange(ctx, ctx + q_lens[i])
        slots.append(tables[i, pos // BS].long() * BS + pos % BS)
    tokens = sum(q_lens)
    cache = torch.randn(1 + sum(blocks), 2, BS, HKV, D, dtype=DTYPE, device="cuda")
    q = torch.randn(tokens, HQ, D, dtype=DTYPE, device="cuda")
    k, v = (torch.randn(tokens, HKV, D, dtype=DTYPE, device="cuda") for _ in range(2))
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    common = CommonAttentionMetadata(len(q_lens), tokens, qsl.cuda(), lens.cuda(), tables.cuda(),
                                     torch.cat(slots).cuda(), qsl, lens, max(q_lens), max(seq_lens),
                                     all(n == 1 for n in q_lens))
    return (q, k, v, torch.empty_like(q), cache), common


def time_step(backend: AttentionBackend, tensors: tuple[torch.Tensor, ...], common: CommonAttentionMetadata,
              graph: bool) -> float:
    """Median milliseconds of one forward (KV write + attention), L2 flushed before each call."""
    q, k, v, out, cache = tensors
    metadata = backend.build_metadata(common)
    fn = lambda: backend.forward(q, k, v, out, cache, metadata)
    fn()
    if graph:
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        fn = g.replay
    return do_bench(fn, warmup=10, rep=50, return_mode="median")


SWEEP = dict(BLOCK_N=(32, 64, 128), BLOCK_N_WIDE=(32, 64, 128), num_warps=(4, 8), num_stages=(2, 3, 4),
             waves=(0.5, 1, 2, 8), one_split_waves=(1, 1.5, 2), min_tiles=(1, 2, 4), merge_chunks=(1, 2, 4))


def knob_values(arg: str) -> tuple[str, tuple | None]:
    """--vary's KNOB or KNOB=V,V (values of the knob's type; None: all of SWEEP's)."""
    knob, _, values = arg.partition("=")
    if knob not in SWEEP:
        raise argparse.ArgumentTypeError(f"unknown knob {knob!r} (one of {', '.join(SWEEP)})")
    cast = type(SWEEP[knob][0])
    return knob, tuple(cast(float(v)) for v in values.split(",")) if values else None


Shape = tuple[int, str, list[int]]  # (batch, label, each request's context)


def decode_shapes(batches: list[int], contexts: list[int], varlen: list[int] | None) -> list[Shape]:
    """(batch, label, each request's context): uniform contexts, or with --varlen LOW HIGH one seeded
    uniform draw per request (an offline run's mix of lengths)."""
    if varlen:
        return [(b, f"U({varlen[0]},{varlen[1]})", [random.Random(b).randint(*varlen) for _ in range(b)])
                for b in batches]
    return [(b, str(c), [c] * b) for b in batches for c in contexts]


def sweep(layout: AttentionLayout, shapes: list[Shape], ceil, json_path: str | None,
          vary: dict[str, tuple] | None = None) -> None:
    """Every Triton decode launch configuration in SWEEP (only the `vary` knobs, the rest at the default) at
    each shape, graph-replayed, checked against the default configuration's output; the best per shape and
    its gain over the default."""
    backend = select_backend("triton", layout, torch.device("cuda"))(layout, torch.device("cuda"))
    default = dict(backend.decode_cfg)
    vary = vary or dict.fromkeys(SWEEP)
    grid = {k: (vary[k] or v) if k in vary else (default[k],) for k, v in SWEEP.items()}
    configs = [dict(zip(grid, values)) for values in itertools.product(*grid.values())]
    elt = torch.finfo(DTYPE).bits // 8
    results, rows = [], []
    for batch, ctx, lens in shapes:
        tensors, common = make_step([1] * batch, [n - 1 for n in lens])
        bytes_moved = elt * D * (sum(lens) * HKV * 2 + batch * HQ * 2 + batch * HKV * 2)
        out, cache = tensors[3], tensors[4]
        snapshot = cache.clone()
        timed, reference = [], out
        for cfg in [default] + configs:
            backend.decode_cfg = cfg
            cache.copy_(snapshot)
            try:
                ms = time_step(backend, tensors, common, graph=True)
                err = float((out.float() - reference.float()).abs().max())
            except Exception as exc:  # noqa: BLE001 - a configuration that does not compile is skipped
                print(f"{cfg}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                continue
            if not timed:  # the default configuration's output is the reference of the others
                reference = out.clone()
            timed.append((ms, cfg, err))
            results.append(dict(batch=batch, ctx=ctx, heads=[HQ, HKV], us=ms * 1e3, err=err, **cfg,
                                of_ceiling=bytes_moved / (ms / 1e3) / ceil.copy_bytes_per_s))
        base = timed[0][0]
        ok = [t for t in timed[1:] if t[2] < 2e-2]
        best = min(ok, key=lambda t: t[0])
        rows.append([batch, ctx, base * 1e3, best[0] * 1e3, base / best[0], str(best[1]),
                     f"{100 * bytes_moved / (best[0] / 1e3) / ceil.copy_bytes_per_s:.0f}%",
                     max(t[2] for t in timed)])
        print(rows[-1], flush=True)
        if json_path:  # after every shape: a sweep cut short keeps what it measured
            with open(json_path, "w") as f:
                json.dump({"stamp": stamp(), "default": default, "results": results}, f, indent=1)
    backend.decode_cfg = default
    print(table(["batch", "ctx", "default us", "best us", "gain", "best config", "of ceiling", "max err"], rows))


MIXED_SWEEP = dict(rows=(64, 128), BLOCK_N=(32, 64, 128), num_warps=(4, 8), num_stages=(2, 3))
BEFORE_TILE = (128, 64, 8, 2)  # the varlen tile before the --mixed sweep of 2026-11-30 (rows, keys, warps, stages)


def mixed_steps(seed: int = 0) -> list[tuple[str, list[int], list[int]]]:
    """(label, q_lens, contexts) of mixed batches, leading decodes first as the scheduler orders them: an
    offline step carrying prefill chunks (issue 16's workload: ~126 decodes beside fresh prompts of U(100,
    1024) tokens filling an 8192-token budget), smaller serving-like mixes, and long fresh prompts alone."""
    rng = random.Random(seed)
    prompts, budget = [], 8192 - 126
    while budget > 0:
        prompts.append(min(budget, rng.randint(100, 1024)))
        budget -= prompts[-1]
    steps = [("offline: 126 decodes + 8066 prompt tokens", [1] * 126 + prompts,
              [rng.randint(100, 1024) for _ in range(126)] + [0] * len(prompts))]
    for decodes, prompt in ((8, 512), (32, 2048), (64, 256), (2, 1024)):
        steps.append((f"{decodes} decodes + {prompt}-token prompt", [1] * decodes + [prompt],
                      [rng.randint(100, 1024) for _ in range(decodes)] + [0]))
    return steps + [("prefill 8 x 4096", [4096] * 8, [0] * 8), ("prefill 1 x 8192", [8192], [0])]


def tile_cfg(tile: tuple[int, ...], group_pad: int) -> dict[str, int]:
    rows, block_n, warps, stages = tile
    return dict(GROUP_PAD=group_pad, BLOCK_Q=max(rows, group_pad, 16) // group_pad, BLOCK_N=block_n,
                num_warps=warps, num_stages=stages)


def mixed(layout: AttentionLayout, json_path: str | None, tiles: list[tuple[int, ...]] | None) -> None:
    """Mixed (prefill + decode) steps and long prefills, eager as they run: before (every request in the
    varlen kernel, the old tile), the leading decodes split off at the old tile, the defaults, then the
    varlen tiles (`tiles`, or all of MIXED_SWEEP) on the split path."""
    backend = select_backend("triton", layout, torch.device("cuda"))(layout, torch.device("cuda"))
    default_cfg, default_min = dict(backend._prefill_cfg), backend.mixed_decode_min
    group_pad = default_cfg["GROUP_PAD"]
    before = tile_cfg(BEFORE_TILE, group_pad)
    arms = [("before", 0, before), ("split, before's tile", 1, before), ("defaults", default_min, default_cfg)]
    for tile in tiles or list(itertools.product(*MIXED_SWEEP.values())):
        arms.append((f"split, {tile[0]} rows x {tile[1]} keys, {tile[2]}w {tile[3]}s", 1, tile_cfg(tile, group_pad)))
    results, rows = [], []
    for label, q_lens, contexts in mixed_steps():
        tensors, common = make_step(q_lens, contexts)
        out, cache = tensors[3], tensors[4]
        snapshot = cache.clone()
        flops = sum(4 * HQ * D * (c * n + n * (n + 1) / 2) for n, c in zip(q_lens, contexts))
        timed: dict[str, float] = {}
        for name, least, cfg in arms:
            backend.mixed_decode_min, backend._prefill_cfg = least, cfg
            cache.copy_(snapshot)
            try:
                ms = time_step(backend, tensors, common, graph=False)
            except Exception as exc:  # noqa: BLE001 - a configuration that does not compile is skipped
                print(f"{name}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                continue
            if not timed:
                reference = out.clone()
            err = float((out.float() - reference.float()).abs().max())
            timed[name] = ms
            results.append(dict(step=label, arm=name, least=least, us=ms * 1e3, err=err, **cfg,
                                tflops=flops / (ms / 1e3) / 1e12))
        base = timed["before"]
        best = min(timed.items(), key=lambda kv: kv[1])
        rows.append([label, base * 1e3, timed["defaults"] * 1e3, base / timed["defaults"], best[0],
                     best[1] * 1e3, base / best[1], f"{flops / (timed['defaults'] / 1e3) / 1e12:.0f}",
                     max(r["err"] for r in results if r["step"] == label)])
        print(rows[-1], flush=True)
    backend.mixed_decode_min, backend._prefill_cfg = default_min, default_cfg
    print(table(["step", "before us", "defaults us", "gain", "best arm", "best us", "best gain",
                 "defaults TFLOP/s", "max err"], rows))
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"stamp": stamp(), "defaults": default_cfg, "decode_split_min": default_min,
                       "results": results}, f, indent=1)


def verify(layout: AttentionLayout, batches: list[int], contexts: list[int], ks: list[int],
           json_path: str | None) -> None:
    """Uniform verify batches (every request k + 1 new tokens) as a FULL graph replays them: the split-KV decode
    kernel, a decode's programs per token (so each token's attention is its decode's, bit for bit), against the
    varlen kernel (the path every multi-token batch took before), whatever the token bound, and a one-token
    decode of the same batch and context beside them."""
    from kiln.attention import triton_backend

    backend = select_backend("triton", layout, torch.device("cuda"))(layout, torch.device("cuda"))
    bound = triton_backend.MAX_MULTI_TOKEN_TOKENS
    header = ["batch", "ctx", "k", "decode us", "varlen us", "split us", "varlen / split", "split / decode",
              "max |split - varlen|", "default"]
    rows, results = [], []
    for batch, ctx, k in itertools.product(batches, contexts, ks):
        decode = time_step(backend, *make_step([1] * batch, [ctx] * batch), graph=True)
        tensors, common = make_step([k + 1] * batch, [ctx] * batch)
        timed, outs = {}, {}
        for arm, tokens in (("split", 1 << 30), ("varlen", 0)):
            triton_backend.MAX_MULTI_TOKEN_TOKENS = tokens
            timed[arm] = time_step(backend, tensors, common, graph=True)
            outs[arm] = tensors[3].clone()
        triton_backend.MAX_MULTI_TOKEN_TOKENS = bound
        err = float((outs["split"].float() - outs["varlen"].float()).abs().max())
        rows.append([batch, ctx, k, decode * 1e3, timed["varlen"] * 1e3, timed["split"] * 1e3,
                     timed["varlen"] / timed["split"], timed["split"] / decode, err,
                     "split" if batch * (k + 1) <= bound else "varlen"])
        results.append(dict(zip(header, rows[-1])))
        print(rows[-1], flush=True)
    print(f"{stamp()}\n{HQ} q / {HKV} kv heads, D={D}, bf16, CUDA-graph replays, L2 flushed")
    print(table(header, rows))
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"stamp": stamp(), "heads": [HQ, HKV], "head_dim": D, "results": results}, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backends", nargs="+", default=["torch", "triton", "flashinfer"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--sweep", action="store_true", help="sweep the Triton decode launch configurations")
    parser.add_argument("--varlen", type=int, nargs=2, metavar=("LOW", "HIGH"),
                        help="decode: each request's context uniform in [LOW, HIGH] instead of --contexts")
    parser.add_argument("--vary", nargs="+", type=knob_values, metavar="KNOB[=V,V]",
                        help=f"sweep only these knobs ({', '.join(SWEEP)}), at the given values or all of SWEEP's")
    parser.add_argument("--mixed", action="store_true",
                        help="mixed steps: leading decodes in the varlen or the decode kernel, varlen configs")
    parser.add_argument("--tiles", nargs="+", default=None, metavar="ROWS,KEYS,WARPS,STAGES",
                        help="--mixed: only these varlen tiles (default: all of MIXED_SWEEP)")
    parser.add_argument("--heads", type=int, nargs=2, metavar=("HQ", "HKV"), default=[HQ, HKV],
                        help="query and KV heads (one tensor-parallel rank's share)")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                        help="the default mode: a cache of the model dtype, or e4m3 (kv_cache_dtype='fp8')")
    parser.add_argument("--head-dim", type=int, default=D)
    parser.add_argument("--verify", type=int, nargs="+", metavar="K",
                        help="verify batches of K proposals (K + 1 tokens a request), split-KV against varlen")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    # make_step and the byte counts read them
    globals().update(HQ=args.heads[0], HKV=args.heads[1], D=args.head_dim)
    ceil = measure_ceilings()
    kv_dtype = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else None
    layout = AttentionLayout(HQ, HKV, D, D ** -0.5, BS, DTYPE, kv_dtype)
    if args.verify:
        verify(layout, args.batches, args.contexts, args.verify, args.json)
        return
    if args.mixed:
        mixed(layout, args.json, [tuple(int(x) for x in t.split(",")) for t in args.tiles] if args.tiles else None)
        return
    if args.sweep:
        sweep(layout, decode_shapes(args.batches, args.contexts, args.varlen), ceil, args.json,
              dict(args.vary) if args.vary else None)
        return
    backends: dict[str, AttentionBackend] = {}
    for name in args.backends:
        try:
            backends[name] = select_backend(name, layout, torch.device("cuda"))(layout, torch.device("cuda"))
        except ValueError as e:
            print(f"skipping {name}: {e}")
    elt = torch.finfo(DTYPE).bits // 8
    kv_elt = 1 if kv_dtype is not None else elt

    def step_inputs(q_lens: list[int], contexts: list[int]) -> tuple[tuple[torch.Tensor, ...], Any]:
        tensors, common = make_step(q_lens, contexts)
        if kv_dtype is not None:  # the same cache in e4m3 (its range clamped first)
            tensors = (*tensors[:4], tensors[4].clamp(-448, 448).to(kv_dtype))
        return tensors, common

    rows = []
    for batch, ctx, lens in decode_shapes(args.batches, args.contexts, args.varlen):
        tensors, common = step_inputs([1] * batch, [n - 1 for n in lens])
        bytes_moved = D * (kv_elt * (sum(lens) * HKV * 2 + batch * HKV * 2) + elt * batch * HQ * 2)
        for name, backend in backends.items():
            eager = time_step(backend, tensors, common, graph=False)
            graphed = (time_step(backend, tensors, common, graph=True)
                       if backend.graph_support >= GraphSupport.UNIFORM_DECODE else float("nan"))
            best = eager if math.isnan(graphed) else min(eager, graphed)
            bw = bytes_moved / (best / 1e3)
            rows.append([name, "decode", batch, ctx, eager * 1e3, graphed * 1e3, f"{bw / 1e9:.0f} GB/s",
                         f"{100 * bw / ceil.copy_bytes_per_s:.0f}%"])
    for batch in [b for b in args.batches if b <= 8]:
        for length in args.contexts:
            tensors, common = step_inputs([length] * batch, [0] * batch)
            flops = batch * 4 * HQ * D * length * (length + 1) / 2  # QK^T and PV over the causal half
            for name, backend in backends.items():
                ms = time_step(backend, tensors, common, graph=False)
                rate = flops / (ms / 1e3)
                rows.append([name, "prefill", batch, length, ms * 1e3, float("nan"), f"{rate / 1e12:.0f} TFLOP/s",
                             f"{100 * rate / ceil.matmul_flops_per_s:.0f}%"])
    for label, q_lens, contexts in mixed_steps():  # prefill chunks beside decodes, as the scheduler mixes them
        tensors, common = step_inputs(q_lens, contexts)
        flops = sum(4 * HQ * D * (c * n + n * (n + 1) / 2) for n, c in zip(q_lens, contexts))
        for name, backend in backends.items():
            ms = time_step(backend, tensors, common, graph=False)
            rate = flops / (ms / 1e3)
            rows.append([name, "mixed", label, "", ms * 1e3, float("nan"), f"{rate / 1e12:.0f} TFLOP/s",
                         f"{100 * rate / ceil.matmul_flops_per_s:.0f}%"])
    print(f"{stamp()}\ncopy bandwidth {ceil.copy_bytes_per_s / 1e12:.2f} TB/s, bf16 matmul "
          f"{ceil.matmul_flops_per_s / 1e12:.0f} TFLOP/s; {HQ} q / {HKV} kv heads, D={D}, bf16, "
          f"KV cache {args.kv_cache_dtype}")
    header = ["backend", "phase", "batch", "ctx", "eager us", "graph us", "achieved", "of ceiling"]
    print(table(header, rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"stamp": stamp(), "copy_bytes_per_s": ceil.copy_bytes_per_s,
                       "matmul_flops_per_s": ceil.matmul_flops_per_s, "rows": [dict(zip(header, r)) for r in rows]},
                      f, indent=1)


if __name__ == "__main__":
    main()
