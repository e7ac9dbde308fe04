"""Programmatic dependent launch (PDL) for kiln's Triton kernels, on Hopper and later.

Why: a decode step is a chain of a few hundred kernels of a few microseconds each inside a CUDA graph, and each
one normally starts only after the one before it has finished and been torn down. A kernel launched with PDL
may have its programs scheduled as soon as every program of the kernel before it has signalled
(`gdc_launch_dependents`) or exited; its programs then wait on the device (`gdc_wait`) until that kernel has
completed and its writes are visible. Inductor emits the same pair in the kernels it generates
(`triton.enable_pdl`, set by kiln.config), so every Triton kernel of a step takes part.

The rule every kernel here keeps: `gdc_wait` comes before its first access to memory an earlier kernel may have
written (or may still be reading), in every program, so a kernel's completion implies its predecessors'. Kernels
that do not take part (cuBLAS, copies) launch plainly and wait for their predecessor in full, as before.
`KILN_PDL=0` (kiln.config.PDL) launches everything plainly.

Weights before the wait: no kernel writes a weight, so a weight-streaming GEMM may read it before `gdc_wait`. While
the kernel before it runs (a norm, attention: latency-bound, the DRAM idle), each program of the small-M GEMM asks
L2 for the first `KILN_GEMM_PREFETCH_KB` of its weight slice (Hopper's bulk prefetch, one instruction a row), so the
loads after the wait start from L2. The bound matters: asking for whole slices (up to 1.8 MB a program at
Llama-3-8B's down projection, far past L2) took 8B's batch-1 step from 4.32 to 6.42 ms and SmolLM2-135M's from 0.70
to 0.84 (one H200, 2026-12-03, `32c8378`).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kiln.config import pdl_enabled

try:  # Triton >= 3.5 on NVIDIA
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - an older Triton: pdl_launch() never turns PDL on
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """A kernel's first statement: wait for the previous kernel's results, then let the next kernel's programs
    be scheduled (they wait in turn, so signalling early costs them nothing but their place on an SM)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def pdl_launch(device: torch.device) -> dict[str, bool]:
    """A kernel's PDL constexpr and Triton's launch option, which must agree:
    `kernel[grid](..., **pdl_launch(x.device))`."""
    on = gdc_wait is not None and pdl_enabled(device)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


# L2 asked for per GEMM program before its wait, in KB (0: none). The programs of a GEMM's first wave (up to two an
# SM) prefetch together, so this times ~264 is what a GEMM puts in L2 ahead of its loads.
PREFETCH_KB = int(os.environ.get("KILN_GEMM_PREFETCH_KB", "0"))


def prefetch_row_bytes(weight: torch.Tensor, rows_per_program: int, pdl: bool) -> int:
    """The ROW_BYTES constexpr of `prefetch_weight_rows`: PREFETCH_KB over a program's weight rows, in whole 16-byte
    units, where PDL is on and the bulk prefetch's 16-byte alignment holds for every row; else 0 (none)."""
    aligned = (weight.data_ptr() | weight.stride(0) * weight.element_size()) % 16 == 0
    if not (pdl and aligned and PREFETCH_KB > 0):
        return 0
    return PREFETCH_KB * 1024 // rows_per_program // 16 * 16


@triton.jit
def prefetch_weight_rows(w_ptr, rows, s_wn, k_first, k_len, ROW_BYTES: tl.constexpr):
    """Before `pdl_start`: ask L2 for up to ROW_BYTES of each weight row from column k_first, the program's K range
    having k_len columns left (k_first * element size a multiple of 16). Nothing is loaded into registers."""
    if ROW_BYTES > 0:
        nbytes = tl.minimum(k_len * (w_ptr.dtype.element_ty.primitive_bitwidth // 8), ROW_BYTES) // 16 * 16
        if nbytes > 0:
            tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; // $0", "=r,l,r",
                                      [w_ptr + rows.to(tl.int64) * s_wn + k_first,
                                       tl.full(rows.shape, nbytes, tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
