"""The P2P all-reduce (kiln/models/allreduce.py) and allreduce_rmsnorm on 2 GPUs.

Op level: every kind (one-shot, two-shot, NCCL) gives NCCL's sum, eagerly and replayed from a CUDA graph
(twice, with new inputs copied in between: the buffers are reused safely); the fused op equals the
all-reduce followed by the reference add + norm, and so does its one-kernel form (kiln/models/p2p_norm.py)
over chains of dependent calls with torch's one-shot kernel between them, eagerly and from a graph.
Model level: TP=2 with the pass, graphs on, gives TP=1's greedy tokens.
"""

from __future__ import annotations

import os
import socket
import traceback

import pytest
import torch
import torch.multiprocessing as tmp

from kiln import Runtime, SamplingParams
from tests.conftest import random_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 NVIDIA GPUs")]

os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join(rank: int, port: int) -> tuple[torch.device, str]:
    """This rank's GPU and the NCCL group of two it joined: (device, the group's name)."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=device)
    return device, dist.group.WORLD.group_name


def _rank(rank: int, port: int, results: dict) -> None:
    import torch.distributed as dist

    from kiln.models.allreduce import AllReducePolicy, P2PAllReduce, nccl_all_reduce
    from kiln.passes.ops import all_reduce_add_rms_norm, rms_norm_ref

    try:
        device, name = _join(rank, port)
        comm = P2PAllReduce(dist.group.WORLD, AllReducePolicy("one_shot", 1 << 20, 1 << 20, 1 << 20), device)
        for dtype in (torch.bfloat16, torch.float32):
            for numel in (8, 4096, 64 * 4096, 256 * 1024):
                if numel * dtype.itemsize > 1 << 20:
                    continue
                x = torch.randn(numel, device=device, dtype=dtype) * (rank + 1)
                for kind in ("one_shot", "two_shot", "nccl"):
                    torch.testing.assert_close(comm.run(x, kind), nccl_all_reduce(x, name), atol=0, rtol=0)
                    static = x.clone()
                    stream = torch.cuda.Stream()
                    stream.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(stream):
                        comm.run(static, kind)
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, stream=stream):
                        out = comm.run(static, kind)
                    for _ in range(2):
                        static.copy_(torch.randn_like(static))
                        graph.replay()
                        torch.testing.assert_close(out, nccl_all_reduce(static, name), atol=0, rtol=0)
        partial = torch.randn(8, 4096, device=device, dtype=torch.bfloat16)
        residual = torch.randn(8, 4096, device=device, dtype=torch.bfloat16)
        weight = torch.rand(4096, device=device, dtype=torch.bfloat16) + 0.5
        from kiln.models import allreduce

        allreduce.setup_p2p_all_reduce(dist.group.WORLD, device)
        normed, summed = all_reduce_add_rms_norm(partial, residual, weight, 1e-5, name)
        expected_sum = nccl_all_reduce(partial, name) + residual
        torch.testing.assert_close(summed, expected_sum, atol=0, rtol=0)
        torch.testing.assert_close(normed, rms_norm_ref(expected_sum, weight, 1e-5), atol=2e-2, rtol=2e-2)
        _check_fused_kernel(comm, name, device)
        results[rank] = "ok"
    except Exception:  # noqa: BLE001 - reported to the parent
        results[rank] = traceback.format_exc()
    os._exit(0)


def _fused_chain(comm, xs: list[torch.Tensor], start: torch.Tensor,
                 weight: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """20 dependent fused calls (each reuses the buffer rows and flags of the one before), torch's one-shot
    kernel (which shares the signal pad) between them."""
    outs, h = [], start
    for i in range(20):
        fused = comm.add_rms_norm(xs[i % 3], h, weight, 1e-5)
        assert fused is not None, tuple(start.shape)
        comm.run(xs[(i + 1) % 3], "one_shot")
        outs.append(fused)
        h = fused[1]
    return outs


def _check_chain(outs: list[tuple[torch.Tensor, torch.Tensor]], xs: list[torch.Tensor], start: torch.Tensor,
                 weight: torch.Tensor, name: str) -> None:
    from kiln.models.allreduce import nccl_all_reduce
    from kiln.passes.ops import rms_norm_ref

    h = start
    for i, (normed, summed) in enumerate(outs):
        h = nccl_all_reduce(xs[i % 3], name) + h
        torch.testing.assert_close(summed, h, atol=0, rtol=0)
        torch.testing.assert_close(normed, rms_norm_ref(h, weight, 1e-5), atol=2e-2, rtol=2e-2)


def _check_fused_kernel(comm, name: str, device: torch.device) -> None:
    """The one-kernel all-reduce + add + norm (kiln/models/p2p_norm.py), eagerly and replayed from a CUDA
    graph with new inputs: sums exact, norms as the reference's."""
    for rows, n in ((1, 8192), (8, 4096), (32, 4096), (64, 4096), (64, 8192)):  # up to 1 MB, the bound given
        xs = [torch.randn(rows, n, device=device, dtype=torch.bfloat16) for _ in range(3)]
        start = torch.randn(rows, n, device=device, dtype=torch.bfloat16)
        weight = torch.rand(n, device=device, dtype=torch.bfloat16) + 0.5
        _check_chain(_fused_chain(comm, xs, start, weight), xs, start, weight, name)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            _fused_chain(comm, xs, start, weight)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            outs = _fused_chain(comm, xs, start, weight)
        for _ in range(2):
            for x in xs:
                x.copy_(torch.randn_like(x))
            graph.replay()
            torch.cuda.synchronize()
            _check_chain(outs, xs, start, weight, name)


