"""FP8 linear weights (kiln/models/quant): the GEMM against a dequantized reference, the embedded model
quantized online against its fp32 self, FP8 checkpoints (written here from a tiny model) against the
online-quantized model, and the errors for checkpoints kiln cannot run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kiln import Runtime, SamplingParams
from kiln.models.quant.fp8 import FP8_DTYPE, Fp8Scheme, dequantize, fp8_linear, quantize_weight
from tests.conftest import hf_greedy, prompt_logits, random_prompts

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
QUESTIONS = [
    "What is the capital of France?", "What is the capital of Japan?", "Name three primary colours.",
    "How many legs does a spider have?", "What is 7 times 8?", "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Celsius?", "Translate 'thank you' into Spanish.",
    "What is the largest planet in the solar system?", "Give me a synonym for happy.",
    "What gas do plants absorb from the air?", "Write a haiku about the sea.",
    "What is the square root of 81?", "Which ocean is the largest?", "What language is spoken in Brazil?",
    "List three fruits.",
]


def first_tokens_agree(a: list[int], b: list[int], n: int) -> bool:
    return a[:n] == b[:n]

E4M3_MAX = 448.0
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = random_prompts([1, 5, 17, 40, 9, 26], 256, seed=17)


def tokens(runtime: Runtime, prompts: list, params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in runtime.generate(prompts, params)]


# --- the GEMM -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("static", [False, True])
def test_fp8_linear_matches_a_dequantized_reference(static: bool) -> None:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(7, 64, generator=g), torch.randn(48, 64, generator=g) * 0.05
    bias = torch.randn(48, generator=g)
    wq, ws = quantize_weight(w)
    assert wq.dtype == FP8_DTYPE and ws.shape == (48,)
    input_scale = torch.tensor([x.abs().max().item() / E4M3_MAX * 1.5]) if static else None
    # reference, written out: round the activations to e4m3 with their scale, multiply in fp32
    x_scale = input_scale.reshape(1, 1) if static else x.abs().amax(-1, keepdim=True) / E4M3_MAX
    x_rounded = (x / x_scale).to(FP8_DTYPE).float() * x_scale
    expected = x_rounded @ dequantize(wq, ws, torch.float32).t() + bias
    got = fp8_linear(x, wq, ws, input_scale, bias)
    assert got.dtype == torch.float32 and got.shape == (7, 48)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # and FP8 rounding stays FP8 rounding: within a few percent of the unquantized product
    assert ((got - (x @ w.t() + bias)).norm() / (x @ w.t()).norm()).item() < 0.06


def test_weight_scales_are_per_output_channel() -> None:
    w = torch.randn(16, 32) * torch.logspace(-3, 1, 16).unsqueeze(1)  # rows of very different magnitude
    wq, ws = quantize_weight(w)
    torch.testing.assert_close(ws, w.abs().amax(-1) / E4M3_MAX)
    assert (dequantize(wq, ws, torch.float32) - w).abs().div(w.abs().amax(-1, keepdim=True)).max() < 2 ** -4


# --- online quantization ----------------------------------------------------------------------------

def fake_quantized_hf(hf: torch.nn.Module) -> torch.nn.Module:
    """A copy of a transformers model that computes what FP8 means, in fp32: every decoder linear's weight
    replaced by its e4m3 per-channel dequantization, its input rounded to e4m3 per token. The reference
    for kiln's FP8 model, written without kiln's layers."""
    import copy

    ref = copy.deepcopy(hf)

    def round_input(module, args):
        x = args[0]
        scale = (x.abs().amax(-1, keepdim=True) / E4M3_MAX).clamp(min=1e-12)
        return ((x / scale).to(FP8_DTYPE).float() * scale,)

    with torch.no_grad():
        for name, module in ref.named_modules():
            if isinstance(module, torch.nn.Linear) and name.rpartition(".")[2] in LINEARS:
                w = module.weight
                scale = w.abs().amax(-1, keepdim=True) / E4M3_MAX
                w.copy_((w / scale).to(FP8_DTYPE).float() * scale)
                module.register_forward_pre_hook(round_input)
    return ref


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2"])
def test_online_fp8_matches_fake_quantized_transformers(preset: str, tiny_checkpoint) -> None:
    path, hf = tiny_checkpoint(preset)
    fp8 = Runtime(str(path), level=0, device="cpu", dtype="fp32", quantization="fp8")
    params = dict(fp8.engine.model.named_parameters())
    assert params["layers.0.self_attn.qkv_proj.weight"].dtype == FP8_DTYPE
    assert params["layers.1.mlp.down_proj.weight_scale"].shape == (64,)
    assert params["embed_tokens.weight"].dtype == fp8.engine.model.lm_head.weight.dtype == torch.float32
    ref = fake_quantized_hf(hf)
    assert tokens(fp8, PROMPTS) == [hf_greedy(ref, p, GREEDY.max_tokens) for p in PROMPTS]
    prompt = PROMPTS[3]
    with torch.no_grad():
        expected = ref(torch.tensor([prompt])).logits[0]
        unquantized = hf(torch.tensor([prompt])).logits[0]
    got = prompt_logits(fp8, prompt)
    # FP8 moves the logits by several percent on these random weights; kiln is within fp32 noise of the
    # reference (an e4m3 rounding flipped by a last-bit difference upstream is the most it may differ by)
    quant_error = ((unquantized - expected).norm() / expected.norm()).item()
    our_error = ((got - expected).norm() / expected.norm()).item()
    print(f"{preset}: FP8 vs fp32 {quant_error:.1e}, kiln vs reference {our_error:.1e}")
    assert our_error < quant_error / 20


def test_quantization_option_is_validated() -> None:
    with pytest.raises(ValueError, match="quantization"):
        Runtime("tiny-llama", level=0, device="cpu", quantization="int8")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_compiled_fp8_matches_eager_fp8(tiny_checkpoint, dtype: str) -> None:
    """_scaled_mm and the activation quantization trace and compile inside the pieces (-O2). In bf16 the
    compiled pieces must round where eager rounds (Inductor's emulate_precision_casts): an activation
    quantized from an unrounded fp32 intermediate moves the FP8 scale and flips greedy tokens."""
    path, _ = tiny_checkpoint("tiny-qwen2")  # with the qkv bias
    eager = Runtime(str(path), level=0, device="cpu", dtype=dtype, quantization="fp8")
    compiled = Runtime(str(path), level=2, device="cpu", dtype=dtype, quantization="fp8",
                       max_num_batched_tokens=64)
    assert tokens(compiled, PROMPTS) == tokens(eager, PROMPTS)
    assert compiled.compile_stats.dynamo_traces == 1


@pytest.fixture(scope="module")
def eager_fp8_answers(embedded_dir) -> tuple[str, list[list[int]], list[list[int]]]:
    """SmolLM2-135M-Instruct quantized online, -O0: the France answer, the QUESTIONS prompts and their first 4
    greedy tokens (shared by the two tests below: one eager FP8 build)."""
    fp8 = Runtime(str(embedded_dir), level=0, device="cpu", dtype="fp32", quantization="fp8",
                  max_num_batched_tokens=512)
    answer = fp8.chat(FRANCE, SamplingParams(max_tokens=24, temperature=0.0)).outputs[0].text
    prompts = [fp8.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    return answer, prompts, tokens(fp8, prompts, FIRST_4)


FIRST_4 = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.mark.slow
def test_embedded_model_in_fp8_keeps_its_answers(embedded_dir, eager_fp8_answers) -> None:
    """Measured (2026-11-30, CPU, torch 2.13): Paris; the first 4 greedy tokens equal fp32's on 12 of these 16
    questions (11/16 for 8 tokens), the other 4 differ from the first token on (an opening word such as "The"
    vs "Sure" that the 135M model holds nearly tied). At least 10/16 leaves room for two more near-ties
    flipping on another CPU's kernels, while a broken scale or a wrong shard (which garbles every answer)
    cannot pass."""
    answer, prompts, ours = eager_fp8_answers
    assert "Paris" in answer, answer
    full = tokens(Runtime(str(embedded_dir), level=0, device="cpu", dtype="fp32", max_num_batched_tokens=512),
                  prompts, FIRST_4)
    agree = sum(first_tokens_agree(a, b, 4) for a, b in zip(ours, full))
    print(f"fp8 vs fp32: first 4 tokens agree on {agree}/{len(prompts)} questions")
    assert agree >= 10


# --- FP8 checkpoints ----------------------------------------------------------------------------------

def calibrate_input_amax(hf: torch.nn.Module, prompts: list[list[int]]) -> dict[str, float]:
    """Largest |input| each decoder linear sees over the prompts (what a calibration run records)."""
    amax: dict[str, float] = {}
    hooks = []
    for name, module in hf.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rpartition(".")[2] in LINEARS:
            def record(module, args, name=name):
                amax[name] = max(amax.get(name, 0.0), args[0].abs().max().item())
            hooks.append(module.register_forward_pre_hook(record))
    with torch.no_grad():
        for prompt in prompts:
            hf(torch.tensor([prompt]))
    for hook in hooks:
        hook.remove()
    return amax


def write_fp8_checkpoint(hf: torch.nn.Module, path: Path, quantization_config: dict, strategy: str,
                         input_amax: dict[str, float] | None = None) -> dict[str, torch.Tensor]:
    """Save `hf` the way FP8 checkpoints are published: every decoder linear's weight in e4m3 with a
    `weight_scale` ([N, 1] per channel, or one per tensor), an `input_scale` when calibrated."""
    from safetensors.torch import save_file

    tensors = {}
    for name, value in hf.state_dict().items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rpartition(".")[2] in LINEARS:
            w = value.float()
            scale = (w.abs().amax(-1, keepdim=True) if strategy == "channel" else w.abs().max().reshape(1)) / E4M3_MAX
            tensors[name] = (w / scale.reshape(-1, 1)).to(FP8_DTYPE)
            tensors[module + ".weight_scale"] = scale
            if input_amax is not None:
                tensors[module + ".input_scale"] = torch.tensor([input_amax[module] / E4M3_MAX])
        else:
            tensors[name] = value.contiguous()
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    config = hf.config.to_dict()
    config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config))
    return tensors


def compressed_tensors_config(strategy: str, static: bool) -> dict:
    acts = ({"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True} if static
            else {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True})
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": acts,
                                          "weights": {"num_bits": 8, "type": "float", "strategy": strategy,
                                                      "dynamic": False, "symmetric": True}}}}


def test_compressed_tensors_checkpoint_equals_online_fp8(tiny_checkpoint, tmp_path) -> None:
    """Per-channel weights, dynamic activations: the same numbers the online quantization computes, so the
    same logits bit for bit."""
    path, hf = tiny_checkpoint("tiny-llama")
    write_fp8_checkpoint(hf, tmp_path, compressed_tensors_config("channel", static=False), "channel")
    loaded = Runtime(str(tmp_path), level=0, device="cpu", dtype="fp32")  # detected from the config alone
    online = Runtime(str(path), level=0, device="cpu", dtype="fp32", quantization="fp8")
    assert loaded.engine.loaded.spec.quantization.source == "compressed-tensors"
    assert tokens(loaded, PROMPTS) == tokens(online, PROMPTS)
    torch.testing.assert_close(prompt_logits(loaded, PROMPTS[3]), prompt_logits(online, PROMPTS[3]),
                               rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", ["fp8", "compressed-tensors"])
def test_static_per_tensor_checkpoint_matches_its_reference(kind: str, tiny_checkpoint, tmp_path) -> None:
    """Per-tensor weight scales (different for q, k and v: kiln keeps one per channel) and static input
    scales from a calibration run, against transformers computing the same FP8 arithmetic in fp32."""
    _, hf = tiny_checkpoint("tiny-llama")
    amax = calibrate_input_amax(hf, PROMPTS)
    qconfig = ({"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}
               if kind == "fp8" else compressed_tensors_config("tensor", static=True))
    tensors = write_fp8_checkpoint(hf, tmp_path, qconfig, "tensor", amax)
    runtime = Runtime(str(tmp_path), level=0, device="cpu", dtype="fp32")
    qkv = runtime.engine.model.layers[0].self_attn.qkv_proj
    scales = [tensors[f"model.layers.0.self_attn.{p}_proj.weight_scale"].item() for p in "qkv"]
    assert len(set(scales)) == 3 and sorted(set(qkv.weight_scale.tolist())) == sorted(scales)
    assert qkv.input_scale.item() == pytest.approx(amax["model.layers.0.self_attn.q_proj"] / E4M3_MAX)

    ref = copy_with_checkpoint_fp8(hf, tensors)
    assert tokens(runtime, PROMPTS) == [hf_greedy(ref, p, GREEDY.max_tokens) for p in PROMPTS]
    with torch.no_grad():
        expected = ref(torch.tensor([PROMPTS[3]])).logits[0]
    got = prompt_logits(runtime, PROMPTS[3])
    assert ((got - expected).norm() / expected.norm()).item() < 1e-5


def copy_with_checkpoint_fp8(hf: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """transformers with each linear's weight dequantized from the checkpoint and its input rounded to
    e4m3 with the checkpoint's static scale (saturating, as the FP8 cast does)."""
    import copy

    ref = copy.deepcopy(hf)
    with torch.no_grad():
        for name, module in ref.named_modules():
            if isinstance(module, torch.nn.Linear) and name.rpartition(".")[2] in LINEARS:
                q, scale = tensors[name + ".weight"], tensors[name + ".weight_scale"]
                module.weight.copy_(q.float() * scale.reshape(-1, 1))
                s = tensors[name + ".input_scale"]
                module.register_forward_pre_hook(
                    lambda m, args, s=s: ((args[0] / s).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE).float() * s,))
    return ref


