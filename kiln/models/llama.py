"""The Llama-family decoder: Llama 2/3 (incl. llama3 RoPE scaling), SmolLM2, Mistral, Qwen2 (qkv bias)
and Qwen3 (per-head q/k RMSNorm). The whole model in one file.

The forward is token-flat: `input_ids` and `positions` are [T] for all requests of a step together;
attention is the `kiln::attention` op, which finds per-request boundaries in the forward context.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kiln.models.attention_op import attention
from kiln.models.base import ModelSpec
from kiln.models.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    SiluAndMul,
    VocabParallelEmbedding,
    default_weight_loader,
)
from kiln.models.parallel import tp_size
from kiln.models.quant.fp8 import FP8_DTYPE

KV_CACHE_SCALES = (".k_scale", ".v_scale", ".kv_scale")


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = spec.head_dim
        self.num_heads = spec.num_heads // tp_size()
        self.num_kv_heads = max(1, spec.num_kv_heads // tp_size())
        self.qkv_proj = QKVParallelLinear(spec.hidden_size, spec.head_dim, spec.num_heads, spec.num_kv_heads,
                                          spec.attention_bias, quant=spec.quantization)
        self.o_proj = RowParallelLinear(spec.num_heads * spec.head_dim, spec.hidden_size, quant=spec.quantization)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.rotary = [rotary]  # a list, so the shared module is not registered once per layer

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary[0](positions, q, k)
        out = torch.empty_like(q)  # allocated here so it lives inside the compiled piece
        attention(q, k, v.contiguous(), out, self.layer_idx)
        return self.o_proj(out.view(-1, q_size))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(spec.hidden_size, [spec.intermediate_size] * 2,
                                                       ["gate", "up"], quant=spec.quantization)
        self.act = SiluAndMul()
        self.down_proj = RowParallelLinear(spec.intermediate_size, spec.hidden_size, quant=spec.quantization)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, layer_idx, rotary)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = self.make_mlp(spec, layer_idx)

    def make_mlp(self, spec: ModelSpec, layer_idx: int) -> nn.Module:
        """The feed-forward block; a mixture-of-experts decoder (moe_lm.py) returns its expert layer."""
        return MLP(spec)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None):
        # The residual add is carried into the next norm, so add + RMSNorm sit together for fusion.
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (our parameter fragment, shard) for merged projections
    STACKED = (
        ("q_proj", "qkv_proj", "q"),
        ("k_proj", "qkv_proj", "k"),
        ("v_proj", "qkv_proj", "v"),
        ("gate_proj", "gate_up_proj", "gate"),
        ("up_proj", "gate_up_proj", "up"),
    )
    decoder_layer: type[DecoderLayer] = DecoderLayer

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        scaling = dict(spec.rope_scaling) if spec.rope_scaling else None
        self.rotary = RotaryEmbedding(spec.head_dim, spec.max_position_embeddings, spec.rope_theta, scaling)
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(self.decoder_layer(spec, i, self.rotary) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = ParallelLMHead(spec.vocab_size, spec.hidden_size)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # an FP8 checkpoint's calibrated KV-cache scales, layer -> [k_scale, v_scale]; used by an fp8 KV cache
        # (kv_cache_dtype="fp8", kiln/runtime/worker.py), ignored by a cache in the model dtype
        self.kv_cache_scales: dict[int, list[float]] = {}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.greedy_tokens(hidden)

    def _record_kv_scale(self, name: str, tensor: torch.Tensor) -> None:
        """`layers.{i}.self_attn[.x_proj].k_scale | v_scale | kv_scale` (one scale for both) -> kv_cache_scales."""
        parts = name.split(".")
        if "layers" not in parts or tensor.numel() != 1:
            raise ValueError(f"KV-cache scale {name!r} is not one per-tensor scale of a decoder layer")
        layer = int(parts[parts.index("layers") + 1])
        scales = self.kv_cache_scales.setdefault(layer, [1.0, 1.0])
        value = float(tensor.float().item())
        if name.endswith(".k_scale"):
            scales[0] = value
        elif name.endswith(".v_scale"):
            scales[1] = value
        else:
            scales[:] = [value, value]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors; returns the names of our parameters that were filled."""
        params = dict(self.named_parameters(remove_duplicate=False))
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb.inv_freq" in name or (self.spec.tie_word_embeddings and name == "lm_head.weight"):
                continue
            if self.spec.quantization is not None and name.endswith(KV_CACHE_SCALES):
                self._record_kv_scale(name, tensor)
                continue
            shard = None
            for ckpt, ours, shard_name in self.STACKED:
                if f".{ckpt}." in name:
                    name, shard = name.replace(ckpt, ours), shard_name
                    break
            target = name
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(self).__name__}")
            loader = getattr(modules[target.rpartition(".")[0]], "weight_loader", None)
            if loader is None:
                default_weight_loader(params[target], tensor)
            elif shard is None:
                loader(params[target], tensor)
            else:
                loader(params[target], tensor, shard)
            loaded.add(target)
            if target.endswith(".weight") and getattr(modules[target.rpartition(".")[0]], "quant", None) \
                    and tensor.dtype != FP8_DTYPE:  # quantized online: the scale came with the weight
                loaded.add(target.removesuffix("weight") + "weight_scale")
        if self.spec.tie_word_embeddings:
            loaded.add("lm_head.weight")
        return loaded
