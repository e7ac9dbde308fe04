"""The kernel warm-up (kiln/runtime/kernel_warmup.py) runs kiln's Triton kernels on inputs of its own, in a process:
one decode batch per distinct split count and tile plus one prefill chunk, on a throwaway backend, leaving the runner's
backend and cache untouched; the GEMMs only where `kiln::dense_gemm` would run them (CUDA, 16-bit). On CPU the
attention kernels run under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from kiln.attention.base import AttentionLayout
from kiln.attention.triton_backend import TritonAttentionBackend
from kiln.models.loader.load import load_model
from kiln.runtime.input_upload import IN_GRAPH
from kiln.runtime.kernel_warmup import (
    KernelWarmup,
    epilogue_shapes,
    gemm_shapes,
    moe_shapes,
    run_attention,
    run_epilogues,
    run_gemms,
    run_moe,
    run_step_kernels,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# the plan runs the kernels around a step's model (run_step_kernels: the inputs' unpacking with and without pending
# tokens, its header-reading form where FULL graphs begin with it, the greedy argmax) on CUDA only
STEP_KERNELS = 3 + IN_GRAPH if DEVICE.type == "cuda" else 0


def test_attention_warmup_runs_one_batch_per_split_count_and_one_prefill() -> None:
    layout = AttentionLayout(8, 2, 32, 32 ** -0.5, 16, torch.float32)
    backend = TritonAttentionBackend(layout, DEVICE)
    sizes = [1, 2, 8]
    splits = {backend.num_splits(n) for n in sizes}
    assert 1 < len(splits) < len(sizes)  # some sizes share a split count: one launch serves them
    workspace = backend._part_out.data_ptr(), backend._part_lse.data_ptr()
    assert run_attention(backend, sizes, block_table_width=16) == len(splits) + 1
    assert (backend._part_out.data_ptr(), backend._part_lse.data_ptr()) == workspace  # the runner's: untouched


def test_attention_warmup_runs_each_decode_tile_of_a_split_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the tile above 64 requests set apart (KILN_DECODE_CONFIG), 64 and 65 requests share a split count but
    not a 16-bit decode tile: each compiles its own kernel, so each gets a batch."""
    monkeypatch.setenv("KILN_DECODE_ONE_SPLIT_WAVES", "0")  # one split: the fewest programs for the interpreter
    monkeypatch.setenv("KILN_DECODE_CONFIG", "BLOCK_N_WIDE=64")
    backend = TritonAttentionBackend(AttentionLayout(4, 1, 16, 16 ** -0.5, 16, torch.float16), DEVICE)
    assert backend.num_splits(64) == backend.num_splits(65)
    assert backend.decode_kernel_key(64) != backend.decode_kernel_key(65)
    assert run_attention(backend, [64, 65], block_table_width=4) == 2 + 1


def test_gemm_shapes_are_the_distinct_projections() -> None:
    model = load_model("tiny-llama", device="cpu", dtype="fp32", load_format="dummy").model
    shapes = {tuple(w.shape) for w in gemm_shapes(model)}
    layer = model.layers[0]
    expected = {tuple(m.weight.shape) for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                 layer.mlp.gate_up_proj, layer.mlp.down_proj)}
    assert shapes == expected
    if DEVICE.type == "cpu":  # kiln::dense_gemm is CUDA-only: nothing to compile
        assert run_gemms(gemm_shapes(model), [1, 2, 4, 8, 16, 32]) == 0


def test_epilogue_shapes_follow_the_enabled_passes() -> None:
    """gate_up_silu_mul, qkv_rope and gemm_add_rmsnorm compile kernels of their own: one per distinct GEMM, only where
    the pass is on and kiln::dense_gemm serves the projection (16-bit CUDA weights; Qwen3's q/k norms keep RoPE
    apart)."""
    both = ("qkv_rope", "gate_up_silu_mul")
    llama = load_model("tiny-llama", device=DEVICE, dtype="bf16", load_format="dummy").model
    if DEVICE.type == "cpu":  # no kiln::dense_gemm on the CPU: nothing to compile
        assert epilogue_shapes(llama, both) == []
        return
    layer = llama.layers[0]
    qkv, gate_up = layer.self_attn.qkv_proj.weight, layer.mlp.gate_up_proj.weight
    attn = layer.self_attn
    expected = [("qkv_rope", *qkv.shape, qkv.dtype, attn.num_heads, attn.num_kv_heads, attn.head_dim),
                ("gate_up_silu_mul", *gate_up.shape, gate_up.dtype, 0, 0, 0)]
    assert epilogue_shapes(llama, both) == expected
    assert epilogue_shapes(llama, ("gate_up_silu_mul",)) == expected[1:]
    assert epilogue_shapes(llama, ()) == []
    qwen3 = load_model("tiny-qwen3", device=DEVICE, dtype="bf16", load_format="dummy").model
    assert [s[0] for s in epilogue_shapes(qwen3, both)] == ["gate_up_silu_mul"]
    assert run_epilogues(expected, [1, 4, 32], DEVICE) == 4  # 32 tokens run the unfused path: nothing to compile
    o, down = layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight
    into_the_residual = [("gemm_add_rmsnorm", *o.shape, o.dtype, 0, 0, 0),
                         ("gemm_add_rmsnorm", *down.shape, down.dtype, 0, 0, 0)]
    assert epilogue_shapes(llama, ("gemm_add_rmsnorm",)) == list(dict.fromkeys(into_the_residual))
    assert run_epilogues(into_the_residual, [1, 4], DEVICE) == 4