def _flashinfer_rank(rank: int, port: int, results: dict) -> None:
    """FlashInfer's all-reduce + add + norm (kiln/models/flashinfer_norm.py) over chains of dependent calls,
    eagerly and replayed from a CUDA graph with new inputs: sums and norms as the reference's to bf16 rounding
    (it sums in fp32 and rounds once), and the same bits on both ranks."""
    import torch.distributed as dist

    from kiln.models.allreduce import AllReducePolicy, flashinfer_norm, nccl_all_reduce
    from kiln.passes.ops import rms_norm_ref

    try:
        device, name = _join(rank, port)
        norm = flashinfer_norm(dist.group.WORLD, AllReducePolicy(fused_norm_kernel="flashinfer"), device)
        assert norm is not None

        def chain(xs, start, weight):
            outs, h = [], start
            for i in range(20):
                fused = norm(xs[i % 3], h, weight, 1e-5)
                assert fused is not None, tuple(start.shape)
                outs.append((h, *fused))
                h = fused[1]
            return outs

        def check(outs, xs, weight):
            for i, (h, normed, summed) in enumerate(outs):
                expected = (nccl_all_reduce(xs[i % 3].float(), name) + h.float()).to(summed.dtype)
                torch.testing.assert_close(summed, expected, atol=2e-2, rtol=2e-2)
                torch.testing.assert_close(normed, rms_norm_ref(summed, weight, 1e-5), atol=3e-2, rtol=3e-2)
                both = [torch.empty_like(summed) for _ in range(2)]
                dist.all_gather(both, summed)
                assert torch.equal(both[0], both[1])

        for rows, n in ((1, 8192), (8, 4096), (64, 4096), (64, 8192)):
            xs = [torch.randn(rows, n, device=device, dtype=torch.bfloat16) for _ in range(3)]
            start = torch.randn(rows, n, device=device, dtype=torch.bfloat16)
            weight = torch.rand(n, device=device, dtype=torch.bfloat16) + 0.5
            check(chain(xs, start, weight), xs, weight)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                chain(xs, start, weight)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                outs = chain(xs, start, weight)
            for _ in range(2):
                for x in xs:
                    x.copy_(torch.randn_like(x))
                graph.replay()
                torch.cuda.synchronize()
                check(outs, xs, weight)
        results[rank] = "ok"
    except Exception:  # noqa: BLE001 - reported to the parent
        results[rank] = traceback.format_exc()
    os._exit(0)


def test_flashinfer_all_reduce_add_norm_eager_and_in_graphs() -> None:
    pytest.importorskip("flashinfer.comm")
    with tmp.Manager() as mgr:
        results = mgr.dict()
        tmp.spawn(_flashinfer_rank, args=(_free_port(), results), nprocs=2)
        assert dict(results) == {0: "ok", 1: "ok"}


def test_p2p_all_reduce_equals_nccl_eager_and_in_graphs() -> None:
    with tmp.Manager() as mgr:
        results = mgr.dict()
        tmp.spawn(_rank, args=(_free_port(), results), nprocs=2)
        assert dict(results) == {0: "ok", 1: "ok"}


PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = random_prompts([5, 17, 40, 3, 26, 64, 1, 9], 256, seed=21)
COMMON = dict(device="cuda", dtype="fp32", kv_cache_bytes=64 << 20, max_num_batched_tokens=64)


@pytest.mark.slow
def test_tp2_with_p2p_all_reduce_and_the_pass_matches_tp1(monkeypatch: pytest.MonkeyPatch) -> None:
    reference = [o.outputs[0].token_ids for o in Runtime("tiny-qwen3", level=0, **COMMON).generate(PROMPTS, PARAMS)]
    runtime = Runtime("tiny-qwen3", level=2, compile_sizes=(), cudagraph_capture_sizes=(1, 2, 4, 8),
                      tensor_parallel_size=2, passes=("allreduce_rmsnorm",), **COMMON)
    try:
        assert [o.outputs[0].token_ids for o in runtime.generate(PROMPTS, PARAMS)] == reference
    finally:
        runtime.engine.shutdown()
