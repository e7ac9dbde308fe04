"""Dynamo's module record per node (`nn_module_stack`), carried beside a pickled graph module.

FX graph modules pickle as their code, and come back without node metadata. Passes that find the model's modules
by that record (kiln/passes/modules.py: the RotaryEmbedding calls qkv_rope rewrites after the split) then find none
in a piece compiled by a worker process (parallel.py: every compile on a GPU host, whose many cores get workers) or
loaded from a saved capture (saved_capture.py). So the record travels beside the graph as plain strings, keyed by
node name (the generated code names each value after its node, so a graph rebuilt from it has the same names), and
is put back only on a node of the same name and target.
"""

from __future__ import annotations

from torch import fx

# node name -> (target name, {stack key: (module path, module class as "module.qualname")})
ModuleStacks = dict[str, tuple[str, dict[str, tuple[str, str]]]]


def _class_name(cls: object) -> str:
    return f"{cls.__module__}.{cls.__qualname__}" if isinstance(cls, type) else str(cls)


def _target_name(target: object) -> str:
    """A node's target by name: the same in every process (a function's repr holds its address)."""
    return target if isinstance(target, str) else getattr(target, "__name__", None) or str(target)


def module_stacks(gm: fx.GraphModule) -> ModuleStacks:
    """The graph's nodes' module records, picklable."""
    stacks: ModuleStacks = {}
    for node in gm.graph.nodes:
        if record := node.meta.get("nn_module_stack"):
            stacks[node.name] = (_target_name(node.target),
                                 {key: (str(path), _class_name(cls)) for key, (path, cls) in record.items()})
    return stacks


def restore_module_stacks(gm: fx.GraphModule, stacks: ModuleStacks) -> int:
    """Puts `module_stacks`' records back on the nodes of the same name and target -> how many."""
    restored = 0
    for node in gm.graph.nodes:
        record = stacks.get(node.name)
        if record is not None and record[0] == _target_name(node.target) and not node.meta.get("nn_module_stack"):
            node.meta["nn_module_stack"] = dict(record[1])
            restored += 1
    return restored
