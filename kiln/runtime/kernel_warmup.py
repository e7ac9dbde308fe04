"""Triton compiles of kiln's own kernels in a process of their own, during the compile phase of a start.

Graph capture runs every capture size once, and the first run of each of kiln's Triton kernels at a new
specialization compiles it (the small-M GEMM of `kiln::dense_gemm` per projection shape and M, and its epilogue
variants where a pass asks for them, the decode attention per split count, the varlen attention, a mixture of
experts' `kiln::fused_moe` kernels per launch config): on a cold 8B start on the H200 they made the capture phase
15.6 s instead of ~3 s. Those kernels need no compiled model, so a process started with the compile phase runs
each once on zeros of the same shapes (a `WarmupPlan`), and Triton's on-disk cache hands the compiled kernels to
the serving process's first launches.

A process rather than a thread: Triton's compile holds the GIL through its Python front end and MLIR passes, and
as a thread (the first version) it slowed the main thread's Dynamo trace (8B: 8.0-12.6 s beside the thread,
5.1-5.5 s beside the process). The process is one of kiln's own (kiln/compiler/process_pool.py), which never
imports the user's main script. In a tensor-parallel rank that rank 0 started the plan runs on a thread (with a
process there, a GPU test once stalled: docs/startup.md). A warm start (its compile cache ready) starts none: the
start that filled the cache compiled these kernels into Triton's. The capture phase joins the warm-up first, so its GPU
memory is free before the KV cache is sized. Any failure is logged and left to the capture to meet again
(docs/startup.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from kiln.attention.base import AttentionBackend, AttentionLayout, CommonAttentionMetadata
from kiln.compiler.process_pool import WorkerPool
from kiln.models import dense_gemm
from kiln.models.layers import _ParallelLinear
from kiln.models.moe import SparseMoeBlock
from kiln.runtime.tp_processes import in_local_worker

logger = logging.getLogger("kiln")


def gemm_shapes(model: torch.nn.Module) -> list[torch.Tensor]:
    """One weight per distinct (N, K, dtype) among the projections that go through `kiln::dense_gemm`, a mixture
    of experts' routers among them (kiln/models/fused_moe/routing.py)."""
    seen: dict[tuple, torch.Tensor] = {}
    for module in model.modules():
        weight = module.gate.weight if isinstance(module, SparseMoeBlock) else getattr(module, "weight", None)
        if isinstance(module, (_ParallelLinear, SparseMoeBlock)) and isinstance(weight, torch.Tensor) \
                and weight.dim() == 2:
            seen.setdefault((*weight.shape, weight.dtype), weight)
    return list(seen.values())


def _served(weight: torch.Tensor) -> bool:
    """Whether `kiln::dense_gemm` runs its Triton kernel for this projection (its activations share the weight's
    device and dtype)."""
    return dense_gemm.applies(weight, None)


def run_gemms(weights: Iterable[torch.Tensor], sizes: Iterable[int]) -> int:
    """Each weight at each M the small-M kernel serves; -> launches."""
    from kiln.models.quant.fp8_kernel import bf16_gemm_triton  # triton: imported where a GPU start needs it

    launches = 0
    for weight in weights:
        if not _served(weight):
            continue
        for m in sizes:
            if 0 < m <= dense_gemm.TRITON_MAX_M:
                bf16_gemm_triton(weight.new_zeros(m, weight.shape[1]), weight)
                launches += 1
    return launches


# (pass, weight rows, K, dtype, heads, KV heads, head_dim): a GEMM that a pass hands an epilogue
# (kiln/models/gemm_epilogues.py); heads are 0 but for qkv_rope; for rmsnorm_gemm (kiln/models/gemv.py) the three
# are (the splits of the partials it reads, the matrix-vector kernel's mode, 0)
EpilogueShape = tuple[str, int, int, torch.dtype, int, int, int]


