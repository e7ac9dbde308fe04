"""A mixture-of-experts model through the artifact cache (CPU, -O1): the cold start saves the pieces around
kiln::fused_moe, and a second start loads them and the saved split graph (no trace, no compile) and generates
the same tokens."""

from __future__ import annotations

import pytest

from kiln import Runtime, SamplingParams
from tests.conftest import random_prompts

pytestmark = pytest.mark.slow

OPTIONS = dict(level=1, device="cpu", dtype="fp32", max_num_batched_tokens=32, max_num_seqs=4)


def test_warm_start_of_a_moe_model_compiles_nothing(tiny_checkpoint, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("KILN_DISABLE_COMPILE_CACHE", raising=False)
    path = str(tiny_checkpoint("tiny-mixtral")[0])
    prompts = random_prompts([5, 11, 3], 256, seed=3)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    cold = Runtime(path, **OPTIONS)
    assert cold.compile_stats.cache_hits == 0 and cold.compile_stats.inductor_compiles == 3  # 2 layers: 3 pieces
    expected = [o.outputs[0].token_ids for o in cold.generate(prompts, params)]
    warm = Runtime(path, **OPTIONS)
    stats = warm.compile_stats
    assert stats.inductor_compiles == 0 and stats.cache_hits == 3 and stats.dynamo_traces == 0, stats.summary()
    assert [o.outputs[0].token_ids for o in warm.generate(prompts, params)] == expected
