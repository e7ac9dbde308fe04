"""A matrix-vector kernel for one token's projections of large weights: each program streams a few weight rows
through a K loop and dots them against the token on the CUDA cores (e4m3 weights, both scales applied).

Why: at one token the MMA kernel (kiln/models/quant/fp8_kernel.py) pads the token to a 16-row MMA tile and needs
split-K (and a reduce kernel after it) where N alone gives too few tiles. A dot on the CUDA cores has neither
constraint: any number of rows a program, so many small programs spread every projection over the SMs in even
waves, and no partial sums to reduce. The products are exact in fp32, so the values are the MMA kernel's up to
summation order. (Small 16-bit weights have a kernel that holds whole rows in registers, kiln/models/gemv.py.)

Only M = 1 (decode at batch 1): the kernel reads the weight once per token. A runner that speculates suspends it as
it suspends gemv.py's kernel: its decode must equal its verify bit for bit.
On where it measured faster than the MMA kernel: the H100 (Llama-3-8B's four FP8 projections at one token 2.635 ->
2.541 ms a step, floor 2.313; FP8 8B decode at batch 1 3.538, 3.534 -> 3.513, 3.504 ms; 2026-12-06, two processes per
arm, alternated; docs/models.md). Off on the H200, where FP8 8B decode at batch 1 took 2.819, 2.819 ms with it against
2.760, 2.761 without (2026-12-06, the same method; not profiled), and on GPUs where it was never measured.
`KILN_FP8_GEMV=1` / `0` turns it on / off anywhere. 16-bit weights took it too, measured and removed: no faster in a
decode step (docs/models.md). The rule (`pick_config`) also shapes the MoE pair kernels at one token
(fused_moe/kernels.py), whatever the GPU.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kiln.models import gemv
from kiln.models.pdl import pdl_launch, pdl_start

# KILN_FP8_GEMV=1 / 0: on / off anywhere; unset (None), on the GPUs named in _FASTER_ON
FP8_ENABLED: bool | None = None if "KILN_FP8_GEMV" not in os.environ else os.environ["KILN_FP8_GEMV"] == "1"
_FASTER_ON = ("H100",)  # device names holding one of these: where the kernel beat the MMA kernel (above)
# Programs the rule aims for per SM: several resident programs keep enough weight loads in flight. 4: the sweep's best
# rows at every Llama-3-8B FP8 projection (one H100, 2026-12-06, the e4m3 rows of `bench_gemm --part gemv-stream`; 8
# took half the rows at o and qkv, 3-4% slower there)
_PROGRAMS_PER_SM = 4
_TILE_BYTES = 4096  # weight bytes a program loads per K step
if "KILN_GEMV_STREAM_RULE" in os.environ:  # "PROGRAMS_PER_SM:TILE_BYTES", an A/B arm on another GPU
    try:
        _PROGRAMS_PER_SM, _TILE_BYTES = (int(v) for v in os.environ["KILN_GEMV_STREAM_RULE"].split(":"))
    except ValueError:
        raise ValueError("KILN_GEMV_STREAM_RULE: expected PROGRAMS_PER_SM:TILE_BYTES, e.g. 4:8192, got "
                         f"{os.environ['KILN_GEMV_STREAM_RULE']!r}") from None


@dataclass(frozen=True)
class GemvStreamConfig:
    """rows: weight rows a program dots; block_k: K elements a step; num_warps / num_stages: Triton's (its pipeliner
    leaves this loop alone: 1 and 3 stages timed the same)."""

    rows: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


@functools.cache
def _faster_on(device: torch.device) -> bool:
    return device.type == "cuda" and any(name in torch.cuda.get_device_name(device) for name in _FASTER_ON)


def applies(m: int, element_bytes: int, device: torch.device) -> bool:
    """Whether M tokens' projection by a weight of `element_bytes` (1: e4m3) on `device` runs here."""
    if element_bytes != 1 or m != 1 or gemv.is_suspended():
        return False
    return FP8_ENABLED if FP8_ENABLED is not None else _faster_on(device)


