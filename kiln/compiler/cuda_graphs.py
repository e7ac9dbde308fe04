"""CUDA graphs: which mode a step runs in (BatchDescriptor -> FULL | PIECEWISE | NONE), and the wrappers
that capture on first sight of a size and replay afterwards.

FULL graphs wrap the whole forward, attention included: one launch per uniform decode step (every request one
token), on backends that can capture attention; with speculative decoding also per uniform verify step (every
request k + 1 tokens), on backends that can capture any batch (GraphSupport.ALWAYS). PIECEWISE graphs wrap
each compiled piece while attention runs eagerly between them: mixed prefill/decode batches, and decode on
backends that cannot be captured. FULL and FULL_AND_PIECEWISE both run mixed batches piecewise;
FULL_DECODE_ONLY runs them without graphs. Above the largest capture size the compiled pieces run without
graphs. Graphs are keyed by the padded token count: the runner pads a batch up to the next capture size, and
padded tokens write into the null KV block.
"""

from __future__ import annotations

import bisect
import contextlib
import enum
import gc
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.config import CUDAGraphMode, GraphSupport, default_piecewise_sizes

logger = logging.getLogger("kiln.compiler")


class RunMode(enum.Enum):
    NONE = "NONE"
    PIECEWISE = "PIECEWISE"
    FULL = "FULL"


@dataclass(frozen=True)
class BatchDescriptor:
    """What a captured graph depends on: padded token and request counts, and whether every request decodes
    exactly one token (the only shape some backends can capture), or verifies exactly `verify_len` tokens."""

    num_tokens: int
    num_reqs: int
    uniform_decode: bool
    verify_len: int = 0  # > 1: a uniform speculative verify batch (docs/spec_decode.md)


