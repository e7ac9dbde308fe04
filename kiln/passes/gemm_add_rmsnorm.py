"""The residual add and the next RMSNorm behind a projection's GEMM (kiln::gemm_add_rms_norm), on CUDA.

Twice a layer a projection (o, down) joins the residual stream and the next norm reads it: at decode sizes that is
the GEMM, its split-K reduce, and Inductor's add + norm kernel, three kernels of which the last two only wait. The
norm needs a whole row, more columns than a GEMM tile holds, but the split-K reduce can hold one: matched in the
post-grad graph, `norm(kiln::dense_gemm(x, W) + residual)` with the sum also kept becomes one op whose small-M GEMM
writes fp32 sums and whose second kernel, a program a row, sums the splits, adds and normalises
(kiln/models/gemm_epilogues.py). Larger M runs torch.mm, then kiln's add + norm kernel. Runs before add_rmsnorm,
which would take these norms alone; after allreduce_rmsnorm (with tensor parallelism the GEMM's output is
all-reduced first, and that pass takes the add and norm).

FP8 projections (`kiln::fp8_gemm`, bf16 out) whose normalised row only feeds the next projection's per-token
quantization become kiln::fp8_gemm_add_rms_norm_quant: the same row kernel also scales the sums and quantizes the
normalised row, so the split-K reduce, Inductor's add + norm + quantization kernel and nothing else go.
"""

from __future__ import annotations

import torch
from torch import fx

from kiln.passes.add_rmsnorm import norms_of_sums, replace_norm_of_sum
from kiln.passes.base import KilnPass, call_outputs, erase_if_dead
from kiln.passes.gate_up_silu_mul import gemm_behind
from kiln.passes.silu_mul_quant import quantization_of


class GemmAddRMSNormPass(KilnPass):
    name = "gemm_add_rmsnorm"

    def apply_post_grad(self, graph: fx.Graph) -> int:
        import kiln.models.dense_gemm  # noqa: F401 - registers kiln::dense_gemm
        import kiln.models.quant.fp8_gemm  # noqa: F401 - registers kiln::fp8_gemm
        import kiln.passes.ops  # noqa: F401 - registers kiln::gemm_add_rms_norm and the FP8 one

        count = 0
        for summed, norm_weight, eps, out, dead in norms_of_sums(graph):
            for side in (0, 1):
                if _rewrite(graph, summed, summed.args[side], summed.args[1 - side], norm_weight, eps, out, dead):
                    count += 1
                    break
        return count


def _rewrite(graph: fx.Graph, summed: fx.Node, operand: object, residual: object, norm_weight: fx.Node, eps: float,
             out: fx.Node, dead: list[fx.Node]) -> bool:
    """Rewrites the norm of `summed` = operand + residual when the operand is a projection's GEMM -> whether it did."""
    found = gemm_behind(operand)  # type: ignore[arg-type]
    if found is not None:
        gemm, views = found
        replace_norm_of_sum(graph, torch.ops.kiln.gemm_add_rms_norm.default,
                            (*gemm.args[:2], residual, norm_weight, eps), summed, out, dead, [*views, gemm])
        return True
    found = gemm_behind(operand, torch.ops.kiln.fp8_gemm.default)  # type: ignore[arg-type]
    quant = quantization_of(out) if found is not None else None
    if quant is None or found[0].args[4] != summed.meta["val"].dtype:  # the GEMM's bf16 is the sum's dtype
        return False
    (gemm, views), (scale, q, chain) = found, quant
    with graph.inserting_before(summed):
        new_q, new_scale, new_sum = call_outputs(graph, torch.ops.kiln.fp8_gemm_add_rms_norm_quant.default,
                                                 (*gemm.args[:4], residual, norm_weight, eps), 3)
    q.replace_all_uses_with(new_q)
    scale.replace_all_uses_with(new_scale)
    summed.replace_all_uses_with(new_sum)
    erase_if_dead(graph, [*chain, scale, *dead, summed, *views, gemm])
    return True
