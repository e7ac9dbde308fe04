"""A mixture-of-experts model over two ranks (gloo, CPU) gives the same greedy tokens as one: experts split along
their intermediate dim (the default), and whole experts per rank (enable_expert_parallel)."""

from __future__ import annotations

import pytest

from kiln import Runtime, SamplingParams
from kiln.models.moe import SparseMoeBlock
from tests.conftest import random_prompts

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = random_prompts([5, 17, 40, 3, 26], 256, seed=29)


@pytest.fixture(scope="module")
def reference(tiny_checkpoint) -> list[list[int]]:
    single = Runtime(str(tiny_checkpoint("tiny-qwen3-moe")[0]), level=0, device="cpu", dtype="fp32")
    return [o.outputs[0].token_ids for o in single.generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_tp2_matches_tp1(tiny_checkpoint, reference, expert_parallel: bool) -> None:
    path = str(tiny_checkpoint("tiny-qwen3-moe")[0])  # 8 experts, the middle layer dense
    runtime = Runtime(path, level=0, device="cpu", dtype="fp32", tensor_parallel_size=2,
                      enable_expert_parallel=expert_parallel)
    try:
        block = runtime.engine.model.layers[0].mlp  # rank 0's shard
        assert isinstance(block, SparseMoeBlock)
        if expert_parallel:
            assert block.w13_weight.shape == (4, 64, 64) and block.first_expert == 0
        else:
            assert block.w13_weight.shape == (8, 32, 64) and block.w2_weight.shape == (8, 64, 16)
        assert [o.outputs[0].token_ids for o in runtime.generate(PROMPTS, PARAMS)] == reference
    finally:
        runtime.engine.shutdown()


def test_expert_parallel_needs_divisible_experts(monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    import kiln.models.moe as moe
    from kiln.models.base import ModelSpec
    from kiln.models.loader.presets import preset_view

    spec = ModelSpec.from_hf(preset_view("tiny-mixtral"))  # 4 experts
    monkeypatch.setattr(moe, "tp_size", lambda: 3)
    with pytest.raises(ValueError, match="num_experts 4 is not divisible by tensor parallel size 3"):
        moe.SparseMoeBlock(dataclasses.replace(spec, moe=dataclasses.replace(spec.moe, expert_parallel=True)))
