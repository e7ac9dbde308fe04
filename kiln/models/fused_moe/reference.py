"""The routed experts in plain torch, one expert at a time: the op's CPU path and the oracle of its tests.

out[t] = sum over k of topk_weights[t, k] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = topk_ids[t, k]: each
token's weighted sum of its k pairs' rows, summed in fp32 and rounded once; an id >= the number of experts names an
expert held by another rank (expert parallelism), whose row adds nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def expert_weight(weight: torch.Tensor, scale: torch.Tensor | None, expert: int, dtype: torch.dtype) -> torch.Tensor:
    """One expert's [N, K] weight in `dtype` (an e4m3 one times its per-output-channel scale)."""
    if scale is None:
        return weight[expert]
    return (weight[expert].float() * scale[expert].float().unsqueeze(-1)).to(dtype)


def fused_moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
                        w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I], topk_weights / topk_ids [T, K]
    -> [T, H] in x's dtype (the routing weight applied in fp32)."""
    out = torch.zeros((*topk_ids.shape, x.shape[1]), dtype=torch.float32, device=x.device)
    for expert in range(w13.shape[0]):
        token, slot = (topk_ids == expert).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        gate, up = F.linear(x[token], expert_weight(w13, w13_scale, expert, x.dtype)).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, expert_weight(w2, w2_scale, expert, x.dtype))
        out[token, slot] = y.float() * topk_weights[token, slot].float().unsqueeze(-1)
    return out.sum(1).to(x.dtype)