def pick_config(n: int, k: int, num_sms: int, element_bytes: int = 1) -> GemvStreamConfig:
    """The most rows a program (at most 16) that still leaves _PROGRAMS_PER_SM programs an SM, and a K step of
    _TILE_BYTES."""
    rows = 16
    while rows > 1 and triton.cdiv(n, rows) < _PROGRAMS_PER_SM * num_sms:
        rows //= 2
    return GemvStreamConfig(rows, min(triton.next_power_of_2(k), max(16, _TILE_BYTES // (rows * element_bytes))))


@triton.jit
def _gemv_stream_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, N, K, s_wn, R: tl.constexpr, BLOCK_K: tl.constexpr,
                        EVEN: tl.constexpr, MODE: tl.constexpr, PDL: tl.constexpr = False):
    """Program p: output columns [p R, p R + R). MODE (gemv.py's): OUT, out in its dtype, times both scales;
    PARTIALS, the fp32 sums (a kernel after it finishes them)."""
    rows = tl.program_id(0) * R + tl.arange(0, R)
    row_mask = rows < N
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows[:, None].to(tl.int64) * s_wn + offs_k[None, :]
    if MODE == 0:  # the scales before the loop, the weight's before the wait (after the loop: a DRAM round trip)
        ws = tl.load(ws_ptr + rows, mask=row_mask, other=0.0)
    pdl_start(PDL)
    if MODE == 0:
        xs = tl.load(xs_ptr)
    acc = tl.zeros((R, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        # The weight's loads before the token's: with the token's first, 8B's FP8 projections streamed 3-8% slower
        # (gate_up 43.0-43.7 against 40.2 us) and FP8 8B decode at batch 1 took 3.617 / 3.610 against 3.506 / 3.505
        # ms (one H100, 2026-12-06; docs/models.md)
        if EVEN:  # N % R == 0 and K % BLOCK_K == 0
            w = tl.load(w_ptrs)
            x = tl.load(x_ptr + k0 + offs_k)
        else:
            k_mask = k0 + offs_k < K
            mask = row_mask[:, None] & k_mask[None, :]
            w = tl.load(w_ptrs, mask=mask, other=0.0)
            x = tl.load(x_ptr + k0 + offs_k, mask=k_mask, other=0.0)
        x = x.to(tl.float32)[None, :]
        acc += w.to(tl.float32) * x
        w_ptrs += BLOCK_K
    sums = tl.sum(acc, 1)
    if MODE == 1:
        tl.store(out_ptr + rows, sums, mask=row_mask)
    else:
        dtype = out_ptr.dtype.element_ty
        sums = sums * xs * ws  # the MMA kernel's order
        tl.store(out_ptr + rows, sums.to(dtype), mask=row_mask)


def gemv_stream(x: torch.Tensor, weight: torch.Tensor,
                scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                out_dtype: torch.dtype = torch.bfloat16, mode: int = gemv.OUT,
                config: GemvStreamConfig | None = None) -> torch.Tensor:
    """x [1, K] (e4m3) @ weight [N, K]^T (e4m3) -> [1, N] in out_dtype, scaled by `scales` (flat fp32 x_scale [1],
    w_scale [N]); gemv.PARTIALS: its unscaled fp32 sums as one split's partials [1, 1, N] (no scales read)."""
    (m, k), n = x.shape, weight.shape[0]
    if m != 1:
        raise ValueError(f"x: one token expected, got shape {tuple(x.shape)}")
    if scales is None and mode != gemv.PARTIALS:
        raise ValueError("scales: the output is scaled; only partials go without")
    from kiln.models.quant.fp8_kernel import num_sms

    config = config or pick_config(n, k, num_sms(x.device), weight.element_size())
    if mode == gemv.PARTIALS:
        out = torch.empty((1, 1, n), dtype=torch.float32, device=x.device)
    else:
        out = torch.empty((1, n), dtype=out_dtype, device=x.device)
    xs, ws = scales if scales is not None else (out, out)  # unread for partials
    even = n % config.rows == 0 and k % config.block_k == 0
    _gemv_stream_kernel[(triton.cdiv(n, config.rows),)](
        x, xs, weight, ws, out, n, k, weight.stride(0), R=config.rows, BLOCK_K=config.block_k, EVEN=even, MODE=mode,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_launch(x.device))
    return out
