"""SiLU-and-mul folded into the down projection's GEMM (kiln::dense_gemm_silu_mul): 16-bit weights on CUDA.

At decode sizes Inductor makes the MLP's activation one pointwise kernel between two GEMMs: on SmolLM2-135M
30 of a batch-1 step's 346 kernels, 1.2 us each (one H200, docs/BENCHMARKS.md), with the gap a launch leaves
beside it. Matched in the post-grad graph, `kiln::dense_gemm(silu(gate) * up, W_down)`, gate and up the two
halves of the gate_up projection's [T, 2I] output, becomes one op whose small-M kernel computes the SiLU-mul
as it loads its operand (kiln/models/quant/fp8_kernel.py, SILU_MUL) and whose larger-M path is the
unfused graph's (kiln::silu_and_mul, then torch.mm). `kiln::dense_gemm` only appears on CUDA (16-bit
projections), so the pass matches nothing elsewhere. Runs before silu_mul, which would take the SiLU-mul alone.
"""

from __future__ import annotations

import torch
from torch import fx

from kiln.passes.base import KilnPass, erase_if_dead, is_call, live_nodes, set_fake_value, single_user
from kiln.passes.silu_mul import silu_mul_operand

aten = torch.ops.aten


def _through_same_shape_view(node: object) -> tuple[object, list[fx.Node]]:
    """The GEMM's input past a view that keeps its shape (the projection's reshape to 2-D of a 2-D tensor)."""
    if is_call(node, aten.view.default, aten.reshape.default) and single_user(node):
        inner = node.args[0]
        if isinstance(inner, fx.Node) and inner.meta.get("val") is not None and \
                tuple(inner.meta["val"].shape) == tuple(node.meta["val"].shape):
            return inner, [node]
    return node, []


class GemmSiluMulPass(KilnPass):
    name = "gemm_silu_mul"

    def apply_post_grad(self, graph: fx.Graph) -> int:
        import kiln.models.dense_gemm  # noqa: F401 - registers kiln::dense_gemm
        import kiln.passes.ops  # noqa: F401 - registers kiln::dense_gemm_silu_mul

        gemm_op, op = torch.ops.kiln.dense_gemm.default, torch.ops.kiln.dense_gemm_silu_mul.default
        count = 0
        for gemm in live_nodes(graph):
            if not is_call(gemm, gemm_op):
                continue
            mul, views = _through_same_shape_view(gemm.args[0])
            if not is_call(mul, aten.mul.Tensor) or not single_user(mul):
                continue
            operand = silu_mul_operand(mul)
            if operand is None or mul.meta["val"].dtype != operand[0].meta["val"].dtype:
                continue
            x, chain = operand
            with graph.inserting_before(gemm):
                fused = graph.call_function(op, (x, gemm.args[1]))
            set_fake_value(fused, op, x, gemm.args[1])
            gemm.replace_all_uses_with(fused)
            erase_if_dead(graph, [gemm, *views, *chain])
            count += 1
        return count
