"""A decode step's projection chain at batch 1: one kernel per projection against one persistent kernel.

Why: at one token a small model's step is a few hundred dependent kernels of 1-3 us each (SmolLM2-135M: eight
a layer, 19.1 us, for 7 MB of weights), so what costs is the boundary between kernels, not bytes. This measures
what a boundary costs against a grid-wide barrier inside one kernel that stays resident for all the layers, on
the same arithmetic: per layer, h += Wo . (Wqkv . norm(h))[:H] and h += Wd . silu_mul(Wgu . norm(h)) (attention
left out, its output stood in for by the first H of qkv), weights streamed from HBM (more than L2 in all).

Arms, each a CUDA graph of all the layers, replayed and alternated in rounds:
- `kernels`: four GEMV kernels a layer (each norms its input itself), launched with programmatic dependent launch
  as kiln's are;
- `kernels+preload`: the same, each program loading its first weight tile before the PDL wait;
- `persistent`: one kernel, one program per SM, a grid barrier (an atomic counter) between the phases;
- `persistent+prefetch`: the same, each program loading its next phase's first weight tile before the barrier;
- `kiln gemm`: kiln's small-M GEMM (kiln/models/quant/fp8_kernel.py, its tuned tiles) for the four projections,
  no norms: what kiln's own kernels take for the bytes;
- `barriers only` / `empty kernels`: as many grid barriers / empty PDL kernels (a program per SM) as the chain has
  phases, no work: what a boundary costs by itself.

    python -m benchmarks.bench_persistent --json /tmp/persistent.json
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from benchmarks.common import measure_ceilings, stamp, table
from kiln.models.pdl import gdc_wait, pdl_launch, pdl_start

EPS = 1e-5


@dataclass(frozen=True)
class Shape:
    hidden: int
    qkv: int
    inter: int
    layers: int

    @property
    def per_layer(self) -> int:  # weight elements a layer: Wqkv, Wo, Wgu (gate rows, then up rows), Wd
        h = self.hidden
        return self.qkv * h + h * h + 2 * self.inter * h + h * self.inter


SHAPES = {"smollm2-135m": Shape(576, 960, 1536, 30)}


@triton.jit
def _load_rows(w_ptr, block, N, K: tl.constexpr, KP: tl.constexpr, R: tl.constexpr):
    """Rows [block * R, block * R + R) of a row-major [N, K] weight, K padded to KP (masked: no bytes read)."""
    rows = block * R + tl.arange(0, R)
    offs_k = tl.arange(0, KP)
    return tl.load(w_ptr + rows[:, None] * K + offs_k[None, :],
                   mask=(rows < N)[:, None] & (offs_k < K)[None, :], other=0.0)


@triton.jit
def _dot(w, x):
    return tl.sum(w.to(tl.float32) * x[None, :], 1)


@triton.jit
def _load_act(ptr, K: tl.constexpr, KP: tl.constexpr):
    """An activation another program wrote: through L2 (.cg), never a stale L1 line."""
    offs = tl.arange(0, KP)
    return tl.load(ptr + offs, mask=offs < K, other=0.0, cache_modifier=".cg")


@triton.jit
def _normed(h_ptr, H: tl.constexpr, HP: tl.constexpr):
    h = _load_act(h_ptr, H, HP)
    return h * tl.rsqrt(tl.sum(h * h, 0) / H + 1e-5)


@triton.jit
def _phase_qkv(w_ptr, first, pid, nprog, h_ptr, qkv_ptr, H: tl.constexpr, HP: tl.constexpr, Q: tl.constexpr,
               R: tl.constexpr):
    """qkv = Wqkv . norm(h); `first` is this program's first tile (block pid), already loaded."""
    x = _normed(h_ptr, H, HP)
    rows = pid * R + tl.arange(0, R)
    tl.store(qkv_ptr + rows, _dot(first, x), mask=rows < Q)
    for block in range(pid + nprog, tl.cdiv(Q, R), nprog):
        rows = block * R + tl.arange(0, R)
        tl.store(qkv_ptr + rows, _dot(_load_rows(w_ptr, block, Q, H, HP, R), x), mask=rows < Q)


