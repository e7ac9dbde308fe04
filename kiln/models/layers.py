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

from kiln.models import dense_gemm
from kiln.models.greedy_argmax import row_max
from kiln.models.parallel import all_reduce, tp_rank, tp_size
from kiln.models.quant.fp8 import FP8_DTYPE, Fp8Scheme, fp8_linear, quantize_weight


def _shard(tensor: torch.Tensor, dim: int, size: int, rank: int) -> torch.Tensor:
    return tensor.narrow(dim, rank * size, size)


def _copy_checked(param: torch.Tensor, loaded: torch.Tensor, name: str = "") -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"weight {name or ''} has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(loaded)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    _copy_checked(param, loaded)


class _ParallelLinear(nn.Module):
    """The weights of one (sharded) projection and their loading, shared by the column and row kinds.

    With `quant` set the weight is e4m3 with one fp32 `weight_scale` per output channel (plus a static
    `input_scale` when the checkpoint has one) and the forward runs kiln/models/quant/fp8.py's GEMM. A
    full-precision checkpoint tensor is quantized whole on arrival, before sharding, so every rank's scales
    are exactly those of the unsharded model (row-parallel: the amax spans the whole input dim).
    Subclasses say which rows/columns of a checkpoint tensor this rank keeps and where they go.
    """

    def _create(self, out_features: int, in_features: int, bias: bool, quant: Fp8Scheme | None) -> None:
        self.quant = quant
        dtype = FP8_DTYPE if quant is not None else None
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.weight_scale = self.input_scale = self.bias = None
        if quant is not None:
            self.weight_scale = nn.Parameter(torch.empty(out_features, dtype=torch.float32), requires_grad=False)
            if quant.static_input:
                self.input_scale = nn.Parameter(torch.empty(1, dtype=torch.float32), requires_grad=False)
                self._input_scales: dict[str | None, float] = {}
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quant is None:
            if dense_gemm.applies(x, bias):  # CUDA, 16-bit: small M runs kiln's Triton kernel (dense_gemm.py)
                y = torch.ops.kiln.dense_gemm(x.reshape(-1, x.shape[-1]), self.weight)
                return y.reshape(*x.shape[:-1], y.shape[-1])
            return F.linear(x, self.weight, bias)
        return fp8_linear(x, self.weight, self.weight_scale, self.input_scale, bias)

    def _output_rows(self, loaded: torch.Tensor, shard: str | None) -> torch.Tensor:
        """This rank's rows (output channels) of a checkpoint weight, bias or per-channel scale."""
        return loaded

    def _input_columns(self, loaded: torch.Tensor) -> torch.Tensor:
        """This rank's columns (input features) of a checkpoint weight."""
        return loaded

    def _destination(self, param: nn.Parameter, shard: str | None) -> torch.Tensor:
        return param.data

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
        if param is self.input_scale:  # merged q/k/v (gate/up) scales: the largest serves all exactly
            self._input_scales[shard] = float(loaded.float().max())
            param.data.fill_(max(self._input_scales.values()))
            return
        if param is self.weight and self.quant is not None and loaded.dtype != FP8_DTYPE:  # online
            loaded, scale = quantize_weight(loaded)
            self.weight_loader(self.weight_scale, scale, shard)
        if param is self.weight_scale:
            if loaded.numel() == 1:  # a per-tensor checkpoint scale: the same for every channel
                self._destination(param, shard).fill_(float(loaded.float().reshape(())))
                return
            loaded = loaded.float().reshape(-1)  # compressed-tensors stores channel scales as [N, 1]
        if param is self.weight:
            loaded = self._input_columns(loaded)
        _copy_checked(self._destination(param, shard), self._output_rows(loaded, shard), shard or "")


