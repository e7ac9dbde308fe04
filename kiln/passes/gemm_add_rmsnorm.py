"""The residual add and the next RMSNorm behind a projection's GEMM (kiln::gemm_add_rms_norm): 16-bit weights, CUDA.

Twice a layer a projection (o, down) joins the residual stream and the next norm reads it: at decode sizes that is
the GEMM, its split-K reduce, and Inductor's add + norm kernel, three kernels of which the last two only wait. The
norm needs a whole row, more columns than a GEMM tile holds, but the split-K reduce can hold one: matched in the
post-grad graph, `norm(kiln::dense_gemm(x, W) + residual)` with the sum also kept becomes one op whose small-M GEMM
writes fp32 sums and whose second kernel, a program a row, sums the splits, adds and normalises
(kiln/models/gemm_epilogues.py). Larger M runs torch.mm, then kiln's add + norm kernel. Runs before add_rmsnorm,
which would take these norms alone; after allreduce_rmsnorm (with tensor parallelism the GEMM's output is
all-reduced first, and that pass takes the add and norm).
"""

from __future__ import annotations

import torch
from torch import fx

from kiln.passes.add_rmsnorm import norms_of_sums, replace_norm_of_sum
from kiln.passes.base import KilnPass
from kiln.passes.gate_up_silu_mul import gemm_behind


class GemmAddRMSNormPass(KilnPass):
    name = "gemm_add_rmsnorm"

    def apply_post_grad(self, graph: fx.Graph) -> int:
        import kiln.models.dense_gemm  # noqa: F401 - registers kiln::dense_gemm
        import kiln.passes.ops  # noqa: F401 - registers kiln::gemm_add_rms_norm

        op = torch.ops.kiln.gemm_add_rms_norm.default
        count = 0
        for summed, norm_weight, eps, out, dead in norms_of_sums(graph):
            for side in (0, 1):
                found = gemm_behind(summed.args[side])
                if found is not None:
                    break
            if found is None:
                continue
            gemm, views = found
            x, weight = gemm.args[:2]
            replace_norm_of_sum(graph, op, (x, weight, summed.args[1 - side], norm_weight, eps), summed, out, dead,
                                [*views, gemm])
            count += 1
        return count
