"""Programmatic dependent launch (PDL) for kiln's Triton kernels, on Hopper and later.

Why: a decode step is a chain of a few hundred kernels of a few microseconds each inside a CUDA graph, and each
one normally starts only after the one before it has finished and been torn down. A kernel launched with PDL
may have its programs scheduled as soon as every program of the kernel before it has signalled
(`gdc_launch_dependents`) or exited; its programs then wait on the device (`gdc_wait`) until that kernel has
completed and its writes are visible. Inductor emits the same pair in the kernels it generates
(`triton.enable_pdl`, set by kiln.config), so every Triton kernel of a step takes part.

The rule every kernel here keeps: `gdc_wait` comes before its first access to memory the kernel just before it may
have written (or may still be reading), in every program, and before its `gdc_launch_dependents`. So a kernel's
completion implies its predecessors', and once a kernel's programs run, every kernel but the one just before it
has completed: what they wrote may be read before the wait (Inductor's kernels do the same). Kernels
that do not take part (cuBLAS, copies) launch plainly and wait for their predecessor in full, as before.
`KILN_PDL=0` (kiln.config.PDL) launches everything plainly.

Where loads go: a small operand whose value a kernel only needs at its end (a norm's weight after the row's
reduction, a GEMM's scales after its K loop) is still loaded first, its weights before the wait and what an earlier
kernel wrote right after it: at the end, Triton's PTX issues the load after the reduction's barriers or the loop,
and the program waits a DRAM round trip for a few bytes (the sm90 PTX tests count loads past the first barrier).

Measured and not kept: the small-M GEMM asking L2 for its weight slice (Hopper's bulk prefetch, one instruction a
row) before its wait, so that the wait would overlap the first DRAM reads. The whole slice: Llama-3-8B decode 6.42
against 4.32 ms at batch 1, SmolLM2-135M 0.84 against 0.70 (one H200, 2026-12-03, `32c8378`). Bounded to the first
64 KB of each program's slice (~17 MB a GEMM, inside L2): 8B 4.53 / 4.66 against 4.29 / 4.42 ms at batch 1 / 8,
SmolLM2 0.77 against 0.73 at batch 1, Qwen3-30B-A3B equal (one H200, 2026-12-03, `c61fcd4`, `KILN_GEMM_PREFETCH_KB`
as a decode-ab arm; benchmarks/results/2026-12-03-h200-c61fcd4). Loads before the wait into registers (one H200,
2026-12-04, one process per arm, benchmarks/results/2026-12-04-h200-007735e): the small-M GEMMs' first weight tile
(`KILN_GEMM_PRELOAD`, `337a7c5`) left SmolLM2-135M at batch 1 0.669 / 0.669 / 0.682 ms against 0.631 / 0.646 /
0.632 without, Llama-3-8B 4.250 against 4.255 / 4.264, Qwen3-30B-A3B 3.16 / 7.97 / 16.45 against 3.10 / 7.88 /
16.47 at batch 1 / 8 / 64; the decode attention's first tile of context (`KILN_DECODE_PREWAIT`, `e9ebb59`): 8B
4.311 against 4.317, SmolLM2 0.628 against 0.695 (the call's first process) and 0.632 (with qkv_rope<=16, which
then matched nothing on a GPU host: docs/passes.md), inside
the 0.63-0.74 ms that identical SmolLM2 processes read that day. Neither kept.
"""

from __future__ import annotations

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