class ColumnParallelLinear(_ParallelLinear):
    """y = x W^T (+ b), W split along the output dim; the output stays sharded."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 quant: Fp8Scheme | None = None) -> None:
        super().__init__()
        if out_features % tp_size():
            raise ValueError(f"output size {out_features} is not divisible by tensor parallel size {tp_size()}")
        self.out_per_rank = out_features // tp_size()
        self._create(self.out_per_rank, in_features, bias, quant)

    def _output_rows(self, loaded: torch.Tensor, shard: str | None) -> torch.Tensor:
        return _shard(loaded, 0, self.out_per_rank, tp_rank())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections in one matmul (qkv, gate_up); each checkpoint shard is
    loaded into its slice by name."""

    def __init__(self, in_features: int, output_sizes: Sequence[int], shard_names: Sequence[str],
                 bias: bool = False, quant: Fp8Scheme | None = None) -> None:
        super().__init__(in_features, sum(output_sizes), bias, quant)
        self.output_sizes = [s // tp_size() for s in output_sizes]
        self.offsets = dict(zip(shard_names, [sum(self.output_sizes[:i]) for i in range(len(output_sizes))]))
        self.sizes = dict(zip(shard_names, self.output_sizes))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
        if shard is None:
            raise ValueError("a merged projection loads one named shard at a time")
        super().weight_loader(param, loaded, shard)

    def _output_rows(self, loaded: torch.Tensor, shard: str | None) -> torch.Tensor:
        return _shard(loaded, 0, self.sizes[shard], tp_rank())

    def _destination(self, param: nn.Parameter, shard: str | None) -> torch.Tensor:
        return param.data.narrow(0, self.offsets[shard], self.sizes[shard])


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k, v projections merged; KV heads are split across ranks, or replicated when there are fewer
    KV heads than ranks."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 quant: Fp8Scheme | None = None) -> None:
        world = tp_size()
        if num_heads % world:
            raise ValueError(f"num_attention_heads {num_heads} is not divisible by tensor parallel size {world}")
        self.kv_replicas = max(1, world // num_kv_heads)
        kv_total = max(num_kv_heads, world)  # replicated KV heads count once per rank
        super().__init__(hidden, [num_heads * head_dim, kv_total * head_dim, kv_total * head_dim],
                         ["q", "k", "v"], bias, quant)
        self.num_kv_heads = num_kv_heads

    def _output_rows(self, loaded: torch.Tensor, shard: str | None) -> torch.Tensor:
        if shard in ("k", "v") and self.kv_replicas > 1:
            size = self.sizes[shard]
            return loaded.narrow(0, (tp_rank() // self.kv_replicas) * size, size)
        return super()._output_rows(loaded, shard)


class RowParallelLinear(_ParallelLinear):
    """y = x W^T, W split along the input dim; partial outputs are summed across ranks. The bias and the
    per-output-channel weight scale are whole on every rank (the bias is added once, after the reduction)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 quant: Fp8Scheme | None = None) -> None:
        super().__init__()
        if in_features % tp_size():
            raise ValueError(f"input size {in_features} is not divisible by tensor parallel size {tp_size()}")
        self.in_per_rank = in_features // tp_size()
        self._create(out_features, self.in_per_rank, bias, quant)

    def _input_columns(self, loaded: torch.Tensor) -> torch.Tensor:
        return _shard(loaded, 1, self.in_per_rank, tp_rank())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(self._matmul(x, None))
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

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """The argmax of compute_logits(hidden) on every rank, without gathering the logits: each rank's best
        (value, id) of its vocabulary range, then the best of those. Ties go to the lowest id on a rank
        (torch's max) and to the lowest rank across them: the gathered argmax's choice."""
        logits = F.linear(hidden, self.weight)
        if self.start + self.per_rank > self.vocab_size:  # padding rows of the last rank never win
            logits[..., max(self.vocab_size - self.start, 0):] = float("-inf")
        value, index = row_max(logits)
        if tp_size() == 1:
            return index
        from kiln.models.parallel import argmax_across_ranks

        return argmax_across_ranks(value, index + self.start)


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
        return rotate_neox(q, cos, sin), rotate_neox(k, cos, sin)


def rotate_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., D] rotated in fp32 by cos / sin [..., D / 2] (first half against second), cast back to x's dtype."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
