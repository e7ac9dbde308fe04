"""The L2 prefetch of the o projection's weight during a small decode step's attention (kiln/attention/l2_prefetch.py):
which weight each layer asks for, when a step asks, and the kernel's shape on Hopper (its effect on tokens: the GPU
test in tests/gpu/test_cuda_graphs.py)."""

from __future__ import annotations

import pytest
import torch

from kiln.attention import l2_prefetch
from tests.conftest import cpu_runtime


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3-moe"])
def test_each_layer_asks_for_its_own_o_projection(tiny_checkpoint, monkeypatch: pytest.MonkeyPatch,
                                                  preset: str) -> None:
    runner = cpu_runtime(tiny_checkpoint(preset)).engine.runner
    assert runner._prefetch_weights() == {}  # the torch backend does not take `prefetch`
    monkeypatch.setattr(l2_prefetch, "MAX_REQS", 8)
    monkeypatch.setattr(type(runner.backend), "supports_l2_prefetch", True)
    runner._prefetch = None
    weights = runner._prefetch_weights()
    layers = [m for m in runner.model.modules() if hasattr(m, "o_proj") and hasattr(m, "layer_idx")]
    assert sorted(weights) == list(range(len(layers) - 1)) and len(layers) >= 2  # the last forks none
    for layer in layers[:-1]:
        assert weights[layer.layer_idx] is layer.o_proj.weight


def test_a_step_asks_only_at_few_requests_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    weight = torch.empty(256, 256, dtype=torch.bfloat16)  # 128 KB
    monkeypatch.setattr(l2_prefetch, "MAX_REQS", 8)
    assert not l2_prefetch.applies(weight, 1)  # on the CPU: never
    if torch.cuda.is_available():
        gpu = weight.cuda()
        assert l2_prefetch.applies(gpu, 1) and l2_prefetch.applies(gpu, 8)
        assert not l2_prefetch.applies(gpu, 9) and not l2_prefetch.applies(gpu, 0)
        assert not l2_prefetch.applies(gpu[:, :8], 1)  # not contiguous
        assert not l2_prefetch.applies(gpu[:8], 1)  # under one chunk


def test_the_kernel_is_one_bulk_prefetch_a_thread() -> None:
    """sm90 ahead of time: one bulk L2 prefetch a thread, and no PDL (on its side stream it waits for the fork
    point in full, so it never runs beside the qkv GEMM that still streams its own weight)."""
    from tests.models.test_fp8_kernel import sm90_ptx

    ptx = sm90_ptx("l2_prefetch")
    assert ptx["bulk_prefetch"] == 1 and not ptx["gdc_wait"] and not ptx["launch_pdl"], ptx
