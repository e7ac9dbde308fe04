"""Each row's maximum logit and its id, for greedy decoding: a row split over many programs on CUDA.

Why: ATen's argmax gives one output row few blocks, so a decode step's single row of logits is walked by a small
part of the GPU: at batch 1 it took 36.1 us of Llama-3-8B's step (128,256 logits; the LM head that wrote them took
246 us; one H200, torch profiler, 2026-12-04). Here a row is cut into slices, one program each, and the last
program of a row to finish (an atomic ticket per row) picks the best slice: one launch, as before
(greedy_argmax_triton.py). Inside CUDA graphs on the H200 (`benchmarks/bench_argmax.py`, 2026-12-04), us, ATen
against this kernel: 128,256 logits 26.5 / 3.1 at 1 row, 27.2 / 9.6 at 64, 46.3 / 33.9 at 256; 151,936: 8.5 / 3.1,
21.8 / 11.1, 54.1 / 39.7; 49,152: 12.0 / 3.1, 12.3 / 5.7, 18.2 / 13.3. Its host launch is slower (~40 us a call
eagerly against ATen's 12-28), hidden behind the device under async scheduling. Rows above MAX_ROWS (none measured)
keep ATen's kernel (KILN_ARGMAX_MAX_ROWS; 0 turns the kernel off).

Same answer as torch: ties go to the lowest id, and a row holding a NaN answers its first NaN (torch's max
propagates NaN); the value is the logit itself, in the logits' dtype.
"""

from __future__ import annotations

import os

import torch

MAX_ROWS = int(os.environ.get("KILN_ARGMAX_MAX_ROWS", "256"))


def _takes_kernel(logits: torch.Tensor) -> bool:
    return (logits.is_cuda and logits.dim() == 2 and 0 < logits.shape[0] <= MAX_ROWS and logits.shape[1] > 0
            and logits.stride(1) == 1)


def row_max(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`logits.max(dim=-1)` as (values, int64 ids): the split kernel for a few rows on CUDA, else ATen's."""
    if _takes_kernel(logits):
        from kiln.models.greedy_argmax_triton import row_max_triton

        return row_max_triton(logits)
    return tuple(logits.max(dim=-1))


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)`: row_max's ids."""
    return row_max(logits)[1]