@triton.jit
def _residual_add(h_ptr, block, y, N, R: tl.constexpr):
    rows = block * R + tl.arange(0, R)
    mask = rows < N
    tl.store(h_ptr + rows, tl.load(h_ptr + rows, mask=mask, other=0.0, cache_modifier=".cg") + y, mask=mask)


@triton.jit
def _phase_o(w_ptr, first, pid, nprog, h_ptr, qkv_ptr, H: tl.constexpr, HP: tl.constexpr, R: tl.constexpr):
    """h += Wo . qkv[:H]."""
    x = _load_act(qkv_ptr, H, HP)
    _residual_add(h_ptr, pid, _dot(first, x), H, R)
    for block in range(pid + nprog, tl.cdiv(H, R), nprog):
        _residual_add(h_ptr, block, _dot(_load_rows(w_ptr, block, H, H, HP, R), x), H, R)


@triton.jit
def _silu_mul_store(act_ptr, block, g, u, N, R: tl.constexpr):
    rows = block * R + tl.arange(0, R)
    tl.store(act_ptr + rows, g / (1 + tl.exp(-g)) * u, mask=rows < N)


@triton.jit
def _phase_gate_up(w_ptr, first_g, first_u, pid, nprog, h_ptr, act_ptr, H: tl.constexpr, HP: tl.constexpr,
                   NI: tl.constexpr, R: tl.constexpr):
    """act = silu(Wg . norm(h)) * (Wu . norm(h)); a block is R gate rows and the matching R up rows."""
    x = _normed(h_ptr, H, HP)
    _silu_mul_store(act_ptr, pid, _dot(first_g, x), _dot(first_u, x), NI, R)
    for block in range(pid + nprog, tl.cdiv(NI, R), nprog):
        g = _dot(_load_rows(w_ptr, block, NI, H, HP, R), x)
        u = _dot(_load_rows(w_ptr + NI * H, block, NI, H, HP, R), x)
        _silu_mul_store(act_ptr, block, g, u, NI, R)


@triton.jit
def _phase_down(w_ptr, first, pid, nprog, h_ptr, act_ptr, H: tl.constexpr, NI: tl.constexpr, NIP: tl.constexpr,
                RD: tl.constexpr):
    """h += Wd . act."""
    x = _load_act(act_ptr, NI, NIP)
    _residual_add(h_ptr, pid, _dot(first, x), H, RD)
    for block in range(pid + nprog, tl.cdiv(H, RD), nprog):
        _residual_add(h_ptr, block, _dot(_load_rows(w_ptr, block, H, NI, NIP, RD), x), H, RD)


@triton.jit
def _layer_weights(w_ptr, layer, H: tl.constexpr, Q: tl.constexpr, NI: tl.constexpr):
    wq = w_ptr + tl.cast(layer, tl.int64) * (Q * H + H * H + 3 * NI * H)
    wo = wq + Q * H
    wgu = wo + H * H
    return wq, wo, wgu, wgu + 2 * NI * H


@triton.jit
def _first_tiles(wq, wo, wgu, wd, pid, PHASE: tl.constexpr, H: tl.constexpr, HP: tl.constexpr, Q: tl.constexpr,
                 NI: tl.constexpr, NIP: tl.constexpr, R: tl.constexpr, RD: tl.constexpr):
    """Program pid's first weight tile of projection PHASE (and, for gate_up, its up tile; the same tile else)."""
    if PHASE == 0:
        first = _load_rows(wq, pid, Q, H, HP, R)
        first_u = first
    elif PHASE == 1:
        first = _load_rows(wo, pid, H, H, HP, R)
        first_u = first
    elif PHASE == 2:
        first = _load_rows(wgu, pid, NI, H, HP, R)
        first_u = _load_rows(wgu + NI * H, pid, NI, H, HP, R)
    else:
        first = _load_rows(wd, pid, H, NI, NIP, RD)
        first_u = first
    return first, first_u


