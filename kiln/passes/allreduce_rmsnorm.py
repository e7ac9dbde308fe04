"""Tensor-parallel all-reduce + residual add + RMSNorm as one op (kiln::all_reduce_add_rms_norm).

Under tensor parallelism every row-parallel projection (o_proj, down_proj) ends in an all-reduce whose
sum is added to the residual stream and normalised by the next RMSNorm:

    h = all_reduce(partial); s = h + residual; y = rms_norm(s)     # y feeds the next matmul, s the residual

In the post-grad graph the all-reduce is either torch's functional collective
(`_c10d_functional.all_reduce` + `wait_tensor`, NCCL or gloo) or `kiln::all_reduce` (the P2P all-reduce,
kiln/models/allreduce.py); the norm is matched exactly as add_rmsnorm matches it. The three become one
op that returns (y, s). On CUDA it runs the all-reduce chosen for the message size and the add + norm in
one Triton program per row; elsewhere the functional all-reduce then the reference add + norm, the same
arithmetic as the unfused graph. This also takes the add + norm away from Inductor, which cannot fuse
across an all-reduce anyway. Two matches per layer: after o_proj and after down_proj (the last layer's
goes into the final norm).

Runs before add_rmsnorm (ALL_PASSES order), which would otherwise take the norm on its own.
"""

from __future__ import annotations

import torch
from torch import fx

from kiln.passes.add_rmsnorm import norms_of_sums, replace_norm_of_sum
from kiln.passes.base import KilnPass, is_call


def _all_reduce_source(node: object) -> tuple[fx.Node, str, list[fx.Node]] | None:
    """(the all-reduced input, group name, the all-reduce's nodes) when `node` is an all-reduce's result
    used only once, else None."""
    if not isinstance(node, fx.Node) or len(node.users) != 1:
        return None
    kiln_all_reduce = getattr(torch.ops.kiln, "all_reduce", None)
    if kiln_all_reduce is not None and is_call(node, kiln_all_reduce.default):
        return node.args[0], str(node.args[1]), [node]  # type: ignore[return-value]
    functional = torch.ops._c10d_functional
    if is_call(node, functional.wait_tensor.default):
        reduce = node.args[0]
        if is_call(reduce, functional.all_reduce.default) and len(reduce.users) == 1 and reduce.args[1] == "sum":
            return reduce.args[0], str(reduce.args[2]), [node, reduce]  # type: ignore[union-attr,return-value]
    return None


class AllReduceRMSNormPass(KilnPass):
    name = "allreduce_rmsnorm"

    def apply_post_grad(self, graph: fx.Graph) -> int:
        import kiln.passes.ops  # noqa: F401 - registers the ops

        op = torch.ops.kiln.all_reduce_add_rms_norm.default
        count = 0
        for summed, weight, eps, out, dead in norms_of_sums(graph):
            a, b = summed.args[:2]
            source, residual = _all_reduce_source(a), b
            if source is None:
                source, residual = _all_reduce_source(b), a
            if source is None:
                continue
            partial, group_name, reduce_nodes = source
            replace_norm_of_sum(graph, op, (partial, residual, weight, eps, group_name), summed, out, dead,
                                reduce_nodes)
            count += 1
        return count