class GraphDispatcher:
    """Resolves the configured mode against what the attention backend and the compiler can do, pads token
    counts to capture sizes, and picks the mode of each step (FULL > PIECEWISE > NONE)."""

    def __init__(self, mode: str, capture_sizes: Sequence[int], backend_support: GraphSupport,
                 has_pieces: bool, max_num_reqs: int | None = None,
                 piecewise_sizes: Sequence[int] | None = None, verify_len: int = 0) -> None:
        self.capture_sizes = sorted(set(capture_sizes))
        largest = self.capture_sizes[-1] if self.capture_sizes else 0
        # a FULL decode graph at size s runs s (padded) requests: no more than the runner's request slots
        self.max_full_size = min(largest, max_num_reqs if max_num_reqs is not None else largest)
        full_wanted = mode in (CUDAGraphMode.FULL, CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL_AND_PIECEWISE)
        # FULL graphs are for uniform decode batches, and only on a backend that can capture its attention
        self.full_decode = full_wanted and backend_support >= GraphSupport.UNIFORM_DECODE
        # PIECEWISE needs compiled pieces to wrap; FULL mode also runs mixed batches piecewise
        piecewise_wanted = mode in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL_AND_PIECEWISE, CUDAGraphMode.FULL)
        self.piecewise = piecewise_wanted and has_pieces
        if not self.capture_sizes:
            self.full_decode = self.piecewise = False
        # where FULL graphs serve decode, PIECEWISE graphs serve only mixed batches: a coarser grid of sizes
        # (docs/cuda_graphs.md); otherwise they serve decode too, at every capture size
        if piecewise_sizes is None:
            piecewise_sizes = default_piecewise_sizes(self.capture_sizes) if self.full_decode else self.capture_sizes
        self.piecewise_sizes = sorted(set(piecewise_sizes)) if self.piecewise else []
        self.piecewise = bool(self.piecewise_sizes)
        self.max_size = max(largest if self.full_decode else 0, self.piecewise_sizes[-1] if self.piecewise else 0)
        # uniform verify batches of verify_len tokens a request: FULL where the backend captures any batch; the
        # capture sizes count requests, and R * verify_len tokens must stay within the largest
        self.full_verify_len = verify_len if (self.full_decode and backend_support >= GraphSupport.ALWAYS
                                              and verify_len > 1) else 0
        self.mode = mode
        if full_wanted and not self.full_decode:
            logger.warning("cudagraph_mode=%s: the attention backend cannot be captured (%s); using %s",
                           mode, backend_support.name, "PIECEWISE" if self.piecewise else "no graphs")

    @property
    def enabled(self) -> bool:
        return self.full_decode or self.piecewise

    def padded_size(self, num_tokens: int, mode: RunMode, verify_len: int = 0) -> int:
        """The size a batch of num_tokens runs at in `mode` (mode_for's): the next size captured for it."""
        if verify_len and mode is RunMode.FULL:  # whole padded requests of verify_len tokens each
            return self.padded_size(num_tokens // verify_len, mode) * verify_len
        sizes = self.capture_sizes if mode is RunMode.FULL else self.piecewise_sizes
        if mode is RunMode.NONE or not sizes or num_tokens > sizes[-1]:
            return num_tokens
        return sizes[bisect.bisect_left(sizes, num_tokens)]

    def mode_for(self, num_tokens: int, uniform_decode: bool, verify_len: int = 0) -> RunMode:
        """num_tokens: unpadded. verify_len: every request has that many tokens (a speculative verify batch)."""
        if verify_len and verify_len == self.full_verify_len:
            num_reqs = num_tokens // verify_len
            if num_reqs <= self.capture_sizes[-1]:
                padded = self.padded_size(num_reqs, RunMode.FULL)
                if padded <= self.max_full_size and padded * verify_len <= self.capture_sizes[-1]:
                    return RunMode.FULL
        if not self.enabled or num_tokens > self.max_size:
            return RunMode.NONE
        if (self.full_decode and uniform_decode and num_tokens <= self.capture_sizes[-1]
                and self.padded_size(num_tokens, RunMode.FULL) <= self.max_full_size):
            return RunMode.FULL
        if self.piecewise and num_tokens <= self.piecewise_sizes[-1]:
            return RunMode.PIECEWISE
        return RunMode.NONE

    def dispatch(self, desc: BatchDescriptor) -> RunMode:
        return self.mode_for(desc.num_tokens, desc.uniform_decode, desc.verify_len)

    def describe(self) -> str:
        parts = [f"mode {self.mode}", f"{len(self.capture_sizes)} sizes up to {self.max_size}"]
        parts.append(f"FULL for uniform decode up to {self.max_full_size}" if self.full_decode else "no FULL")
        if self.full_verify_len:
            parts.append(f"FULL for uniform verify batches of {self.full_verify_len} tokens a request")
        parts.append(f"PIECEWISE otherwise ({len(self.piecewise_sizes)} sizes)" if self.piecewise else "no PIECEWISE")
        return ", ".join(parts)


# ---------------------------------------------------------------------------------------------------------
# capture / replay


# KILN_GRAPH_CAPTURE_SYNC=1: capture through torch.cuda.graph, which synchronises the device and empties the
# allocators' caches before every graph (the A/B's other arm; docs/cuda_graphs.md, "Why captures skip
# torch.cuda.graph's preparations")
_capture_sync = os.environ.get("KILN_GRAPH_CAPTURE_SYNC", "0") == "1"
_capture_streams: dict[int, torch.cuda.Stream] = {}


class TorchGraph:
    """torch.cuda.CUDAGraph behind the small interface the wrappers use (tests substitute a fake).

    Captures on a side stream of its own without torch.cuda.graph's per-graph device synchronisation and
    cache flush: start-up captures hundreds of graphs back to back, and the flush handed each eager run's
    activations back to the driver only for the next run to allocate them again."""

    def __init__(self, pool: Any) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, fn: Callable[[], Any]) -> Any:
        if _capture_sync:
            with torch.cuda.graph(self.graph, pool=self.pool):
                return fn()
        current = torch.cuda.current_stream()
        stream = _capture_streams.get(current.device.index)
        if stream is None:  # one per device, made once (setdefault would take a pool stream on every capture)
            stream = _capture_streams[current.device.index] = torch.cuda.Stream(current.device)
        stream.wait_stream(current)  # ordered after the queued work, as torch.cuda.graph's device sync ordered it
        with torch.cuda.stream(stream):
            self.graph.capture_begin(*(() if self.pool is None else (self.pool,)))
            try:
                return fn()
            finally:
                self.graph.capture_end()

    def replay(self) -> None:
        self.graph.replay()


GraphFactory = Callable[[Any], Any]


@dataclass
class GraphStats:
    captures: dict[str, int] = field(default_factory=lambda: {"FULL": 0, "PIECEWISE": 0})
    replays: dict[str, int] = field(default_factory=lambda: {"FULL": 0, "PIECEWISE": 0, "NONE": 0})
    capture_seconds: float = 0.0
    prerun_seconds: float = 0.0  # the eager run before each capture
    preruns_skipped: int = 0  # PIECEWISE captures of a piece whose artifact already ran at that size
    memory_bytes: int = 0
    after_warmup_captures: int = 0