def epilogue_shapes(model: torch.nn.Module, passes: Iterable[str]) -> list[EpilogueShape]:
    """The distinct GEMMs the enabled epilogue passes (gate_up_silu_mul, qkv_rope, gemm_add_rmsnorm, rmsnorm_gemm)
    will run kernels for."""
    from kiln.models.llama import MLP, Attention

    passes, seen = set(passes), {}
    behind: torch.Tensor | None = None  # the last projection into the residual stream, whose norm the next GEMM reads
    if "rmsnorm_gemm" in passes:
        from kiln.models import gemv  # triton: imported where the pass is on (on a GPU)
    for module in model.modules():
        if isinstance(module, (MLP, Attention, SparseMoeBlock)) and "rmsnorm_gemm" in passes:
            mlp, moe = isinstance(module, MLP), isinstance(module, SparseMoeBlock)
            # the GEMM after the norm: the router's sums (into its top-k), the gate_up's SiLU-mul or the qkv
            first = module.gate.weight if moe else module.gate_up_proj.weight if mlp else module.qkv_proj.weight
            mode = gemv.PARTIALS if moe else gemv.SILU_MUL if mlp else gemv.OUT
            if behind is not None and _served(behind) and _served(first) and _gemv_takes(first):
                seen[("rmsnorm_gemm", *first.shape, first.dtype, _splits(behind), mode, 0)] = None
            behind = None if moe else module.down_proj.weight if mlp else module.o_proj.weight
        if isinstance(module, (MLP, Attention)) and "gemm_add_rmsnorm" in passes:
            weight = module.down_proj.weight if isinstance(module, MLP) else module.o_proj.weight
            if _served(weight):
                seen[("gemm_add_rmsnorm", *weight.shape, weight.dtype, 0, 0, 0)] = None
        if isinstance(module, MLP) and "gate_up_silu_mul" in passes and _served(module.gate_up_proj.weight):
            weight = module.gate_up_proj.weight
            seen[("gate_up_silu_mul", *weight.shape, weight.dtype, 0, 0, 0)] = None
        elif isinstance(module, Attention) and "qkv_rope" in passes and module.q_norm is None \
                and _served(module.qkv_proj.weight) and getattr(module.qkv_proj, "bias", None) is None:
            weight = module.qkv_proj.weight
            seen[("qkv_rope", *weight.shape, weight.dtype, module.num_heads, module.num_kv_heads,
                  module.head_dim)] = None
    return list(seen)


def _gemv_takes(weight: torch.Tensor, m: int = 1) -> bool:
    from kiln.models import gemv

    return gemv.applies(m, weight.shape[0], weight.shape[1], weight.element_size())


def _splits(weight: torch.Tensor) -> int:
    """How many fp32 partials the small-M GEMM of `weight` writes at one token (kiln/models/quant/fp8_kernel.py)."""
    from kiln.models import gemv_stream
    from kiln.models.quant.fp8_kernel import num_sms, pick_config, split_k

    if _gemv_takes(weight) or gemv_stream.applies(1, weight.element_size(), weight.device):
        return 1
    config = pick_config(1, weight.shape[0], weight.shape[1], num_sms(weight.device), weight.element_size())
    return split_k(weight.shape[1], config, config.split_k)[0]


def run_epilogues(shapes: Iterable[EpilogueShape], sizes: Iterable[int], device: torch.device) -> int:
    """Each epilogue GEMM at each M its kernel serves, on zeros. -> launches."""
    from kiln.models.gemm_epilogues import gate_up_silu_mul_triton, gemm_add_rms_norm_triton, qkv_rope_triton

    launches = 0
    for name, n, k, dtype, heads, kv_heads, head_dim in shapes:
        weight = torch.zeros(n, k, dtype=dtype, device=device)
        for m in sizes:
            if not 0 < m <= dense_gemm.TRITON_MAX_M:
                continue
            x = torch.zeros(m, k, dtype=dtype, device=device)
            if name == "gate_up_silu_mul":
                gate_up_silu_mul_triton(x, weight)
            elif name == "gemm_add_rmsnorm":
                gemm_add_rms_norm_triton(x, weight, x.new_zeros(m, n), x.new_ones(n), 1e-6)
            elif name == "rmsnorm_gemm":
                from kiln.models import gemv

                if not _gemv_takes(weight, m):  # the op runs gemm_add_rmsnorm's kernels and the next GEMM's there
                    continue
                gemv.gemv_after_norm(torch.zeros(heads, m, k, device=device), x, x.new_ones(k), 1e-6, weight, kv_heads)
            else:
                qkv_rope_triton(x, weight, torch.zeros(m, dtype=torch.int64, device=device),
                                torch.zeros(2, head_dim, device=device), heads, kv_heads)
            launches += 1
    return launches


# (experts on this rank, intermediate per rank, hidden, top_k, weight dtype, activation dtype, FP8 scales,
#  the router's experts (all of them), renormalised routing weights)
MoeShape = tuple[int, int, int, int, torch.dtype, torch.dtype, bool, int, bool]


