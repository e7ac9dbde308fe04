"""What every model exposes to the runtime, and the architecture-independent view of an HF config."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kiln.models.quant.fp8 import Fp8Scheme


@dataclass(frozen=True)
class MoeSpec:
    """The routed-experts part of a mixture-of-experts config (Qwen3-MoE, Mixtral)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # per expert (a dense layer of a mixed model uses ModelSpec.intermediate_size)
    norm_topk_prob: bool  # renormalise the top-k routing weights to sum to 1
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP instead (mlp_only_layers, decoder_sparse_step)
    # whole experts placed on ranks (tensor parallelism otherwise splits every expert's intermediate dim);
    # set by the loader from the runtime option
    expert_parallel: bool = False

    @classmethod
    def from_hf(cls, config: Any, arch: str, num_layers: int) -> MoeSpec | None:
        num_experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
        if not num_experts:
            return None
        if arch == "MixtralForCausalLM":  # every layer sparse, weights always renormalised
            return cls(num_experts, config.num_experts_per_tok, config.intermediate_size, True)
        only = set(getattr(config, "mlp_only_layers", None) or ())
        step = getattr(config, "decoder_sparse_step", None) or 1
        dense = tuple(i for i in range(num_layers) if i in only or (i + 1) % step)
        return cls(num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                   bool(getattr(config, "norm_topk_prob", False)), dense)


@dataclass(frozen=True)
class ModelSpec:
    """The fields of an HF config that shape a decoder-only model, normalised across transformers versions."""

    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: tuple[tuple[str, Any], ...] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None
    # FP8 linear weights (kiln/models/quant): set by the loader from the checkpoint or the runtime option;
    # part of the spec so it reaches the model's layers and the compile-cache key with everything else
    quantization: Fp8Scheme | None = None
    moe: MoeSpec | None = None  # a mixture-of-experts model's routed experts

    @classmethod
    def from_hf(cls, config: Any) -> ModelSpec:
        arch = (getattr(config, "architectures", None) or ["?"])[0]
        rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
        theta = rope.pop("rope_theta", None) or getattr(config, "rope_theta", None) or 10000.0
        if rope.get("rope_type", rope.get("type")) in (None, "default"):
            rope = {}
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        eos = getattr(config, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        return cls(
            architecture=arch,
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            rms_norm_eps=config.rms_norm_eps,
            rope_theta=float(theta),
            rope_scaling=tuple(sorted(rope.items())) if rope else None,
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(config, "attention_bias", False)) or arch == "Qwen2ForCausalLM",
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            eos_token_ids=eos_ids,
            torch_dtype=str(dtype).replace("torch.", "") if dtype is not None else None,
            moe=MoeSpec.from_hf(config, arch, config.num_hidden_layers),
        )


class CausalLM(Protocol):
    """The runtime's view of a model: a token-flat forward and a separate logits head."""

    spec: ModelSpec

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[T] token ids and positions -> [T, hidden] final hidden states."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """argmax of compute_logits(hidden), the same on every tensor-parallel rank."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]: ...