class GraphPool:
    """One memory pool shared by every graph (captured largest-first, smaller ones reuse its memory)."""

    def __init__(self, factory: GraphFactory | None = None, check_inputs: bool = False) -> None:
        self.factory = factory or TorchGraph
        self.handle = torch.cuda.graph_pool_handle() if factory is None else None
        self.stats = GraphStats()
        self.check_inputs = check_inputs
        self.warmed_up = False
        self._captured_any = False
        self.callables: list[GraphedCallable] = []  # every wrapper holding graphs from this pool
        self.ran: set[tuple[str, int]] = set()  # (piece artifact, size) already run eagerly before a capture

    def release(self) -> None:
        """Drop every graph captured from this pool and the pool itself (the caller has synchronised)."""
        for callable_ in self.callables:
            callable_.entries.clear()
        self.callables.clear()
        self.handle = None

    @contextlib.contextmanager
    def _capturing(self) -> Iterator[None]:
        # after the first graph, a GC pass during capture only costs time (nothing it frees is reusable)
        disable = self._captured_any and gc.isenabled()
        if disable:
            gc.disable()
        try:
            yield
        finally:
            if disable:
                gc.enable()
            self._captured_any = True

    def capture(self, kind: str, fn: Callable[[], Any]) -> tuple[Any, Any]:
        if self.warmed_up:
            self.stats.after_warmup_captures += 1
            logger.warning("captured a %s CUDA graph after warm-up (a size was missed at start-up)", kind)
        start = time.perf_counter()
        graph = self.factory(self.handle)
        with self._capturing():
            output = graph.capture(fn)
        self.stats.captures[kind] += 1
        self.stats.capture_seconds += time.perf_counter() - start
        return graph, output


class GraphedCallable:
    """Captures `fn` once per key and replays it after; the captured outputs are held, so their memory
    stays valid, and returned by every replay."""

    def __init__(self, pool: GraphPool, kind: str) -> None:
        self.pool = pool
        self.kind = kind
        self.entries: dict[Any, tuple[Any, Any, list[int]]] = {}
        pool.callables.append(self)

    def __call__(self, key: Any, fn: Callable[[], Any], inputs: Sequence[torch.Tensor] = (),
                 prerun: bool = True) -> Any:
        entry = self.entries.get(key)
        if entry is None:
            if prerun:  # one eager run first: lazy initialisation (cuBLAS handles, autotuning) must not be captured
                start = time.perf_counter()
                fn()
                self.pool.stats.prerun_seconds += time.perf_counter() - start
            graph, output = self.pool.capture(self.kind, fn)
            self.entries[key] = (graph, output, [t.data_ptr() for t in inputs])
            return output
        graph, output, addresses = entry
        if self.pool.check_inputs and addresses != [t.data_ptr() for t in inputs]:
            raise RuntimeError(f"{self.kind} CUDA graph for {key}: an input moved since capture")
        graph.replay()
        self.pool.stats.replays[self.kind] += 1
        return output


# The step's mode, seen by the piece wrappers (set by the runner around one forward).
_piecewise_size: int | None = None


@contextlib.contextmanager
def piecewise_graphs(num_tokens: int | None) -> Iterator[None]:
    global _piecewise_size
    previous, _piecewise_size = _piecewise_size, num_tokens
    try:
        yield
    finally:
        _piecewise_size = previous


# KILN_GRAPH_PRERUN=all: an eager run before every PIECEWISE capture (the A/B's other arm), not only before the
# first capture of each distinct piece at a size
_prerun_every_piece = os.environ.get("KILN_GRAPH_PRERUN", "") == "all"


class GraphedPiece:
    """Wraps a compiled piece: under `piecewise_graphs(n)` a call with n tokens replays that piece's graph.

    Pieces that share an artifact (every decoder layer's) run the same kernels on same-shaped inputs, so once
    one of them has run eagerly at a size, whatever a first run initialises lazily is done: the others capture
    at that size without an eager run of their own."""

    def __init__(self, runner: Callable[..., Any], pool: GraphPool, num_tokens_of: Callable[[tuple], int]) -> None:
        self.runner = runner
        self.graphs = GraphedCallable(pool, "PIECEWISE")
        self.num_tokens_of = num_tokens_of
        self.artifact = getattr(runner, "piece_hash", None) or str(id(runner))

    def __call__(self, *args: Any) -> Any:
        size = _piecewise_size
        if size is None or self.num_tokens_of(args) != size:
            return self.runner(*args)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        pool = self.graphs.pool
        prerun = _prerun_every_piece or (self.artifact, size) not in pool.ran
        if size not in self.graphs.entries:
            pool.ran.add((self.artifact, size))
            pool.stats.preruns_skipped += not prerun
        return self.graphs(size, lambda: self.runner(*args), tensors, prerun=prerun)


# ---------------------------------------------------------------------------------------------------------
# installation and start-up capture


def wrap_pieces(compiled: Any, pool: GraphPool) -> int:
    """Put a GraphedPiece in front of every compiled (non-attention) piece of the split graph."""
    split = compiled.capture.split
    wrapped = 0
    for piece in split.pieces:
        if piece.is_attention:
            continue
        runner = split.module.__dict__[piece.name]
        split.module.__dict__[piece.name] = GraphedPiece(runner, pool, runner.num_tokens)
        wrapped += 1
    return wrapped


