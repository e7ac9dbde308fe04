"""`kiln::moe_route`: a MoE layer's routing (the router GEMM, the top k of its logits and their weights) as one op.

In plain torch the router after its GEMM is a cast of the logits to fp32, `torch.topk` (an ATen kernel Inductor
cannot fuse) and a softmax over the k winners: three kernels a layer, each a few microseconds inside a CUDA
graph whatever the batch, 48 times a Qwen3-30B-A3B decode step. On CUDA the GEMM's output goes to one Triton
program per token, which picks the top k of the E logits with k passes of max-and-mask in registers and computes
their weights (routing_triton.py; at decode sizes it takes the GEMM's split-K partials and adds them itself, in
place of the GEMM's reduce kernel); elsewhere the torch formula, also the tests' oracle.

`renormalize` (Qwen3's norm_topk_prob, always for Mixtral): the weights are the softmax of the k winning logits,
which equals the full softmax renormalised over them. Otherwise they are the full softmax's values at the
winners. The winners come in no particular order (the weighted sum does not depend on it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.models import dense_gemm


def router_logits(x: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """x [T, H] @ the router's weight [E, H]^T -> [T, E] in x's dtype. On CUDA through kiln::dense_gemm: kiln's
    small-M kernel up to 16 tokens takes part in programmatic dependent launch, which cuBLAS's GEMM does not;
    Qwen3-30B-A3B decode at batch 1 / 8 / 64 took 3.09 / 8.00 / 16.67 ms against 3.24 / 8.15 / 16.72 through
    cuBLAS (one H200, 2026-12-03, `11ae38c`, docs/moe.md)."""
    if dense_gemm.applies(x, None):
        return dense_gemm.dense_gemm(x, gate_weight)
    return F.linear(x, gate_weight)


def moe_topk_reference(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    logits = logits.float()
    if renormalize:
        top, ids = torch.topk(logits, top_k, dim=-1, sorted=False)
        return F.softmax(top, dim=-1), ids.to(torch.int32)
    weights, ids = torch.topk(F.softmax(logits, dim=-1), top_k, dim=-1, sorted=False)
    return weights, ids.to(torch.int32)


@torch.library.custom_op("kiln::moe_route", mutates_args=())
def moe_route(x: torch.Tensor, gate_weight: torch.Tensor, top_k: int,
              renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H], the router's weight [E, H] -> (weights fp32 [T, K], expert ids int32 [T, K])."""
    if x.is_cuda:
        from kiln.models.fused_moe.routing_triton import moe_route_triton, moe_topk_triton

        if dense_gemm.applies(x, None) and x.shape[0] <= dense_gemm.TRITON_MAX_M:  # the small-M kernel's sums
            return moe_route_triton(x, gate_weight, top_k, renormalize)
        return moe_topk_triton(router_logits(x, gate_weight), top_k, renormalize)
    return moe_topk_reference(router_logits(x, gate_weight), top_k, renormalize)


@moe_route.register_fake
def _moe_route_fake(x, gate_weight, top_k, renormalize):
    shape = (x.shape[0], top_k)
    return x.new_empty(shape, dtype=torch.float32), x.new_empty(shape, dtype=torch.int32)
