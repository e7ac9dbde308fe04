"""`kiln::fused_moe`: the torch reference against a dense formula, and the Triton kernels (both shapes: the pair
kernels of decode and the grouped ones over tokens sorted per expert) against the reference on random routing,
with experts that get no tokens, pairs routed to another rank's experts, FP8 weights, and 1 to 1000 tokens.
Without a GPU the kernels run under Triton's CPU interpreter (small shapes: it is slow)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.conftest import define_interpreted  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    define_interpreted("kiln.models.fused_moe.align_triton", "kiln.models.fused_moe.kernels",
                       "kiln.models.fused_moe.routing_triton", "kiln.models.quant.fp8_kernel")

from kiln.models.fused_moe.align import align_by_expert, max_padded_pairs  # noqa: E402
from kiln.models.fused_moe.align_triton import align_by_expert_triton  # noqa: E402
from kiln.models.fused_moe.configs import MoeKernelConfig, heuristic, pick_config  # noqa: E402
from kiln.models.fused_moe.kernels import fused_moe_triton  # noqa: E402
from kiln.models.fused_moe.reference import fused_moe_reference  # noqa: E402
from kiln.models.fused_moe.routing import moe_topk_reference  # noqa: E402
from kiln.models.fused_moe.routing_triton import moe_route_triton, moe_topk_triton  # noqa: E402
from kiln.models.quant.fp8 import quantize_weight  # noqa: E402


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def problem(tokens: int, experts: int, top_k: int, hidden: int, inter: int, seed: int, unused: int = 0):
    """Random x, stacked weights and top-k routing; the first `unused` experts are never chosen."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1
    w2 = torch.randn(experts, hidden, inter, generator=g) * 0.1
    logits = torch.randn(tokens, experts, generator=g)
    logits[:, :unused] = -1e4
    weights, ids = torch.topk(logits.softmax(-1), top_k, dim=-1)
    return x, w13, w2, weights, ids.to(torch.int32)


def on_device(x, w13, w2, weights, ids, fp8: bool = False) -> list[torch.Tensor]:
    """The op's arguments on DEVICE; fp8: the experts quantized to e4m3 and their scales after the ids."""
    scales = ()
    if fp8:
        (w13, s13), (w2, s2) = quantize_weight(w13), quantize_weight(w2)
        scales = (s13, s2)
    return [t.to(DEVICE) for t in (x, w13, w2, weights, ids, *scales)]


