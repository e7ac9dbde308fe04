"""Example inputs for compiling one piece for one CompileKey, each in a fake mode of its own.

Dynamo's shape environment assumes every dynamic size is >= 2 (its 0/1 specialisation) and knows
nothing of our ranges. So each compile gets a fresh ShapeEnv whose only symbol is the token count,
constrained to the key's range (hinted at its upper end, the size autotuning should favour), or replaced
by the exact size. This also keeps compiled artifacts independent of the Dynamo trace that produced the
graph, which is what lets the compile cache load them without one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch import fx
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StrictMinMaxConstraint
from torch.utils._sympy.value_ranges import ValueRanges

from kiln.compiler.ranges import CompileKey


def placeholder_values(gm: fx.GraphModule) -> list[Any]:
    """The example value Dynamo recorded for each input of the graph (fake tensors, SymInts)."""
    values = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if "example_value" not in node.meta:
                raise ValueError(f"graph input {node.name} has no example value; was the graph captured by Dynamo?")
            values.append(node.meta["example_value"])
    return values


def _free_symbols(value: Any) -> set[sympy.Symbol]:
    if isinstance(value, torch.SymInt):
        return set(value.node.expr.free_symbols)
    if isinstance(value, torch.Tensor):
        out: set[sympy.Symbol] = set()
        for v in (*value.shape, *value.stride(), value.storage_offset()):
            out |= _free_symbols(v)
        return out
    return set()


def token_symbol(gm: fx.GraphModule) -> sympy.Symbol | None:
    """The one symbolic size in the graph (the token count); None for a graph traced with static shapes."""
    symbols: set[sympy.Symbol] = set()
    for value in placeholder_values(gm):
        symbols |= _free_symbols(value)
    if len(symbols) > 1:
        raise ValueError(f"the captured graph has several symbolic sizes {sorted(map(str, symbols))}; kiln "
                         "compiles the token count as the only dynamic dimension")
    return next(iter(symbols), None)


@dataclass(frozen=True)
class TensorSpec:
    """A graph input tensor's layout, sizes as ints or sympy expressions in the token count (picklable:
    a compile in a worker process rebuilds its fake inputs from these)."""

    shape: tuple[Any, ...]
    stride: tuple[Any, ...]
    offset: Any
    dtype: torch.dtype
    device: torch.device


@dataclass(frozen=True)
class SymSpec:
    expr: Any  # a SymInt input as its sympy expression


def _expr(value: Any) -> Any:
    return value.node.expr if isinstance(value, torch.SymInt) else int(value)


def input_specs(gm: fx.GraphModule) -> list[Any]:
    """Each graph input as a TensorSpec, a SymSpec, or its plain value."""
    specs: list[Any] = []
    for value in placeholder_values(gm):
        if isinstance(value, torch.Tensor):
            specs.append(TensorSpec(tuple(map(_expr, value.shape)), tuple(map(_expr, value.stride())),
                                    _expr(value.storage_offset()), value.dtype, value.device))
        elif isinstance(value, torch.SymInt):
            specs.append(SymSpec(value.node.expr))
        else:
            specs.append(value)
    return specs


def example_inputs(gm: fx.GraphModule, key: CompileKey,
                   symbol: sympy.Symbol | None) -> tuple[FakeTensorMode, list[Any]]:
    """Fake inputs for `gm` with the token count as `key` describes (symbolic in a range, or exact)."""
    return fake_inputs(input_specs(gm), key, symbol)


def fake_inputs(specs: list[Any], key: CompileKey, symbol: sympy.Symbol | None) -> tuple[FakeTensorMode, list[Any]]:
    """Fake inputs from `input_specs`, in a fresh fake mode."""
    dynamic = symbol is not None and not key.exact and key.lo < key.hi
    env = ShapeEnv(specialize_zero_one=False) if dynamic else ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    if dynamic:
        new = env.create_symbol(key.hi, ConstantSource("num_tokens"), dynamic_dim=DimDynamic.DYNAMIC,
                                constraint_dim=StrictMinMaxConstraint(vr=ValueRanges(key.lo, key.hi),
                                                                      warn_only=False))

        def size(expr: Any) -> Any:
            if isinstance(expr, int):
                return expr
            expr = expr.xreplace({symbol: new})
            if expr.is_number:
                return int(expr)
            return env.create_symintnode(expr, hint=int(expr.xreplace({new: key.hi})))
    else:
        def size(expr: Any) -> Any:
            if isinstance(expr, int):
                return expr
            return int(expr.xreplace({symbol: key.lo}) if symbol is not None else expr)

    inputs: list[Any] = []
    with mode:
        for spec in specs:
            if isinstance(spec, TensorSpec):
                inputs.append(_fake_like(spec, size))
            elif isinstance(spec, SymSpec):
                inputs.append(size(spec.expr))
            else:
                inputs.append(spec)
    return mode, inputs


def _fake_like(spec: TensorSpec, size: Any) -> torch.Tensor:
    shape = [size(s) for s in spec.shape]
    stride = [size(s) for s in spec.stride]
    offset = size(spec.offset)
    if offset == 0:
        return torch.empty_strided(shape, stride, dtype=spec.dtype, device=spec.device)
    # a view into a larger buffer (e.g. q split out of the fused qkv output): keep its layout exactly
    extent = offset + 1 + sum((n - 1) * s for n, s in zip(shape, stride))
    base = torch.empty(extent, dtype=spec.dtype, device=spec.device)
    return base.as_strided(shape, stride, offset)
