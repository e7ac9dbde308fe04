"""The kiln Dynamo backend: split the captured graph at attention and compile the pieces piecewise.

Dynamo calls the backend once per trace with the FX graph and real example inputs. Everything that will
ever be compiled is compiled here, for every range and size, so that serving never compiles. The backend
also keeps what `CompiledForward` needs to call the split graph directly afterwards (bypassing Dynamo's
guards): each graph input's source expression, and the real inputs of the trace to check them against.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
from torch import fx

from kiln.compiler import saved_capture
from kiln.compiler.dump import DebugDump
from kiln.compiler.fakes import input_specs, token_symbol
from kiln.compiler.inductor import InductorCompiler
from kiln.compiler.piecewise import (
    PieceRunner,
    compile_pieces,
    generated_forward,
    install_runners,
    record_split,
    stats_of_piece,
)
from kiln.compiler.ranges import Dispatcher
from kiln.compiler.split import SplitGraph, split_at_attention
from kiln.compiler.stats import CompileStats

logger = logging.getLogger("kiln.compiler")


@dataclass
class Capture:
    """The result of one trace: the Dynamo graph, its split form, and how to feed it."""

    graph: fx.GraphModule
    split: SplitGraph
    runners: dict[str, PieceRunner]
    sources: list[str | None]  # per graph input, Dynamo's source expression (L['self']..., L['input_ids'])
    example_inputs: list[Any] = field(default_factory=list)  # the trace's real inputs; cleared after checks
    outputs: Any = None  # what the graph returned on the trace's own call; cleared after checks
    record: bool = True
    saved: bytes | None = None  # this capture for the artifact cache (saved_capture.py); None if not picklable
    inputs: list[saved_capture.InputInfo] = field(default_factory=list)  # set when loaded from the cache
    # the token count's symbol in the pieces' example values (None: static)
    symbol: sympy.Symbol | None = None
    # each distinct piece's input layouts (fakes.input_specs) as traced: later compiles (background.py)
    # need them, and the shape environment may specialise the token count once the trace is done
    piece_specs: dict[str, list[Any]] = field(default_factory=dict)


class KilnBackend:
    def __init__(self, dispatcher: Dispatcher, compiler: InductorCompiler, stats: CompileStats,
                 dump: DebugDump | None = None, progress: bool = True,
                 graph_passes: Callable[[fx.GraphModule], fx.GraphModule] | None = None,
                 compile_workers: int | None = 1) -> None:
        self.compile_workers = compile_workers  # processes for the compiles (None: from the host's cores)
        self.graph_passes = graph_passes  # kiln/passes: rewrites that must see across the attention split
        self.dispatcher = dispatcher
        self.compiler = compiler
        self.stats = stats
        self.dump = dump
        self.progress = progress
        self.capture: Capture | None = None
        self.trace_started: float | None = None  # set by the caller just before entering Dynamo

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        now = time.perf_counter()
        self.stats.record_trace(now - self.trace_started if self.trace_started is not None else 0.0)
        symbol = token_symbol(gm)
        check_token_count_guards(gm, symbol, self.dispatcher.max_num_tokens)
        if self.graph_passes is not None:
            gm = self.graph_passes(gm)
        split = split_at_attention(gm)
        record_split(self.stats, split)
        specs = {h: input_specs(group[0].module) for h, group in split.distinct().items()}
        runners = self._compile(split, symbol)
        sources = [_source_name(n) for n in gm.graph.nodes if n.op == "placeholder"]
        saved = _save(split, runners, sources, list(example_inputs), symbol, specs) \
            if self.compiler.store is not None else None
        install_runners(split, runners)
        if self.dump is not None:
            self.dump.write_split_graph(split, self.dispatcher)
        capture = Capture(gm, split, runners, sources, list(example_inputs), saved=saved, symbol=symbol,
                          piece_specs=specs)
        self.capture = capture
        forward = generated_forward(split.module)

        def run(*args: Any) -> Any:
            out = forward(*args)
            if capture.record:  # only the trace's own call: CompiledForward checks it against the result
                capture.outputs, capture.record = out, False
            return out

        return run

    def restore(self, saved: saved_capture.SavedCapture) -> Capture:
        """The capture of an earlier start, every artifact loaded from the cache (no Dynamo, no Inductor);
        raises if any artifact is missing (the caller then traces as usual)."""
        split = saved.split_graph()
        runners: dict[str, PieceRunner] = {}
        infos = {p.name: p for p in saved.pieces}
        for piece_hash, group in split.distinct().items():
            stats_of_piece(self.stats, piece_hash, group)
            compiled = {}
            for key in self.dispatcher.keys:
                fn = self.compiler.load(group[0].module, key, piece_hash)
                if fn is None:
                    raise LookupError(f"no cached artifact for piece {piece_hash[:12]} at {key}")
                compiled[key] = fn
            for piece in group:
                info = infos[piece.name]
                runners[piece.name] = PieceRunner(piece.name, piece_hash, dict(compiled), self.dispatcher,
                                                  info.token_arg, info.token_arg_is_tensor)
        install_runners(split, runners)
        record_split(self.stats, split)
        self.stats.capture_loaded = True
        self.capture = Capture(split.module, split, runners, [i.source for i in saved.inputs], record=False,
                               inputs=saved.inputs, symbol=saved.symbol, piece_specs=saved.piece_specs)
        return self.capture

    def _compile(self, split: SplitGraph, symbol: sympy.Symbol | None) -> dict[str, PieceRunner]:
        from tqdm.auto import tqdm

        distinct = split.distinct()
        total = len(distinct) * len(self.dispatcher.keys)
        start = time.perf_counter()
        with tqdm(total=total, desc="kiln: compiling pieces", unit="graph", disable=not self.progress,
                  leave=False) as bar:
            runners = compile_pieces(split, self.dispatcher, symbol, self.compiler, self.stats, bar.update,
                                     self.compile_workers)
        logger.info("compiled %d distinct pieces (of %d, %d attention) x %d ranges/sizes = %d graphs in "
                    "%.1f s; %s", len(distinct), len(split.pieces), self.stats.num_attention_pieces,
                    len(self.dispatcher.keys), total, time.perf_counter() - start, self.dispatcher.describe())
        return runners


def check_token_count_guards(gm: fx.GraphModule, symbol: sympy.Symbol | None, max_num_tokens: int) -> None:
    """Fail if the trace is only valid for some token counts: calls skip guards, so they must be vacuous.

    A model that branches on the token count (`if x.shape[0] > 4`) makes Dynamo guard on it or specialise
    it; one graph for every count would then be silently wrong for some of them.
    """
    if symbol is None:
        if max_num_tokens > 1:
            raise ValueError("Dynamo specialised the token count to a constant; the model's forward must "
                             "not depend on the number of tokens")
        return
    shape_env = None
    for node in gm.graph.nodes:
        value = node.meta.get("example_value")
        if isinstance(value, torch.SymInt):
            shape_env = value.node.shape_env
            break
        if isinstance(value, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in value.shape):
            shape_env = next(s for s in value.shape if isinstance(s, torch.SymInt)).node.shape_env
            break
    if shape_env is None:
        return
    samples = sorted({1, 2, 3, max(1, max_num_tokens // 2), max_num_tokens})
    for guard in shape_env.guards:
        expr = guard.expr
        for n in samples:
            value = expr.xreplace({s: sympy.Integer(n) for s in expr.free_symbols})
            if value == sympy.false:  # unevaluated leftovers (e.g. FloorDiv) are given the benefit
                raise ValueError(f"the model's forward depends on the token count (Dynamo guard {expr} fails "
                                 f"for {n} tokens); kiln needs one graph valid for every token count")


def _save(split: SplitGraph, runners: dict[str, PieceRunner], sources: list[str | None],
          example_inputs: list[Any], symbol: sympy.Symbol | None, specs: dict[str, list[Any]]) -> bytes | None:
    """Inputs whose source does not go through the model (`L['self']`) are the per-call token tensors."""
    try:
        per_call = {i for i, src in enumerate(sources) if src is not None and "L['self']" not in src}
        pieces = [saved_capture.PieceInfo(p.name, p.structural_hash, p.is_attention,
                                          None if p.is_attention else runners[p.name].token_arg,
                                          False if p.is_attention else runners[p.name].token_arg_is_tensor)
                  for p in split.pieces]
        inputs = saved_capture.describe_inputs(sources, example_inputs, per_call)
        return saved_capture.dump(split.module, pieces, inputs, symbol, specs)
    except Exception as exc:  # noqa: BLE001 - only a later start's shortcut is lost
        logger.info("the captured graph cannot be saved (%s); warm starts will trace it again", exc)
        return None


def _source_name(node: fx.Node) -> str | None:
    source = getattr(node.meta.get("grapharg"), "source", None)
    if source is None:
        return None
    name = source.name  # a property in recent torch, a method in older releases
    return name() if callable(name) else name
