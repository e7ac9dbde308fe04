"""HF `architectures` name -> model class."""

from __future__ import annotations

from torch import nn

from kiln.models.base import ModelSpec
from kiln.models.llama import LlamaForCausalLM

ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def model_class(spec: ModelSpec) -> type[nn.Module]:
    try:
        return ARCHITECTURES[spec.architecture]
    except KeyError:
        raise ValueError(
            f"unsupported model architecture {spec.architecture!r}; kiln supports: {', '.join(sorted(ARCHITECTURES))}"
        ) from None
