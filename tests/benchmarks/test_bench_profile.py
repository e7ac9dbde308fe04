"""bench_profile's attribution of a step's busy time to kernels when their spans overlap (programmatic dependent
launch schedules a kernel's programs before its predecessor ends)."""

from __future__ import annotations

import pytest

from benchmarks.bench_profile import busy_us, charges, critical_us, layer_chain


def test_overlapping_spans_are_charged_from_the_previous_completion() -> None:
    # a: 0-10; b scheduled at 2 (waits on the device) and done at 14; a gap; c 20-23; d scheduled at 21, done at 30
    spans = [(0.0, 10.0, "a"), (2.0, 14.0, "b"), (20.0, 23.0, "c"), (21.0, 30.0, "d")]
    charged = critical_us(spans)
    assert charged == {"a": 10.0, "b": 4.0, "c": 3.0, "d": 7.0}
    assert sum(charged.values()) == pytest.approx(busy_us([(s, e) for s, e, _ in spans]))
    assert sum(e - s for s, e, _ in spans) > sum(charged.values())  # what the span sums over-count


def test_repeated_kernels_add_up_by_name_and_nested_spans_cost_nothing() -> None:
    spans = [(0.0, 5.0, "gemm"), (1.0, 3.0, "copy"), (4.0, 8.0, "norm"), (7.0, 12.0, "gemm")]
    # copy ends inside gemm's span, before it: the busy time up to its completion (0-3) is its; gemm's from 3
    assert critical_us(spans) == {"copy": 3.0, "gemm": 2.0 + 4.0, "norm": 3.0}
    assert sum(critical_us(spans).values()) == pytest.approx(busy_us([(s, e) for s, e, _ in spans]))


def test_a_layer_chain_is_the_repeating_period_of_kernel_names() -> None:
    # a step: embed, then 6 layers of (norm, gemm, attn), then the head; charges 1, 2 + layer, 3 per kind
    names = ["embed"] + [n for _ in range(6) for n in ("norm", "gemm", "attn")] + ["head"]
    charged = [(name, {"norm": 1.0, "gemm": 2.0, "attn": 3.0}.get(name, 9.0)) for name in names]
    chain = layer_chain(charged * 2)  # two steps: the middle is the second step's embed, its layers follow
    assert [k["kernel"] for k in chain] in (["norm", "gemm", "attn"], ["gemm", "attn", "norm"],
                                            ["attn", "norm", "gemm"])
    assert {k["kernel"]: k["us"] for k in chain} == {"norm": 1.0, "gemm": 2.0, "attn": 3.0}
    assert layer_chain([("a", 1.0), ("b", 1.0), ("c", 1.0), ("d", 1.0)]) == []  # nothing repeats
    assert [n for n, _ in charges([(0.0, 2.0, "x"), (1.0, 5.0, "y")])] == ["x", "y"]
