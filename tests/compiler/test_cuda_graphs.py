"""CUDA-graph dispatch on CPU: the descriptor -> mode table, and capture/replay through a fake graph that
re-runs the captured function and writes into the captured outputs, as a real graph replay would."""

from __future__ import annotations

import dataclasses
import weakref

import pytest
import torch

from kiln import Runtime, SamplingParams
from kiln.compiler.cuda_graphs import (
    BatchDescriptor,
    GraphDispatcher,
    GraphedPiece,
    GraphPool,
    RunMode,
    install_cuda_graphs,
    piecewise_graphs,
    recapture,
)
from kiln.config import CUDAGraphMode, GraphSupport, default_capture_sizes
from tests.conftest import cpu_runtime, random_prompts

SIZES = (1, 2, 4, 8, 16)
FULL, PIECE, NONE = RunMode.FULL, RunMode.PIECEWISE, RunMode.NONE


@pytest.mark.parametrize("mode, support, pieces, expected", [
    # expected modes for: uniform decode of 3, mixed batch of 3, uniform decode of 16, mixed 17 (above max)
    (CUDAGraphMode.FULL_AND_PIECEWISE, GraphSupport.ALWAYS, True, (FULL, PIECE, FULL, NONE)),
    (CUDAGraphMode.FULL_AND_PIECEWISE, GraphSupport.UNIFORM_DECODE, True, (FULL, PIECE, FULL, NONE)),
    (CUDAGraphMode.FULL_AND_PIECEWISE, GraphSupport.NEVER, True, (PIECE, PIECE, PIECE, NONE)),
    (CUDAGraphMode.FULL_AND_PIECEWISE, GraphSupport.NEVER, False, (NONE, NONE, NONE, NONE)),
    (CUDAGraphMode.FULL, GraphSupport.ALWAYS, True, (FULL, PIECE, FULL, NONE)),
    (CUDAGraphMode.FULL, GraphSupport.NEVER, True, (PIECE, PIECE, PIECE, NONE)),
    (CUDAGraphMode.FULL_DECODE_ONLY, GraphSupport.UNIFORM_DECODE, True, (FULL, NONE, FULL, NONE)),
    (CUDAGraphMode.FULL_DECODE_ONLY, GraphSupport.NEVER, True, (NONE, NONE, NONE, NONE)),
    (CUDAGraphMode.PIECEWISE, GraphSupport.ALWAYS, True, (PIECE, PIECE, PIECE, NONE)),
    (CUDAGraphMode.NONE, GraphSupport.ALWAYS, True, (NONE, NONE, NONE, NONE)),
])
def test_dispatch_table(mode, support, pieces, expected) -> None:
    d = GraphDispatcher(mode, SIZES, support, pieces)
    got = (d.mode_for(3, True), d.mode_for(3, False), d.mode_for(16, True), d.mode_for(17, False))
    assert got == expected
    assert d.dispatch(BatchDescriptor(d.padded_size(3, expected[0]), 4, True)) == expected[0]


def test_padding_to_capture_sizes_and_edges() -> None:
    d = GraphDispatcher(CUDAGraphMode.FULL_AND_PIECEWISE, SIZES, GraphSupport.ALWAYS, True)
    assert [d.padded_size(n, d.mode_for(n, True)) for n in (1, 3, 5, 8, 9, 16, 17, 100)] == [1, 4, 8, 8, 16, 16, 17,
                                                                                           100]
    # a FULL decode graph needs as many request slots as its size
    small = GraphDispatcher(CUDAGraphMode.FULL_AND_PIECEWISE, SIZES, GraphSupport.ALWAYS, True, max_num_reqs=6)
    assert small.mode_for(4, True) is FULL and small.mode_for(5, True) is PIECE
    assert not GraphDispatcher(CUDAGraphMode.FULL, (), GraphSupport.ALWAYS, True).enabled


def test_piecewise_graphs_take_a_coarser_grid_where_full_graphs_serve_decode() -> None:
    sizes = default_capture_sizes(512)
    d = GraphDispatcher(CUDAGraphMode.FULL_AND_PIECEWISE, sizes, GraphSupport.UNIFORM_DECODE, True, max_num_reqs=256)
    assert d.piecewise_sizes == [1, 2, 4, 8, 16, 32, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512]
    # decode keeps every capture size (FULL); a mixed batch pads to the coarser grid (PIECEWISE)
    assert (d.mode_for(136, True), d.padded_size(136, FULL)) == (FULL, 136)
    assert (d.mode_for(136, False), d.padded_size(136, PIECE)) == (PIECE, 160)
    assert (d.mode_for(300, True), d.padded_size(300, PIECE)) == (PIECE, 320)  # above the request slots
    assert d.mode_for(513, False) is NONE and d.padded_size(513, NONE) == 513
    # a backend without FULL graphs runs decode piecewise: every capture size then
    piecewise_only = GraphDispatcher(CUDAGraphMode.FULL_AND_PIECEWISE, sizes, GraphSupport.NEVER, True)
    assert piecewise_only.piecewise_sizes == list(sizes)
    # an explicit list is kept; an empty one turns PIECEWISE off
    explicit = GraphDispatcher(CUDAGraphMode.FULL_AND_PIECEWISE, SIZES, GraphSupport.ALWAYS, True,
                               piecewise_sizes=(4, 16))
    assert explicit.padded_size(3, PIECE) == 4 and explicit.padded_size(3, FULL) == 4
    assert explicit.padded_size(5, PIECE) == 16 and explicit.padded_size(5, FULL) == 8
    none = GraphDispatcher(CUDAGraphMode.FULL_AND_PIECEWISE, SIZES, GraphSupport.ALWAYS, True, piecewise_sizes=())
    assert none.mode_for(3, False) is NONE and none.mode_for(3, True) is FULL


