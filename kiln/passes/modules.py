"""Find calls of kiln's model modules (RotaryEmbedding, RMSNorm) in a Dynamo-captured or a post-grad graph.

Dynamo records, per node, the stack of modules it was traced in (`nn_module_stack`), and AOTAutograd carries the
record to the ATen nodes of the post-grad graph. Matching a module call by that record, rather than by the exact
torch-level ops inside it, keeps passes immune to how the arithmetic is spelled (methods vs functions, dtype
casts, decompositions) across torch versions; the fused op then computes exactly what the module computes
(kiln/passes/ops.py), and the tests check the numbers.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import fx

from kiln.passes.base import live_nodes, tensor_value

ROTARY = "kiln.models.layers.RotaryEmbedding"
RMSNORM = "kiln.models.layers.RMSNorm"


def _scope(node: fx.Node) -> tuple[str, str] | None:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path, cls = list(stack.values())[-1]
    name = f"{cls.__module__}.{cls.__qualname__}" if isinstance(cls, type) else str(cls)
    return str(path), name


@dataclass
class ModuleCall:
    path: str
    nodes: list[fx.Node]  # computing nodes, graph order (no placeholders)
    inputs: list[fx.Node]  # values from outside the call, first use first
    outputs: list[fx.Node]  # nodes of the call used outside it

    def sources(self, node: fx.Node) -> set[fx.Node]:
        """The call's inputs that `node` (one of its nodes) depends on."""
        inside, found, stack, seen = set(self.nodes), set(), [node], set()
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            for arg in n.all_input_nodes:
                if arg in inside:
                    stack.append(arg)
                else:
                    found.add(arg)
        return found

    def find(self, method: str, function: object = None) -> list[fx.Node]:
        return [n for n in self.nodes if (n.op == "call_method" and n.target == method)
                or (function is not None and n.op == "call_function" and n.target is function)]

    def float_constant(self) -> float | None:
        """The one float literal added in the call (RMSNorm's eps); None unless exactly one."""
        found = [a for n in self.nodes if n.op == "call_function" and n.target in (operator.add, torch.add)
                 for a in n.args if isinstance(a, float)]
        return found[0] if len(found) == 1 else None


def module_call(node: fx.Node, cls: str) -> ModuleCall | None:
    """The call of a `cls` module that computed `node`, or None if `node` did not come from one."""
    scope = _scope(node)
    if node.op not in ("call_function", "call_method") or scope is None or scope[1] != cls:
        return None
    path = scope[0]
    nodes = [n for n in node.graph.nodes if n.op in ("call_function", "call_method") and _scope(n) == scope]
    inside = set(nodes)
    inputs: dict[fx.Node, None] = {}
    for n in nodes:
        for arg in n.all_input_nodes:
            if arg not in inside:
                inputs[arg] = None
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    return ModuleCall(path, nodes, list(inputs), outputs)


@dataclass
class RopeCall:
    """One `RotaryEmbedding(positions, q, k)` call, optionally preceded by Qwen3's per-head q/k RMSNorm."""

    call: ModuleCall
    q_rot: fx.Node
    k_rot: fx.Node
    q: fx.Node  # what the rotation (or the norm, when absorbed) reads
    k: fx.Node
    positions: fx.Node
    cos_sin_cache: fx.Node
    norms: list[ModuleCall]  # q_norm, k_norm calls absorbed into the match (empty: none)
    q_weight: fx.Node | None = None
    k_weight: fx.Node | None = None
    eps: float = 0.0

    @property
    def nodes(self) -> list[fx.Node]:
        return [n for c in (self.call, *self.norms) for n in c.nodes]


def _cache_rows(call: ModuleCall) -> tuple[object, object] | None:
    """(cos_sin_cache, positions) of the call's one row lookup: `index_select(cache, 0, positions)` as Dynamo
    records it, `aten.index(cache, [positions])` (or aten.index_select) in a post-grad graph."""
    lookups = call.find("index_select", torch.index_select) + [
        n for n in call.nodes if n.op == "call_function"
        and n.target in (torch.ops.aten.index.Tensor, torch.ops.aten.index_select.default)]
    if len(lookups) != 1:
        return None
    args = lookups[0].args
    if len(args) == 3 and args[1] == 0:
        return args[0], args[2]
    if len(args) == 2 and isinstance(args[1], (list, tuple)) and len(args[1]) == 1:
        return args[0], args[1][0]
    return None


def match_rope(q_rot: fx.Node, k_rot: fx.Node, with_norms: bool) -> RopeCall | None:
    call = module_call(q_rot, ROTARY)
    if call is None or set(call.outputs) != {q_rot, k_rot} or k_rot not in call.nodes:
        return None
    rows = _cache_rows(call)
    if rows is None:
        return None
    cache, positions = rows
    q_src = call.sources(q_rot) - {cache, positions}
    k_src = call.sources(k_rot) - {cache, positions}
    if len(q_src) != 1 or len(k_src) != 1 or q_src == k_src:
        return None
    q, k = q_src.pop(), k_src.pop()
    qv, kv, cv = tensor_value(q), tensor_value(k), tensor_value(cache)
    if qv is None or kv is None or cv is None or qv.dim() != 3 or kv.dim() != 3 or qv.shape[-1] % 2 \
            or cv.shape[-1] != qv.shape[-1] or kv.shape[-1] != qv.shape[-1]:
        return None
    rope = RopeCall(call, q_rot, k_rot, q, k, positions, cache, [])  # type: ignore[arg-type]
    if with_norms:
        _absorb_norms(rope)
    return rope


def rope_calls(graph: fx.Graph, with_norms: bool) -> Iterator[RopeCall]:
    """Each `RotaryEmbedding(positions, q, k)` call of the graph that match_rope recognises, once, in graph order
    (a pass may rewrite the graph between two)."""
    seen: set[str] = set()
    for node in live_nodes(graph):
        call = module_call(node, ROTARY)
        if call is None or call.path in seen or len(call.outputs) != 2:
            continue
        seen.add(call.path)
        q_rot, k_rot = call.outputs  # graph order: the model rotates q first
        rope = match_rope(q_rot, k_rot, with_norms)
        if rope is not None:
            yield rope


def _absorb_norms(rope: RopeCall) -> None:
    """Qwen3: q and k come straight from per-head RMSNorm calls used by nothing else."""
    parts = []
    for x in (rope.q, rope.k):
        norm = module_call(x, RMSNORM)
        if norm is None or norm.outputs != [x] or len(x.users) != 1 or len(norm.inputs) != 2:
            return
        weights = [i for i in norm.inputs if (v := tensor_value(i)) is not None and v.dim() == 1]
        eps = norm.float_constant()
        if len(weights) != 1 or eps is None:
            return
        parts.append((norm, [i for i in norm.inputs if i is not weights[0]][0], weights[0], eps))
    (qn, q, qw, q_eps), (kn, k, kw, k_eps) = parts
    if q_eps != k_eps:
        return
    rope.norms, rope.q, rope.k, rope.q_weight, rope.k_weight, rope.eps = [qn, kn], q, k, qw, kw, q_eps
