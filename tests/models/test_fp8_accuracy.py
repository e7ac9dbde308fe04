"""The FP8 accuracy measurement (benchmarks/fp8_accuracy.py): its metrics against hand-computed values, and the
embedded model served in FP8 (online, per-channel weights, per-token activations) against bf16 on real text."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.fp8_accuracy import EVAL, compare, measure


def test_top1_and_kl_are_the_textbook_ones() -> None:
    p, q = [0.5, 0.3, 0.2], [0.2, 0.3, 0.5]
    ref = [torch.tensor([p, p]).log()]
    other = [torch.tensor([p, q]).log() + 3.0]  # logits: a constant shift changes nothing
    got = compare(ref, other)
    # position 1 agrees exactly; position 2: argmax 0 vs 2, KL(p || q) = 0.5 ln(0.5/0.2) + 0.2 ln(0.2/0.5)
    assert got["positions"] == 2 and got["top1"] == 0.5
    assert got["mean_kl"] == pytest.approx((0.5 * math.log(2.5) + 0.2 * math.log(0.4)) / 2, rel=1e-5)


@pytest.mark.slow
def test_embedded_model_in_fp8_follows_bf16_on_real_text(embedded_dir) -> None:
    """Teacher-forced over the Dickens passage (145 positions), FP8 and bf16 activations both: measured
    (2026-12-01, CPU, torch 2.13) top-1 agreement 0.924 and mean KL(bf16 || fp8) 0.037 nats; over all five
    passages (906 positions) 0.876 and 0.082. The bounds leave room for another CPU's bf16 kernels; an
    activation scale off by 2x (saturating the largest values) measured 0.23 and 3.3."""
    result = measure(str(embedded_dir), granularities=("channel/token",), lm_head=False, fp32_reference=False,
                     texts=EVAL[2:3])
    bf16, fp8 = result["rows"]
    assert bf16["model"] == "bf16" and fp8["model"] == "channel/token"
    assert fp8["bf16"]["positions"] == 145
    print(f"fp8 vs bf16: top-1 {fp8['bf16']['top1']:.3f}, mean KL {fp8['bf16']['mean_kl']:.4f}")
    assert fp8["bf16"]["top1"] >= 0.85
    assert fp8["bf16"]["mean_kl"] <= 0.08
    assert fp8["perplexity"] < 1.1 * bf16["perplexity"]
