"""The compile artifact cache on the GPU: a second start of the same model loads every artifact and the saved
split graph (no Dynamo trace, no Inductor compile), captures its CUDA graphs over them, and generates the
same greedy tokens (skipped without a GPU).

The workload is two batches so that the warm start runs every graph mode over loaded artifacts: a prefill
of 75 tokens (above the largest capture size 16: compiled pieces without graphs), its decode steps (FULL),
and a prefill of 10 tokens (a mixed batch within the capture sizes: PIECEWISE)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln import Runtime, SamplingParams
from tests.conftest import random_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]


def test_warm_start_on_gpu(tiny_checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("KILN_DISABLE_COMPILE_CACHE", raising=False)
    options = dict(device="cuda", dtype="fp32", level=2, compile_sizes=(), max_num_batched_tokens=128,
                   max_num_seqs=16, kv_cache_bytes=64 << 20, cudagraph_capture_sizes=(1, 2, 4, 8, 16))
    path = str(tiny_checkpoint("tiny-llama")[0])
    # a prefill larger than every capture size runs without graphs, so PIECEWISE needs the short batch
    batches = [random_prompts([5, 17, 1, 40, 9, 3], 256, seed=4), random_prompts([3, 5, 2], 256, seed=5)]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    cold = Runtime(path, **options)
    expected = [[o.outputs[0].token_ids for o in cold.generate(prompts, greedy)] for prompts in batches]
    warm = Runtime(path, **options)
    stats = warm.compile_stats
    assert stats.inductor_compiles == 0 and stats.dynamo_traces == 0 and stats.capture_loaded, stats.summary()
    assert [[o.outputs[0].token_ids for o in warm.generate(prompts, greedy)] for prompts in batches] == expected
    replays = warm.engine.graph_replays
    assert replays["FULL"] > 0 and replays["PIECEWISE"] > 0 and replays["NONE"] > 0, replays
