"""Qwen3 q/k-norm + RoPE: per-head RMSNorm of q and k followed by the rotation, as one op.

Matches, on the captured graph, `rotary(positions, q_norm(q), k_norm(k))` where the norms feed nothing
else, and replaces the three module calls with `kiln::qk_norm_rope` (kiln/passes/ops.py): on CUDA a
single Triton kernel over all q and k heads of a token (norm in registers, then rotate), where Inductor
emits a reduction + rotation kernel for q and another for k.

When `rope_kv` applies, it absorbs the norms itself (norm, RoPE and the cache write in one kernel) and
this pass finds nothing left to do. Runs before the split because it matches module calls, which are
only recorded on the captured graph; the op stays inside the compiled piece.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from kiln.passes.base import KilnPass, erase_if_dead
from kiln.passes.modules import rope_calls


class QKNormRopePass(KilnPass):
    name = "qk_norm_rope"

    def apply_graph(self, gm: fx.GraphModule) -> int:
        import kiln.passes.ops  # noqa: F401 - registers kiln::qk_norm_rope

        graph = gm.graph
        count = 0
        for rope in rope_calls(graph, with_norms=True):
            if not rope.norms:
                continue
            q_rot, k_rot = rope.q_rot, rope.k_rot
            with graph.inserting_before(rope.call.nodes[0]):
                fused = graph.call_function(torch.ops.kiln.qk_norm_rope.default, args=(
                    rope.q, rope.k, rope.positions, rope.cos_sin_cache, rope.q_weight, rope.k_weight, rope.eps))
                q_new = graph.call_function(operator.getitem, (fused, 0))
                k_new = graph.call_function(operator.getitem, (fused, 1))
            for new, old in ((q_new, q_rot), (k_new, k_rot)):
                new.meta = dict(old.meta)
            fused.meta = {key: val for key, val in q_rot.meta.items() if key != "example_value"}
            fused.meta["example_value"] = (q_rot.meta.get("example_value"), k_rot.meta.get("example_value"))
            q_rot.replace_all_uses_with(q_new)
            k_rot.replace_all_uses_with(k_new)
            erase_if_dead(graph, list(reversed(rope.nodes)))
            count += 1
        return count
