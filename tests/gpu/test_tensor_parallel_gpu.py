"""Tensor parallelism over NCCL on 2 GPUs: greedy tokens equal TP=1 on a tiny fp32 model, eager, compiled with
CUDA graphs at default settings (the all-reduces are captured in the graphs), and with async scheduling, and on a
tiny mixture of experts with its experts split or placed whole per GPU; and every TP=2 runtime shuts down inside
the test, its worker leaving by itself (the old hang was at shutdown)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from kiln import Runtime, SamplingParams
from tests.conftest import random_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 NVIDIA GPUs")]

# NVLink multicast off: it can take a shared host's GPUs down
for _key, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                     ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_key, _value)

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = random_prompts([5, 17, 40, 3, 26, 64, 1, 9], 256, seed=21)
COMMON = dict(device="cuda", dtype="fp32", kv_cache_bytes=64 << 20, max_num_batched_tokens=64,
              cudagraph_capture_sizes=(1, 2, 4, 8))


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    runtime = Runtime("tiny-qwen3", level=0, **COMMON)
    return [o.outputs[0].token_ids for o in runtime.generate(PROMPTS, PARAMS)]


def shut_down(runtime: Runtime) -> None:
    procs = list(runtime.engine.tp.procs)
    stopper = threading.Thread(target=runtime.engine.shutdown, daemon=True)
    stopper.start()
    stopper.join(timeout=120)
    assert not stopper.is_alive(), "Engine.shutdown() did not return"
    # left by itself, its process groups destroyed (3: it gave up on them; negative: it was terminated)
    assert [(p.is_alive(), p.exitcode) for p in procs] == [(False, 0)]
    assert not torch.distributed.is_initialized()  # rank 0's groups are destroyed too


@pytest.mark.parametrize("level, extra", [(0, {}), (2, {}), (2, dict(async_scheduling=True))],
                         ids=["eager", "O2-default-graphs", "O2-default-graphs-async"])
def test_tp2_matches_tp1_on_gpus(reference, level: int, extra: dict) -> None:
    runtime = Runtime("tiny-qwen3", level=level, tensor_parallel_size=2, **extra, **COMMON)
    try:
        assert [o.outputs[0].token_ids for o in runtime.generate(PROMPTS, PARAMS)] == reference
        assert runtime.engine.kv_cache.shape[-2] == 1  # one of the two KV heads per GPU
        if level:
            assert runtime.compile_stats.compiles_after_warmup == 0
            replays = runtime.engine.graph_replays
            assert replays["FULL"] > 0, replays  # decode steps replayed graphs holding the all-reduces
        if extra.get("async_scheduling"):
            assert runtime.engine.stats.overlapped_steps > 0
    finally:
        shut_down(runtime)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["experts-split", "expert-parallel"])
def test_a_mixture_of_experts_over_two_gpus_matches_one(expert_parallel: bool) -> None:
    """Qwen3-MoE at -O2 with CUDA graphs over two GPUs, each expert's intermediate dim split (the default) or whole
    experts per GPU (`enable_expert_parallel`): the fused MoE kernels on each rank and one all-reduce give one
    GPU's greedy tokens."""
    single = Runtime("tiny-qwen3-moe", level=0, **COMMON)
    try:
        want = [o.outputs[0].token_ids for o in single.generate(PROMPTS, PARAMS)]
    finally:
        single.engine.shutdown()
    runtime = Runtime("tiny-qwen3-moe", level=2, tensor_parallel_size=2, enable_expert_parallel=expert_parallel,
                      **COMMON)
    try:
        assert [o.outputs[0].token_ids for o in runtime.generate(PROMPTS, PARAMS)] == want
        assert runtime.engine.graph_replays["FULL"] > 0
    finally:
        shut_down(runtime)
