"""-O1..-O3 against -O0 on a tiny fp32 Llama: same greedy tokens, close logits, one trace, no late compile.

Compiled runtimes are built once per module (each costs a few Inductor compiles on CPU) and shared.
"""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest
import torch

from kiln import Runtime, SamplingParams
from kiln.compiler import CompileKey, TokenCountError
from tests.conftest import prompt_logits, random_prompts

pytestmark = pytest.mark.slow

BUDGET = 32  # small, so long prompts are chunked and most steps mix prefill chunks with decodes
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# per level: extra options; -O1 also splits its range and dumps, to cover both in one set of compiles
LEVEL_OPTIONS = {0: {}, 1: {"compile_ranges": (8,)}, 2: {}, 3: {}}


@pytest.fixture(scope="module")
def dump_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("compile_dump")


@pytest.fixture(scope="module")
def runtimes(tiny_checkpoint, dump_dir: Path) -> dict[int, Runtime]:
    path = str(tiny_checkpoint("tiny-llama")[0])
    made = {}
    for level, options in LEVEL_OPTIONS.items():
        if level == 1:
            options = {**options, "debug_dump_path": str(dump_dir)}
        made[level] = Runtime(path, level=level, device="cpu", dtype="fp32", max_num_batched_tokens=BUDGET,
                              max_num_seqs=8, **options)
    return made


@pytest.mark.parametrize("level", [1, 2, 3])
def test_greedy_tokens_match_eager(runtimes: dict[int, Runtime], level: int) -> None:
    prompts = random_prompts([1, 5, 20, 45, 70, 3], 256, seed=11)
    expected = [o.outputs[0].token_ids for o in runtimes[0].generate(prompts, GREEDY)]
    got = [o.outputs[0].token_ids for o in runtimes[level].generate(prompts, GREEDY)]
    assert got == expected
    assert runtimes[level].engine.worker.compiled.bypasses_dynamo


@pytest.mark.parametrize("level", [1, 2, 3])
@pytest.mark.parametrize("num_tokens", [1, 2, 7, 13, BUDGET])
def test_logits_close_to_eager(runtimes: dict[int, Runtime], level: int, num_tokens: int) -> None:
    prompt = random_prompts([num_tokens], 256, seed=num_tokens)[0]
    diff = (prompt_logits(runtimes[level], prompt) - prompt_logits(runtimes[0], prompt)).abs().max().item()
    assert diff < 1e-4, f"-O{level}, {num_tokens} tokens: max |logit diff| {diff:.2e}"


def test_split_structure_and_distinct_pieces(runtimes: dict[int, Runtime]) -> None:
    layers = runtimes[0].engine.loaded.spec.num_layers
    # -O3's sizes 2 and 4 compile in worker processes after start-up and join the dispatcher's keys when a step
    # swaps them in, which an earlier test's steps may or may not have done by now: swap them in here
    background = runtimes[3].engine.worker.compiled.background
    assert background is not None and background.wait(timeout=1800)
    background.swap_if_done()
    for level in (1, 2, 3):
        stats = runtimes[level].compile_stats
        compiled = runtimes[level].engine.worker.compiled
        later = set(compiled.background.sizes) if compiled.background is not None else set()
        at_start = [k for k in compiled.backend.dispatcher.keys if not (k.exact and k.lo in later)]
        assert stats.num_pieces == 2 * layers + 1 and stats.num_attention_pieces == layers
        assert stats.num_distinct_pieces <= 3
        assert stats.inductor_compiles == stats.num_distinct_pieces * len(at_start)
        assert stats.background_swapped == stats.num_distinct_pieces * len(later)
        for piece in stats.pieces.values():  # each distinct piece compiled exactly once per range/size
            assert sorted(piece.compile_seconds) == sorted(str(k) for k in at_start)


