"""Post-grad passes (inside Inductor, per piece and range/size): match counts, numbers, gating, dumps.

The pieces' post-grad graphs are taken exactly as Inductor hands them to the hook (Inductor is stopped
before code generation), for an exact size (runnable eagerly: numbers) and for a range (symbolic: counts).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import fx

from kiln.compiler.ranges import CompileKey
from kiln.models.layers import RMSNorm
from kiln.passes import PassConfig
from kiln.passes.base import PassEnv
from kiln.passes.context import compiling
from kiln.passes.manager import PassManager
from tests.passes.conftest import NUM_LAYERS, PRESETS, PROMPT
from tests.passes.harness import piece_inputs, post_grad, split

SIZE, RANGE = CompileKey.size(len(PROMPT)), CompileKey.range(1, 32)
# pass -> rewrites expected over all compiled pieces of a tiny model (each piece counted where it occurs)
EXPECTED = {
    "add_rmsnorm": 2 * NUM_LAYERS + 1,  # input and post-attention norm per layer, and the final norm
    "silu_mul": NUM_LAYERS,
    "noop": 0,  # Inductor's remove_noop_ops leaves nothing here on these models (see docs/passes.md)
}


def real_outputs(gm: fx.GraphModule, args: list) -> list[torch.Tensor]:
    """The graph's outputs, minus buffers it only allocates (the attention output, uninitialised)."""
    with torch.inference_mode():
        outs = gm(*args)
    nodes = next(iter(reversed(gm.graph.nodes))).args[0]
    return [o for o, n in zip(outs, nodes) if isinstance(o, torch.Tensor)
            and not (isinstance(n, fx.Node) and n.target is torch.ops.aten.empty.memory_format)]


def count_and_compare(captured, preset: str, names: list[str], key: CompileKey) -> PassManager:
    cap = captured(preset)
    pieces = split(cap.gm)
    inputs = piece_inputs(pieces, cap.inputs, cap.context) if key.exact else {}
    manager = PassManager(PassConfig.from_names(names), PassEnv())
    for piece_hash, group in pieces.distinct().items():
        before, after = post_grad(group[0].module, key, manager, f"{piece_hash[:12]}_{key}")
        if key.exact:
            args = inputs[group[0].name]
            for ref, got in zip(real_outputs(before, args), real_outputs(after, args)):
                torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    return manager


def total_over_model(captured, preset: str, manager: PassManager, name: str, key: CompileKey) -> int:
    pieces = split(captured(preset).gm)
    return sum(manager.matches[f"{h[:12]}_{key}"][name] * len(group) for h, group in pieces.distinct().items())


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("name", list(EXPECTED))
def test_post_grad_pass_matches_and_keeps_numbers(captured, preset: str, name: str) -> None:
    for key in (SIZE, RANGE):
        manager = count_and_compare(captured, preset, [name], key)
        assert total_over_model(captured, preset, manager, name, key) == EXPECTED[name], key


def test_all_post_grad_passes_together(captured) -> None:
    manager = count_and_compare(captured, "tiny-qwen3", ["noop", "add_rmsnorm", "silu_mul"], SIZE)
    for name, expected in EXPECTED.items():
        assert total_over_model(captured, "tiny-qwen3", manager, name, SIZE) == expected


class AddNorm(torch.nn.Module):
    """A residual add that Inductor cannot fold into a matmul: the fused add + norm form."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = RMSNorm(48, 1e-6)
        torch.nn.init.normal_(self.norm.weight)

    def forward(self, x: torch.Tensor, residual: torch.Tensor):
        hidden, residual = self.norm(x, residual)
        return hidden, residual * 2


def test_add_rmsnorm_fuses_a_residual_add() -> None:
    gm_box: dict = {}

    def backend(gm, inputs):
        gm_box["gm"], gm_box["inputs"] = gm, list(inputs)
        return gm.forward

    model, x, r = AddNorm(), torch.randn(7, 48), torch.randn(7, 48)
    torch._dynamo.reset()
    torch.compile(model, backend=backend, fullgraph=True)(x, r)
    torch._dynamo.reset()
    manager = PassManager(PassConfig.from_names(["add_rmsnorm"]))
    before, after = post_grad(gm_box["gm"], CompileKey.size(7), manager)
    args = gm_box["inputs"]  # Dynamo's: the lifted norm weight and x, r, in its order
    with torch.inference_mode():
        refs, gots = before(*args), after(*args)
    for ref, got in zip(refs, gots):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    assert sum(n.target is torch.ops.kiln.fused_add_rms_norm.default for n in after.graph.nodes) == 1


def test_passes_are_gated_by_the_compile_range(captured) -> None:
    config = PassConfig.from_names(["add_rmsnorm<=1"])
    assert config.token_bound("add_rmsnorm") == 1
    pieces = split(captured("tiny-llama").gm)
    piece = next(iter(pieces.distinct().values()))[0].module
    manager = PassManager(config)
    post_grad(piece, CompileKey.size(1), manager, "size")
    post_grad(piece, RANGE, manager, "range")
    assert manager.matches["size"]["add_rmsnorm"] == 1 and "add_rmsnorm" not in manager.matches["range"]
    # which passes are active is part of the uuid Inductor keys its cache with
    with compiling("a", CompileKey.size(1)):
        small = manager.uuid()
    with compiling("b", RANGE):
        large = manager.uuid()
    assert small != large


def test_a_bounded_pass_gets_a_compile_range_of_its_own(monkeypatch) -> None:
    """A post-grad pass bounded to N tokens applies only to ranges within N, so resolving the config cuts the range
    at N (the passes' list or the level's, KILN_PASSES included); a graph-only pass takes no bound."""
    from kiln.config import CompilationConfig

    cpu = torch.device("cpu")
    bounded = CompilationConfig(level=2, passes=("gate_up_silu_mul<=16", "gemm_add_rmsnorm<=16", "silu_mul<=32"))
    assert bounded.resolve(cpu, 8192).compile_ranges == (16, 32)
    assert bounded.resolve(cpu, 24).compile_ranges == (16,)  # no empty range past the budget
    off = CompilationConfig(level=2, passes=("silu_mul<=32",), enable_passes=False)
    assert off.resolve(cpu, 8192).compile_ranges == ()
    monkeypatch.setenv("KILN_PASSES", "silu_mul<=64")
    assert CompilationConfig(level=2, compile_ranges=(256,)).resolve(cpu, 8192).compile_ranges == (64, 256)
    with pytest.raises(ValueError, match="rope_kv rewrites the captured graph"):
        PassConfig.from_names(["rope_kv<=16"])


def test_each_pass_dumps_its_graph_before_and_after(captured, tmp_path: Path) -> None:
    pieces = split(captured("tiny-llama").gm)
    piece_hash, group = next(iter(pieces.distinct().items()))
    manager = PassManager(PassConfig.from_names(["noop", "add_rmsnorm"]), dump_dir=tmp_path)
    post_grad(group[0].module, SIZE, manager, "p")
    files = sorted(p.name for p in (tmp_path / "passes" / "p").iterdir())
    assert files == ["00_noop.after.txt", "00_noop.before.txt", "01_add_rmsnorm.after.txt",
                     "01_add_rmsnorm.before.txt"]
    after = (tmp_path / "passes" / "p" / "01_add_rmsnorm.after.txt").read_text()
    assert after.startswith("# 1 rewrite(s)") and "kiln.rms_norm" in after
