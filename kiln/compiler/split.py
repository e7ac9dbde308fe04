"""Split the captured FX graph at every `kiln::attention` call, and fingerprint the pieces.

Attention stays outside the compiled pieces: it reads per-step metadata from the forward context and
(on GPU) is the part a piecewise CUDA graph cannot contain. Cutting there gives 2L+1 pieces for L layers,
but only about three distinct graphs (before the first attention, the repeated layer body, after the last
attention), so pieces are fingerprinted structurally and each distinct graph is compiled once.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.fx.passes.split_module import split_module

from kiln.models.attention_op import is_attention_node_target


@dataclass
class Piece:
    name: str  # the submodule name in the split graph (submod_<i>)
    module: fx.GraphModule
    is_attention: bool
    structural_hash: str


@dataclass
class SplitGraph:
    module: fx.GraphModule  # calls the pieces in order; the compiler swaps them for compiled runners
    pieces: list[Piece]

    @property
    def compiled_pieces(self) -> list[Piece]:
        return [p for p in self.pieces if not p.is_attention]

    def as_text(self, hash_chars: int, *notes: str) -> str:
        """Which piece runs what (compiled pieces by their hash's first `hash_chars`, the length the
        reader's file names use), any notes, then the split graph's code."""
        lines = ["# kiln split graph: pieces in call order", *(f"# {note}" for note in notes)]
        for piece in self.pieces:
            kind = "attention (eager)" if piece.is_attention else f"compiled {piece.structural_hash[:hash_chars]}"
            lines.append(f"#   {piece.name}: {kind}")
        return "\n".join(lines) + "\n\n" + self.module.print_readable(print_output=False)

    def distinct(self) -> dict[str, list[Piece]]:
        """structural hash -> the non-attention pieces that share it, in graph order."""
        groups: dict[str, list[Piece]] = {}
        for piece in self.compiled_pieces:
            groups.setdefault(piece.structural_hash, []).append(piece)
        return groups


def is_attention_node(node: fx.Node) -> bool:
    return node.op == "call_function" and is_attention_node_target(node.target)


def split_at_attention(gm: fx.GraphModule) -> SplitGraph:
    """Cut before and after each attention call; every attention call becomes a piece of its own."""
    partition_of: dict[fx.Node, int] = {}
    current = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if is_attention_node(node):
            partition_of[node] = current + 1
            current += 2
        else:
            partition_of[node] = current
    if not any(is_attention_node(n) for n in gm.graph.nodes):
        raise ValueError("the captured graph has no kiln::attention call to split at; is the model using "
                         "kiln.models.attention_op.attention?")
    split = split_module(gm, None, lambda node: partition_of[node], keep_original_order=True)
    pieces = []
    for name, module in split.named_children():
        assert isinstance(module, fx.GraphModule)
        is_attn = any(is_attention_node(n) for n in module.graph.nodes)
        pieces.append(Piece(name, module, is_attn, structural_hash(module)))
    # named_children follows registration order, which split_module makes the call order
    order = {node.target: i for i, node in enumerate(split.graph.nodes) if node.op == "call_module"}
    pieces.sort(key=lambda p: order[p.name])
    return SplitGraph(split, pieces)


def structural_hash(gm: fx.GraphModule) -> str:
    """A fingerprint equal for graphs that compute the same function of their inputs by position.

    Node and placeholder names differ per layer (they carry parameter paths), so the fingerprint uses
    node positions, op targets, literal arguments and the inputs' shapes/strides/dtypes instead. Attribute
    constants are fingerprinted by value, because two graphs differing only in a constant are not the same.
    """
    index: dict[fx.Node, int] = {}
    lines: list[str] = []

    def ref(value: Any) -> Any:
        return fx.node.map_arg(value, lambda n: f"%{index[n]}")

    for i, node in enumerate(gm.graph.nodes):
        index[node] = i
        if node.op == "placeholder":
            target = f"input{i}"
            extra = _describe_value(node.meta.get("example_value", node.meta.get("val")))
        elif node.op == "get_attr":
            target = "attr"
            extra = _describe_attr(_fetch_attr(gm, str(node.target)))
        elif node.op == "call_module":
            target = "module"
            extra = structural_hash(gm.get_submodule(str(node.target)))
        elif node.op == "call_function":
            target, extra = _qualified_name(node.target), ""
        else:  # call_method, output
            target, extra = str(node.target) if node.op != "output" else "output", ""
        lines.append(f"{node.op}|{target}|{ref(node.args)!r}|{ref(node.kwargs)!r}|{extra}")
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def _qualified_name(target: Any) -> str:
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or repr(target)
    return f"{module}.{name}"


def _describe_value(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return (f"tensor{tuple(value.shape)}/{value.stride()}+{value.storage_offset()}/{value.dtype}/"
                f"{value.device.type}")
    return repr(value)


def _fetch_attr(gm: fx.GraphModule, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _describe_attr(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        data = value.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return f"{_describe_value(value)}/{hashlib.sha256(data).hexdigest()}"
    if isinstance(value, fx.GraphModule):
        return structural_hash(value)
    return repr(value)
