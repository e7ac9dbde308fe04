"""Residual add + RMSNorm as one kernel (kiln::fused_add_rms_norm / kiln::rms_norm).

Matches, in Inductor's post-grad graph, RMSNorm over the last dim of a [T, hidden] tensor, in the form
the model's RMSNorm decomposes to (dtype casts optional):

    xf = x.float(); y = w * (xf * rsqrt(mean(xf ** 2, -1) + eps)).to(x.dtype)

and, when x is itself `a + b`, the add with it. On CUDA the replacement is one Triton program per row that
holds the row in registers: it reads a and b once, writes a + b and the normalised row. Inductor emits a
looped reduction for wide rows (hidden 4096) that reads x twice, which is what this pass is after.

Where Inductor has already folded the residual add into the preceding matmul (addmm: the add's other
user is the next matmul), only the norm is replaced. Per-head norms (Qwen3's q/k norm, 3-D) are left to
qk_norm_rope.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import fx

from kiln.passes.base import KilnPass, call_two_outputs, erase_if_dead, is_call, live_nodes, set_fake_value, strip_cast

aten, prims = torch.ops.aten, torch.ops.prims


def _other(node: fx.Node, one: fx.Node) -> object:
    """The other operand of a binary op that has `one` as an operand, or None."""
    a, b = node.args[:2]
    return b if a is one else a if b is one else None


class AddRMSNormPass(KilnPass):
    name = "add_rmsnorm"

    def apply_post_grad(self, graph: fx.Graph) -> int:
        import kiln.passes.ops  # noqa: F401 - registers the ops

        count = 0
        for rsqrt in live_nodes(graph):
            if not is_call(rsqrt, aten.rsqrt.default):
                continue
            match = rms_norm_match(rsqrt)
            if match is None:
                continue
            x, weight, eps, out, dead = match
            summed = x if is_call(x, aten.add.Tensor) and fusable_add(x) else None
            with graph.inserting_after(x):
                if summed is not None:
                    a, b = summed.args[:2]
                    normed, new_sum = call_two_outputs(graph, torch.ops.kiln.fused_add_rms_norm.default,
                                                       (a, b, weight, eps))
                else:
                    normed = graph.call_function(torch.ops.kiln.rms_norm.default, (x, weight, eps))
                    set_fake_value(normed, torch.ops.kiln.rms_norm.default, x, weight, eps)
            out.replace_all_uses_with(normed)
            erase_if_dead(graph, dead)
            if summed is not None:
                summed.replace_all_uses_with(new_sum)
                graph.erase_node(summed)
            count += 1
        return count


def norms_of_sums(graph: fx.Graph) -> Iterator[tuple[fx.Node, fx.Node, float, fx.Node, list[fx.Node]]]:
    """Each RMSNorm (as rms_norm_match finds it) whose input is an add of two like tensors: (the add, the norm's
    weight, eps, its output, its nodes)."""
    for rsqrt in live_nodes(graph):
        match = rms_norm_match(rsqrt) if is_call(rsqrt, aten.rsqrt.default) else None
        if match is not None and is_call(match[0], aten.add.Tensor) and fusable_add(match[0]):
            yield match


def replace_norm_of_sum(graph: fx.Graph, op: object, args: tuple, summed: fx.Node, out: fx.Node,
                        dead: list[fx.Node], inputs: list[fx.Node]) -> None:
    """`op(*args)` -> (normed, sum), inserted before the add, takes the uses of the norm's output and of the add;
    the norm's nodes, the add and `inputs` (what fed the add) are erased where nothing else uses them."""
    with graph.inserting_before(summed):
        normed, new_sum = call_two_outputs(graph, op, args)
    out.replace_all_uses_with(normed)
    erase_if_dead(graph, dead)
    summed.replace_all_uses_with(new_sum)
    erase_if_dead(graph, [summed, *inputs])


def fusable_add(add: fx.Node) -> bool:
    """An add of two tensors of its own shape and dtype (no broadcast, no promotion)."""
    a, b = add.args[:2]
    va, vb, vx = (n.meta.get("val") if isinstance(n, fx.Node) else None for n in (a, b, add))
    return all(isinstance(v, torch.Tensor) for v in (va, vb)) and va.shape == vx.shape == vb.shape \
        and va.dtype == vb.dtype == vx.dtype  # type: ignore[union-attr]


def rms_norm_match(rsqrt: fx.Node) -> tuple[fx.Node, fx.Node, float, fx.Node, list[fx.Node]] | None:
    """The model's RMSNorm around this rsqrt -> (its input, weight, eps, its output, the nodes that go with it)."""
    add_eps = rsqrt.args[0]
    if not is_call(add_eps, aten.add.Tensor, aten.add.Scalar) or len(add_eps.users) != 1 \
            or not isinstance(add_eps.args[1], float):
        return None
    mean = add_eps.args[0]
    if not is_call(mean, aten.mean.dim) or len(mean.users) != 1 or len(mean.args) < 3 or mean.args[2] is not True:
        return None
    square = mean.args[0]
    if not is_call(square, aten.pow.Tensor_Scalar) or square.args[1] != 2 or len(square.users) != 1:
        return None
    xf = square.args[0]
    xv = xf.meta.get("val")
    if not isinstance(xv, torch.Tensor) or xv.dim() != 2 or list(mean.args[1]) not in ([-1], [1]):
        return None
    if len(rsqrt.users) != 1:
        return None
    scaled = next(iter(rsqrt.users))
    if not is_call(scaled, aten.mul.Tensor) or _other(scaled, rsqrt) is not xf or len(scaled.users) != 1:
        return None
    cast = next(iter(scaled.users))
    out = next(iter(cast.users)) if is_call(cast, prims.convert_element_type.default) and len(cast.users) == 1 \
        else cast
    if not is_call(out, aten.mul.Tensor) or (cast is not out and _other(out, cast) is None):
        return None
    weight = _other(out, cast if cast is not out else scaled)
    wv = weight.meta.get("val") if isinstance(weight, fx.Node) else None
    if not isinstance(wv, torch.Tensor) or wv.dim() != 1:
        return None
    x = strip_cast(xf)
    # a cast feeds only the norm; x itself may also feed the rest of the graph (the residual stream)
    if (xf is not x and set(xf.users) != {square, scaled}) or not {square, scaled} <= set(xf.users):
        return None
    out_v = out.meta.get("val")
    if not isinstance(out_v, torch.Tensor) or out_v.dtype != x.meta["val"].dtype:
        return None
    dead = [out, cast, scaled, rsqrt, add_eps, mean, square] + ([xf] if xf is not x else [])
    return x, weight, float(add_eps.args[1]), out, dead  # type: ignore[return-value]
