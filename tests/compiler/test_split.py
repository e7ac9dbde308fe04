"""Splitting the captured graph at kiln::attention, and structural hashing (Dynamo only, no Inductor)."""

from __future__ import annotations

import pytest
import torch
from torch import fx

from kiln.compiler.capture import _private_forward
from kiln.compiler.split import split_at_attention, structural_hash
from kiln.models.base import ModelSpec
from kiln.models.forward_context import ForwardContext, set_forward_context
from kiln.models.llama import LlamaForCausalLM
from kiln.models.loader.presets import preset_config


def capture_graph(preset: str, num_layers: int) -> fx.GraphModule:
    """The FX graph Dynamo hands a backend for a tiny model with `num_layers` layers."""
    config = preset_config(preset)
    config.num_hidden_layers = num_layers
    torch.manual_seed(0)
    model = LlamaForCausalLM(ModelSpec.from_hf(config))
    graphs: list[fx.GraphModule] = []

    def record(gm: fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    forward = torch.compile(_private_forward(model), backend=record, fullgraph=True, dynamic=False)
    ids, pos = torch.zeros(13, dtype=torch.long), torch.arange(13)
    torch._dynamo.mark_dynamic(ids, 0)
    torch._dynamo.mark_dynamic(pos, 0)
    with torch.inference_mode(), set_forward_context(ForwardContext(attention=lambda i, q, k, v, o: o.zero_())):
        forward(ids, pos)
    assert len(graphs) == 1
    return graphs[0]


@pytest.mark.parametrize("preset, layers", [("tiny-llama", 4), ("tiny-qwen3", 3), ("tiny-qwen2", 1)])
def test_2l_plus_1_pieces_and_at_most_3_distinct(preset: str, layers: int) -> None:
    split = split_at_attention(capture_graph(preset, layers))
    assert len(split.pieces) == 2 * layers + 1
    assert [p.is_attention for p in split.pieces] == [i % 2 == 1 for i in range(2 * layers + 1)]
    distinct = split.distinct()
    assert len(distinct) == min(3, layers + 1)
    body = split.pieces[2:-1:2]  # between two attention calls: the repeated layer body
    assert len({p.structural_hash for p in body}) <= 1
    assert split.pieces[0].structural_hash != split.pieces[-1].structural_hash
    # attention pieces hold the op and nothing that would need compiling
    for piece in split.pieces[1::2]:
        ops = [n for n in piece.module.graph.nodes if n.op == "call_function"]
        assert len(ops) == 1 and "kiln.attention" in str(ops[0].target)


def test_split_graph_runs_like_the_original() -> None:
    gm = capture_graph("tiny-llama", 2)
    split = split_at_attention(gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    torch.manual_seed(1)
    args = []
    for node in placeholders:
        value = node.meta["example_value"]
        if isinstance(value, torch.SymInt):
            args.append(5)
        elif value.dtype == torch.int64:
            args.append(torch.randint(0, 200, (5,)))
        else:
            args.append(torch.randn([5 if isinstance(s, torch.SymInt) else s for s in value.shape]))

    def attention(i, q, k, v, o):  # deterministic stand-in: the op's contract is only "write out"
        o.copy_(q * 0.5 + i)

    with torch.inference_mode(), set_forward_context(ForwardContext(attention=attention)):
        expected, got = gm(*args)[0], split.module(*args)[0]
    torch.testing.assert_close(got, expected)


def _toy_graph(scale: float, use_packet: bool) -> fx.GraphModule:
    op = torch.ops.kiln.attention if use_packet else torch.ops.kiln.attention.default

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        q = x @ w
        out = torch.empty_like(q)
        op(q.view(-1, 2, 2), q.view(-1, 2, 2), q.view(-1, 2, 2), out.view(-1, 2, 2), 0)
        return out * scale

    return fx.symbolic_trace(f)


@pytest.mark.parametrize("use_packet", [True, False])
def test_both_op_forms_are_split_points(use_packet: bool) -> None:
    split = split_at_attention(_toy_graph(2.0, use_packet))
    assert [p.is_attention for p in split.pieces] == [False, True, False]


def test_structural_hash_ignores_names_but_not_constants() -> None:
    a, b = _toy_graph(2.0, True), _toy_graph(2.0, True)
    for node in b.graph.nodes:  # same computation, other names (as for layer 0 vs layer 1)
        if node.op == "placeholder":
            node.name = node.name + "_layer1"
    b.recompile()
    assert structural_hash(a) == structural_hash(b)
    assert structural_hash(a) != structural_hash(_toy_graph(3.0, True))


def test_graph_without_attention_is_rejected() -> None:
    with pytest.raises(ValueError, match="no kiln::attention call"):
        split_at_attention(fx.symbolic_trace(lambda x: x + 1))
