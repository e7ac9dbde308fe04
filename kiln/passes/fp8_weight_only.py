"""One token's FP8 projections without the per-token quantization (kiln::fp8_weight_only_gemm), on CUDA.

An FP8 linear quantizes its activation per token (amax, scale, divide, e4m3) and runs the W8A8 GEMM. At one token
the GEMM is the streaming kernel (kiln/models/gemv_stream.py), which widens both operands to fp32 anyway, so the
quantization buys nothing there and costs a row reduction in a kernel before every projection: at batch 1 on
Llama-3-8B FP8 those kernels (with the add + norm, the SiLU-mul) took 12.3 us a layer against ~3 for the 16-bit
model's (one H200, 2026-12-05, docs/BENCHMARKS.md). Matched in the post-grad graph, `kiln::fp8_gemm` of a per-token
quantization of a 16-bit x becomes `kiln::fp8_weight_only_gemm(x, W, w_scale)`: the 16-bit token against the e4m3
weight (weight-only FP8, closer to the 16-bit model than W8A8). gemm_add_rmsnorm and gate_up_silu_mul then fold the
add + norm and the SiLU-mul into these projections as they do for 16-bit ones.

Only for one token (the `<=1` bound gives that count a compile range of its own): the kernel re-reads the weight
per token. A runner that speculates suspends the kernel (its decode must equal its verify, which runs W8A8), and
the ops then quantize themselves (kiln/passes/fp8_weight_only_ops.py). Runs before gemm_add_rmsnorm,
silu_mul_quant and gate_up_silu_mul. Not a default: FP8 Llama-3-8B at batch 1 took 3.549 ms with it against 3.506
without (one H100): at o and down, 4 rows a program, every program re-reads the 16-bit token (docs/passes.md);
`passes=(..., "fp8_weight_only<=1")` selects it.
"""

from __future__ import annotations

import torch
from torch import fx

from kiln.passes.base import KilnPass, erase_if_dead, is_call, set_fake_value
from kiln.passes.silu_mul_quant import per_token_quants


class Fp8WeightOnlyPass(KilnPass):
    name = "fp8_weight_only"

    def apply_post_grad(self, graph: fx.Graph) -> int:
        import kiln.models.quant.fp8_gemm  # noqa: F401 - registers kiln::fp8_gemm
        import kiln.passes.ops  # noqa: F401 - registers the weight-only ops

        op = torch.ops.kiln.fp8_weight_only_gemm.default
        count = 0
        for x, scale, q, chain in per_token_quants(graph):
            if not _sixteen_bit(x):
                continue
            for gemm in list(q.users):
                if not is_call(gemm, torch.ops.kiln.fp8_gemm.default) or gemm.args[2] is not scale:
                    continue
                args = (x, gemm.args[1], gemm.args[3], gemm.args[4])
                with graph.inserting_before(gemm):
                    new = graph.call_function(op, args)
                set_fake_value(new, op, *args)
                gemm.replace_all_uses_with(new)
                graph.erase_node(gemm)
                count += 1
            erase_if_dead(graph, [*chain, scale])
        return count


def _sixteen_bit(node: object) -> bool:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return isinstance(value, torch.Tensor) and value.dtype in (torch.bfloat16, torch.float16)