@triton.jit
def _projection_kernel(w_ptr, h_ptr, qkv_ptr, act_ptr, layer, PHASE: tl.constexpr, H: tl.constexpr,
                       HP: tl.constexpr, Q: tl.constexpr, NI: tl.constexpr, NIP: tl.constexpr, R: tl.constexpr,
                       RD: tl.constexpr, PRELOAD: tl.constexpr, PDL: tl.constexpr = False):
    """One projection of one layer (PHASE 0 qkv, 1 o, 2 gate_up, 3 down), a program per block of rows. PRELOAD:
    the program's weight tile is loaded before the PDL wait (weights are never written, so that is safe)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    wq, wo, wgu, wd = _layer_weights(w_ptr, layer, H, Q, NI)
    if PRELOAD:
        first, first_u = _first_tiles(wq, wo, wgu, wd, pid, PHASE, H, HP, Q, NI, NIP, R, RD)
    pdl_start(PDL)
    if not PRELOAD:
        first, first_u = _first_tiles(wq, wo, wgu, wd, pid, PHASE, H, HP, Q, NI, NIP, R, RD)
    if PHASE == 0:
        _phase_qkv(wq, first, pid, nprog, h_ptr, qkv_ptr, H, HP, Q, R)
    elif PHASE == 1:
        _phase_o(wo, first, pid, nprog, h_ptr, qkv_ptr, H, HP, R)
    elif PHASE == 2:
        _phase_gate_up(wgu, first, first_u, pid, nprog, h_ptr, act_ptr, H, HP, NI, R)
    else:
        _phase_down(wd, first, pid, nprog, h_ptr, act_ptr, H, NI, NIP, RD)


@triton.jit
def _grid_sync(bar_ptr, target):
    """Wait until every program has arrived `target` times in all (the counter only grows within a launch): the
    block-wide barrier orders this program's stores before thread 0's release; the acquire after the wait
    orders the others' before this program's next loads (which go through L2: `_load_act`)."""
    tl.debug_barrier()
    count = tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu") + 1
    while count < target:
        count = tl.load(bar_ptr, volatile=True)
    tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _barrier_then_tiles(bar_ptr, arrivals, wq, wo, wgu, wd, pid, PHASE: tl.constexpr, PREFETCH: tl.constexpr,
                        H: tl.constexpr, HP: tl.constexpr, Q: tl.constexpr, NI: tl.constexpr, NIP: tl.constexpr,
                        R: tl.constexpr, RD: tl.constexpr):
    """The grid barrier before projection PHASE and that projection's first tiles, loaded before the barrier
    (PREFETCH) or after it."""
    if PREFETCH:
        first, first_u = _first_tiles(wq, wo, wgu, wd, pid, PHASE, H, HP, Q, NI, NIP, R, RD)
    _grid_sync(bar_ptr, arrivals)
    if not PREFETCH:
        first, first_u = _first_tiles(wq, wo, wgu, wd, pid, PHASE, H, HP, Q, NI, NIP, R, RD)
    return first, first_u


@triton.jit
def _persistent_kernel(w_ptr, h_ptr, qkv_ptr, act_ptr, bar_ptr, layers, H: tl.constexpr, HP: tl.constexpr,
                       Q: tl.constexpr, NI: tl.constexpr, NIP: tl.constexpr, R: tl.constexpr, RD: tl.constexpr,
                       PREFETCH: tl.constexpr):
    """Every layer's four projections in one launch, a grid barrier after each; at most one program per SM, all
    resident (the barrier needs it). PREFETCH: each program loads its first tile of the next phase before it
    waits at the barrier (the weights do not depend on the phase before)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    arrivals = 0
    wq, wo, wgu, wd = _layer_weights(w_ptr, 0, H, Q, NI)
    first_q = _load_rows(wq, pid, Q, H, HP, R)
    for layer in range(layers):
        wq, wo, wgu, wd = _layer_weights(w_ptr, layer, H, Q, NI)
        if not PREFETCH:
            first_q = _load_rows(wq, pid, Q, H, HP, R)
        _phase_qkv(wq, first_q, pid, nprog, h_ptr, qkv_ptr, H, HP, Q, R)
        arrivals += nprog
        first_o, _ = _barrier_then_tiles(bar_ptr, arrivals, wq, wo, wgu, wd, pid, 1, PREFETCH, H, HP, Q, NI, NIP, R,
                                         RD)
        _phase_o(wo, first_o, pid, nprog, h_ptr, qkv_ptr, H, HP, R)
        arrivals += nprog
        first_g, first_u = _barrier_then_tiles(bar_ptr, arrivals, wq, wo, wgu, wd, pid, 2, PREFETCH, H, HP, Q, NI,
                                               NIP, R, RD)
        _phase_gate_up(wgu, first_g, first_u, pid, nprog, h_ptr, act_ptr, H, HP, NI, R)
        arrivals += nprog
        first_d, _ = _barrier_then_tiles(bar_ptr, arrivals, wq, wo, wgu, wd, pid, 3, PREFETCH, H, HP, Q, NI, NIP, R,
                                         RD)
        _phase_down(wd, first_d, pid, nprog, h_ptr, act_ptr, H, NI, NIP, RD)
        if PREFETCH:  # the next layer's (the last layer reads its own again: nothing past the buffer)
            next_q, _, _, _ = _layer_weights(w_ptr, tl.minimum(layer + 1, layers - 1), H, Q, NI)
            first_q = _load_rows(next_q, pid, Q, H, HP, R)
        arrivals += nprog
        _grid_sync(bar_ptr, arrivals)