def test_reference_is_the_dense_formula() -> None:
    x, w13, w2, weights, ids = problem(9, 6, 2, 16, 8, seed=1, unused=2)
    ids[0, 1] = 6  # a pair on another rank's expert: contributes nothing
    gate, up = torch.einsum("th,enh->ten", x, w13).chunk(2, dim=-1)
    every = torch.einsum("tei,ehi->teh", torch.nn.functional.silu(gate) * up, w2)  # [T, E, H]
    dense = torch.zeros(9, 7).scatter_add_(1, ids.long(), weights)[:, :6]  # routing weight per (token, expert)
    expected = (every * dense.unsqueeze(-1)).sum(1)
    out = fused_moe_reference(x, w13, w2, weights, ids)
    assert out.shape == (9, 16)  # each token's k weighted rows, summed
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens, experts, top_k, config, remote", [
    (1, 8, 2, MoeKernelConfig(1, 16, 32), True),      # decode: pair kernels
    (1, 8, 2, MoeKernelConfig(16, 16, 16), True),     # one token through the grouped kernels
    (5, 8, 3, MoeKernelConfig(1, 32, 16), False),     # N and K not multiples of the tile
    (37, 8, 2, MoeKernelConfig(16, 32, 32), True),
    (37, 6, 4, MoeKernelConfig(32, 16, 16), False),
    (1000, 8, 5, MoeKernelConfig(64, 32, 32), True),  # 5000 pairs: the torch layout (align.py)
])
def test_kernels_match_reference(tokens: int, experts: int, top_k: int, config: MoeKernelConfig,
                                 remote: bool) -> None:
    """Each token's sum of its pairs' weighted rows; with `remote` (expert parallelism) a third of the tokens route a
    pair to another rank's expert, which must add nothing (the grouped kernels never visit it)."""
    x, w13, w2, weights, ids = problem(tokens, experts, top_k, 40, 24, seed=tokens, unused=2)
    if remote:
        ids[::3, 0] = experts
    x, w13, w2, weights, ids = (t.to(DEVICE) for t in (x, w13, w2, weights, ids))
    got = fused_moe_triton(x, w13, w2, weights, ids, remote_experts=remote, config=config)
    assert got.shape == (tokens, 40)
    torch.testing.assert_close(got, fused_moe_reference(x, w13, w2, weights, ids), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("tokens, experts, top_k, block_m", [(1, 128, 8, 16), (8, 8, 4, 16), (16, 8, 4, 16),
                                                             (3, 6, 2, 32)])
def test_pair_blocks_equal_the_align_layout(tokens: int, experts: int, top_k: int, block_m: int,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to PAIR_BLOCK_TOKENS tokens each pair has a block of the grouped kernels to itself: the same rows (bit
    for bit on the GPU) as through align's layout, with pairs on another rank's experts and (16 tokens) an expert
    holding more pairs than a block (ids repeated within a token). The bound is raised here to reach many tokens."""
    from kiln.models.fused_moe import kernels

    x, w13, w2, weights, ids = problem(tokens, experts, top_k, 40, 24, seed=tokens + experts)
    ids[::3, 0] = experts
    if tokens == 16:
        ids[:, 1:3] = 1
    x, w13, w2, weights, ids = (t.to(DEVICE) for t in (x, w13, w2, weights, ids))
    config = MoeKernelConfig(block_m, 16, 16)
    monkeypatch.setattr(kernels, "PAIR_BLOCK_TOKENS", tokens)
    pair_blocks = fused_moe_triton(x, w13, w2, weights, ids, remote_experts=True, config=config)
    monkeypatch.setattr(kernels, "PAIR_BLOCK_TOKENS", 0)
    aligned = fused_moe_triton(x, w13, w2, weights, ids, remote_experts=True, config=config)
    if DEVICE == "cuda":
        assert torch.equal(pair_blocks, aligned)
    else:  # the interpreter's tl.dot is numpy's matmul, whose OpenBLAS kernel (picked per CPU model) may round a row
        # by its place in the block: 1.5e-8 apart on one row of 16 tokens (OpenBLAS 0.3.31, Triton 3.9, 2026-12-05)
        torch.testing.assert_close(pair_blocks, aligned, rtol=0, atol=1e-7)
    torch.testing.assert_close(pair_blocks, fused_moe_reference(x, w13, w2, weights, ids), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fp8, hidden, inter", [(False, 40, 24), (True, 40, 24), (False, 32, 32)])
def test_one_token_streams_its_pairs_by_the_rule(fp8: bool, hidden: int, inter: int,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """KILN_MOE_STREAM: one token's experts take the pair kernels at the streaming kernel's rule (rows for ~4
    programs an SM over the k experts' gate rows, a 4 KB weight step); the reference's sums, e4m3 weights too, a
    pair on another rank's expert adding nothing; 32 x 32: whole K steps (the loops without masks). Suspended (a
    speculating runner) and past one token: the table's."""
    from kiln.models import gemv
    from kiln.models.fused_moe import kernels

    config = kernels.one_token_config(8, 768, 2048, 2, torch.device("cpu"))  # Qwen3-30B-A3B on 132 SMs
    assert (config.block_m, config.block_n, config.block_k) == (1, 8, 256)  # 8 * 96 = 768 programs >= 4 * 132
    assert kernels.one_token_config(8, 768, 2048, 1, torch.device("cpu")).block_k == 512
    x, w13, w2, weights, ids = problem(1, 6, 3, hidden, inter, seed=5)
    ids[0, 2] = 6
    args = on_device(x, w13, w2, weights, ids, fp8)
    chosen = []
    real = kernels.one_token_config
    monkeypatch.setattr(kernels, "one_token_config", lambda *a: chosen.append(real(*a)) or chosen[-1])
    monkeypatch.setattr(kernels, "STREAM_ONE_TOKEN", True)
    got = fused_moe_triton(*args, remote_experts=True)
    assert [c.block_m for c in chosen] == [1] and (hidden % chosen[0].block_k == 0) == (hidden == 32)
    torch.testing.assert_close(got, fused_moe_reference(*args), rtol=1e-4, atol=1e-5)
    with gemv.suspended():
        fused_moe_triton(*args, remote_experts=True)
    two = [t.to(DEVICE) for t in problem(2, 6, 3, hidden, inter, seed=6)]
    fused_moe_triton(*two)
    assert len(chosen) == 1


@pytest.mark.parametrize("tokens, top_k, remote, fp8, repeat", [
    (1, 4, False, False, False),  # k a power of two, whole tiles, every expert local: the loads without masks
    (3, 4, False, True, True),    # e4m3 experts, one expert twice in a token
    (2, 3, True, False, False),   # k padded to 4 slots, pairs on another rank's expert
])
def test_pair_path_down_kernel_sums_each_tokens_pairs(tokens: int, top_k: int, remote: bool, fp8: bool,
                                                      repeat: bool) -> None:
    """The pair path's down kernel streams the same rows of a token's k experts in one tile and writes their
    weighted sum: the reference's sum whether the slots fill a power of two or not, an expert repeats (a slot
    holds its own weight) or a slot's expert is on another rank (it adds nothing). Its tile is the streaming
    rule's over the token's rows with the k experts' K side by side."""
    from kiln.models.fused_moe import kernels

    assert kernels.token_down_tile(8, 768, 2048, 2, torch.device("cpu")) == (2, 128)  # 1024 programs, 4 KB a step
    assert kernels.token_down_tile(8, 768, 2048, 1, torch.device("cpu")) == (2, 256)
    x, w13, w2, weights, ids = problem(tokens, 8, top_k, 32, 32, seed=11 + tokens)
    if repeat:
        ids[1, 1] = ids[1, 0]
    if remote:
        ids[0, 1] = 8
    args = on_device(x, w13, w2, weights, ids, fp8)
    got = fused_moe_triton(*args, remote_experts=remote, config=MoeKernelConfig(1, 16, 16))
    torch.testing.assert_close(got, fused_moe_reference(*args), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("block_m", [1, 16])
def test_kernels_with_fp8_weights_match_reference(block_m: int) -> None:
    x, w13, w2, weights, ids = problem(6, 4, 2, 32, 16, seed=7)
    w13, s13 = quantize_weight(w13)
    w2, s2 = quantize_weight(w2)
    assert s13.shape == (4, 32) and s2.shape == (4, 32)  # one scale per (expert, output channel)
    args = [t.to(DEVICE) for t in (x, w13, w2, weights, ids, s13, s2)]
    got = fused_moe_triton(*args, config=MoeKernelConfig(block_m, 16, 16))
    torch.testing.assert_close(got, fused_moe_reference(*args), rtol=1e-4, atol=1e-5)


def test_align_by_expert_lays_every_pair_out_once() -> None:
    g = torch.Generator().manual_seed(3)
    experts, block_m = 8, 4
    ids = torch.randint(0, experts + 1, (50, 2), generator=g)  # value 8: another rank's expert
    ids[ids == 5] = 6  # expert 5 gets nothing
    sorted_pairs, block_expert = align_by_expert(ids, experts, block_m)
    assert sorted_pairs.numel() == max_padded_pairs(100, experts, block_m) == block_expert.numel() * block_m
    flat = ids.reshape(-1)
    real = sorted_pairs[sorted_pairs < 100].long()
    assert sorted(real.tolist()) == [p for p in range(100) if flat[p] < experts]  # each local pair once
    for block, expert in enumerate(block_expert.tolist()):
        rows = sorted_pairs[block * block_m:(block + 1) * block_m].long()
        rows = rows[rows < 100]
        if expert == experts:
            assert rows.numel() == 0
        else:
            assert rows.numel() > 0 and (flat[rows] == expert).all()
    assert 5 not in block_expert.tolist()


@pytest.mark.parametrize("tokens, experts, top_k, block_m", [(1, 8, 2, 16), (50, 8, 2, 4), (64, 128, 8, 16),
                                                             (13, 6, 3, 64)])
def test_triton_align_equals_torch_align(tokens: int, experts: int, top_k: int, block_m: int) -> None:
    """The one-program Triton layout (decode and short prefills) is exactly the torch one."""
    ids = torch.randint(0, experts + 1, (tokens, top_k), generator=torch.Generator().manual_seed(tokens))
    ids = ids.to(torch.int32)
    want = align_by_expert(ids, experts, block_m)
    got = align_by_expert_triton(ids.to(DEVICE), experts, block_m)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


@pytest.mark.parametrize("tokens, experts, top_k", [(1, 128, 8), (7, 8, 2), (3, 60, 4), (5, 6, 6)])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routing_kernel_matches_torch(tokens: int, experts: int, top_k: int, renormalize: bool,
                                      dtype: torch.dtype) -> None:
    """The routing's top-k kernel: the same experts as torch.topk (as sets: the order is free) and, per expert,
    the same weight, on 16-bit logits as the router's GEMM leaves them; E not a power of two, k = E; ties for
    first place."""
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(tokens + experts)).to(dtype)
    logits[0, 1::2] = logits[0, 0]  # ties for first place
    got = moe_topk_triton(logits.to(DEVICE), top_k, renormalize)
    assert got[1].dtype == torch.int32 and got[0].dtype == torch.float32
    same_routing(got, moe_topk_reference(logits, top_k, renormalize))


@pytest.mark.parametrize("tokens, experts, top_k, hidden", [(1, 128, 8, 2048), (5, 8, 2, 96), (16, 60, 4, 1024)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_routing_from_the_gemms_sums_is_routing_its_output(tokens: int, experts: int, top_k: int, hidden: int,
                                                           renormalize: bool) -> None:
    """At decode sizes the top-k kernel adds the router GEMM's split-K partials itself: the same experts and the
    same weights, bit for bit, as the small-M GEMM's output through the plain top-k kernel (split K or not)."""
    from kiln.models.quant.fp8_kernel import bf16_gemm_triton

    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16  # the interpreter mis-loads bf16
    g = torch.Generator().manual_seed(tokens * experts)
    x = torch.randn(tokens, hidden, generator=g).to(dtype).to(DEVICE)
    weight = (torch.randn(experts, hidden, generator=g) * 0.1).to(dtype).to(DEVICE)
    got = moe_route_triton(x, weight, top_k, renormalize)
    want = moe_topk_triton(bf16_gemm_triton(x, weight), top_k, renormalize)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


def same_routing(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    """The same experts per token (as sets) with the same weight each."""
    (weights, ids), (want_weights, want_ids) = got, want
    got_order, want_order = ids.cpu().long().sort(dim=-1), want_ids.long().sort(dim=-1)
    assert torch.equal(got_order.values, want_order.values)
    torch.testing.assert_close(weights.cpu().gather(1, got_order.indices),
                               want_weights.gather(1, want_order.indices), rtol=1e-5, atol=1e-6)


def test_config_table_and_rule() -> None:
    assert heuristic(128, 8, 1).block_m == 1 and heuristic(128, 8, 64).block_m == 16
    assert heuristic(128, 8, 4096).block_m == 64
    # a shape the table does not hold takes its nearest tuned shape (same K, top-k, dtype), else the rule
    assert pick_config(7, 24, 40, 2, 3, torch.float32) == heuristic(7, 2, 3)
    for tokens in (1, 8, 64, 3000):  # expert parallel over 2 ranks: Qwen3-30B-A3B's 128 experts' entry
        assert pick_config(64, 768, 2048, 8, tokens, torch.bfloat16) == \
            pick_config(128, 768, 2048, 8, tokens, torch.bfloat16)
    assert pick_config(64, 768, 2048, 8, 1, torch.bfloat16).block_m > 1  # the grouped kernels, not the rule's
    # the nearest N wins over the nearest E: split over 2 ranks and expert parallel over 2 more
    assert pick_config(64, 384, 2048, 8, 8, torch.bfloat16) == pick_config(128, 384, 2048, 8, 8, torch.bfloat16)


@pytest.mark.parametrize("kernel, vector_loads", [("token_down", 3), ("token_down_fp8", 4), ("sum_pairs", 8),
                                                  ("top_k", 0)])
def test_summing_kernels_compile_for_hopper(kernel: str, vector_loads: int) -> None:
    """Ahead-of-time compile for sm90 (no GPU needed), which the CPU interpreter never does: the kernels build, take
    part in programmatic dependent launch and load in 16-byte vectors (a K step of the down kernel: its weight
    tile's 32 bytes a thread and the token's h, 16 bytes bf16 / 32 at e4m3's longer step; the sum: a vector per
    pair row), or they could not stream at bandwidth. The down kernel loads its routing before the wait (ids, pair
    weights; e4m3: the scales), only what the gate/up kernel wrote after it. The top-k kernel builds and takes part."""
    from tests.models.test_fp8_kernel import sm90_ptx

    ptx = sm90_ptx(kernel)
    assert ptx["gdc_wait"] and ptx["launch_pdl"], ptx
    assert ptx["ld_v4"] >= vector_loads, ptx
    if kernel.startswith("token_down"):  # ids and pair weights (e4m3: and scales), a load or more each
        assert ptx["ld_before_wait"] >= (3 if kernel == "token_down_fp8" else 2), ptx
