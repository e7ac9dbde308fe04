"""The next projection takes the norm of kiln::gemm_add_rms_norm (kiln::gemm_add_rms_norm_gemm), on CUDA.

After gemm_add_rmsnorm a layer still runs, twice, a kernel a row between two GEMMs: the sum of the projection's
split partials, the residual add and the norm, whose output only the next projection reads (the gate_up GEMM with
its SiLU-mul, or the next layer's qkv GEMM). Matched in the post-grad graph, `kiln::gemm_add_rms_norm` whose
normalised row feeds one `kiln::dense_gemm` or `kiln::gate_up_silu_mul` and nothing else becomes one op, whose
second GEMM, where it is the matrix-vector kernel (kiln/models/gemv.py: small projections), finishes the row itself
before its dot: one kernel fewer at decode sizes. (An MMA kernel computing that operand in its K loop was measured
and removed: docs/passes.md.) Runs after gemm_add_rmsnorm and gate_up_silu_mul, whose ops it matches.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from kiln.passes.base import KilnPass, call_outputs, erase_if_dead, is_call, live_nodes, single_user


class RMSNormGemmPass(KilnPass):
    name = "rmsnorm_gemm"

    def apply_post_grad(self, graph: fx.Graph) -> int:
        import kiln.models.dense_gemm  # noqa: F401 - registers kiln::dense_gemm
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
    """Rewrites `fused` and the projection after it when its normalised row feeds only that projection (whose
    weight, a graph input, is defined before `fused`, where the new op goes)."""
    outputs = {user.args[1]: user for user in fused.users if is_call(user, operator.getitem)}
    normed, summed = outputs.get(0), outputs.get(1)
    if normed is None or len(outputs) != len(fused.users) or not single_user(normed):
        return False
    (consumer,) = normed.users
    silu_mul = is_call(consumer, torch.ops.kiln.gate_up_silu_mul.default)
    if not (silu_mul or is_call(consumer, torch.ops.kiln.dense_gemm.default)) or consumer.args[0] is not normed:
        return False
    weight = consumer.args[1]
    if isinstance(weight, fx.Node) and order.get(weight, len(order)) > order[fused]:
        return False
    if not _takes_matrix_vector(weight):  # the op would run the two ops it replaces: keep the graph as it is
        return False
    with graph.inserting_before(fused):
        out, new_sum = call_outputs(graph, torch.ops.kiln.gemm_add_rms_norm_gemm.default,
                                    (*fused.args, weight, silu_mul), 2)
    consumer.replace_all_uses_with(out)
    if summed is not None:
        summed.replace_all_uses_with(new_sum)
    erase_if_dead(graph, [consumer, *outputs.values(), fused])
    return True
