"""Compile every distinct piece for every range and size, and run pieces by the step's token count.

Compilation happens once, at start-up, for everything the dispatcher can select; the runner only looks
up. Identical pieces (the repeated layer body) share one table of compiled artifacts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import sympy
import torch
from torch import fx

from kiln.compiler.inductor import CompiledFn, InductorCompiler
from kiln.compiler.ranges import CompileKey, Dispatcher
from kiln.compiler.split import Piece, SplitGraph
from kiln.compiler.stats import CompileStats, PieceStats

logger = logging.getLogger("kiln.compiler")


class PieceRunner:
    """One piece of the split graph: picks the compiled artifact for this call's token count."""

    def __init__(self, name: str, piece_hash: str, compiled: dict[CompileKey, CompiledFn],
                 dispatcher: Dispatcher, token_arg: int | None, token_arg_is_tensor: bool) -> None:
        self.name = name
        self.piece_hash = piece_hash
        # artifacts are shared by every piece with this hash, but the table is this runner's own: a CUDA
        # graph wrapper replacing an entry captures this occurrence's inputs, not its twins'
        self.compiled = compiled
        self.dispatcher = dispatcher
        self.token_arg = token_arg
        self.token_arg_is_tensor = token_arg_is_tensor
        self.last_key: CompileKey | None = None  # what the last call dispatched to (tests, debugging)
        self._by_count: dict[int, tuple[CompileKey, CompiledFn]] = {}

    def num_tokens(self, args: tuple[Any, ...]) -> int:
        if self.token_arg is None:  # traced with static shapes: the only size is the range's
            return self.dispatcher.max_num_tokens
        value = args[self.token_arg]
        return int(value.shape[0]) if self.token_arg_is_tensor else int(value)

    def __call__(self, *args: Any) -> Any:
        n = self.num_tokens(args)
        entry = self._by_count.get(n)
        if entry is None:
            key = self.dispatcher.select(n)
            entry = self._by_count[n] = (key, self.compiled[key])
        self.last_key = entry[0]
        return entry[1](*args)

    def reset_dispatch(self) -> None:
        """Forget memoised choices, after `compiled` entries were replaced."""
        self._by_count.clear()


def token_argument(gm: fx.GraphModule, symbol: sympy.Symbol | None) -> tuple[int | None, bool]:
    """Which input of a piece carries the token count: the SymInt itself, else a tensor's dim 0."""
    if symbol is None:
        return None, False
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, node in enumerate(placeholders):
        value = node.meta.get("example_value")
        if isinstance(value, torch.SymInt) and value.node.expr == symbol:
            return i, False
    for i, node in enumerate(placeholders):
        value = node.meta.get("example_value")
        if isinstance(value, torch.Tensor) and value.dim() and isinstance(value.shape[0], torch.SymInt) \
                and value.shape[0].node.expr == symbol:
            return i, True
    raise ValueError(f"piece {gm} has no input that carries the token count {symbol}")


def record_split(stats: CompileStats, split: SplitGraph) -> None:
    stats.num_pieces = len(split.pieces)
    stats.num_attention_pieces = sum(p.is_attention for p in split.pieces)


def stats_of_piece(stats: CompileStats, piece_hash: str, group: list[Piece]) -> PieceStats:
    """The stats entry of one distinct piece (`group`: the pieces sharing it), created on first sight."""
    return stats.pieces.setdefault(piece_hash[:12], PieceStats(
        piece_hash[:12], [p.name for p in group], sum(1 for _ in group[0].module.graph.nodes)))


def compile_pieces(split: SplitGraph, dispatcher: Dispatcher, symbol: sympy.Symbol | None,
                   compiler: InductorCompiler, stats: CompileStats,
                   progress: Callable[[int], Any] | None = None, workers: int | None = 1) -> dict[str, PieceRunner]:
    """Compile each distinct piece for every key; -> submodule name -> its runner.

    Cached artifacts are loaded first; the misses are independent compiles, run by `workers` processes
    (None: `parallel.default_workers`; 1: here, one after the other)."""
    from kiln.compiler.parallel import CompileJob, CompilePool, default_workers

    tables: dict[str, dict[CompileKey, CompiledFn]] = {}
    missing: list[CompileJob] = []
    for piece_hash, group in split.distinct().items():
        stats_of_piece(stats, piece_hash, group)
        table = tables[piece_hash] = {}
        for key in dispatcher.keys:
            loaded = compiler.load(group[0].module, key, piece_hash)
            if loaded is None:
                missing.append(CompileJob(piece_hash, group[0].module, key))
            else:
                table[key] = loaded
                if progress is not None:
                    progress(1)
    workers = default_workers(len(missing)) if workers is None else workers
    if compiler.dump is not None:  # dumps write Inductor's output code from this process
        workers = 1

    def done(result: Any) -> None:
        job = result.job
        tables[job.piece_hash][job.key] = result.fn
        stats.record_compile(stats.pieces[job.piece_hash[:12]], str(job.key), result.seconds)
        stats.worker_compiles += result.in_worker
        if progress is not None:
            progress(1)

    start = time.perf_counter()
    with CompilePool(compiler, symbol, workers) as pool:
        pool.compile(missing, done)
    if missing:
        logger.info("%d Inductor compiles in %.1f s with %d worker process(es)", len(missing),
                    time.perf_counter() - start, workers if workers > 1 and len(missing) > 1 else 0)
    stats.compile_workers = workers
    runners: dict[str, PieceRunner] = {}
    for piece_hash, group in split.distinct().items():
        compiled = {key: tables[piece_hash][key] for key in dispatcher.keys}  # dispatch order, as before
        for piece in group:
            token_arg, is_tensor = token_argument(piece.module, symbol)
            runners[piece.name] = PieceRunner(piece.name, piece_hash, dict(compiled), dispatcher, token_arg,
                                              is_tensor)
    return runners


def install_runners(split: SplitGraph, runners: dict[str, PieceRunner]) -> None:
    """Make the split graph call the runners (and attention pieces without nn.Module call overhead).

    nn.Module refuses non-Module children, but instance attributes are looked up before `_modules`,
    so the split graph's generated `self.submod_i(...)` finds these first.
    """
    for piece in split.pieces:
        split.module.__dict__[piece.name] = runners[piece.name] if not piece.is_attention else \
            generated_forward(piece.module)


def generated_forward(gm: fx.GraphModule) -> Callable[..., Any]:
    """gm's generated forward, bound. A lazily recompiled GraphModule's `forward` would otherwise be a
    stub that checks for recompilation and re-enters nn.Module.__call__ on every call."""
    real_recompile = getattr(gm, "real_recompile", None)
    if real_recompile is not None:
        real_recompile()
    return gm.forward
