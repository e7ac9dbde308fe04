"""`kiln::attention`: the one op through which every attention layer runs, and the graph split point.

The op writes this step's keys/values into the paged cache and attends over it. It is opaque to Dynamo
(a fake implementation describes it), so the compiler can cut the FX graph at every call.
"""

from __future__ import annotations

import torch

from kiln.models.forward_context import get_forward_context
from kiln.models.kv_quant import quantize_kv

OP_NAME = "kiln::attention"


@torch.library.custom_op(OP_NAME, mutates_args=("out",))
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer_idx: int) -> None:
    """q/out: [T, num_heads, head_dim]; k/v: [T, num_kv_heads, head_dim]. Writes `out` in place."""
    get_forward_context().attention(layer_idx, q, k, v, out)


@attention.register_fake
def _attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    layer_idx: int) -> None:
    return None


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Scatter k/v [T, Hkv, D] into one layer's paged cache [num_blocks, 2, block_size, Hkv, D] at
    slot_mapping[:T] (padded tokens land in the null block), quantized with the layer's scales when the
    cache is fp8 (kiln/models/kv_quant.py). The reference write: the torch backend and the fused ops'
    fallback use it, the GPU backends and kernels have their own."""
    block_size = kv_cache.shape[2]
    slots = slot_mapping[: k.shape[0]]
    block, offset = slots // block_size, slots % block_size
    kv_cache[block, 0, offset] = quantize_kv(k, k_scale, kv_cache.dtype)
    kv_cache[block, 1, offset] = quantize_kv(v, v_scale, kv_cache.dtype)


# Other ops that, like attention, run between compiled pieces: fused variants that kiln/passes rewrites
# attention calls to (they need this step's paged cache, so they cannot live inside a compiled piece).
_SPLIT_OPS: list[torch._ops.OpOverloadPacket] = []


def register_split_op(op: torch._ops.OpOverloadPacket) -> None:
    if op not in _SPLIT_OPS:
        _SPLIT_OPS.append(op)


def is_attention_node_target(target: object) -> bool:
    """True for the op as it appears in an FX graph (the packet or its `.default` overload), or a variant
    registered with `register_split_op`."""
    return any(target is op or target is op.default for op in (torch.ops.kiln.attention, *_SPLIT_OPS))
