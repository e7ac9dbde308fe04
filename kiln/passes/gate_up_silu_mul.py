"""The MLP's activation in the gate_up projection's epilogue (kiln::gate_up_silu_mul): 16-bit weights on CUDA.

At decode sizes Inductor makes `silu(gate) * up` one pointwise kernel between the gate_up and down GEMMs: a
kernel a layer that only waits for the GEMM before it and holds up the one after it. Matched in the post-grad
graph, `silu(gate) * up` over the halves of `kiln::dense_gemm(x, W_gate_up)` becomes one op whose small-M kernel
takes each tile's gate rows with the up rows that pair with them and writes silu(gate) * up from registers
(kiln/models/gemm_epilogues.py). The activation is computed after the sums, where the operands of
the GEMM stay plain loads (the opposite placement, in the down GEMM's operand loads, cost Llama-3-8B 8% at batch
1: docs/passes.md). Larger M runs the unfused graph's GEMM and kiln::silu_and_mul. `kiln::dense_gemm` only
appears on CUDA (16-bit projections), so elsewhere the pass matches nothing. Runs before silu_mul.
"""

from __future__ import annotations

import torch
from torch import fx

from kiln.passes.base import KilnPass, erase_if_dead, is_call, live_nodes, set_fake_value, single_user
from kiln.passes.silu_mul import silu_mul_operand

aten = torch.ops.aten


def gemm_behind(node: fx.Node, op: object = None) -> tuple[fx.Node, list[fx.Node]] | None:
    """The `kiln::dense_gemm` call (or `op`'s) that produced `node` (itself, or through one view of the same shape:
    the projection's reshape back to its input's leading dims) and feeds nothing else -> (gemm, the view if any)."""
    views = []
    if is_call(node, aten.view.default, aten.reshape.default) and single_user(node):
        inner = node.args[0]
        if not isinstance(inner, fx.Node) or "val" not in inner.meta \
                or tuple(inner.meta["val"].shape) != tuple(node.meta["val"].shape):
            return None
        node, views = inner, [node]
    if is_call(node, op or torch.ops.kiln.dense_gemm.default) and single_user(node):
        return node, views
    return None


class GateUpSiluMulPass(KilnPass):
    name = "gate_up_silu_mul"

    def apply_post_grad(self, graph: fx.Graph) -> int:
        import kiln.models.dense_gemm  # noqa: F401 - registers kiln::dense_gemm
        import kiln.passes.ops  # noqa: F401 - registers kiln::gate_up_silu_mul

        op = torch.ops.kiln.gate_up_silu_mul.default
        count = 0
        for mul in live_nodes(graph):
            operand = silu_mul_operand(mul) if is_call(mul, aten.mul.Tensor) else None
            found = gemm_behind(operand[0]) if operand is not None else None
            if found is None or mul.meta["val"].dtype != operand[0].meta["val"].dtype:
                continue
            gemm, views = found
            x, weight = gemm.args[:2]
            with graph.inserting_before(mul):
                fused = graph.call_function(op, (x, weight))
            set_fake_value(fused, op, x, weight)
            mul.replace_all_uses_with(fused)
            erase_if_dead(graph, [*operand[1], *views, gemm])
            count += 1
        return count