@triton.jit
def _barriers_kernel(bar_ptr, count):
    """`count` grid barriers and nothing else: what one costs."""
    for i in range(count):
        _grid_sync(bar_ptr, (i + 1) * tl.num_programs(0))


@triton.jit
def _empty_kernel(PDL: tl.constexpr = False):
    """A kernel that only takes part in PDL: what a boundary costs."""
    pdl_start(PDL)


class Chain:
    """The weights and activations of `shape`, and each arm as a callable that runs every layer once."""

    R = 8  # rows a block for the K = hidden projections
    RD = 4  # and for down (its K padded to a power of two is larger)

    def __init__(self, shape: Shape, device: str, programs: int, warps: int):
        self.shape, self.device, self.programs, self.warps = shape, device, programs, warps
        gen = torch.Generator(device=device).manual_seed(0)
        self.weights = (torch.randn(shape.layers * shape.per_layer, device=device, generator=gen)
                        / math.sqrt(shape.hidden)).to(torch.bfloat16)
        self.h0 = torch.randn(shape.hidden, device=device, generator=gen)
        self.h = self.h0.clone()
        self.qkv = torch.zeros(shape.qkv, device=device)
        self.act = torch.zeros(shape.inter, device=device)
        self.barrier = torch.zeros(1, dtype=torch.int32, device=device)
        s = shape
        self.meta = {"H": s.hidden, "HP": triton.next_power_of_2(s.hidden), "Q": s.qkv, "NI": s.inter,
                     "NIP": triton.next_power_of_2(s.inter), "R": self.R, "RD": self.RD}

    def layer_views(self, layer: int) -> tuple[torch.Tensor, ...]:
        s, h = self.shape, self.shape.hidden
        w = self.weights[layer * s.per_layer:(layer + 1) * s.per_layer]
        sizes = [s.qkv * h, h * h, 2 * s.inter * h, h * s.inter]
        wq, wo, wgu, wd = torch.split(w, sizes)
        return wq.view(s.qkv, h), wo.view(h, h), wgu.view(2 * s.inter, h), wd.view(h, s.inter)

    def reference(self) -> torch.Tensor:
        """The chain in fp32 torch from h0."""
        h = self.h0.clone()
        for layer in range(self.shape.layers):
            wq, wo, wgu, wd = (w.float() for w in self.layer_views(layer))
            normed = lambda v: v * torch.rsqrt(v.square().mean() + EPS)  # noqa: E731
            h = h + wo @ (wq @ normed(h))[:self.shape.hidden]
            g, u = (wgu @ normed(h)).chunk(2)
            h = h + wd @ (torch.nn.functional.silu(g) * u)
        return h

    def kernels(self, preload: bool) -> None:
        self.h.copy_(self.h0)
        s, m = self.shape, self.meta
        grids = [triton.cdiv(s.qkv, self.R), triton.cdiv(s.hidden, self.R), triton.cdiv(s.inter, self.R),
                 triton.cdiv(s.hidden, self.RD)]
        pdl = pdl_launch(self.h.device)
        for layer in range(s.layers):
            for phase, grid in enumerate(grids):
                _projection_kernel[(grid,)](self.weights, self.h, self.qkv, self.act, layer, PHASE=phase,
                                            PRELOAD=preload, num_warps=4, **m, **pdl)

    def persistent(self, prefetch: bool) -> None:
        self.h.copy_(self.h0)
        self.barrier.zero_()
        _persistent_kernel[(self.programs,)](self.weights, self.h, self.qkv, self.act, self.barrier,
                                             self.shape.layers, PREFETCH=prefetch, num_warps=self.warps,
                                             **self.meta)

    def barriers_only(self) -> None:
        self.barrier.zero_()
        _barriers_kernel[(self.programs,)](self.barrier, 4 * self.shape.layers, num_warps=self.warps)

    def empty_kernels(self) -> None:
        pdl = pdl_launch(self.h.device)
        for _ in range(4 * self.shape.layers):
            _empty_kernel[(self.programs,)](num_warps=4, **pdl)

    def kiln_gemm(self) -> None:
        from kiln.models.quant.fp8_kernel import bf16_gemm_triton

        x, act = self.h0.to(torch.bfloat16)[None], self.act.to(torch.bfloat16)[None]
        for layer in range(self.shape.layers):  # the inputs stay fixed: the same kernels, one after another
            wq, wo, wgu, wd = self.layer_views(layer)
            for inputs, weight in ((x, wq), (x, wo), (x, wgu), (act, wd)):
                bf16_gemm_triton(inputs, weight)


