"""RoPE in the qkv projection's epilogue (kiln::qkv_rope): 16-bit weights on CUDA, models without q/k norms.

At decode sizes Inductor makes the rotation of q and k (and the copy that makes v contiguous for attention) one
pointwise kernel between the qkv GEMM and attention: a kernel a layer that only waits for the GEMM. Matched in the
post-grad graph, `rotary(positions, q, k)` where q, k (and v) are the heads of one `kiln::dense_gemm(x, W_qkv)`
output split three ways becomes one op whose small-M kernel rotates in registers and writes q, k and v as
contiguous tensors (kiln/models/gemm_epilogues.py); larger M runs the GEMM, then kiln's RoPE kernel, so the pass
is meant for decode sizes (`qkv_rope<=16`), where the range above keeps Inductor's kernels. The rotation is
recognised as a call of the model's RotaryEmbedding by the module record the ATen nodes carry
(kiln/passes/modules.py); rope_kv and qk_norm_rope, on the captured graph, take the rotations they match first
(with the cache write, or with Qwen3's norms, which need a whole head's sum and so do not fit a tile of the
GEMM). Until 2026-12-04 this pass rewrote the captured graph, which serves every token count, so it could not be
bounded and cost prefill (docs/passes.md).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from kiln.passes.base import KilnPass, call_outputs, erase_if_dead, is_call, single_user, tensor_value
from kiln.passes.modules import rope_calls

aten = torch.ops.aten
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
_SPLITS = (aten.split_with_sizes.default, aten.split.Tensor)


def _head_of(view: fx.Node) -> tuple[fx.Node, int] | None:
    """`view(split[i], [T, heads, head_dim])` used once -> (the split, i)."""
    if not is_call(view, *_VIEWS) or not single_user(view):
        return None
    item = view.args[0]
    if not (is_call(item, operator.getitem) and single_user(item)):  # type: ignore[union-attr]
        return None
    return item.args[0], item.args[1]  # type: ignore[union-attr,return-value]


def _qkv_gemm(q: fx.Node, k: fx.Node) -> tuple[fx.Node, fx.Node, list[fx.Node]] | None:
    """q, k: views of the first two parts of a three-way split of one dense_gemm output (through a view) ->
    (the gemm, the v heads' view or its contiguous copy, the nodes that go once q, k and v come from the op)."""
    q_head, k_head = _head_of(q), _head_of(k)
    if q_head is None or k_head is None or q_head[0] is not k_head[0] or (q_head[1], k_head[1]) != (0, 1):
        return None
    split = q_head[0]
    if not is_call(split, *_SPLITS) or (split.args[2] if len(split.args) > 2 else 0) not in (-1, 1):
        return None
    items = {u.args[1]: u for u in split.users if is_call(u, operator.getitem)}
    if set(items) != {0, 1, 2} or len(split.users) != 3 or len(items[2].users) != 1:
        return None
    v = next(iter(items[2].users))
    source = split.args[0]
    chain = [split, *items.values(), q, k, v]
    if is_call(source, *_VIEWS) and single_user(source):  # type: ignore[arg-type]
        chain.append(source)  # type: ignore[arg-type]
        source = source.args[0]  # type: ignore[union-attr]
    if not is_call(source, torch.ops.kiln.dense_gemm.default) or not single_user(source) or not is_call(v, *_VIEWS):
        return None
    copy = next(iter(v.users)) if single_user(v) else None
    if is_call(copy, aten.clone.default) and copy.kwargs.get("memory_format", torch.contiguous_format) \
            == torch.contiguous_format:  # the op's v already is contiguous
        chain.append(copy)
        v = copy
    return source, v, chain + [source]  # type: ignore[list-item,return-value]


class QKVRopePass(KilnPass):
    name = "qkv_rope"

    def apply_post_grad(self, graph: fx.Graph) -> int:
        import kiln.models.dense_gemm  # noqa: F401 - registers kiln::dense_gemm
        import kiln.passes.ops  # noqa: F401 - registers kiln::qkv_rope
        from kiln.models.gemm_epilogues import fits_a_tile  # imports triton: only where a pass runs

        op = torch.ops.kiln.qkv_rope.default
        count = 0
        for rope in rope_calls(graph, with_norms=False):
            found = _qkv_gemm(rope.q, rope.k)
            qv, kv = tensor_value(rope.q), tensor_value(rope.k)
            if found is None or qv is None or kv is None or not fits_a_tile(qv.shape[-1]):
                continue
            gemm, v, chain = found
            args = (gemm.args[0], gemm.args[1], rope.positions, rope.cos_sin_cache, qv.shape[1], kv.shape[1])
            with graph.inserting_before(rope.q_rot):  # after every input (positions among them), before every use
                outs = call_outputs(graph, op, args, 3)
            for new, old in zip(outs, (rope.q_rot, rope.k_rot, v)):
                old.replace_all_uses_with(new)
            erase_if_dead(graph, list(reversed(rope.nodes)) + chain[::-1])
            count += 1
        return count
