"""Fixtures for the pass tests: one eager (-O0) runtime and one captured graph per tiny model, shared."""

from __future__ import annotations

import pytest

from kiln import Runtime
from tests.passes.harness import Capture, capture

PRESETS = ("tiny-llama", "tiny-qwen2", "tiny-qwen3")
NUM_LAYERS = 2  # every tiny preset
PROMPT = list(range(3, 16))  # 13 tokens: one prefill, also the exact size the post-grad graphs are built for


@pytest.fixture(scope="session")
def eager_runtime(tiny_checkpoint):
    made: dict[str, Runtime] = {}

    def get(preset: str) -> Runtime:
        if preset not in made:
            made[preset] = Runtime(str(tiny_checkpoint(preset)[0]), level=0, device="cpu", dtype="fp32",
                                   max_num_batched_tokens=32, max_num_seqs=4, num_blocks=8)
        return made[preset]

    return get


@pytest.fixture(scope="session")
def captured(eager_runtime):
    made: dict[str, Capture] = {}

    def get(preset: str) -> Capture:
        if preset not in made:
            made[preset] = capture(eager_runtime(preset), PROMPT)
        return made[preset]

    return get