def test_default_capture_sizes() -> None:
    sizes = default_capture_sizes(512)
    assert sizes[:5] == (1, 2, 4, 8, 16) and sizes[-1] == 512 and 256 in sizes and 264 not in sizes
    assert all(b - a == 16 for a, b in zip(sizes[sizes.index(256):], sizes[sizes.index(256) + 1:]))
    assert default_capture_sizes(100)[-1] == 96


class FakeGraph:
    """Capture runs fn; replay runs it again and copies the results into the captured outputs."""

    captures = 0
    replays = 0

    def __init__(self, pool: object) -> None:
        self.fn = None
        self.output = None

    def capture(self, fn):
        FakeGraph.captures += 1
        self.fn, self.output = fn, fn()
        return self.output

    def replay(self) -> None:
        FakeGraph.replays += 1
        fresh = self.fn()
        pairs = zip(self.output, fresh) if isinstance(self.output, (tuple, list)) else [(self.output, fresh)]
        for old, new in pairs:
            if isinstance(old, torch.Tensor):
                old.copy_(new)


@pytest.fixture(scope="module")
def runtimes(tiny_checkpoint):
    path = str(tiny_checkpoint("tiny-llama")[0])
    kwargs = dict(device="cpu", dtype="fp32", max_num_batched_tokens=64, max_num_seqs=8)
    eager = Runtime(path, level=0, **kwargs)
    graphed = Runtime(path, level=1, **kwargs)
    return eager, graphed


