"""`kiln::moe_topk`: a MoE layer's routing (top-k of the router logits, their weights) as one op.

In plain torch the router after its GEMM is a cast of the logits to fp32, `torch.topk` (an ATen kernel Inductor
cannot fuse) and a softmax over the k winners: three kernels a layer, each a few microseconds inside a CUDA
graph whatever the batch, 48 times a Qwen3-30B-A3B decode step. On CUDA one Triton program per token does all of
it on the GEMM's output as it is (16-bit), with k passes of max-and-mask over the token's E logits in registers;
elsewhere the torch formula (also the tests' oracle).

`renormalize` (Qwen3's norm_topk_prob, always for Mixtral): the weights are the softmax of the k winning logits,
which equals the full softmax renormalised over them. Otherwise they are the full softmax's values at the
winners. The winners come in no particular order (the weighted sum does not depend on it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def moe_topk_reference(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    logits = logits.float()
    if renormalize:
        top, ids = torch.topk(logits, top_k, dim=-1, sorted=False)
        return F.softmax(top, dim=-1), ids.to(torch.int32)
    weights, ids = torch.topk(F.softmax(logits, dim=-1), top_k, dim=-1, sorted=False)
    return weights, ids.to(torch.int32)


@torch.library.custom_op("kiln::moe_topk", mutates_args=())
def moe_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (any float dtype) -> (weights fp32 [T, K], expert ids int32 [T, K])."""
    if logits.is_cuda:
        from kiln.models.fused_moe.routing_triton import moe_topk_triton

        return moe_topk_triton(logits, top_k, renormalize)
    return moe_topk_reference(logits, top_k, renormalize)


@moe_topk.register_fake
def _moe_topk_fake(logits, top_k, renormalize):
    shape = (logits.shape[0], top_k)
    return logits.new_empty(shape, dtype=torch.float32), logits.new_empty(shape, dtype=torch.int32)