def arms(chain: Chain) -> dict:
    return {"kernels": lambda: chain.kernels(False), "kernels+preload": lambda: chain.kernels(True),
            "persistent": lambda: chain.persistent(False), "persistent+prefetch": lambda: chain.persistent(True),
            "kiln gemm": chain.kiln_gemm, "barriers only": chain.barriers_only, "empty kernels": chain.empty_kernels}


def check(chain: Chain) -> dict[str, float]:
    """Each Triton arm's h after all layers against the fp32 reference: max |diff| / max |ref|."""
    ref = chain.reference()
    errors = {}
    for name, run in arms(chain).items():
        if name in ("kiln gemm", "barriers only", "empty kernels"):
            continue
        run()
        errors[name] = ((chain.h - ref).abs().max() / ref.abs().max()).item()
        if name.startswith("persistent"):  # each program arrived once a barrier (not once a thread)
            arrivals = chain.barrier.item()
            assert arrivals == 4 * chain.shape.layers * chain.programs, arrivals
    return errors


def time_arms(chain: Chain, rounds: int, replays: int) -> dict[str, list[float]]:
    """us a step of each arm, its CUDA graph replayed `replays` times, arms alternated over `rounds`."""
    graphs = {}
    for name, run in arms(chain).items():
        run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        graphs[name] = graph
    times: dict[str, list[float]] = {name: [] for name in graphs}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(rounds):
        for name, graph in graphs.items():
            graph.replay()
            start.record()
            for _ in range(replays):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end) * 1e3 / replays)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, help="fewer layers than the model's (the CPU check)")
    parser.add_argument("--programs", type=int, help="the persistent kernel's programs (default: one per SM)")
    parser.add_argument("--warps", type=int, default=4, help="the persistent kernel's warps a program")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--json")
    args = parser.parse_args()
    print(stamp())
    shape = SHAPES[args.model]
    if args.layers:
        shape = Shape(shape.hidden, shape.qkv, shape.inter, args.layers)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    programs = args.programs or (torch.cuda.get_device_properties(0).multi_processor_count if cuda else 1)
    chain = Chain(shape, device, programs, args.warps)
    errors = check(chain)
    print("max |h - fp32 reference| / max |reference|:", {k: f"{v:.2e}" for k, v in errors.items()})
    result = {"stamp": stamp(), "model": args.model, "shape": vars(shape) | {"per_layer": shape.per_layer},
              "programs": programs, "warps": args.warps, "errors": errors, "pdl": bool(gdc_wait is not None)}
    if cuda:
        times = time_arms(chain, args.rounds, args.replays)
        floor_us = shape.layers * shape.per_layer * 2 / measure_ceilings().copy_bytes_per_s * 1e6
        base = min(times["kernels"])
        print(table(["arm", "us a step (best)", "us a step (median)", "us a layer", "x bytes floor", "kernels / arm"],
                    [[name, min(t), sorted(t)[len(t) // 2], min(t) / shape.layers, min(t) / floor_us, base / min(t)]
                     for name, t in times.items()]))
        result |= {"times_us": times, "floor_us": floor_us}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


main()
