"""The split-row argmax kernel (kiln/models/greedy_argmax.py) against torch's max / argmax, under Triton's
interpreter on the CPU: ties to the lowest id inside a slice and across slices, NaN rows, -inf rows, strided rows."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kiln.models.greedy_argmax import row_max  # noqa: E402
from kiln.models.greedy_argmax_triton import CHUNK, SLICES, row_max_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def check(logits: torch.Tensor) -> None:
    values, ids = row_max_triton(logits)
    want_values, want_ids = logits.max(dim=-1)
    assert torch.equal(ids.cpu(), want_ids.cpu())
    assert torch.equal(ids.cpu(), logits.argmax(dim=-1).cpu())
    assert values.dtype == logits.dtype
    assert torch.equal(values.cpu().isnan(), want_values.cpu().isnan())
    assert torch.equal(values.cpu().nan_to_num(), want_values.cpu().nan_to_num())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("rows", "vocab"), [(1, 1), (1, 100), (1, 3 * CHUNK + 17), (3, 2 * CHUNK), (5, 1000)])
def test_matches_torch(rows: int, vocab: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(rows * vocab)
    check(torch.randn(rows, vocab, generator=g).to(dtype).to(DEVICE))


def test_ties_go_to_the_lowest_id_within_and_across_slices() -> None:
    vocab = 3 * CHUNK + 5
    logits = torch.zeros(4, vocab, dtype=torch.bfloat16)
    logits[0, [7, 9, CHUNK + 1, 2 * CHUNK]] = 3.0  # the first slice holds the first of the ties
    logits[1, [CHUNK + 3, CHUNK + 4, 3 * CHUNK + 1]] = 2.0  # the ties start in a later slice
    logits[2] = -1.0  # the whole row ties
    logits[3, [3 * CHUNK + 4, 3 * CHUNK + 2]] = 1.0  # in the last, partial slice
    check(logits.to(DEVICE))


def test_nan_and_minus_inf_rows() -> None:
    vocab = 2 * CHUNK + 3
    logits = torch.randn(3, vocab)
    logits[0, [CHUNK + 5, 2 * CHUNK + 1]] = float("nan")  # the first NaN answers, even beside +inf
    logits[0, 3] = float("inf")
    logits[1] = float("-inf")  # every logit -inf: id 0
    logits[2, [10, CHUNK + 2]] = float("inf")
    check(logits.to(DEVICE))


def test_strided_rows_and_repeated_calls() -> None:
    # rows of a wider buffer (a padded batch's logits), and a second call: the row counters were reset
    wide = torch.randn(6, CHUNK + 300)
    check(wide[:, : CHUNK + 100].to(DEVICE) if DEVICE == "cpu" else wide.to(DEVICE)[:, : CHUNK + 100])
    check(wide[:2, : CHUNK + 100].to(DEVICE) if DEVICE == "cpu" else wide.to(DEVICE)[:2, : CHUNK + 100])


def test_a_vocabulary_past_the_slices_takes_wider_slices() -> None:
    check(torch.randn(1, SLICES * CHUNK + 3000).to(DEVICE))


def test_cpu_tensors_take_torch() -> None:
    logits = torch.randn(2, 50)
    values, ids = row_max(logits)
    assert torch.equal(ids, logits.argmax(dim=-1)) and torch.equal(values, logits.max(dim=-1).values)