def moe_shapes(model: torch.nn.Module) -> list[MoeShape]:
    """The distinct expert layers that run `kiln::fused_moe`'s Triton kernels (CUDA weights)."""
    seen: dict[MoeShape, None] = {}
    for module in model.modules():
        if isinstance(module, SparseMoeBlock) and module.w13_weight.is_cuda:
            w13 = module.w13_weight
            seen[(w13.shape[0], module.inter, w13.shape[2], module.top_k, w13.dtype, module.gate.weight.dtype,
                  module.w13_scale is not None, module.num_experts, module.norm_topk_prob)] = None
    return list(seen)


def run_moe(shapes: Iterable[MoeShape], sizes: Iterable[int], device: torch.device) -> int:
    """Each expert layer at each token count, on zeros (every token on expert 0: the kernels and launch configs
    compile the same whatever the routing). -> launches."""
    from kiln.models.fused_moe.kernels import fused_moe_triton  # triton: imported where a GPU start needs it
    from kiln.models.fused_moe.routing_triton import moe_route_triton, moe_topk_triton

    launches = 0
    for experts, inter, hidden, top_k, dtype, act_dtype, scaled, router_experts, renormalize in shapes:
        moe_topk_triton(torch.zeros(1, router_experts, dtype=act_dtype, device=device), top_k, renormalize)
        x = torch.zeros(1, hidden, dtype=act_dtype, device=device)
        if dense_gemm.applies(x, None):  # decode sizes route as kiln::moe_route does: the GEMM's sums into the top-k
            moe_route_triton(x, torch.zeros(router_experts, hidden, dtype=act_dtype, device=device), top_k, renormalize)
        w13 = torch.zeros(experts, 2 * inter, hidden, dtype=dtype, device=device)
        w2 = torch.zeros(experts, hidden, inter, dtype=dtype, device=device)
        scales = (torch.ones(experts, 2 * inter, device=device), torch.ones(experts, hidden, device=device)) \
            if scaled else (None, None)
        for m in sizes:
            x = torch.zeros(m, hidden, dtype=act_dtype, device=device)
            ids = torch.zeros(m, top_k, dtype=torch.int32, device=device)
            fused_moe_triton(x, w13, w2, torch.zeros(m, top_k, device=device), ids, *scales,
                             remote_experts=experts != router_experts)  # expert parallel: the kernels' masked form
            launches += 1
    return launches


