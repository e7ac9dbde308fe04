"""One forward at the full token budget with a throwaway KV cache, to measure the activation peak."""

from __future__ import annotations

import math

import torch

from kiln.models.forward_context import ForwardContext, set_forward_context
from kiln.runtime.attention.base import AttentionLayout, CommonAttentionMetadata
from kiln.runtime.attention.torch_backend import TorchAttentionBackend


@torch.inference_mode()
def profile_activation_peak(model: torch.nn.Module, device: torch.device, num_tokens: int,
                            layout: AttentionLayout) -> int:
    """`layout`: this rank's attention heads (a tensor-parallel rank holds a share of them)."""
    block_size = layout.block_size
    num_blocks = math.ceil(num_tokens / block_size) + 1
    cache = torch.zeros(num_blocks, 2, block_size, layout.num_kv_heads, layout.head_dim, dtype=layout.dtype,
                        device=device)
    backend = TorchAttentionBackend(layout, device)
    i32 = dict(dtype=torch.int32, device=device)
    qsl = torch.tensor([0, num_tokens], dtype=torch.int32)
    lens = torch.tensor([num_tokens], dtype=torch.int32)
    metadata = CommonAttentionMetadata(
        num_reqs=1, num_tokens=num_tokens, query_start_loc=qsl.to(device), seq_lens=lens.to(device),
        block_tables=torch.arange(1, num_blocks, **i32).unsqueeze(0),
        slot_mapping=torch.arange(block_size, block_size + num_tokens, device=device),
        query_start_loc_cpu=qsl, seq_lens_cpu=lens, max_query_len=num_tokens, max_seq_len=num_tokens,
        uniform_decode=False)
    planned = backend.build_metadata(metadata)
    context = ForwardContext(attention=lambda i, q, k, v, out: backend.forward(q, k, v, out, cache, planned),
                             metadata=metadata, num_tokens=num_tokens)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    with set_forward_context(context):
        hidden = model(ids, torch.arange(num_tokens, device=device))
        model.compute_logits(hidden[-min(num_tokens, 256):])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    return int(peak)
