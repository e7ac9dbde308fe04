"""The captured, split graph as bytes, so a start whose artifacts are all cached skips the Dynamo trace.

What a warm start needs besides the compiled artifacts is exactly what the trace produced: the split
graph (its generated code and the attention pieces; compiled pieces are replaced by their artifacts),
which piece input carries the token count, and each graph input's source expression with the shape and
dtype it had; and, for compiles after start-up (background.py), the token count's symbol and each distinct
piece's input layouts (fakes.input_specs), which a piece loaded from here has no example values to give, and
their nodes' module records (node_meta.py), which the pickle drops. FX graph modules pickle as their code, so
this is small. Loading re-checks every input
against the live model (parameters by shape and dtype); any mismatch, unreadable blob or missing
artifact means "trace with Dynamo as usual", never a wrong graph.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from kiln.compiler.node_meta import module_stacks, restore_module_stacks
from kiln.compiler.split import Piece, SplitGraph

FORMAT = 3  # 2: the symbol and the pieces' input layouts; 3: the pieces' module records (node_meta.py)


@dataclass(frozen=True)
class PieceInfo:
    name: str
    structural_hash: str
    is_attention: bool
    token_arg: int | None
    token_arg_is_tensor: bool


@dataclass(frozen=True)
class InputInfo:
    """A graph input as traced: a tensor's shape and dtype (None for per-call inputs), or a plain value."""

    source: str
    shape: tuple[int, ...] | None
    dtype: str | None


@dataclass
class SavedCapture:
    split_module: fx.GraphModule
    pieces: list[PieceInfo]
    inputs: list[InputInfo]
    symbol: Any = None  # the token count's sympy symbol (None: static shapes)
    piece_specs: dict[str, list[Any]] = field(default_factory=dict)  # by structural hash

    def split_graph(self) -> SplitGraph:
        modules = dict(self.split_module.named_children())
        return SplitGraph(self.split_module, [Piece(p.name, modules[p.name], p.is_attention, p.structural_hash)
                                              for p in self.pieces])


def describe_inputs(sources: list[str | None], example_inputs: list[Any], per_call: set[int]) -> list[InputInfo]:
    infos = []
    for i, (source, value) in enumerate(zip(sources, example_inputs)):
        if source is None:
            raise ValueError(f"graph input {i} has no source")
        if isinstance(value, torch.Tensor) and i not in per_call:
            infos.append(InputInfo(source, tuple(int(s) for s in value.shape), str(value.dtype)))
        else:
            infos.append(InputInfo(source, None, None))
    return infos


def dump(split_module: fx.GraphModule, pieces: list[PieceInfo], inputs: list[InputInfo], symbol: Any = None,
         piece_specs: dict[str, list[Any]] | None = None) -> bytes:
    """`split_module` must still hold its FX pieces (call before the compiled runners are installed)."""
    stacks = {name: module_stacks(child) for name, child in split_module.named_children()
              if isinstance(child, fx.GraphModule)}
    return pickle.dumps({"format": FORMAT, "torch": torch.__version__, "split": pickle.dumps(split_module),
                         "pieces": pieces, "inputs": inputs, "symbol": symbol, "piece_specs": piece_specs or {},
                         "module_stacks": stacks})


def load(blob: bytes) -> SavedCapture:
    data = pickle.loads(blob)  # noqa: S301 - our own cache file, checksummed by the store
    if data.get("format") != FORMAT or data.get("torch") != torch.__version__:
        raise ValueError(f"saved capture has format {data.get('format')} / torch {data.get('torch')}")
    split_module = pickle.loads(data["split"])  # noqa: S301
    for name, child in split_module.named_children():  # for the passes of compiles after start-up
        if isinstance(child, fx.GraphModule):
            restore_module_stacks(child, data["module_stacks"].get(name, {}))
    return SavedCapture(split_module, data["pieces"], data["inputs"], data["symbol"], data["piece_specs"])


def matches(info: InputInfo, value: Any) -> bool:
    if info.shape is None:
        return True
    return isinstance(value, torch.Tensor) and tuple(value.shape) == info.shape and str(value.dtype) == info.dtype