def test_dispatch_picks_exact_size_then_range(runtimes: dict[int, Runtime]) -> None:
    cases = {
        1: [(1, CompileKey.range(1, 8)), (8, CompileKey.range(1, 8)), (9, CompileKey.range(9, BUDGET))],
        2: [(1, CompileKey.size(1)), (2, CompileKey.range(1, BUDGET)), (BUDGET, CompileKey.range(1, BUDGET))],
        3: [(1, CompileKey.size(1)), (2, CompileKey.size(2)), (4, CompileKey.size(4)),
            (3, CompileKey.range(1, BUDGET))],
    }
    for level, expectations in cases.items():
        compiled = runtimes[level].engine.worker.compiled
        if level == 3:  # -O3's sizes 2 and 4 compile after start-up, swapped in at a step boundary
            assert compiled.background is not None and compiled.background.wait(timeout=1800)
            compiled.background.swap_if_done()  # what the engine does before a step (prompt_logits is no step)
        for n, key in expectations:
            prompt_logits(runtimes[level], random_prompts([n], 256, seed=n)[0])
            assert {r.last_key for r in compiled.capture.runners.values()} == {key}, (level, n)
    assert runtimes[3].compile_stats.background_swapped == 3 * 2  # 3 distinct pieces x sizes 2, 4


def test_beyond_the_largest_range_is_a_clear_error(runtimes: dict[int, Runtime]) -> None:
    # The runner never gets here: its buffers hold max_num_batched_tokens and the scheduler chunks prompts
    # to that budget (the 100-step test checks every step). Called directly, the compiled forward refuses.
    compiled = runtimes[2].engine.worker.compiled
    with torch.inference_mode(), pytest.raises(TokenCountError, match=f"forward of {BUDGET + 1} tokens"):
        compiled(torch.zeros(BUDGET + 1, dtype=torch.long), torch.arange(BUDGET + 1))


def _run_mixed_steps(runtime: Runtime, steps: int, seed: int) -> dict[str, list[int]]:
    """Requests arrive during `steps` engine steps with random lengths (some above the budget)."""
    rng = random.Random(seed)
    engine = runtime.engine
    outputs: dict[str, list[int]] = {}

    def step() -> None:
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids

    for i in range(steps):
        if i % 7 == 0 or rng.random() < 0.15:
            prompt = random_prompts([rng.choice([1, 2, 3, 9, 17, 40, 75])], 256, seed=seed * 1000 + i)[0]
            params = SamplingParams(max_tokens=rng.randint(1, 20), temperature=0.0, ignore_eos=True)
            engine.add_request(prompt, params, request_id=f"r{i}")
        step()
    while engine.has_unfinished():
        step()
    return outputs


def test_one_trace_and_no_compile_across_100_varied_steps(runtimes: dict[int, Runtime]) -> None:
    runtime = runtimes[2]
    compiled = runtime.engine.worker.compiled
    stats = runtime.compile_stats
    compiles_at_start = stats.inductor_compiles
    seen: list[int] = []
    first_runner = next(iter(compiled.capture.runners.values()))
    original = first_runner.num_tokens

    def spy(args):  # records every forward's token count as the first compiled piece sees it
        n = original(args)
        seen.append(n)
        return n

    first_runner.num_tokens = spy
    try:
        outputs = _run_mixed_steps(runtime, 100, seed=5)
    finally:
        del first_runner.num_tokens
    assert len(seen) >= 100 and len(set(seen)) >= 10, sorted(set(seen))
    assert max(seen) <= BUDGET
    assert stats.dynamo_traces == 1 and stats.traces_after_warmup == 0
    assert stats.inductor_compiles == compiles_at_start and stats.compiles_after_warmup == 0
    eager = _run_mixed_steps(runtimes[0], 100, seed=5)
    assert outputs == eager


def test_eager_runtime_has_empty_stats(runtimes: dict[int, Runtime]) -> None:
    stats = runtimes[0].compile_stats
    assert (stats.level, stats.dynamo_traces, stats.inductor_compiles) == (0, 0, 0)
    assert runtimes[0].engine.worker.compiled is None


def test_compile_dump(runtimes: dict[int, Runtime], dump_dir: Path) -> None:
    stats = runtimes[1].compile_stats
    graph = (dump_dir / "computation_graph.py").read_text()
    assert "submod_0" in graph and "attention (eager)" in graph
    outputs = sorted((dump_dir / "inductor").glob("*.py"))
    assert len(outputs) == stats.num_distinct_pieces * 2  # two ranges at -O1 here
    assert all("def call(" in p.read_text() for p in outputs)
    if importlib.util.find_spec("depyf") is not None:  # optional: without it the dump just has no dynamo/
        dynamo = list((dump_dir / "dynamo").rglob("*.py"))
        assert any("transformed_code" in p.name or "full_code" in p.name for p in dynamo), [p.name for p in dynamo]
