"""RoPE in the qkv projection's epilogue (kiln::qkv_rope): 16-bit weights on CUDA, models without q/k norms.

At decode sizes Inductor makes the rotation of q and k (and the copy that makes v contiguous for attention) one
pointwise kernel between the qkv GEMM and attention: a kernel a layer that only waits for the GEMM. Matched on
the captured graph, `rotary(positions, q, k)` where q, k (and v) are the heads of one `kiln::dense_gemm(x, W_qkv)`
output split three ways becomes one op whose small-M kernel rotates in registers and writes q, k and v as
contiguous tensors (kiln/models/gemm_epilogues.py); larger M runs the GEMM, then kiln's RoPE kernel. Runs on the
captured graph because the rotation is recognised as a call of the model's RotaryEmbedding (kiln/passes/modules.py);
after rope_kv and qk_norm_rope, which take the rotations they match first (with the cache write, or with Qwen3's
norms, which need a whole head's sum and so do not fit a tile of the GEMM).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from kiln.passes.base import KilnPass, erase_if_dead, single_user, tensor_value
from kiln.passes.modules import rope_calls

_VIEWS = ("view", "reshape")


def _is_view(node: object) -> bool:
    if not isinstance(node, fx.Node):
        return False
    return (node.op == "call_method" and node.target in _VIEWS) or (node.op == "call_function"
                                                                     and node.target is torch.reshape)


def _is_gemm(node: object) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in (
        torch.ops.kiln.dense_gemm, torch.ops.kiln.dense_gemm.default)


def _head_of(view: fx.Node) -> tuple[fx.Node, int] | None:
    """`view(split[i], -1, heads, head_dim)` used once -> (the split, i)."""
    if not _is_view(view) or not single_user(view):
        return None
    item = view.args[0]
    if not (isinstance(item, fx.Node) and item.target is operator.getitem and single_user(item)):
        return None
    return item.args[0], item.args[1]  # type: ignore[return-value]


def _qkv_gemm(q: fx.Node, k: fx.Node) -> tuple[fx.Node, fx.Node, list[fx.Node]] | None:
    """q, k: views of the first two parts of a three-way split of one dense_gemm output (through a reshape) ->
    (the gemm, the v heads' view or its contiguous copy, the nodes that go once q, k and v come from the op)."""
    q_head, k_head = _head_of(q), _head_of(k)
    if q_head is None or k_head is None or q_head[0] is not k_head[0] or (q_head[1], k_head[1]) != (0, 1):
        return None
    split = q_head[0]
    if not ((split.op == "call_method" and split.target == "split") or split.target is torch.split):
        return None
    dim = split.kwargs.get("dim", split.args[2] if len(split.args) > 2 else 0)
    if dim not in (-1, 1):
        return None
    items = {u.args[1]: u for u in split.users if u.target is operator.getitem}
    if set(items) != {0, 1, 2} or len(split.users) != 3 or len(items[2].users) != 1:
        return None
    v = next(iter(items[2].users))
    source = split.args[0]
    chain = [split, *items.values(), q, k, v]
    if _is_view(source) and single_user(source):
        chain.append(source)
        source = source.args[0]
    if not _is_gemm(source) or not single_user(source) or not _is_view(v):
        return None
    copy = next(iter(v.users)) if single_user(v) else None
    if copy is not None and copy.op == "call_method" and copy.target == "contiguous":  # the op's v already is
        chain.append(copy)
        v = copy
    return source, v, chain + [source]


class QKVRopePass(KilnPass):
    name = "qkv_rope"

    def apply_graph(self, gm: fx.GraphModule) -> int:
        import kiln.models.dense_gemm  # noqa: F401 - registers kiln::dense_gemm
        import kiln.passes.ops  # noqa: F401 - registers kiln::qkv_rope
        from kiln.models.gemm_epilogues import fits_a_tile  # imports triton: only where a pass runs

        graph, op = gm.graph, torch.ops.kiln.qkv_rope.default
        count = 0
        for rope in rope_calls(graph, with_norms=False):
            found = _qkv_gemm(rope.q, rope.k)
            if found is None:
                continue
            q_rot, k_rot = rope.q_rot, rope.k_rot
            gemm, v, chain = found
            qv, kv = tensor_value(rope.q), tensor_value(rope.k)
            if not fits_a_tile(qv.shape[-1]):
                continue
            args = (gemm.args[0], gemm.args[1], rope.positions, rope.cos_sin_cache, qv.shape[1], kv.shape[1])
            with graph.inserting_before(gemm):
                fused = graph.call_function(op, args)
                outs = [graph.call_function(operator.getitem, (fused, i)) for i in range(3)]
            # the outputs' example values: the rotated q and k are contiguous already; v is, made by the op
            values = [tensor_value(n) for n in (q_rot, k_rot, v)]
            if not values[2].is_contiguous():
                values[2] = values[2].new_empty(values[2].shape)  # in the graph's own fake mode
            fused.meta = {key: val for key, val in gemm.meta.items() if key != "example_value"}
            fused.meta["example_value"] = tuple(values)
            for new, old, value in zip(outs, (q_rot, k_rot, v), values):
                new.meta = {**old.meta, "example_value": value}
                old.replace_all_uses_with(new)
            erase_if_dead(graph, list(reversed(rope.nodes)) + chain[::-1])
            count += 1
        return count

