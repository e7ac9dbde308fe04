"""Mixture-of-experts decoders: Qwen3-MoE (QK-norm, dense layers by mlp_only_layers / decoder_sparse_step) and
Mixtral. The Llama decoder (llama.py) with its feed-forward block replaced by the expert layer (moe.py) where
the config says; checkpoints name experts one by one (`mlp.experts.{e}.gate_proj`, Mixtral's
`block_sparse_moe.experts.{e}.w1|w3|w2`) or stacked per layer as transformers 5 holds them
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]); both load.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from kiln.models.base import ModelSpec
from kiln.models.llama import MLP, DecoderLayer, LlamaForCausalLM
from kiln.models.moe import SparseMoeBlock

_EXPERT = re.compile(r"layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(?:(\d+)\.)?"
                     r"(gate_up_proj|gate_proj|up_proj|down_proj|w1|w2|w3)(?:\.weight)?$")
_KINDS = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down",
          "gate_up_proj": "gate_up"}


class MoeDecoderLayer(DecoderLayer):
    def make_mlp(self, spec: ModelSpec, layer_idx: int) -> nn.Module:
        assert spec.moe is not None
        return MLP(spec) if layer_idx in spec.moe.dense_layers else SparseMoeBlock(spec)


class MoeForCausalLM(LlamaForCausalLM):
    decoder_layer = MoeDecoderLayer

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        blocks = {i: layer.mlp for i, layer in enumerate(self.layers) if isinstance(layer.mlp, SparseMoeBlock)}

        def the_rest() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                match = _EXPERT.search(name)
                if match is None:
                    yield name.replace(".block_sparse_moe.", ".mlp."), tensor
                    continue
                layer = int(match[1])
                if layer not in blocks:
                    raise ValueError(f"checkpoint tensor {name!r}: layer {layer} has no experts in this config")
                blocks[layer].load_expert_weight(_KINDS[match[3]], None if match[2] is None else int(match[2]),
                                                 tensor)

        loaded = super().load_weights(the_rest())
        for i, block in blocks.items():
            if not block.missing_experts():  # else the loader names these parameters as missing
                loaded |= {f"layers.{i}.mlp.{n}" for n, _ in block.named_parameters() if not n.startswith("gate.")}
        return loaded
