"""Building blocks shared by every model: tensor-parallel linears, embedding/LM head, RMSNorm, RoPE.

Linear layers are written tensor-parallel from the start (world size 1 by default): each module has a
`weight_loader` that takes the full checkpoint tensor and keeps this rank's shard, so sharding a model
later changes configuration, not model code.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kiln.models.parallel import all_reduce, tp_rank, tp_size


def _shard(tensor: torch.Tensor, dim: int, size: int, rank: int) -> torch.Tensor:
    return tensor.narrow(dim, rank * size, size)


def _copy_checked(param: torch.Tensor, loaded: torch.Tensor, name: str = "") -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"weight {name or ''} has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(loaded)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    _copy_checked(param, loaded)


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+ b), W split along the output dim; the output stays sharded."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        if out_features % tp_size():
            raise ValueError(f"output size {out_features} is not divisible by tensor parallel size {tp_size()}")
        self.out_per_rank = out_features // tp_size()
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features), requires_grad=False)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_per_rank), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        _copy_checked(param, _shard(loaded, 0, self.out_per_rank, tp_rank()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections in one matmul (qkv, gate_up); each checkpoint shard is
    loaded into its slice by name."""

    def __init__(self, in_features: int, output_sizes: Sequence[int], shard_names: Sequence[str],
                 bias: bool = False) -> None:
        super().__init__(in_features, sum(output_sizes), bias)
        self.output_sizes = [s // tp_size() for s in output_sizes]
        self.offsets = dict(zip(shard_names, [sum(self.output_sizes[:i]) for i in range(len(output_sizes))]))
        self.sizes = dict(zip(shard_names, self.output_sizes))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
        if shard is None:
            raise ValueError("a merged projection loads one named shard at a time")
        size = self.sizes[shard]
        _copy_checked(param.data.narrow(0, self.offsets[shard], size), _shard(loaded, 0, size, tp_rank()), shard)


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k, v projections merged; KV heads are split across ranks, or replicated when there are fewer
    KV heads than ranks."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool) -> None:
        world = tp_size()
        if num_heads % world:
            raise ValueError(f"num_attention_heads {num_heads} is not divisible by tensor parallel size {world}")
        self.kv_replicas = max(1, world // num_kv_heads)
        kv_total = max(num_kv_heads, world)  # replicated KV heads count once per rank
        super().__init__(hidden, [num_heads * head_dim, kv_total * head_dim, kv_total * head_dim],
                         ["q", "k", "v"], bias)
        self.num_kv_heads = num_kv_heads

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
        if shard in ("k", "v") and self.kv_replicas > 1:
            size = self.sizes[shard]
            start = (tp_rank() // self.kv_replicas) * size
            _copy_checked(param.data.narrow(0, self.offsets[shard], size), loaded.narrow(0, start, size), shard)
            return
        super().weight_loader(param, loaded, shard)


class RowParallelLinear(nn.Module):
    """y = x W^T, W split along the input dim; partial outputs are summed across ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        if in_features % tp_size():
            raise ValueError(f"input size {in_features} is not divisible by tensor parallel size {tp_size()}")
        self.in_per_rank = in_features // tp_size()
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank), requires_grad=False)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if param is self.bias:  # the bias is added once, after the reduction: not sharded
            _copy_checked(param, loaded)
            return
        _copy_checked(param, _shard(loaded, 1, self.in_per_rank, tp_rank()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding split along the vocabulary; each rank looks up its range and the results are summed."""

    def __init__(self, vocab_size: int, hidden: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.per_rank = math.ceil(vocab_size / tp_size())
        self.start = tp_rank() * self.per_rank
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        rows = loaded[self.start:self.start + self.per_rank]
        param.data[: rows.shape[0]].copy_(rows)
        param.data[rows.shape[0]:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(out.masked_fill(outside.unsqueeze(-1), 0))


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection; shares its weight with the embedding when the model ties them."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        if tp_size() > 1:
            from kiln.models.parallel import all_gather_last_dim

            logits = all_gather_last_dim(logits)
        return logits[..., : self.vocab_size]


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With a residual: returns (norm(x + residual), x + residual), the fusable pair."""
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    is_mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(is_mid, mid, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE over a cos/sin cache computed once and shared by every layer."""

    def __init__(self, head_dim: int, max_positions: int, base: float, scaling: dict | None = None) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.base, self.scaling = head_dim, max_positions, base, scaling
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if rope_type not in ("default", "linear", "llama3", None):
            raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: default, linear, llama3)")
        self.rope_type = rope_type
        self.register_buffer("cos_sin_cache", torch.empty(max_positions, head_dim, dtype=torch.float32),
                             persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """(Re)compute the cache; the loader calls this after materialising a meta-device model."""
        if self.cos_sin_cache.is_meta:
            return
        # fp32 throughout, as transformers does, so fp32 logits match it as closely as possible
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim))
        if self.rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, self.scaling)
        elif self.rope_type == "linear":
            inv_freq = inv_freq / self.scaling["factor"]
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32), inv_freq)
        cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        self.cos_sin_cache.copy_(cache.to(self.cos_sin_cache.device))

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, H, D], k: [T, Hkv, D] -> rotated copies."""
        cos, sin = self.cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
