"""One token's FP8 projection of an activation from outside the graph without its per-token quantization
(kiln::fp8_weight_only_gemm), on CUDA.

An FP8 linear quantizes its activation per token (amax, scale, divide, e4m3) and runs the W8A8 GEMM. At one token
the GEMM is the streaming kernel (kiln/models/gemv_stream.py), which widens both operands to fp32 anyway, so the
quantization buys nothing there. Where the activation is computed in the graph (a norm's output, the SiLU-mul's),
Inductor or a kiln epilogue folds the quantization into the kernel that computes it, at no cost. Where it comes from
outside the graph (the o projection: the attention's output, the piece's input after the split at the attention),
the quantization is a kernel of its own (1.4 us a layer on Llama-3-8B, one H100, 2026-12-06). Matched in the
post-grad graph, `kiln::fp8_gemm` of a per-token quantization of such a 16-bit x becomes
`kiln::fp8_weight_only_gemm(x, W, w_scale)`: the 16-bit token against the e4m3 weight (weight-only FP8). Then
gemm_add_rmsnorm folds the add + norm after it, and the next projection's quantization, into its row kernel.

Why not every projection: with every one weight-only, FP8 Llama-3-8B at batch 1 took 3.549 ms against 3.506 (one
H100, 2026-12-06): every program re-reads the 16-bit token, and the MLP's kernels (gate_up with its SiLU-mul, down,
its add + norm) took 70.6-85.6 us a layer against W8A8's 68.9 at every row count swept (docs/passes.md).

Only for one token (the `<=1` bound gives that count a compile range of its own): the kernel re-reads the weight
per token. A runner that speculates suspends the kernel (its decode must equal its verify, which runs W8A8), and
the ops then quantize themselves (kiln/passes/fp8_weight_only_ops.py). Runs before gemm_add_rmsnorm,
silu_mul_quant and gate_up_silu_mul. `passes=(..., "fp8_weight_only<=1")` selects it.
"""

from __future__ import annotations

import torch
from torch import fx

from kiln.passes.base import KilnPass, erase_if_dead, is_call, set_fake_value
from kiln.passes.silu_mul_quant import per_token_quants

aten = torch.ops.aten


class Fp8WeightOnlyPass(KilnPass):
    name = "fp8_weight_only"

    def apply_post_grad(self, graph: fx.Graph) -> int:
        import kiln.models.quant.fp8_gemm  # noqa: F401 - registers kiln::fp8_gemm
        import kiln.passes.ops  # noqa: F401 - registers the weight-only ops

        op = torch.ops.kiln.fp8_weight_only_gemm.default
        count = 0
        for x, scale, q, chain in per_token_quants(graph):
            if not _sixteen_bit(x) or _computed_in_graph(x):
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


def _computed_in_graph(node: object) -> bool:
    """Whether `node`, through views, is computed in this graph (its quantization then fuses into the kernel that
    computes it) rather than a graph input."""
    while is_call(node, aten.view.default, aten.reshape.default, aten._unsafe_view.default):
        node = node.args[0]  # type: ignore[union-attr]
    return not (isinstance(node, fx.Node) and node.op == "placeholder")