def run_attention(backend: Any, decode_sizes: Iterable[int], block_table_width: int) -> int:
    """A throwaway backend of the runner's backend's class and layout (workspaces of its own), on a cache of
    its own: a uniform decode batch per distinct split count and tile of `decode_sizes`, and one prefill chunk;
    block tables as wide as the runner's (their stride is a kernel argument Triton specializes on). -> launches."""
    layout, device = backend.layout, backend.device
    fresh = type(backend)(layout, device)
    cache = torch.zeros(2, 2, layout.block_size, layout.num_kv_heads, layout.head_dim, dtype=layout.cache_dtype,
                        device=device)
    by_kernel: dict[tuple[int, int], int] = {}
    for n in sorted(set(decode_sizes)):
        by_kernel.setdefault(fresh.decode_kernel_key(n), n)
    launches = 0
    for num_reqs, num_tokens in [(n, n) for n in by_kernel.values()] + [(1, 32)]:
        lens = [num_tokens // num_reqs] * num_reqs
        qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        common = CommonAttentionMetadata(
            num_reqs=num_reqs, num_tokens=num_tokens, query_start_loc=qsl.to(device), seq_lens=seq_lens.to(device),
            block_tables=torch.zeros(num_reqs, block_table_width, dtype=torch.int32, device=device),
            slot_mapping=torch.zeros(num_tokens, dtype=torch.int64, device=device), query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens, max_query_len=max(lens), max_seq_len=max(lens),
            uniform_decode=num_reqs == num_tokens)
        q = torch.zeros(num_tokens, layout.num_heads, layout.head_dim, dtype=layout.dtype, device=device)
        k = torch.zeros(num_tokens, layout.num_kv_heads, layout.head_dim, dtype=layout.dtype, device=device)
        fresh.forward(q, k, torch.zeros_like(k), torch.empty_like(q), cache, fresh.build_metadata(common))
        launches += 1
    return launches


def run_step_kernels(device: torch.device, logits_dtype: torch.dtype) -> int:
    """The kernels a step runs around the model: the inputs' unpacking, with and without pending tokens, and the
    greedy rows' argmax (one compiled kernel for every vocabulary up to 256K). -> launches."""
    from kiln.models.greedy_argmax_triton import row_max_triton
    from kiln.runtime.input_upload import HEADER, IN_GRAPH, ORDER, Counts, device_dtype
    from kiln.runtime.input_upload_triton import unpack_from_header, unpack_triton

    arrays = {name: torch.zeros(4, dtype=device_dtype(name), device=device) for name in ORDER}
    arrays["block_tables"] = torch.zeros(2, 4, dtype=device_dtype("block_tables"), device=device)
    counts = Counts(tokens=1, reqs=1, logits=1, width=1)
    staged = torch.zeros(HEADER + counts.total, dtype=torch.int32, device=device)
    for sampled in (None, torch.zeros(1, dtype=torch.int64, device=device)):
        unpack_triton(staged, arrays, counts, sampled)
    if IN_GRAPH:  # the header's zeros: no ints to write
        unpack_from_header(staged, arrays, counts.total)
    row_max_triton(torch.zeros(1, 8, dtype=logits_dtype, device=device))
    return 3 + IN_GRAPH


@dataclass(frozen=True)
class WarmupPlan:
    """What the warm-up process runs: plain shapes and types, so it pickles without the model."""

    gemms: tuple[tuple[int, int, torch.dtype], ...]  # (N, K, dtype) of each distinct projection weight
    sizes: tuple[int, ...]  # the M values the GEMMs run at
    attention: type[AttentionBackend] | None  # the Triton backend's class, None when another backend serves
    layout: AttentionLayout
    decode_sizes: tuple[int, ...]
    block_table_width: int
    device: str
    moe: tuple[MoeShape, ...] = ()  # expert layers, run at `sizes` tokens
    epilogues: tuple[EpilogueShape, ...] = ()  # GEMMs with an epilogue, run at `sizes` tokens
    step_kernels: bool = False  # on CUDA: the kernels a step runs around the model (run_step_kernels)

    @property
    def empty(self) -> bool:
        return (not self.gemms and self.attention is None and not self.moe and not self.epilogues
                and not self.step_kernels)


def run_plan(plan: WarmupPlan) -> int:
    """In the warm-up process: each kernel once, on zeros of the planned shapes (Triton writes what it compiles
    to its cache directory, where the serving process finds it). -> launches."""
    device = torch.device(plan.device)
    if device.type == "cuda" and device.index is not None:  # ("cuda" alone: the current device, as it is)
        torch.cuda.set_device(device)
    weights = [torch.zeros(n, k, dtype=dtype, device=device) for n, k, dtype in plan.gemms]
    with torch.inference_mode():
        launches = run_gemms(weights, plan.sizes) + run_moe(plan.moe, plan.sizes, device) \
            + run_epilogues(plan.epilogues, plan.sizes, device)
        if plan.attention is not None:
            launches += run_attention(plan.attention(plan.layout, device), plan.decode_sizes,
                                      plan.block_table_width)
        if plan.step_kernels:
            launches += run_step_kernels(device, plan.layout.dtype)
    return launches


class KernelWarmup:
    """The warm-up process, started by the constructor; `join()` waits for it (and says how long it ran)."""

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, sizes: Iterable[int],
                 decode_sizes: Iterable[int], block_table_width: int, passes: Iterable[str] = ()) -> None:
        self.launches = 0
        self.seconds = 0.0
        self._started = time.perf_counter()
        gemms = tuple((w.shape[0], w.shape[1], w.dtype) for w in gemm_shapes(model) if _served(w))
        self.plan = WarmupPlan(gemms, tuple(sorted(set(sizes))), type(backend) if backend.name == "triton" else None,
                               backend.layout, tuple(sorted(set(decode_sizes))), block_table_width,
                               str(backend.device), tuple(moe_shapes(model)), tuple(epilogue_shapes(model, passes)),
                               backend.device.type == "cuda")
        self._pool: WorkerPool | Executor | None = None
        self._future: Future[int] | None = None
        if self.plan.empty:
            return
        if in_local_worker():
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="kiln-kernel-warmup")
        else:
            # started now, before the compile phase points TRITON_CACHE_DIR at the compile cache: the child keeps
            # the directory the serving process's own launches will look in
            self._pool = WorkerPool(1, "kiln-kernel-warmup")
        self._future = self._pool.submit(run_plan, self.plan)

    def join(self) -> None:
        """Wait for the warm-up to end (a process's GPU memory is free before the KV cache is sized)."""
        if self._future is not None:
            try:
                self.launches = self._future.result()
            except Exception as exc:  # noqa: BLE001 - an optimisation: the capture compiles what is left
                logger.warning("kernel warm-up failed (%s: %s)", type(exc).__name__, exc)
            finally:
                self._pool.shutdown()
                self._future = None
        self.seconds = time.perf_counter() - self._started
        logger.info("kernel warm-up: %d launches in %.1f s beside the compile phase", self.launches, self.seconds)
