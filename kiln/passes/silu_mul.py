"""SiLU-and-mul over the merged gate_up projection output, as one op (kiln::silu_and_mul).

Matches, in Inductor's post-grad graph, `silu(gate) * up` where gate and up are the two halves of one
[T, 2N] tensor split along the last dim. SiLU appears decomposed (`g / (1 + exp(-g))`, `g * sigmoid(g)`)
or whole, with optional casts around it. Replaced by one op that reads [T, 2N] once and writes [T, N]; on
CUDA a Triton kernel.

Inductor already fuses this chain into one pointwise kernel on both CPU and GPU, so the pass mostly
documents (and measures) that; it exists for the cases where a split output prevents that fusion.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from kiln.passes.base import KilnPass, erase_if_dead, is_call, live_nodes, set_fake_value, strip_cast

aten = torch.ops.aten


def _silu_of(node: object) -> tuple[fx.Node, list[fx.Node]] | None:
    """If `node` computes silu(g) (any decomposition, optional casts), -> (g, the nodes it used)."""
    inner = strip_cast(node)
    used = [n for n in (node, inner) if isinstance(n, fx.Node)]
    if is_call(inner, aten.silu.default):
        return strip_cast(inner.args[0]), used + [inner.args[0]]  # type: ignore[union-attr,return-value]
    if is_call(inner, aten.div.Tensor):  # g / (1 + exp(-g))
        g, denom = inner.args[:2]  # type: ignore[union-attr]
        if is_call(denom, aten.add.Tensor, aten.add.Scalar) and 1 in denom.args[1:2]:
            exp = denom.args[0]
            if is_call(exp, aten.exp.default) and is_call(exp.args[0], aten.neg.default) and exp.args[0].args[0] is g:
                return strip_cast(g), used + [denom, exp, exp.args[0], g]  # type: ignore[return-value]
    if is_call(inner, aten.mul.Tensor):  # g * sigmoid(g)
        a, b = inner.args[:2]  # type: ignore[union-attr]
        for g, sig in ((a, b), (b, a)):
            if is_call(sig, aten.sigmoid.default) and sig.args[0] is g:
                return strip_cast(g), used + [sig, g]  # type: ignore[return-value]
    return None


def _halves(gate: object, up: object) -> fx.Node | None:
    """The [T, 2N] tensor whose last-dim split gives gate (first half) and up (second half)."""
    if not (is_call(gate, operator.getitem) and is_call(up, operator.getitem)) or gate.args[0] is not up.args[0]:
        return None
    split = gate.args[0]
    if gate.args[1] != 0 or up.args[1] != 1 or len(split.users) != 2:
        return None
    x = split.args[0]
    xv = x.meta.get("val")
    if not isinstance(xv, torch.Tensor) or xv.dim() != 2:
        return None
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    if dim not in (-1, 1):
        return None
    half = xv.shape[-1] // 2
    if is_call(split, aten.split.Tensor) and split.args[1] == half:
        return x
    if is_call(split, aten.split_with_sizes.default) and list(split.args[1]) == [half, half]:
        return x
    return None


def silu_mul_operand(mul: fx.Node) -> tuple[fx.Node, list[fx.Node]] | None:
    """If `mul` computes silu(gate) * up (either operand order) over the halves of one [T, 2N] tensor ->
    (that tensor, the chain's nodes from mul back to the split, for erase_if_dead)."""
    for act, up in (mul.args[:2], mul.args[1::-1]):
        silu = _silu_of(act)
        x = _halves(silu[0], up) if silu is not None else None
        if x is not None:
            gate, used = silu
            return x, [mul, *used, gate, up, gate.args[0]]
    return None


class SiluMulPass(KilnPass):
    name = "silu_mul"

    def apply_post_grad(self, graph: fx.Graph) -> int:
        import kiln.passes.ops  # noqa: F401 - registers kiln::silu_and_mul

        count = 0
        for mul in live_nodes(graph):
            operand = silu_mul_operand(mul) if is_call(mul, aten.mul.Tensor) else None
            if operand is None:  # (intermediates with other users just stay alive: still correct)
                continue
            x, chain = operand
            mv = mul.meta.get("val")
            if not isinstance(mv, torch.Tensor) or mv.dtype != x.meta["val"].dtype:
                continue
            with graph.inserting_before(mul):
                fused = graph.call_function(torch.ops.kiln.silu_and_mul.default, (x,))
            set_fake_value(fused, torch.ops.kiln.silu_and_mul.default, x)
            mul.replace_all_uses_with(fused)
            erase_if_dead(graph, chain)
            count += 1
        return count
