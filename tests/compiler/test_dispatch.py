"""Ranges, exact sizes and dispatch by token count, with fake compiled callables (fast, no compile)."""

from __future__ import annotations

import pytest
import torch

from kiln.compiler import CompileKey, Dispatcher, TokenCountError, build_dispatcher, build_ranges
from kiln.compiler.piecewise import PieceRunner
from kiln.config import CompilationConfig


def test_build_ranges() -> None:
    assert build_ranges(32) == [CompileKey.range(1, 32)]
    assert build_ranges(64, (16, 8, 16, 64, 0, 100)) == [CompileKey.range(1, 8), CompileKey.range(9, 16),
                                                        CompileKey.range(17, 64)]
    assert build_ranges(1) == [CompileKey.range(1, 1)]
    with pytest.raises(ValueError):
        CompileKey.range(5, 4)


def test_exact_size_first_then_the_containing_range() -> None:
    d = Dispatcher(build_ranges(64, (16,)), sizes=(1, 4, 32))
    assert d.select(1) == CompileKey.size(1)
    assert d.select(4) == CompileKey.size(4)
    assert d.select(32) == CompileKey.size(32)
    assert d.select(2) == CompileKey.range(1, 16)
    assert d.select(16) == CompileKey.range(1, 16)
    assert d.select(17) == CompileKey.range(17, 64)
    assert d.select(64) == CompileKey.range(17, 64)
    assert d.keys == [CompileKey.range(1, 16), CompileKey.range(17, 64)] + [CompileKey.size(s) for s in (1, 4, 32)]
    assert str(CompileKey.size(4)) == "size_4" and str(CompileKey.range(17, 64)) == "range_17_64"


@pytest.mark.parametrize("n", [0, 65, 1000])
def test_outside_every_range_is_a_clear_error(n: int) -> None:
    d = Dispatcher(build_ranges(64), sizes=(1,))
    with pytest.raises(TokenCountError, match=f"no compiled graph covers a forward of {n} tokens.*"
                                               r"max_num_batched_tokens=64"):
        d.select(n)


def test_sizes_outside_the_ranges_are_rejected() -> None:
    with pytest.raises(ValueError, match="outside every compile range"):
        Dispatcher(build_ranges(8), sizes=(16,))


def test_dispatcher_from_a_resolved_config() -> None:
    config = CompilationConfig(level=3, compile_ranges=(8,)).resolve(torch.device("cpu"), 32)
    d = build_dispatcher(config, 32)
    assert d.ranges == [CompileKey.range(1, 8), CompileKey.range(9, 32)] and d.sizes == (1,)
    assert config.background_compile_sizes == (2, 4)  # -O3's extras: compiled after start-up


def _fake_compiled(d: Dispatcher, calls: list[CompileKey]) -> dict[CompileKey, object]:
    def make(key: CompileKey):
        return lambda *args: (calls.append(key), args)[1]
    return {key: make(key) for key in d.keys}


@pytest.mark.parametrize("tensor_arg", [False, True])
def test_piece_runner_dispatches_by_token_count(tensor_arg: bool) -> None:
    d = Dispatcher(build_ranges(32, (8,)), sizes=(1, 4))
    calls: list[CompileKey] = []
    runner = PieceRunner("submod_0", "h", _fake_compiled(d, calls), d, token_arg=1, token_arg_is_tensor=tensor_arg)
    for n, expected in [(1, CompileKey.size(1)), (3, CompileKey.range(1, 8)), (4, CompileKey.size(4)),
                        (9, CompileKey.range(9, 32)), (3, CompileKey.range(1, 8))]:
        x = torch.zeros(n, 2)
        out = runner(x, x if tensor_arg else n)
        assert calls[-1] == expected == runner.last_key
        assert out[0] is x  # arguments pass through untouched
    with pytest.raises(TokenCountError):
        runner(torch.zeros(33), torch.zeros(33) if tensor_arg else 33)


def test_warmup_runs_every_range_and_size_once() -> None:
    from kiln.compiler.warmup import warmup_token_counts

    d = Dispatcher(build_ranges(64, (2, 16)), sizes=(1, 2, 4))
    counts = warmup_token_counts(d)
    assert counts[0] == 13  # the trace
    # every key that dispatch can select runs once; [1, 2] cannot be selected (1 and 2 are exact sizes)
    assert {d.select(n) for n in counts} == set(d.keys) - {CompileKey.range(1, 2)}
    assert warmup_token_counts(Dispatcher(build_ranges(1))) == [1]