def install_cuda_graphs(runner: Any, config: Any, compiled: Any, *, progress: bool = True,
                        factory: GraphFactory | None = None, verify_len: int = 0) -> GraphPool | None:
    """Resolve the graph mode for this runner's backend, wrap the pieces, and capture every size now.

    `runner` is the ModelRunner (duck-typed: the compiler does not import the runtime); `factory` replaces
    torch.cuda.CUDAGraph in tests.
    """
    if config.cudagraph_mode in (None, CUDAGraphMode.NONE) or (factory is None and runner.device.type != "cuda"):
        return None
    has_pieces = compiled is not None and compiled.capture is not None
    dispatcher = GraphDispatcher(config.cudagraph_mode, config.cudagraph_capture_sizes or (),
                                 type(runner.backend).graph_support, has_pieces, runner.max_num_seqs,
                                 config.cudagraph_piecewise_sizes, verify_len)
    if not dispatcher.enabled:
        return None
    pool = GraphPool(factory, check_inputs=config.debug_check_graph_inputs)
    if dispatcher.piecewise:
        wrap_pieces(compiled, pool)
    runner.graphs, runner.full_graph = dispatcher, GraphedCallable(pool, "FULL")
    capture_all(runner, dispatcher, pool, progress)
    background = getattr(compiled, "background", None)
    if background is not None:  # a background swap replaces artifacts these graphs hold
        background.on_swap = lambda sizes: recapture(runner, dispatcher, pool, sizes)
    stats = pool.stats
    logger.info("CUDA graphs: %s; %d FULL + %d PIECEWISE captured in %.1fs after %.1fs of eager runs (%d PIECEWISE "
                "without one: their artifact had run at that size), %.0f MiB", dispatcher.describe(),
                stats.captures["FULL"], stats.captures["PIECEWISE"], stats.capture_seconds, stats.prerun_seconds,
                stats.preruns_skipped, stats.memory_bytes / 2**20)
    return pool


@torch.inference_mode()
def capture_all(runner: Any, dispatcher: GraphDispatcher, pool: GraphPool, progress: bool,
                only: set[int] | None = None) -> None:
    """Capture every (size, mode) largest-first on null-block batches, so serving never captures; `only`:
    just those sizes."""
    from tqdm import tqdm

    on_gpu = runner.device.type == "cuda"
    if on_gpu:
        torch.cuda.synchronize(runner.device)
        before = torch.cuda.memory_allocated(runner.device)  # graph pools' live blocks count as allocated
    full = {s for s in dispatcher.capture_sizes if dispatcher.mode_for(s, True) is RunMode.FULL}
    piecewise = set(dispatcher.piecewise_sizes)
    q = dispatcher.full_verify_len  # uniform verify batches: R requests of q tokens, at R * q tokens
    verify = {r * q for r in dispatcher.capture_sizes if q and dispatcher.mode_for(r * q, False, q) is RunMode.FULL}
    verify = {s for s in verify if dispatcher.padded_size(s, RunMode.FULL, q) == s}
    sizes = (full | piecewise | verify) & only if only is not None else full | piecewise | verify
    for size in tqdm(sorted(sizes, reverse=True), desc="capturing CUDA graphs", unit="size",
                     disable=not progress):
        if size in full:
            runner.run_model(runner.to_device(runner.dummy_shape(size, decode=True), []))
        if size in piecewise:
            runner.run_model(runner.to_device(runner.dummy_shape(size, decode=False), []))
        if size in verify:
            runner.run_model(runner.to_device(runner.dummy_shape(size, decode=True, query_len=q), []))
    if on_gpu:
        torch.cuda.synchronize(runner.device)
        pool.stats.memory_bytes += max(torch.cuda.memory_allocated(runner.device) - before, 0)
    pool.warmed_up = True


def recapture(runner: Any, dispatcher: GraphDispatcher, pool: GraphPool, sizes: Sequence[int]) -> None:
    """Drop the graphs at `sizes` and capture them again: the compiled artifacts they ran were swapped.

    Called at a step boundary. The device is synchronised first: the step in flight runs the graphs it was
    launched with, and its inputs have been read before the null-block batches overwrite them."""
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    stale = set(sizes)
    # the dropped graphs stay alive until their replacements are captured: the allocator refuses a capture into
    # a shared pool that no live graph holds any more (its use-count assertion), as when every size is stale
    retired = []
    for callable_ in pool.callables:  # FULL graphs are keyed by BatchDescriptor, PIECEWISE ones by size
        for key in [k for k in callable_.entries if getattr(k, "num_tokens", k) in stale]:
            retired.append(callable_.entries.pop(key))
    pool.ran = {(artifact, size) for artifact, size in pool.ran if size not in stale}  # new artifacts run first
    pool.warmed_up = False  # these captures are planned, not sizes missed at start-up
    capture_all(runner, dispatcher, pool, progress=False, only=stale)
    retired.clear()
