"""The compiler on CUDA (Triton): -O1/-O2 greedy tokens equal -O0 on a tiny fp32 model (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from kiln import Runtime, SamplingParams
from tests.conftest import random_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("level, options", [(1, {}), (2, {"compile_sizes": (1, 4)})])
def test_compiled_matches_eager_on_cuda(tiny_checkpoint, level: int, options: dict) -> None:
    path = str(tiny_checkpoint("tiny-llama")[0])
    common = dict(device="cuda", dtype="fp32", max_num_batched_tokens=32, max_num_seqs=8, attention_backend="torch",
                  kv_cache_bytes=64 << 20)  # two runtimes in one process: neither may take the whole GPU
    eager = Runtime(path, level=0, **common)
    compiled = Runtime(path, level=level, **common, **options)
    prompts = random_prompts([1, 4, 20, 45, 70], 256, seed=3)
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, GREEDY)]
    assert [o.outputs[0].token_ids for o in compiled.generate(prompts, GREEDY)] == expected
    stats = compiled.compile_stats
    assert stats.dynamo_traces == 1 and stats.traces_after_warmup == 0 and stats.compiles_after_warmup == 0
    assert compiled.engine.worker.compiled.bypasses_dynamo
