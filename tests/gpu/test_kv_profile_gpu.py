"""KV sizing by profiling on the GPU with a token budget (2048) beyond the model's context (tiny-llama: 512
positions): the profiling forward must stay inside the rotary table (it used to hit a device-side assert),
and the runtime it sizes gives the same greedy tokens as one with a fixed KV budget (no profiling)."""

from __future__ import annotations

import pytest
import torch

from kiln import Runtime, SamplingParams
from tests.conftest import random_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]


def test_profiled_kv_sizing_with_a_budget_beyond_the_context() -> None:
    prompts, params = random_prompts([7, 30], 256, seed=3), SamplingParams(max_tokens=8, temperature=0.0,
                                                                           ignore_eos=True)
    common = dict(level=0, device="cuda", dtype="fp32", max_num_batched_tokens=2048)
    profiled = Runtime("tiny-llama", gpu_memory_utilization=0.3, **common)
    assert profiled.engine.loaded.spec.max_position_embeddings < 2048
    fixed = Runtime("tiny-llama", kv_cache_bytes=64 << 20, **common)
    assert ([o.outputs[0].token_ids for o in profiled.generate(prompts, params)]
            == [o.outputs[0].token_ids for o in fixed.generate(prompts, params)])
