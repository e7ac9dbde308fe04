"""kv_cache_dtype='fp8' end to end on the CPU (torch backend): validation, KV capacity, greedy agreement with the
model-dtype cache, and prefix caching / preemption (which only move block ids) on an fp8 cache."""

from __future__ import annotations

import pytest
import torch

from kiln import Runtime, SamplingParams
from kiln.attention import AttentionLayout, select_backend
from kiln.attention.torch_backend import TorchAttentionBackend
from kiln.config import CacheConfig
from tests.conftest import assert_pool_clean, prompt_logits, random_prompts
from tests.conftest import cpu_runtime as make

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("tiny-llama")


def test_unknown_kv_cache_dtype_is_a_value_error_naming_the_field() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        Runtime("tiny-llama", load_format="dummy", device="cpu", level=0, kv_cache_dtype="fp16")


def test_cli_flag_reaches_the_runtime_and_refuses_unknown_values() -> None:
    import argparse

    from kiln.entrypoints.cli.main import add_runtime_args, runtime_kwargs

    parser = argparse.ArgumentParser()
    add_runtime_args(parser)
    assert runtime_kwargs(parser.parse_args(["m", "--kv-cache-dtype", "fp8"]))["kv_cache_dtype"] == "fp8"
    assert "kv_cache_dtype" not in runtime_kwargs(parser.parse_args(["m"]))  # unset: the default, auto
    with pytest.raises(SystemExit):
        parser.parse_args(["m", "--kv-cache-dtype", "int4"])


def test_a_backend_without_fp8_is_refused_at_selection(monkeypatch) -> None:
    layout = AttentionLayout(4, 2, 64, 0.125, 16, torch.bfloat16, torch.float8_e4m3fn)
    assert select_backend("torch", layout, torch.device("cpu")) is TorchAttentionBackend
    monkeypatch.setattr(TorchAttentionBackend, "supports_fp8_kv", False)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        select_backend("torch", layout, torch.device("cpu"))


