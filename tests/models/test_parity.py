"""Greedy parity with HF transformers (fp32) on tiny random Llama / Qwen2 / Qwen3 checkpoints."""

from __future__ import annotations

import pytest
import torch

from kiln import Runtime, SamplingParams
from tests.conftest import hf_greedy, prompt_logits, random_prompts

PRESETS = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-llama3"]
LENGTHS = [1, 3, 9, 16, 17, 40, 77, 130]


@pytest.mark.parametrize("preset", PRESETS)
def test_greedy_matches_transformers(preset: str, tiny_checkpoint) -> None:
    path, hf = tiny_checkpoint(preset)
    runtime = Runtime(str(path), level=0, device="cpu", dtype="fp32", max_num_batched_tokens=96)
    prompts = random_prompts(LENGTHS, hf.config.vocab_size, seed=len(preset))
    outs = runtime.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    produced = [o.outputs[0].token_ids for o in outs]
    expected = [hf_greedy(hf, p, 16) for p in prompts]
    assert produced == expected
    assert len({tuple(t) for t in expected}) > 1, "degenerate model: every prompt gives the same output"

    prompt = prompts[-2]  # within one step's token budget
    ours = prompt_logits(runtime, prompt)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    diff = (ours - ref).abs().max().item()
    print(f"{preset}: max |logit diff| vs transformers = {diff:.2e}")
    assert diff < 1e-4


def test_unsupported_architecture_is_a_clear_error(tmp_path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(ValueError, match="unsupported model architecture 'GPT2LMHeadModel'"):
        Runtime(str(tmp_path), level=0, device="cpu")


def test_unknown_model_argument(tmp_path) -> None:
    with pytest.raises(ValueError, match="neither a directory"):
        Runtime(str(tmp_path / "nope"), level=0, device="cpu")


def test_sharded_checkpoint_and_dtypes(tiny_checkpoint, tmp_path) -> None:
    path, hf = tiny_checkpoint("tiny-qwen2")
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    prompt = random_prompts([21], hf.config.vocab_size, seed=3)[0]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    sharded = Runtime(str(tmp_path), level=0, device="cpu", dtype="fp32")
    assert sharded.generate([prompt], params)[0].outputs[0].token_ids == hf_greedy(hf, prompt, 8)
    for dtype, torch_dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        rt = Runtime(str(path), level=0, device="cpu", dtype=dtype)
        assert next(rt.engine.model.parameters()).dtype == torch_dtype
        assert rt.engine.kv_cache.dtype == torch_dtype
        assert len(rt.generate([prompt], params)[0].outputs[0].token_ids) == 8
    with pytest.raises(ValueError, match="dtype"):
        Runtime(str(path), level=0, device="cpu", dtype="int3")
