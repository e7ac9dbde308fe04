"""RoPE + KV-cache write: rotate q/k and scatter k/v into the paged cache in one kernel.

Matches, on the captured graph, a `RotaryEmbedding` call whose rotated q and k go straight into
`kiln::attention` (and nowhere else but the `empty_like` that allocates the output), and rewrites

    q', k' = rotary(positions, q, k); out = empty_like(q'); attention(q', k', v, out, layer)
to
    out = empty_like(q); rope_attention(q, k, v, positions, cos_sin_cache, out, layer)

`kiln::rope_attention` (kiln/passes/ops.py) rotates q/k, writes the rotated k and v into the layer's
cache in the same kernel and then attends reading only the cache. Before, Inductor's RoPE kernel wrote
q'/k' to memory, and the backend read k'/v back to write them into the cache in a second kernel.

This has to happen before the split: the cache write lives inside the attention op, which the compiled
pieces never see. The rewritten op is itself a split point, so the rotation moves from the compiled
piece into the eager attention step (a CUDA-graph capture covers it under FULL graphs).

With `qk_norm_rope` also enabled, Qwen3's per-head q/k RMSNorm feeding the rotation is absorbed too.
Only applied when the attention backend can attend from the cache alone (`supports_cache_only`) or rotates q/k
inside its own kernel (`supports_rope`: the Triton backend's decode kernel, which then also norms, writes the
cache and attends, one kernel where there were two or three); elsewhere it would just move RoPE out of Inductor for
nothing.
"""

from __future__ import annotations

import torch
from torch import fx

from kiln.passes.base import KilnPass, erase_if_dead
from kiln.passes.modules import match_rope


class RopeKVCachePass(KilnPass):
    name = "rope_kv"

    def apply_graph(self, gm: fx.GraphModule) -> int:
        if not (self.env.cache_only_attention or self.env.rope_in_attention):
            return 0
        import kiln.passes.ops  # noqa: F401 - registers kiln::rope_attention as a split op

        graph = gm.graph
        count = 0
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in (torch.ops.kiln.attention,
                                                                 torch.ops.kiln.attention.default):
                continue
            if node.kwargs or len(node.args) != 5:
                continue
            q_rot, k_rot, v, out, layer_idx = node.args
            if not all(isinstance(n, fx.Node) for n in (q_rot, k_rot, v, out)):
                continue
            rope = match_rope(q_rot, k_rot, with_norms=self.config.qk_norm_rope)
            if rope is None or set(k_rot.users) != {node} or not self._only_alloc_uses(q_rot, node, out):
                continue
            with graph.inserting_before(node):
                fused = graph.call_function(torch.ops.kiln.rope_attention.default, args=(
                    rope.q, rope.k, v, rope.positions, rope.cos_sin_cache, out, layer_idx,
                    rope.q_weight, rope.k_weight, rope.eps))
            fused.meta = {key: val for key, val in node.meta.items() if key != "example_value"}
            if q_rot in out.all_input_nodes:  # empty_like(q'): same shape and dtype as q, contiguous
                out.args = (rope.q, *out.args[1:])
                out.kwargs = {**out.kwargs, "memory_format": torch.contiguous_format}
            graph.erase_node(node)
            erase_if_dead(graph, list(reversed(rope.nodes)))
            count += 1
        return count

    @staticmethod
    def _only_alloc_uses(q_rot: fx.Node, attention: fx.Node, out: fx.Node) -> bool:
        """q' feeds the attention op and at most the allocation of its output buffer (`empty_like`)."""
        others = set(q_rot.users) - {attention}
        if not others:
            return True
        return others == {out} and out.op == "call_function" and out.target is torch.empty_like \
            and out.args == (q_rot,) and set(out.kwargs) <= {"memory_format"}
