"""Named configs for dummy-weight models: real shapes for benchmarks, tiny ones for tests."""

from __future__ import annotations

from typing import Any

from kiln.models.loader.config_view import ConfigView

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-5,
             bos_token_id=1, eos_token_id=2)

PRESETS: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                      max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                      rope_scaling=_LLAMA3_ROPE, bos_token_id=128000, eos_token_id=128001,
                      tie_word_embeddings=False, dtype="bfloat16"),
    "llama3-70b": dict(architectures=["LlamaForCausalLM"], hidden_size=8192, intermediate_size=28672,
                       num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                       max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                       rope_scaling=_LLAMA3_ROPE, bos_token_id=128000, eos_token_id=128001,
                       tie_word_embeddings=False, dtype="bfloat16"),
    "smollm2-135m": dict(architectures=["LlamaForCausalLM"], hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                         max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=True, dtype="bfloat16"),
    "qwen3-8b": dict(architectures=["Qwen3ForCausalLM"], hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                     bos_token_id=151643, eos_token_id=151645, tie_word_embeddings=False,
                     dtype="bfloat16"),
    "qwen3-30b-a3b": dict(architectures=["Qwen3MoeForCausalLM"], hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                          decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                          rms_norm_eps=1e-6, rope_theta=1000000.0, bos_token_id=151643, eos_token_id=151645,
                          tie_word_embeddings=False, dtype="bfloat16"),
    "mixtral-8x7b": dict(architectures=["MixtralForCausalLM"], hidden_size=4096, intermediate_size=14336,
                         num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=32000, max_position_embeddings=32768, rms_norm_eps=1e-5,
                         rope_theta=1000000.0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                         dtype="bfloat16"),
    "tiny-llama": dict(architectures=["LlamaForCausalLM"], tie_word_embeddings=False, **_TINY),
    "tiny-llama3": dict(architectures=["LlamaForCausalLM"], tie_word_embeddings=True, rope_theta=500000.0,
                        rope_scaling={**_LLAMA3_ROPE, "original_max_position_embeddings": 128}, **_TINY),
    "tiny-qwen2": dict(architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True, **_TINY),
    "tiny-qwen3": dict(architectures=["Qwen3ForCausalLM"], tie_word_embeddings=False, head_dim=32, **_TINY),
    # three layers, the middle one dense (mlp_only_layers); 8 experts, so a step leaves some without tokens;
    # routing weights not renormalised (tiny-mixtral covers renormalised ones)
    "tiny-qwen3-moe": dict(architectures=["Qwen3MoeForCausalLM"], tie_word_embeddings=False, head_dim=32,
                           moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                           decoder_sparse_step=1, mlp_only_layers=[1], rope_theta=10000.0,
                           **{**_TINY, "num_hidden_layers": 3}),
    "tiny-mixtral": dict(architectures=["MixtralForCausalLM"], tie_word_embeddings=False, num_local_experts=4,
                         num_experts_per_tok=2, rope_theta=10000.0, **_TINY),
}

_MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe", "MixtralForCausalLM": "mixtral"}


def preset_view(name: str) -> ConfigView:
    """The preset as kiln loads it: a read-only view of its fields, no transformers import (config_view.py)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; presets: {', '.join(sorted(PRESETS))}")
    values = PRESETS[name]
    return ConfigView({"model_type": _MODEL_TYPES[values["architectures"][0]], **values})


def preset_config(name: str) -> Any:
    """The preset as a transformers config object (so HF models can be built from it in tests)."""
    from transformers import AutoConfig

    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; presets: {', '.join(sorted(PRESETS))}")
    values = dict(PRESETS[name])
    model_type = _MODEL_TYPES[values["architectures"][0]]
    if "rope_scaling" in values:
        values["rope_parameters"] = {**values.pop("rope_scaling"), "rope_theta": values.pop("rope_theta")}
    elif "rope_theta" in values:
        values["rope_parameters"] = {"rope_type": "default", "rope_theta": values.pop("rope_theta")}
    return AutoConfig.for_model(model_type, **values)
