"""What a kiln pass is: a name, where it runs, which token counts it suits, and a uuid for cache keys.

A pass runs at one or both of two places:

- on the captured graph, before it is split at attention (`apply_graph`): the only place where work on
  both sides of the attention op is visible, and where model-level structure (which module a node came
  from) is still attached. One graph serves every token count, so these passes cannot be gated by range.
- inside Inductor, as part of its post-grad pipeline, once per piece and per compile range/size
  (`apply_post_grad`): on normalised ATen graphs; these can be gated by token count (`applies_to`).

Both return how many places they rewrote, which the manager records (tests assert on it).
"""

from __future__ import annotations

import hashlib
import inspect
import operator
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import fx

from kiln.passes.config import PassConfig
from kiln.passes.context import CompileScope


@dataclass(frozen=True)
class PassEnv:
    """What the passes need to know about the runtime they compile for."""

    # the attention backend can attend reading only the paged cache (`supports_cache_only`), which is
    # what lets rope_kv move the K/V write out of it
    cache_only_attention: bool = False
    # the attention backend rotates q/k inside its kernel where it can (`supports_rope`): rope_kv then hands it the
    # rotation too
    rope_in_attention: bool = False


class KilnPass:
    name: ClassVar[str]

    def __init__(self, config: PassConfig, env: PassEnv) -> None:
        self.config = config
        self.env = env

    def applies_to(self, scope: CompileScope | None) -> bool:
        """Post-grad gating: only compiles whose whole token range lies within the configured bound."""
        bound = self.config.token_bound(self.name)
        return bound is None or scope is None or scope.hi <= bound

    def apply_graph(self, gm: fx.GraphModule) -> int:
        return 0

    def apply_post_grad(self, graph: fx.Graph) -> int:
        return 0

    def uuid(self) -> str:
        """Changes whenever the pass's code or its inputs change (Inductor and kiln cache keys use it)."""
        source = inspect.getsource(sys.modules[type(self).__module__])
        return hashlib.sha256(f"{self.name}|{self.env}|{source}".encode()).hexdigest()


def is_call(node: object, *targets: object) -> bool:
    """`node` is an FX node calling one of `targets`."""
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def tensor_value(node: object) -> torch.Tensor | None:
    """The (fake) tensor an FX node computes: `example_value` on a Dynamo graph, `val` on a post-grad one."""
    if not isinstance(node, fx.Node):
        return None
    value = node.meta.get("val", node.meta.get("example_value"))
    return value if isinstance(value, torch.Tensor) else None


def strip_cast(node: object) -> object:
    """What a dtype conversion (`prims.convert_element_type`) reads, else the node itself."""
    return node.args[0] if is_call(node, torch.ops.prims.convert_element_type.default) else node  # type: ignore[union-attr]


def live_nodes(graph: fx.Graph) -> Iterator[fx.Node]:
    """The graph's nodes as they stand now, skipping any that a rewrite made during the walk has erased."""
    for node in list(graph.nodes):
        if not getattr(node, "_erased", False):
            yield node


def single_user(node: fx.Node) -> bool:
    return len(node.users) == 1


def erase_if_dead(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    """Erase the given nodes that nothing uses any more, consumers before producers."""
    pending = [n for n in dict.fromkeys(nodes) if n.op in ("call_function", "call_method")]
    changed = True
    while changed:
        changed = False
        for node in list(pending):
            if not node.users:
                graph.erase_node(node)
                pending.remove(node)
                changed = True


def call_outputs(graph: fx.Graph, op: object, args: tuple, count: int) -> list[fx.Node]:
    """A call of `op` (which returns `count` tensors) at the graph's insertion point, and its outputs taken right
    after it, each node carrying its fake value."""
    fused = graph.call_function(op, args)  # type: ignore[arg-type]
    set_fake_value(fused, op, *args)
    outs, after = [], fused
    for i in range(count):
        with graph.inserting_after(after):
            after = graph.call_function(operator.getitem, (fused, i))
        after.meta["val"] = fused.meta["val"][i] if "val" in fused.meta else None
        outs.append(after)
    return outs


def call_two_outputs(graph: fx.Graph, op: object, args: tuple) -> tuple[fx.Node, fx.Node]:
    first, second = call_outputs(graph, op, args, 2)
    return first, second


def set_fake_value(node: fx.Node, op: object, *args: object) -> None:
    """Fill node.meta["val"] by running `op`'s fake implementation on the arguments' fake values, as
    Inductor expects every node of a post-grad graph to carry one."""
    from torch._guards import detect_fake_mode

    vals = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in args]
    mode = detect_fake_mode([v for v in vals if v is not None])
    if mode is None:
        return
    with mode:
        node.meta["val"] = op(*vals)  # type: ignore[operator]
