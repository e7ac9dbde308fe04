"""A mixture of experts' top-k sum, the residual add and the next RMSNorm as one kernel (kiln::fused_add_rms_norm on
the experts' rows).

A MoE layer returns its experts' weighted rows [T, k, H] summed over k (kiln/models/moe.py); the decoder layer adds
the residual and the next RMSNorm follows. At decode sizes Inductor makes two kernels of the three (1.0 + 1.3 us a
layer on Qwen3-30B-A3B at batch 1, one H200, 2026-12-04), and fused into the norm's reduction they took 5.0 us (one
program reading k rows in a loop). Matched in the post-grad graph:

    s = pairs.sum(1); h = s + residual; y = rms_norm(h)     ->     y, h = fused_add_rms_norm(pairs, residual, w)

whose kernel (kiln/passes/kernels.py) holds a token's row in registers: the k rows summed in fp32 in order and
rounded (as the sum's output is), the residual added, the row normalised. Under tensor parallelism the sum goes
through the all-reduce first and this pass finds nothing (allreduce_rmsnorm takes the norm there).
"""

from __future__ import annotations

import torch
from torch import fx

from kiln.passes.add_rmsnorm import fuse_norms_of_sums
from kiln.passes.base import KilnPass, is_call


def _expert_rows(node: object) -> tuple[fx.Node, tuple, list[fx.Node]] | None:
    """(the [T, k, H] rows, no extra args, the sum) when `node` is their sum over dim 1 used only once, else None."""
    if not is_call(node, torch.ops.aten.sum.dim_IntList) or len(node.users) != 1 or node.kwargs:
        return None
    rows, dims = node.args[0], list(node.args[1])
    keepdim = node.args[2] if len(node.args) > 2 else False
    value = rows.meta.get("val") if isinstance(rows, fx.Node) else None
    if not isinstance(value, torch.Tensor) or value.dim() != 3 or dims not in ([1], [-2]) or keepdim:
        return None
    return rows, (), [node]  # type: ignore[return-value]


class MoESumRMSNormPass(KilnPass):
    name = "moe_sum_rmsnorm"

    def apply_post_grad(self, graph: fx.Graph) -> int:
        import kiln.passes.ops  # noqa: F401 - registers the ops

        return fuse_norms_of_sums(graph, torch.ops.kiln.fused_add_rms_norm.default, _expert_rows)
