"""`kiln::fused_moe`: one MoE layer's routed experts as a custom op.

Why a custom op: routing makes every shape inside the layer data-dependent (how many tokens each expert gets),
which Dynamo could only trace with graph breaks and Inductor could only compile per routing. Opaque to both (the
fake gives the output's shape: a row per token), the op lets the whole model trace as one graph; Inductor compiles
the norms, attention and residual adds around it and calls the op (and the routing's, routing.py) as an extern
kernel, and CUDA graphs capture it. Its sizes depend on the token count alone (align.py), and it never syncs with
the host.

On CUDA it runs the Triton kernels (kernels.py); elsewhere the torch reference (reference.py).
"""

from __future__ import annotations

import torch

from kiln.models.fused_moe.reference import fused_moe_reference


@torch.library.custom_op("kiln::fused_moe", mutates_args=())
def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None, remote_experts: bool = False) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights fp32 / topk_ids int [T, K] -> each token's pairs'
    weighted rows summed, [T, H]; `remote_experts`: ids may name other ranks' experts (id E)."""
    if x.is_cuda:
        from kiln.models.fused_moe.kernels import fused_moe_triton

        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, remote_experts)
    return fused_moe_reference(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)


@fused_moe.register_fake
def _fused_moe_fake(x, w13, w2, topk_weights, topk_ids, w13_scale=None, w2_scale=None, remote_experts=False):
    return x.new_empty(x.shape)
