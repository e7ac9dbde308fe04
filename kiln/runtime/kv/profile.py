"""One forward at the full token budget, to measure the activation peak."""

from __future__ import annotations

import math
from itertools import accumulate

import torch

from kiln.attention.base import AttentionLayout, CommonAttentionMetadata
from kiln.attention.torch_backend import TorchAttentionBackend
from kiln.models.forward_context import AttentionFn, ForwardContext, set_forward_context


def profiling_batch(num_tokens: int, max_model_len: int) -> tuple[list[int], torch.Tensor]:
    """Sequence lengths and positions of the profiling batch: the token budget split into sequences of at most
    max_model_len tokens, since a model whose context is shorter than the budget has no rotary (or learned)
    position beyond it, and a real step never asks for one either."""
    lens = [max_model_len] * (num_tokens // max_model_len)
    if num_tokens % max_model_len:
        lens.append(num_tokens % max_model_len)
    return lens, torch.cat([torch.arange(n) for n in lens])


def _reference_attention(layout: AttentionLayout, device: torch.device, lens: list[int]) -> AttentionFn:
    """The torch backend's attention over a throwaway paged cache, each sequence in blocks of its own."""
    block_size = layout.block_size
    blocks_per_seq = [math.ceil(n / block_size) for n in lens]
    num_blocks = sum(blocks_per_seq) + 1  # + the null block
    cache = torch.zeros(num_blocks, 2, block_size, layout.num_kv_heads, layout.head_dim, dtype=layout.dtype,
                        device=device)
    backend = TorchAttentionBackend(layout, device)
    qsl = torch.tensor([0, *accumulate(lens)], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    tables = torch.zeros(len(lens), max(blocks_per_seq), dtype=torch.int32)
    slots, first = [], 1  # each sequence owns consecutive blocks after the null block
    for i, (n, b) in enumerate(zip(lens, blocks_per_seq)):
        tables[i, :b] = torch.arange(first, first + b)
        slots.append(torch.arange(n) + first * block_size)
        first += b
    metadata = CommonAttentionMetadata(
        num_reqs=len(lens), num_tokens=sum(lens), query_start_loc=qsl.to(device), seq_lens=seq_lens.to(device),
        block_tables=tables.to(device), slot_mapping=torch.cat(slots).to(device),
        query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens, max_query_len=max(lens), max_seq_len=max(lens),
        uniform_decode=False)
    planned = backend.build_metadata(metadata)
    return lambda layer, q, k, v, out: backend.forward(q, k, v, out, cache, planned)


def _zero_attention(layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                    out: torch.Tensor) -> None:
    out.zero_()


@torch.inference_mode()
def profile_activation_peak(model: torch.nn.Module, device: torch.device, num_tokens: int,
                            layout: AttentionLayout, max_model_len: int, run_attention: bool = False) -> int:
    """`layout`: this rank's attention heads (a tensor-parallel rank holds a share of them). Returns the peak
    of CUDA memory the forward allocated beyond what was in use (0 on other devices, which only run it).

    `run_attention`: whether the engine's backend materializes a prefill's scores (the torch reference's math
    path: `AttentionBackend.materializes_scores`), so the profile runs that attention. Otherwise attention writes
    zeros, since the GPU kernels allocate nothing beyond their output, and the peak is the rest of the forward:
    the torch reference's scores at an 8192-token prefill had taken the KV cache's room (docs/startup.md)."""
    on_gpu = device.type == "cuda"
    lens, positions = profiling_batch(num_tokens, max_model_len)
    attention = _reference_attention(layout, device, lens) if run_attention else _zero_attention
    context = ForwardContext(attention=attention, num_tokens=num_tokens)
    if on_gpu:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    with set_forward_context(context):
        hidden = model(ids, positions.to(device))
        model.compute_logits(hidden[-min(num_tokens, 256):])
    if not on_gpu:
        return 0
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    return int(peak)
