"""SiLU-and-mul, then the FP8 per-token quantization of the result, as one op (kiln::silu_mul_quant).

In an FP8 model the down projection's input is silu(gate) * up, quantized per token for the FP8 GEMM
(kiln/models/quant/fp8.py `quantize_per_token`: amax -> scale -> divide -> clamp -> e4m3). On the H200 Inductor
makes that two kernels, a reduction for the row's amax and a pointwise kernel that recomputes the SiLU-mul
and quantizes (the 8B FP8 step profile, docs/passes.md). Matched in the post-grad graph, the chain becomes one
op that reads the [T, 2N] gate_up once and writes the e4m3 [T, N] and its fp32 [T, 1] scale: on CUDA one
Triton program per row; elsewhere the same torch ops as the unfused graph.

Runs before silu_mul, which would otherwise take the SiLU-mul alone.
"""

from __future__ import annotations

import torch
from torch import fx

from kiln.models.quant.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE
from kiln.passes.base import KilnPass, call_two_outputs, erase_if_dead, is_call, live_nodes, single_user, strip_cast
from kiln.passes.silu_mul import silu_mul_operand

aten, prims = torch.ops.aten, torch.ops.prims


def _only_user(node: fx.Node, *targets) -> fx.Node | None:
    """The node's one user, when it has exactly one and that one calls a target."""
    user = next(iter(node.users), None)
    return user if single_user(node) and is_call(user, *targets) else None


def _per_token_quant(amax: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node, list[fx.Node]] | None:
    """amax(|x32|, -1, keepdim) -> /448 -> clamp_min = scale; x32 / scale -> clamp(+-448) -> e4m3 = q.
    -> (x before its fp32 cast, scale, q, the chain's nodes) or None."""
    if amax.args[1:] != ([-1], True) or not is_call(amax.args[0], aten.abs.default):
        return None
    x32 = amax.args[0].args[0]
    div = _only_user(amax, aten.div.Tensor)
    scale = _only_user(div, aten.clamp_min.default) if div is not None and div.args[1] == FP8_MAX else None
    if scale is None or scale.args[1] != MIN_SCALE:
        return None
    divided = [u for u in x32.users if is_call(u, aten.div.Tensor) and u.args == (x32, scale)]
    low = _only_user(divided[0], aten.clamp_min.default) if len(divided) == 1 else None
    high = _only_user(low, aten.clamp_max.default) if low is not None and low.args[1] == -FP8_MAX else None
    q = _only_user(high, prims.convert_element_type.default) if high is not None and high.args[1] == FP8_MAX else None
    if q is None or q.args[1] != FP8_DTYPE:
        return None
    return strip_cast(x32), scale, q, [q, high, low, divided[0], amax.args[0], amax, div, x32]


def quantization_of(node: fx.Node) -> tuple[fx.Node, fx.Node, list[fx.Node]] | None:
    """The per-token quantization that is `node`'s only use (through its fp32 cast) -> (scale, q, its nodes)."""
    x32 = next(iter(node.users), None) if single_user(node) else None
    if not is_call(x32, prims.convert_element_type.default) or x32.args[1] != torch.float32:
        return None
    absolute = next((u for u in x32.users if is_call(u, aten.abs.default)), None)
    amax = _only_user(absolute, aten.amax.default) if absolute is not None else None
    quant = _per_token_quant(amax) if amax is not None else None
    if quant is None or quant[0] is not node or len(x32.users) != 2:
        return None
    return quant[1], quant[2], quant[3]


class SiluMulQuantPass(KilnPass):
    name = "silu_mul_quant"

    def apply_post_grad(self, graph: fx.Graph) -> int:
        import kiln.passes.ops  # noqa: F401 - registers kiln::silu_mul_quant

        op = torch.ops.kiln.silu_mul_quant.default
        count = 0
        for amax in live_nodes(graph):
            if not is_call(amax, aten.amax.default):
                continue
            quant = _per_token_quant(amax)
            if quant is None or not is_call(quant[0], aten.mul.Tensor):
                continue
            mul, scale, q, chain = quant
            operand = silu_mul_operand(mul)
            if operand is None:
                continue
            x, silu_chain = operand
            with graph.inserting_before(q):
                new_q, new_scale = call_two_outputs(graph, op, (x,))
            q.replace_all_uses_with(new_q)
            # the scale's users come after it, and so after the op: the GEMM reads it too
            scale.replace_all_uses_with(new_scale)
            erase_if_dead(graph, [*chain, scale, *silu_chain])
            count += 1
        return count
