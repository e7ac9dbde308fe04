"""HF `architectures` name -> model class."""

from __future__ import annotations

from typing import Any

from torch import nn

from kiln.models.llama import LlamaForCausalLM
from kiln.models.moe_lm import MoeForCausalLM

ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": MoeForCausalLM,
    "MixtralForCausalLM": MoeForCausalLM,
}


def model_class(hf_config: Any) -> type[nn.Module]:
    architecture = (getattr(hf_config, "architectures", None) or ["<none>"])[0]
    try:
        return ARCHITECTURES[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; kiln supports: {', '.join(sorted(ARCHITECTURES))}"
        ) from None