def test_fake_graphs_replay_to_the_same_tokens(runtimes, monkeypatch) -> None:
    eager, graphed = runtimes
    worker = graphed.engine.worker
    # pretend the torch backend can be captured, so FULL decode graphs are exercised too
    monkeypatch.setattr(type(worker.backend), "graph_support", GraphSupport.ALWAYS)
    config = dataclasses.replace(worker.compilation, cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE,
                                 cudagraph_capture_sizes=SIZES)
    pool = install_cuda_graphs(worker.runner, config, worker.compiled, progress=False, factory=FakeGraph)
    assert pool is not None
    worker.graph_pool = pool
    captured = dict(pool.stats.captures)
    num_pieces = sum(not p.is_attention for p in worker.compiled.capture.split.pieces)
    # FULL decode graphs only up to max_num_seqs=8 request slots; PIECEWISE for every size and piece
    assert captured == {"FULL": 4, "PIECEWISE": len(SIZES) * num_pieces}

    prompts = random_prompts([3, 7, 1, 4], 256, seed=31)  # the first step is a 15-token mixed batch
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in graphed.generate(prompts, params)]
    assert got == expected
    replays = graphed.engine.graph_replays
    assert replays["FULL"] > 0 and replays["PIECEWISE"] > 0  # decode steps and mixed steps both replayed
    assert pool.stats.captures == captured and pool.stats.after_warmup_captures == 0
    # a repeated descriptor replays rather than captures
    before = dict(replays)
    graphed.generate([prompts[0]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert graphed.engine.graph_replays["FULL"] > before["FULL"] and pool.stats.captures == captured
    # above the largest capture size the compiled pieces run without graphs
    graphed.generate([random_prompts([40], 256)[0]], SamplingParams(max_tokens=1))
    assert graphed.engine.graph_replays["NONE"] > before.get("NONE", 0)
    assert graphed.compile_stats.compiles_after_warmup == 0


class PooledGraph(FakeGraph):
    """A fake graph under the caching allocator's rule for a shared pool: once a graph was captured in it, a
    capture may begin only while some graph still holds it (on a GPU: the use-count assertion)."""

    live = 0
    captured = False

    def capture(self, fn):
        if PooledGraph.captured and PooledGraph.live == 0:
            raise RuntimeError("capture into a memory pool that no live graph holds")
        PooledGraph.live += 1
        PooledGraph.captured = True
        self.holds = True
        return super().capture(fn)

    def __del__(self) -> None:
        if getattr(self, "holds", False):
            PooledGraph.live -= 1


def test_recapturing_every_size_keeps_the_pool_held(runtimes, tiny_checkpoint, monkeypatch) -> None:
    """A background swap may make every captured size stale: the graphs are captured again (each new) while
    the old ones still hold the pool, and the tokens stay the eager runtime's."""
    eager = runtimes[0]
    graphed = cpu_runtime(tiny_checkpoint("tiny-llama"), level=1, max_num_batched_tokens=64, max_num_seqs=8)
    worker = graphed.engine.worker
    monkeypatch.setattr(type(worker.backend), "graph_support", GraphSupport.ALWAYS)
    monkeypatch.setattr(PooledGraph, "live", 0)
    monkeypatch.setattr(PooledGraph, "captured", False)
    config = dataclasses.replace(worker.compilation, cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE,
                                 cudagraph_capture_sizes=SIZES)
    pool = worker.graph_pool = install_cuda_graphs(worker.runner, config, worker.compiled, progress=False,
                                                   factory=PooledGraph)
    before = {(id(c), key): weakref.ref(entry[0]) for c in pool.callables for key, entry in c.entries.items()}
    captured = sum(pool.stats.captures.values())
    recapture(worker.runner, worker.runner.graphs, pool, SIZES)
    after = {(id(c), key): entry[0] for c in pool.callables for key, entry in c.entries.items()}
    assert after.keys() == before.keys() and sum(pool.stats.captures.values()) == captured + len(after)
    # every graph is new, and the old ones went once their replacements were in
    assert all(ref() is None for ref in before.values()) and PooledGraph.live == len(after)
    prompts = random_prompts([3, 7, 1, 4], 256, seed=31)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in graphed.generate(prompts, params)] == expected
    assert graphed.engine.graph_replays["FULL"] > 0


class FrozenGraph(FakeGraph):
    """Replays without running anything: its outputs stay those of the capture (nothing reads the step's context)."""

    def replay(self) -> None:
        FakeGraph.replays += 1


def test_full_replays_skip_the_metadata_a_backend_does_not_read(tiny_checkpoint, monkeypatch) -> None:
    """A backend whose FULL graphs read only the runner's buffers (Triton's) has no metadata built for a step that
    replays a captured graph; a step that runs otherwise (the prefill, PIECEWISE) still builds it."""
    graphed = cpu_runtime(tiny_checkpoint("tiny-llama"), level=1, max_num_batched_tokens=64, max_num_seqs=8)
    worker = graphed.engine.worker
    backend = worker.backend
    monkeypatch.setattr(type(backend), "graph_support", GraphSupport.ALWAYS)
    monkeypatch.setattr(type(backend), "replay_needs_metadata", False)
    built: list[int] = []
    build = backend.build_metadata
    monkeypatch.setattr(backend, "build_metadata", lambda common: built.append(common.num_tokens) or build(common))
    config = dataclasses.replace(worker.compilation, cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE,
                                 cudagraph_capture_sizes=SIZES)
    worker.graph_pool = install_cuda_graphs(worker.runner, config, worker.compiled, progress=False,
                                            factory=FrozenGraph)
    built.clear()
    before = dict(graphed.engine.graph_replays)
    graphed.generate([[3, 4, 5]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert graphed.engine.graph_replays["FULL"] - before["FULL"] == 5  # every decode step replayed
    assert built == [3]  # the prefill's, none for the replays
    monkeypatch.setattr(type(backend), "replay_needs_metadata", True)
    graphed.generate([[3, 4, 5]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert built == [3, 3] + [1] * 5


class CountingPiece:
    """A compiled piece stand-in: counts its runs; pieces built with the same hash share an artifact."""

    def __init__(self, piece_hash: str) -> None:
        self.piece_hash = piece_hash
        self.runs = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.runs += 1
        return x + 1

    @staticmethod
    def num_tokens(args: tuple) -> int:
        return args[0].shape[0]


def test_pieces_sharing_an_artifact_capture_without_an_eager_run_once_one_has_run() -> None:
    pool = GraphPool(FakeGraph)
    runners = [CountingPiece(h) for h in ("first", "layer", "layer", "layer", "last")]
    pieces = [GraphedPiece(r, pool, r.num_tokens) for r in runners]
    for size in (8, 4, 8):  # the second time at 8 replays: no capture, no eager run
        with piecewise_graphs(size):
            for piece in pieces:
                piece(torch.zeros(size))
    # a capture runs the piece once (FakeGraph calls it) and a replay once more; the eager run before a capture
    # only for the first piece of each artifact at each size
    assert [r.runs for r in runners] == [2 + 2 + 1, 2 + 2 + 1, 1 + 1 + 1, 1 + 1 + 1, 2 + 2 + 1]
    assert pool.stats.preruns_skipped == 4 and pool.stats.captures["PIECEWISE"] == 10
    with piecewise_graphs(3):  # a size never captured runs the piece as it is
        assert pieces[1](torch.zeros(5)).tolist() == [1.0] * 5
