"""The greedy argmax kernel (kiln/runtime/greedy_argmax.py) against torch.argmax: ties to the lowest id across and
within chunks, rows of -inf (a grammar mask), vocabularies off the chunk, strided rows (the interpreter on the CPU)."""

from __future__ import annotations

import pytest
import torch

from kiln.runtime.greedy_argmax import CHUNK, argmax_triton, greedy_argmax

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("rows,vocab", [(1, 49152), (3, CHUNK * 2 + 5), (5, 100)])
def test_matches_torch_argmax(rows: int, vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16  # the interpreter mis-loads bf16
    logits = torch.randn(rows, vocab, generator=g).to(dtype)
    logits[0, vocab // 3] = logits[0, vocab - 1] = 30.0  # a tie across chunks: the lower id wins
    if rows > 1:
        logits[1] = float("-inf")  # everything masked: id 0, as torch
    if rows > 2:
        logits[2, 7] = logits[2, 8] = 40.0  # a tie inside a chunk
    logits = logits.to(DEVICE)
    assert torch.equal(argmax_triton(logits).cpu(), logits.argmax(dim=-1).cpu())
    assert torch.equal(greedy_argmax(logits).cpu(), logits.argmax(dim=-1).cpu())


def test_strided_rows_and_empty_batches() -> None:
    wide = torch.randn(4, 300, generator=torch.Generator().manual_seed(0)).half().to(DEVICE)
    rows = wide[:, :257]  # rows contiguous, a stride of 300 between them
    assert torch.equal(argmax_triton(rows).cpu(), rows.argmax(dim=-1).cpu())
    assert argmax_triton(wide[:0]).shape == (0,)
