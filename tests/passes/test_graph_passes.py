"""Graph-level passes (before the split): match counts per model, and the same numbers after rewriting.

Each pass runs alone on a copy of the captured graph; both graphs then run eagerly on the same inputs
and must give the same hidden states and write the same KV cache.
"""

from __future__ import annotations

import pytest
import torch

from kiln.passes import PassConfig
from kiln.passes.base import PassEnv
from kiln.passes.manager import GRAPH_SCOPE, PassManager
from tests.passes.conftest import NUM_LAYERS, PRESETS
from tests.passes.harness import copy_graph_module, split

# pass -> preset -> rewrites expected on the whole graph (the tiny presets have two layers)
EXPECTED = {
    "noop": dict.fromkeys(PRESETS, NUM_LAYERS),  # the contiguous copy of V before each attention
    "rope_kv": dict.fromkeys(PRESETS, NUM_LAYERS),  # every attention call
    "qk_norm_rope": {"tiny-llama": 0, "tiny-qwen2": 0, "tiny-qwen3": NUM_LAYERS},  # Qwen3 only
}
CACHE_ONLY = PassEnv(cache_only_attention=True)


def run_pass(captured, preset: str, names: list[str], env: PassEnv = CACHE_ONLY):
    cap = captured(preset)
    manager = PassManager(PassConfig.from_names(names), env)
    gm = manager.run_graph_passes(copy_graph_module(cap.gm))
    return cap, manager, gm


def assert_same_numbers(cap, gm) -> None:
    hidden_ref, cache_ref = cap.run(cap.gm)
    hidden, cache = cap.run(gm)
    torch.testing.assert_close(hidden, hidden_ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(cache, cache_ref, atol=1e-5, rtol=0)
    assert cache_ref.abs().sum() > 0  # the prefill really wrote K/V


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("name", list(EXPECTED))
def test_graph_pass_matches_and_keeps_numbers(captured, preset: str, name: str) -> None:
    cap, manager, gm = run_pass(captured, preset, [name])
    assert manager.matches[GRAPH_SCOPE][name] == EXPECTED[name][preset]
    assert_same_numbers(cap, gm)


@pytest.mark.parametrize("preset", PRESETS)
def test_rope_kv_moves_rope_and_the_cache_write_into_one_split_op(captured, preset: str) -> None:
    _, _, gm = run_pass(captured, preset, ["noop", "rope_kv"])
    pieces = split(gm).pieces
    fused = [n for p in pieces for n in p.module.graph.nodes if n.target is torch.ops.kiln.rope_attention.default]
    assert len(fused) == NUM_LAYERS and len(pieces) == 2 * NUM_LAYERS + 1
    assert all(p.is_attention == any(n.target is torch.ops.kiln.rope_attention.default for n in p.module.graph.nodes)
               for p in pieces)
    for piece in split(gm).compiled_pieces:  # no rotation or copy left for Inductor
        methods = {n.target for n in piece.module.graph.nodes if n.op == "call_method"}
        assert not methods & {"index_select", "contiguous"}


def test_rope_kv_absorbs_qwen3_qk_norm_when_both_are_on(captured) -> None:
    cap, manager, gm = run_pass(captured, "tiny-qwen3", ["rope_kv", "qk_norm_rope"])
    assert manager.matches[GRAPH_SCOPE] == {"rope_kv": NUM_LAYERS, "qk_norm_rope": 0}
    fused = [n for n in gm.graph.nodes if n.target is torch.ops.kiln.rope_attention.default]
    assert all(n.args[7] is not None and n.args[8] is not None for n in fused)  # the norm weights
    assert_same_numbers(cap, gm)


def test_rope_kv_keeps_the_plain_path_numbers_without_a_cache_only_backend(captured) -> None:
    # the pass does not apply at all then; and the fused op itself falls back to the plain path
    cap, manager, gm = run_pass(captured, "tiny-llama", ["rope_kv"], PassEnv())
    assert manager.matches[GRAPH_SCOPE]["rope_kv"] == 0
    _, _, fused = run_pass(captured, "tiny-llama", ["rope_kv"])
    saved = cap.context.cache_only_attention
    cap.context.cache_only_attention = False
    try:
        assert_same_numbers(cap, fused)
    finally:
        cap.context.cache_only_attention = saved
