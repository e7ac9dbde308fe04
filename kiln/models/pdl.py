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
`KILN_PDL` (kiln.config.PDL) switches it.
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


# KILN_PDL_PREFETCH=1: a weight-streaming GEMM first asks L2 for its slice of the weight (which no kernel writes),
# then waits; the wait then overlaps the first DRAM reads with the kernel before it
PREFETCH_WEIGHTS = os.environ.get("KILN_PDL_PREFETCH", "0") == "1"


@triton.jit
def prefetch_rows_l2(row_ptrs, nbytes):
    """Ask L2 for `nbytes` from each row pointer (a multiple of 16 bytes, 16-byte aligned): Hopper's bulk prefetch,
    one instruction a row, nothing loaded into registers."""
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; // $0", "=r,l,r",
                              [row_ptrs, tl.full(row_ptrs.shape, nbytes, tl.int32)], dtype=tl.int32, is_pure=False,
                              pack=1)


def pdl_launch(device: torch.device) -> dict[str, bool]:
    """A kernel's PDL constexpr and Triton's launch option, which must agree:
    `kernel[grid](..., **pdl_launch(x.device))`."""
    on = gdc_wait is not None and pdl_enabled(device)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}
