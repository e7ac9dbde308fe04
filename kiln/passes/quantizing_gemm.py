"""An FP8 projection's activation quantization taken into its GEMM (kiln::fp8_quantizing_gemm*), on CUDA.

In an FP8 model at decode sizes two of a layer's projections still read an activation that a kernel of its own
quantized per token just before: the o projection (attention's output, quantized by Inductor's kernel) and the down
projection (silu(gate) * up, kiln::silu_mul_quant's kernel, one program a row). The qkv and gate_up projections
already read theirs from the norm kernel before them (gemm_add_rmsnorm). Matched in the post-grad graph, a
quantization whose e4m3 values and scale only feed `kiln::fp8_gemm` or `kiln::fp8_gemm_add_rms_norm_quant` goes, and
the GEMM takes the 16-bit activation and quantizes it per token itself
(kiln/models/quant/fp8_quantizing_gemm.py): one dependent kernel a projection fewer, the same e4m3 operands.

Runs after gemm_add_rmsnorm and silu_mul_quant, whose ops it rewrites.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from kiln.passes.base import KilnPass, call_outputs, erase_if_dead, is_call, live_nodes, set_fake_value, single_user
from kiln.passes.silu_mul_quant import quantization_of


def _quantized_operand(gemm: fx.Node, q: object, scale: object) -> tuple[fx.Node, bool, list[fx.Node]] | None:
    """The activation that (q, scale) quantize, when nothing but `gemm` reads them -> (activation, whether it is a
    gate_up that kiln::silu_mul_quant SiLU-muls first, the nodes the rewrite leaves dead) or None."""
    if not (isinstance(q, fx.Node) and isinstance(scale, fx.Node) and single_user(q)):
        return None
    if is_call(q, operator.getitem):  # kiln::silu_mul_quant's outputs
        op = q.args[0]
        if (is_call(op, torch.ops.kiln.silu_mul_quant.default) and is_call(scale, operator.getitem)
                and scale.args[0] is op and (q.args[1], scale.args[1]) == (0, 1) and single_user(scale)):
            return op.args[0], True, [q, scale, op]
        return None
    # q = e4m3(clamp(x32 / scale)): back through the clamps and the division to x32, the cast of the activation
    node = q.args[0] if is_call(q, torch.ops.prims.convert_element_type.default) else None
    while isinstance(node, fx.Node) and node.args and not is_call(node, torch.ops.prims.convert_element_type.default):
        node = node.args[0]
    source = node.args[0] if isinstance(node, fx.Node) else None
    quant = quantization_of(source) if isinstance(source, fx.Node) else None
    if quant is None or quant[0] is not scale or quant[1] is not q or set(scale.users) - set(quant[2]) != {gemm}:
        return None
    return source, False, [q, scale, *quant[2]]


class QuantizingGemmPass(KilnPass):
    name = "quantizing_gemm"

    def apply_post_grad(self, graph: fx.Graph) -> int:
        import kiln.models.quant.fp8_gemm  # noqa: F401 - registers kiln::fp8_gemm
        import kiln.passes.ops  # noqa: F401 - registers the fused ops

        kiln = torch.ops.kiln
        fused = {kiln.fp8_gemm.default: kiln.fp8_quantizing_gemm.default,
                 kiln.fp8_gemm_add_rms_norm_quant.default: kiln.fp8_quantizing_gemm_add_rms_norm_quant.default}
        count = 0
        for gemm in live_nodes(graph):
            if not is_call(gemm, *fused):
                continue
            q, weight, scale, weight_scale, *rest = gemm.args
            found = _quantized_operand(gemm, q, scale)
            if found is None:
                continue
            activation, silu_mul, dead = found
            op = fused[gemm.target]
            args = (activation, weight, weight_scale, *rest, silu_mul)
            with graph.inserting_before(gemm):
                if op is kiln.fp8_quantizing_gemm.default:
                    new = graph.call_function(op, args)
                    set_fake_value(new, op, *args)
                    gemm.replace_all_uses_with(new)
                else:
                    outs = call_outputs(graph, op, args, 3)
                    for i, user in [(u.args[1], u) for u in list(gemm.users)]:
                        user.replace_all_uses_with(outs[i])
                        graph.erase_node(user)
            graph.erase_node(gemm)
            erase_if_dead(graph, dead)
            count += 1
        return count