def test_fp8_pool_holds_twice_the_blocks_of_bf16(checkpoint) -> None:
    budget = 8 << 20
    bf16 = make(checkpoint, dtype="bf16", kv_cache_bytes=budget)
    fp8 = make(checkpoint, dtype="bf16", kv_cache_bytes=budget, kv_cache_dtype="fp8")
    assert bf16.engine.worker.kv_cache.dtype == torch.bfloat16
    assert fp8.engine.worker.kv_cache.dtype == torch.float8_e4m3fn
    usable_bf16, usable_fp8 = bf16.engine.worker.num_blocks - 1, fp8.engine.worker.num_blocks - 1
    assert abs(usable_fp8 - 2 * usable_bf16) <= 1
    nbytes = [rt.engine.worker.kv_cache.numel() * rt.engine.worker.kv_cache.element_size() for rt in (bf16, fp8)]
    assert all(n <= budget + nbytes[0] // (usable_bf16 + 1) for n in nbytes)  # within the budget + the null block
    # and the bf16 model still generates through its fp8 cache
    prompt = random_prompts([30], 256, seed=3)[0]
    assert len(fp8.generate([prompt], GREEDY)[0].outputs[0].token_ids) == 12


def test_prefix_caching_and_preemption_on_an_fp8_cache(checkpoint) -> None:
    prompts = random_prompts([21, 45, 30, 25], 256, seed=8)
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    roomy = make(checkpoint, max_num_batched_tokens=64, kv_cache_dtype="fp8", enable_prefix_caching=False)
    alone = [roomy.generate([p], long)[0].outputs[0].token_ids for p in prompts]
    # 12 usable blocks: the four requests (61..85 tokens each) cannot all stay resident
    tight = make(checkpoint, max_num_batched_tokens=64, num_blocks=13, kv_cache_dtype="fp8")
    outs = tight.generate(prompts, long)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == alone
    # a second request with the same first 32 tokens reads them from cached fp8 blocks
    shared = prompts[1][:32] + prompts[2][:9]
    expected = roomy.generate([shared], long)[0].outputs[0].token_ids
    tight.generate([prompts[1]], GREEDY)
    hits = tight.engine.kv.hits
    assert tight.generate([shared], long)[0].outputs[0].token_ids == expected
    assert tight.engine.kv.hits >= hits + 32
    assert_pool_clean(tight)


@pytest.mark.slow
def test_embedded_model_greedy_agreement_with_fp32_cache() -> None:
    """SmolLM2-135M (fp32 compute) with an fp8 cache against an fp32 cache, 8 chat prompts x 32 greedy tokens.
    Measured (torch 2.13, CPU): tokens before the first difference 26 17 6 5 11 32 6 12 (mean 14.4, 1 of 8
    identical); last-prompt-position logits at 1.5-13% relative error (mean 4.4%), the same argmax on all 8.
    e4m3 keeps 3 mantissa bits (~2.5% mean relative rounding error of K/V); this 135M model's keys reach |20|,
    far from 448, so nothing clamps."""
    questions = ["What is the capital of France?", "Write a haiku about the sea.", "List three colours.",
                 "Explain photosynthesis briefly.", "Who wrote Hamlet?", "Count from one to ten.",
                 "What is 12 times 7?", "Describe a cat."]
    runs = {}
    for kv in ("auto", "fp8"):
        rt = Runtime(None, level=0, device="cpu", dtype="fp32", max_num_batched_tokens=512, kv_cache_bytes=64 << 20,
                     kv_cache_dtype=kv)
        prompts = [rt.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
        outs = rt.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
        logits = [prompt_logits(rt, p)[-1] for p in prompts]
        runs[kv] = ([o.outputs[0].token_ids for o in outs], logits)
    firsts = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
              for a, b in zip(runs["auto"][0], runs["fp8"][0])]
    errs = [((got - ref).norm() / ref.norm()).item() for ref, got in zip(runs["auto"][1], runs["fp8"][1])]
    same = [bool(got.argmax() == ref.argmax()) for ref, got in zip(runs["auto"][1], runs["fp8"][1])]
    assert min(firsts) >= 4, firsts  # every answer starts the same
    assert sum(firsts) / len(firsts) >= 8, firsts
    assert min(errs) > 0 and max(errs) < 0.25 and sum(errs) / len(errs) < 0.08, errs  # fp8 in use, and close
    assert sum(same) >= 7, same


@pytest.mark.slow
def test_fused_rope_cache_write_honours_the_layer_scales(monkeypatch) -> None:
    """-O2 with the rope_kv pass writes K/V from kiln::rope_attention (ForwardContext.kv_scales), -O0 from the
    backend (write_kv): with scales other than 1.0 the two must still produce the same tokens."""
    import kiln.passes.ops as ops

    fused = []
    real = ops.rope_and_cache
    monkeypatch.setattr(ops, "rope_and_cache", lambda *a, **kw: fused.append(kw) or real(*a, **kw))
    prompts = random_prompts([21, 45, 30, 7], 256, seed=8)
    tokens = []
    for level in (0, 2):
        rt = Runtime("tiny-llama", load_format="dummy", device="cpu", dtype="fp32", level=level, kv_cache_dtype="fp8",
                     max_num_batched_tokens=128, passes=("rope_kv",), enable_passes=True)
        rt.engine.runner.kv_scales = tuple((0.5 + 0.1 * i, 2.0 - 0.1 * i) for i in range(len(rt.engine.kv_cache)))
        outs = rt.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
        tokens.append([o.outputs[0].token_ids for o in outs])
    assert fused  # the pass did rewrite attention at -O2
    assert tokens[0] == tokens[1]


def test_an_fp8_checkpoints_kv_scales_reach_the_fp8_cache(tiny_checkpoint, tmp_path) -> None:
    """`k_scale`/`v_scale` (and the older single `kv_scale`) of an FP8 checkpoint become the layers' scales of
    an fp8 cache; layers without them keep 1.0; a model-dtype cache ignores them."""
    from safetensors.torch import load_file, save_file

    from tests.models.test_fp8 import compressed_tensors_config, write_fp8_checkpoint

    _, hf = tiny_checkpoint("tiny-llama")
    write_fp8_checkpoint(hf, tmp_path, compressed_tensors_config("channel", static=False), "channel")
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    tensors["model.layers.0.self_attn.v_scale"] = torch.tensor(2.0)
    tensors["model.layers.1.self_attn.kv_scale"] = torch.tensor([0.25])
    save_file(tensors, str(tmp_path / "model.safetensors"))
    fp8 = Runtime(str(tmp_path), level=0, device="cpu", dtype="fp32", kv_cache_dtype="fp8")
    layers = hf.config.num_hidden_layers
    expected = ((0.5, 2.0), (0.25, 0.25)) + ((1.0, 1.0),) * (layers - 2)
    assert fp8.engine.runner.kv_scales == expected
    auto = Runtime(str(tmp_path), level=0, device="cpu", dtype="fp32")
    assert auto.engine.runner.kv_scales is None
    prompt = random_prompts([30], 256, seed=4)[0]
    assert len(fp8.generate([prompt], GREEDY)[0].outputs[0].token_ids) == 12
