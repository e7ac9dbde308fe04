"""Compile statistics: every Dynamo trace and Inductor compile, counted, timed and attributed to a piece.

A trace or compile after warm-up means some step paid compile latency while serving; it is a bug, so it
is counted separately and logged as a warning rather than hidden in a debug log.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any

logger = logging.getLogger("kiln.compiler")


@dataclass
class PieceStats:
    """One distinct compiled piece (several pieces of the split graph may share it)."""

    piece_hash: str
    occurrences: list[str]  # submodule names in the split graph that run this piece
    num_nodes: int
    compile_seconds: dict[str, float] = field(default_factory=dict)  # str(CompileKey) -> seconds


@dataclass
class CompileStats:
    level: int = 0
    dynamo_traces: int = 0
    inductor_compiles: int = 0
    traces_after_warmup: int = 0
    compiles_after_warmup: int = 0
    trace_seconds: float = 0.0  # Dynamo bytecode analysis + FX capture
    compile_seconds: float = 0.0  # all Inductor compiles, summed (in parallel, more than the wall time)
    compile_workers: int = 1  # processes the start-up compiles ran in (1: this one)
    worker_compiles: int = 0  # compiles done by a worker process (the rest, here)
    # background compiles (kiln/compiler/background.py): artifacts still compiling, swapped in, failed, and
    # dropped by a cancel (a shutdown or the process's exit before they were swapped in)
    background_pending: int = 0
    background_swapped: int = 0
    background_failed: int = 0
    background_cancelled: int = 0
    background_swap_seconds: float = 0.0  # the step boundary's swap: artifact loads and graph re-captures
    warmup_seconds: float = 0.0  # the whole start-up compile phase, trace and test forwards included
    num_pieces: int = 0  # pieces of the split graph (2L+1)
    num_attention_pieces: int = 0
    pieces: dict[str, PieceStats] = field(default_factory=dict)  # by structural hash
    warm: bool = False
    # the compile cache (kiln/cache): None/0 without one
    cache_key: str | None = None
    cache_hits: int = 0  # artifacts loaded instead of compiled
    cache_saves: int = 0
    cache_recovered: int = 0  # corrupt artifacts discarded and recompiled
    cold_warmup_seconds: float | None = None  # warm-up of the start that filled the cache, on a hit
    capture_loaded: bool = False  # the split graph came from the cache: no Dynamo trace at all
    # seconds per start-up phase and the total, set by the engine once ready (kiln.runtime.startup.StartupTimes
    # .as_dict(): load, tokenizer, trace, compile, kv, capture, other, total); empty until then
    startup: dict[str, float] = field(default_factory=dict)

    def record_trace(self, seconds: float) -> None:
        self.dynamo_traces += 1
        self.trace_seconds += seconds
        if self.warm:
            self.traces_after_warmup += 1
            logger.warning("Dynamo traced the model again after warm-up (trace #%d): a recompile while "
                           "serving is a bug; check guards and the token-dim marking", self.dynamo_traces)

    def record_compile(self, piece: PieceStats, key: str, seconds: float) -> None:
        self.inductor_compiles += 1
        self.compile_seconds += seconds
        piece.compile_seconds[key] = piece.compile_seconds.get(key, 0.0) + seconds
        if self.warm:
            self.compiles_after_warmup += 1
            logger.warning("Inductor compiled piece %s for %s after warm-up (%.1f s): compiling while "
                           "serving is a bug", piece.piece_hash, key, seconds)

    def mark_warm(self, seconds: float) -> None:
        self.warm = True
        self.warmup_seconds = seconds

    @property
    def num_distinct_pieces(self) -> int:
        return len(self.pieces)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["num_distinct_pieces"] = self.num_distinct_pieces
        return out

    def summary(self) -> str:
        return (f"-O{self.level}: {self.dynamo_traces} Dynamo trace(s) in {self.trace_seconds:.1f} s, "
                f"{self.inductor_compiles} Inductor compile(s) in {self.compile_seconds:.1f} s, "
                f"{self.num_pieces} pieces ({self.num_distinct_pieces} distinct compiled, "
                f"{self.num_attention_pieces} attention), warm-up {self.warmup_seconds:.1f} s"
                + (f", {self.compile_workers} compile workers" if self.compile_workers > 1 else "")
                + (f", {self.background_pending} background compile(s) pending" if self.background_pending else "")
                + (f", {self.background_cancelled} background compile(s) cancelled"
                   if self.background_cancelled else "")
                + self.cache_summary())

    def cache_summary(self) -> str:
        if self.cache_key is None:
            return ""
        cold = f" (cold start: {self.cold_warmup_seconds:.1f} s)" if self.cold_warmup_seconds is not None else ""
        graph = ", captured graph loaded (no trace)" if self.capture_loaded else ""
        return (f"; compile cache {self.cache_key[:12]}: {self.cache_hits} loaded{graph}, {self.cache_saves} saved, "
                f"{self.cache_recovered} recovered; compile phase {self.warmup_seconds:.1f} s{cold}")