def test_moe_shapes_are_the_distinct_expert_layers() -> None:
    model = load_model("tiny-qwen3-moe", device=DEVICE, dtype="bf16", load_format="dummy").model
    # the routers' GEMM runs on kiln::dense_gemm: its weight [experts, hidden] is among the GEMMs warmed up
    assert (8, 64, torch.bfloat16) in {(*w.shape, w.dtype) for w in gemm_shapes(model)}
    shapes = moe_shapes(model)
    if DEVICE.type == "cpu":  # kiln::fused_moe runs its Triton kernels on CUDA only: nothing to compile
        assert shapes == []
        return
    assert shapes == [(8, 32, 64, 2, torch.bfloat16, torch.bfloat16, False, 8, False)]  # two sparse layers, one shape
    assert run_moe(shapes, [1, 4, 64], DEVICE) == 3
    from kiln.models import gemv  # the rmsnorm_gemm pass's router: its sums from the row it finishes, one token

    router = model.layers[0].mlp.gate.weight
    routes = [s for s in epilogue_shapes(model, ("rmsnorm_gemm",)) if s[5] == gemv.PARTIALS]
    assert [s[:4] for s in routes] == [("rmsnorm_gemm", *router.shape, router.dtype)]
    assert run_epilogues(routes, [1, 4], DEVICE) == 1


def test_the_warmup_leaves_other_backends_alone() -> None:
    from kiln.attention.torch_backend import TorchAttentionBackend

    model = load_model("tiny-llama", device="cpu", dtype="fp32", load_format="dummy").model
    layout = AttentionLayout(4, 2, 16, 0.25, 16, torch.float32)
    warmup = KernelWarmup(model, TorchAttentionBackend(layout, torch.device("cpu")), [1, 2, 4], [1, 2, 4], 16)
    assert warmup.plan.empty and warmup._future is None  # no Triton attention, no CUDA GEMMs: no process
    warmup.join()
    assert warmup.launches == 0 and warmup.seconds > 0


def test_the_warmup_process_runs_the_plan() -> None:
    """The plan crosses to a worker process (attention under Triton's interpreter on a CPU): as many launches
    as the in-process run makes, and the process is gone after join."""
    model = load_model("tiny-llama", device="cpu", dtype="fp32", load_format="dummy").model
    layout = AttentionLayout(8, 2, 32, 32 ** -0.5, 16, torch.float32)
    backend = TritonAttentionBackend(layout, DEVICE)
    sizes = [1, 2, 8]
    warmup = KernelWarmup(model, backend, sizes, sizes, 16)
    assert warmup.plan.attention is TritonAttentionBackend and warmup._future is not None
    warmup.join()
    decode_kernels = len({backend.decode_kernel_key(n) for n in sizes})
    expected = decode_kernels + 1 + run_gemms(gemm_shapes(model), sizes) + STEP_KERNELS
    assert warmup.launches == expected
    processes = warmup._pool.processes
    assert len(processes) == 1 and processes[0].exitcode == 0  # it ran there and exited once told to


def test_a_tensor_parallel_worker_warms_up_on_a_thread(monkeypatch) -> None:
    """In a rank that rank 0 started, the plan runs on a thread (docs/startup.md says why)."""
    from concurrent.futures import ThreadPoolExecutor

    from kiln.runtime.tp_processes import RANK0_PID_ENV

    monkeypatch.setenv(RANK0_PID_ENV, "1")
    model = load_model("tiny-llama", device="cpu", dtype="fp32", load_format="dummy").model
    backend = TritonAttentionBackend(AttentionLayout(8, 2, 32, 32 ** -0.5, 16, torch.float32), DEVICE)
    warmup = KernelWarmup(model, backend, [1, 2, 8], [1, 2, 8], 16)
    assert isinstance(warmup._pool, ThreadPoolExecutor)
    warmup.join()
    assert warmup.launches == len({backend.decode_kernel_key(n) for n in (1, 2, 8)}) + 1 + STEP_KERNELS


@pytest.mark.parametrize("in_graph", [False, True])
def test_the_step_kernels_compile(monkeypatch, in_graph: bool) -> None:
    """The inputs' unpacking with and without pending tokens, its form that reads the header where FULL graphs
    begin with it, then the argmax, once each (the interpreter on the CPU)."""
    from kiln.runtime import input_upload

    monkeypatch.setattr(input_upload, "IN_GRAPH", in_graph)
    assert run_step_kernels(DEVICE, torch.float32) == 3 + in_graph