@pytest.mark.parametrize("qconfig, message", [
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}, "block-wise"),
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq'"),
    ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}}},
     "4-bit int"),
    ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "block"}}}},
     "strategy 'block'"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": ["model.layers.0.mlp.down_proj"]},
     "ignored_layers"),
])
def test_checkpoints_kiln_cannot_run_are_named(qconfig: dict, message: str, tiny_checkpoint, tmp_path) -> None:
    path, _ = tiny_checkpoint("tiny-llama")
    config = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": qconfig}))
    with pytest.raises(ValueError, match=message):
        Runtime(str(tmp_path), level=0, device="cpu")


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_fp8_scales_follow_their_shard_with_replicated_kv_heads(rank: int) -> None:
    """TP=4 over 2 KV heads: each rank keeps its q heads and a replica of one KV head, weight and scale alike
    (the layer's loader alone; no process group is needed to load)."""
    from kiln.models.layers import QKVParallelLinear
    from kiln.models.parallel import TPGroup, set_tp_group

    head_dim, hidden = 16, 64
    g = torch.Generator().manual_seed(0)
    full = {name: torch.randn(rows * head_dim, hidden, generator=g) for name, rows in (("q", 4), ("k", 2), ("v", 2))}
    set_tp_group(TPGroup(rank=rank, size=4))
    try:
        layer = QKVParallelLinear(hidden, head_dim, 4, 2, bias=False, quant=Fp8Scheme())
        for name, tensor in full.items():
            layer.weight_loader(layer.weight, tensor, name)
    finally:
        set_tp_group(TPGroup())
    q_rows = slice(rank * head_dim, (rank + 1) * head_dim)
    kv_rows = slice((rank // 2) * head_dim, (rank // 2 + 1) * head_dim)
    for name, rows, offset in (("q", q_rows, 0), ("k", kv_rows, head_dim), ("v", kv_rows, 2 * head_dim)):
        wq, ws = quantize_weight(full[name])
        assert torch.equal(layer.weight[offset:offset + head_dim].float(), wq[rows].float())
        assert torch.equal(layer.weight_scale[offset:offset + head_dim], ws[rows])


def test_cli_flag_reaches_the_runtime_options() -> None:
    import argparse

    from kiln.entrypoints.cli.main import add_runtime_args, runtime_kwargs

    parser = argparse.ArgumentParser()
    add_runtime_args(parser)
    assert runtime_kwargs(parser.parse_args(["--quantization", "fp8"]))["quantization"] == "fp8"
    assert "quantization" not in runtime_kwargs(parser.parse_args([]))


@pytest.mark.slow
def test_embedded_model_in_fp8_compiled_matches_eager(embedded_dir, eager_fp8_answers) -> None:
    """-O2 (compiled pieces, the quantization fused into the norm / SiLU kernels) against -O0 on the same
    FP8 weights. They are not bit-equal and cannot be: compiled fp32 kernels sum in another order, and a
    last-bit change in an activation or its amax moves an e4m3 rounding (a step of 1/16 of the value).
    This FP8 model amplifies such flips: in eager mode alone, quantizing with x * (1/scale) instead of
    x / scale moves the France prompt's last logits by 4.0% (relative norm); -O2 vs -O0 measured 6.6%,
    FP8 vs fp32 9.2%. The first 4 greedy tokens agree on 13/16 questions (the 135M model has near-tied
    openings; see the fp32 comparison above, 12/16), so at least 12 is asserted, and Paris. The range
    artifact alone serves every size (no exact size-1 compile: the same kernels, half the CPU compile)."""
    compiled = Runtime(str(embedded_dir), level=2, device="cpu", dtype="fp32", quantization="fp8",
                       max_num_batched_tokens=512, compile_sizes=())
    assert "Paris" in compiled.chat(FRANCE, SamplingParams(max_tokens=24, temperature=0.0)).outputs[0].text
    _, prompts, eager = eager_fp8_answers
    ours = tokens(compiled, prompts, FIRST_4)
    assert compiled.compile_stats.compiles_after_warmup == 0
    agree = sum(a == b for a, b in zip(ours, eager))
    print(f"fp8 -O2 vs -O0: first 4 tokens agree on {agree}/{len(prompts)} questions")
    assert agree >= 12
