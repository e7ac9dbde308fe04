"""The next projection takes the norm of kiln::gemm_add_rms_norm (kiln::gemm_add_rms_norm_gemm, _route), on CUDA.

After gemm_add_rmsnorm a layer still runs, twice, a kernel a row between two GEMMs: the sum of the projection's
split partials, the residual add and the norm, whose output the next projection reads (the gate_up GEMM with its
SiLU-mul, the next layer's qkv GEMM, or a MoE layer's router). Matched in the post-grad graph,
`kiln::gemm_add_rms_norm` whose normalised row feeds one `kiln::dense_gemm` or `kiln::gate_up_silu_mul` and nothing
else, or a `kiln::moe_route` (and the experts, which then read the row the new op writes), becomes one op, whose
second GEMM, where it is the matrix-vector kernel (kiln/models/gemv.py: small projections), finishes the row itself
before its dot: one kernel fewer at decode sizes. (An MMA kernel computing that operand in its K loop was measured
and removed: docs/passes.md.) Runs after gemm_add_rmsnorm and gate_up_silu_mul, whose ops it matches.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from kiln.passes.base import KilnPass, call_outputs, erase_if_dead, is_call, live_nodes


class RMSNormGemmPass(KilnPass):
    name = "rmsnorm_gemm"

    def apply_post_grad(self, graph: fx.Graph) -> int:
        import kiln.models.dense_gemm  # noqa: F401 - registers kiln::dense_gemm
        import kiln.models.fused_moe.routing  # noqa: F401 - registers kiln::moe_route
        import kiln.passes.ops  # noqa: F401 - registers the kiln ops matched and made here

        order = {node: i for i, node in enumerate(graph.nodes)}
        count = 0
        for node in live_nodes(graph):
            if is_call(node, torch.ops.kiln.gemm_add_rms_norm.default) and _rewrite(graph, node, order):
                count += 1
        return count


def _takes_matrix_vector(weight: object) -> bool:
    from kiln.models import gemv  # triton: imported when the pass runs (on CUDA)

    value = weight.meta.get("val") if isinstance(weight, fx.Node) else weight
    return isinstance(value, torch.Tensor) and value.dim() == 2 and gemv.takes(*value.shape, value.element_size())


def _rewrite(graph: fx.Graph, fused: fx.Node, order: dict[fx.Node, int]) -> bool:
    """Rewrites `fused` and the projection after it when its normalised row feeds only that projection, or a router
    among other users (the projection's weight, a graph input, is defined before `fused`, where the new op goes)."""
    outputs = {user.args[1]: user for user in fused.users if is_call(user, operator.getitem)}
    normed, summed = outputs.get(0), outputs.get(1)
    if normed is None or len(outputs) != len(fused.users):
        return False
    routers = [u for u in normed.users if is_call(u, torch.ops.kiln.moe_route.default) and u.args[0] is normed]
    if len(routers) == 1:  # new op's outputs: the router's weights and ids, h, the row its other users read
        (consumer,) = routers
        op, extra = torch.ops.kiln.gemm_add_rms_norm_route.default, tuple(consumer.args[1:4])
        if not all(is_call(user, operator.getitem) for user in consumer.users):
            return False
    elif len(normed.users) == 1:  # new op's outputs: the projection's, h
        (consumer,) = normed.users
        silu_mul = is_call(consumer, torch.ops.kiln.gate_up_silu_mul.default)
        if not (silu_mul or is_call(consumer, torch.ops.kiln.dense_gemm.default)) or consumer.args[0] is not normed:
            return False
        op, extra = torch.ops.kiln.gemm_add_rms_norm_gemm.default, (consumer.args[1], silu_mul)
    else:
        return False
    weight = consumer.args[1]
    if isinstance(weight, fx.Node) and order.get(weight, len(order)) > order[fused]:
        return False
    if not _takes_matrix_vector(weight):  # the op would run the two ops it replaces: keep the graph as it is
        return False
    with graph.inserting_before(fused):
        new = call_outputs(graph, op, (*fused.args, *extra), 4 if routers else 2)
    if routers:  # the router's weights and ids; the experts (and any other user) read the op's normalised row
        uses = {**{user: new[user.args[1]] for user in consumer.users}, normed: new[3], summed: new[2]}
    else:
        uses = {consumer: new[0], summed: new[1]}
    uses.pop(None, None)  # summed, where nothing read h
    for node, value in uses.items():
        node.replace_all_uses_with(value)
    erase_if_dead(graph, [*uses, consumer, *outputs.values(), fused])
    return True
