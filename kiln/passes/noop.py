"""No-op elimination: copies and reshapes that change nothing a consumer can see.

On the captured graph: a `.contiguous()` (or `.clone()`) whose only consumers are attention ops taking it
as k or v. The model makes V contiguous for the attention op, which costs a copy kernel per layer, yet
every backend reads K/V through strides (last-dim stride 1 suffices) and the op writes them into the
paged cache anyway. Only attention consumers qualify: a compiled piece downstream would have been
compiled for the contiguous layout.

Inside Inductor (post-grad, per piece): reshape-of-reshape chains become one reshape, and reshapes to the
same shape, full-range slices, same-layout clones and same-dtype conversions disappear. Inductor's own
`remove_noop_ops` catches most of these before our hook; what is left is mainly what rewrites (ours and
Inductor's pattern passes) produce afterwards.
"""

from __future__ import annotations

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from kiln.models.attention_op import is_attention_node_target
from kiln.passes.base import KilnPass, tensor_value

aten = torch.ops.aten
_RESHAPES = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)
_KV_ARGS = (1, 2)  # k, v positions of kiln::attention and its registered variants


def _is_copy_method(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in ("contiguous", "clone") and len(node.args) == 1 and not node.kwargs
    return node.op == "call_function" and node.target in (torch.Tensor.contiguous, torch.clone) \
        and len(node.args) == 1 and not node.kwargs


def _only_attention_kv_uses(node: fx.Node) -> bool:
    for user in node.users:
        if not (user.op == "call_function" and is_attention_node_target(user.target)):
            return False
        positions = [i for i, a in enumerate(user.args) if a is node]
        if user.kwargs and any(v is node for v in user.kwargs.values()):
            return False
        if not positions or any(i not in _KV_ARGS for i in positions):
            return False
    return bool(node.users)


def _same(a: object, b: object) -> bool:
    return statically_known_true(a == b) if not (isinstance(a, int) and isinstance(b, int)) else a == b


def _same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dim() == b.dim() and all(_same(x, y) for x, y in zip(a.shape, b.shape))


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return _same_shape(a, b) and a.dtype == b.dtype and all(_same(x, y) for x, y in zip(a.stride(), b.stride()))


class NoOpEliminationPass(KilnPass):
    name = "noop"

    def apply_graph(self, gm: fx.GraphModule) -> int:
        count = 0
        for node in list(gm.graph.nodes):
            if not _is_copy_method(node) or not _only_attention_kv_uses(node):
                continue
            src = node.args[0]
            value = tensor_value(src)
            if value is None or value.dim() == 0 or value.stride(-1) != 1:
                continue
            node.replace_all_uses_with(src)  # type: ignore[arg-type]
            gm.graph.erase_node(node)
            count += 1
        return count

    def apply_post_grad(self, graph: fx.Graph) -> int:
        output = next(iter(reversed(graph.nodes)))
        outputs = set(output.all_input_nodes)
        placeholders = {n for n in graph.nodes if n.op == "placeholder"}
        count = 0
        for node in list(graph.nodes):
            if node.op != "call_function":
                continue
            if node.target in _RESHAPES and isinstance(node.args[0], fx.Node) and node.args[0].target in _RESHAPES \
                    and len(node.args[0].users) == 1:
                inner = node.args[0]
                node.args = (inner.args[0], *node.args[1:])
                if node.target is not aten.reshape.default:  # a view of a view may need reshape semantics now
                    node.target = aten.reshape.default
                graph.erase_node(inner)
                count += 1
            src = self._noop_source(node)
            if src is None:
                continue
            # never make an output alias an input or another output (Inductor's rule, fx_passes/README.md)
            if node in outputs and (src in placeholders or src in outputs):
                continue
            node.replace_all_uses_with(src)
            graph.erase_node(node)
            count += 1
        return count

    @staticmethod
    def _noop_source(node: fx.Node) -> fx.Node | None:
        src = node.args[0] if node.args else None
        out, inp = tensor_value(node), tensor_value(src)
        if out is None or inp is None or not isinstance(src, fx.Node):
            return None
        target = node.target
        if target in _RESHAPES and _same_shape(out, inp):
            return src
        if target is aten.slice.Tensor and _same_shape(out, inp):
            step = node.args[4] if len(node.args) > 4 else 1
            return src if step == 1 else None
        if target in (aten.clone.default, torch.ops.prims.convert_element_type.default) and _same_layout(out, inp):
            return src
        return None
