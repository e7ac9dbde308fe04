"""Mixture-of-experts models (Qwen3-MoE with a dense middle layer, Mixtral) against transformers on tiny random
checkpoints: greedy tokens and logits eager and compiled (-O2, one Dynamo graph around kiln::fused_moe), both
checkpoint layouts of the experts (one tensor per expert, or stacked per layer), and online FP8 against a
fake-quantized transformers model."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from kiln import Runtime, SamplingParams
from kiln.models.llama import MLP
from kiln.models.moe import SparseMoeBlock
from kiln.models.quant.fp8 import FP8_DTYPE
from tests.conftest import hf_greedy, prompt_logits, random_prompts
from tests.models.test_fp8 import E4M3_MAX, fake_quantized_hf

PRESETS = ["tiny-qwen3-moe", "tiny-mixtral"]
PROMPTS = random_prompts([1, 3, 9, 17, 40, 77], 256, seed=29)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def tokens(runtime: Runtime, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in runtime.generate(prompts, GREEDY)]


def logits_diff(runtime: Runtime, hf: torch.nn.Module, prompt: list[int]) -> float:
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    return (prompt_logits(runtime, prompt) - ref).abs().max().item()


@pytest.fixture(scope="module")
def expected(tiny_checkpoint) -> dict[str, list[list[int]]]:
    return {p: [hf_greedy(tiny_checkpoint(p)[1], q, GREEDY.max_tokens) for q in PROMPTS] for p in PRESETS}


@pytest.mark.parametrize("preset", PRESETS)
def test_greedy_matches_transformers(preset: str, tiny_checkpoint, expected) -> None:
    path, hf = tiny_checkpoint(preset)
    runtime = Runtime(str(path), level=0, device="cpu", dtype="fp32", max_num_batched_tokens=96)
    kinds = [type(layer.mlp) for layer in runtime.engine.model.layers]
    assert kinds == ([SparseMoeBlock, MLP, SparseMoeBlock] if preset == "tiny-qwen3-moe" else [SparseMoeBlock] * 2)
    assert tokens(runtime) == expected[preset]
    assert len({tuple(t) for t in expected[preset]}) > 1, "degenerate model: every prompt gives the same output"
    assert logits_diff(runtime, hf, PROMPTS[4]) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
def test_compiled_greedy_matches_transformers(preset: str, tiny_checkpoint, expected) -> None:
    path, _ = tiny_checkpoint(preset)
    runtime = Runtime(str(path), level=2, compile_sizes=(), device="cpu", dtype="fp32")
    assert tokens(runtime) == expected[preset]
    assert runtime.compile_stats.dynamo_traces == 1  # the MoE layer traced whole: no graph break


def test_stacked_expert_checkpoint_loads(tiny_checkpoint, expected, tmp_path) -> None:
    """transformers 5 holds experts stacked (mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I]) and
    writes them one per expert; a checkpoint saved in the stacked layout loads to the same model."""
    path, hf = tiny_checkpoint("tiny-mixtral")
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    runtime = Runtime(str(tmp_path), level=0, device="cpu", dtype="fp32")
    assert tokens(runtime) == expected["tiny-mixtral"]


def test_missing_expert_is_named(tiny_checkpoint, tmp_path) -> None:
    path, hf = tiny_checkpoint("tiny-mixtral")
    state = {k: v.contiguous() for k, v in hf.state_dict().items() if not k.endswith("layers.1.mlp.experts.down_proj")}
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(ValueError, match="missing weights: layers.1.mlp.w13_weight"):
        Runtime(str(tmp_path), level=0, device="cpu", dtype="fp32")


def test_online_fp8_experts_match_fake_quantized_transformers(tiny_checkpoint) -> None:
    """quantization="fp8": the dense linears as for dense models (e4m3 weights and activations), the experts'
    weights e4m3 with a scale per (expert, output channel) and their activations in full precision."""
    path, hf = tiny_checkpoint("tiny-qwen3-moe")
    fp8 = Runtime(str(path), level=0, device="cpu", dtype="fp32", quantization="fp8")
    block = fp8.engine.model.layers[0].mlp
    assert block.w13_weight.dtype == block.w2_weight.dtype == FP8_DTYPE
    assert block.w13_scale.shape == (8, 64) and block.w2_scale.shape == (8, 64)
    ref = fake_quantized_hf(hf)
    with torch.no_grad():
        for name, param in ref.named_parameters():
            if ".experts." in name:  # [E, N, K]: one scale per (expert, output row)
                scale = param.abs().amax(-1, keepdim=True) / E4M3_MAX
                param.copy_((param / scale).to(FP8_DTYPE).float() * scale)
    assert tokens(fp8) == [hf_greedy(ref, p, GREEDY.max_tokens) for p in PROMPTS]
    prompt = PROMPTS[4]
    with torch.no_grad():
        reference, unquantized = ref(torch.tensor([prompt])).logits[0], hf(torch.tensor([prompt])).logits[0]
    got = prompt_logits(fp8, prompt)
    quant_error = ((unquantized - reference).norm() / reference.norm()).item()
    our_error = ((got - reference).norm() / reference.norm()).item()
    assert our_error < quant_error / 20, (our_error, quant_error)


def test_fp8_moe_checkpoint_is_refused_by_name(tiny_checkpoint, tmp_path) -> None:
    import json

    path, _ = tiny_checkpoint("tiny-mixtral")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"FP8 checkpoints \(fp8\) of mixture-of-experts models are not supported"):
        Runtime(str(tmp_path), level=0, device="cpu")
