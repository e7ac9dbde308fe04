"""The embedded SmolLM2-135M-Instruct at the default level (-O2) on CPU: compiled, and still right."""

from __future__ import annotations

import pytest

from kiln import Runtime, SamplingParams

pytestmark = pytest.mark.slow

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def test_o2_answers_paris(embedded_dir) -> None:
    runtime = Runtime(None, device="cpu", dtype="fp32", max_num_batched_tokens=256)  # None: the embedded model
    stats = runtime.compile_stats
    assert stats.level == 2 and stats.dynamo_traces == 1
    assert stats.num_pieces == 2 * runtime.engine.loaded.spec.num_layers + 1 and stats.num_distinct_pieces == 3
    out = runtime.chat(FRANCE, SamplingParams(max_tokens=24, temperature=0.0))
    assert "Paris" in out.outputs[0].text, out.outputs[0].text
    assert stats.traces_after_warmup == 0 and stats.compiles_after_warmup == 0
