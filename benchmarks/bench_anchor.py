"""The decode table's anchor: a gpt-fast-style Llama, written plainly in one file and compiled whole.

Fused qkv and gate-up weights, a static KV cache of [batch, kv_heads, max_len, head_dim] per layer written in
place, SDPA over the whole cache under a position mask, and one decode step (the LM head included) under
`torch.compile(mode="reduce-overhead", fullgraph=True)`: what a few hundred lines of compiled PyTorch reach on the
same GPU, beside kiln's decode (docs/BENCHMARKS.md). Random weights at a preset's shapes; RoPE takes the config's
base without its scaling (llama3's changes the table, not the cost). tests/benchmarks/test_bench_anchor.py holds
the model to transformers' greedy tokens.

    python -m benchmarks.bench_anchor --preset llama3-8b --batches 1 8 --json anchor.json
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.common import PROMPT_LEN, decode_step_bytes, eager_seconds, measure_ceilings, stamp, table


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    vocab: int
    eps: float
    theta: float

    @classmethod
    def of(cls, config: Any) -> Shape:
        rope = getattr(config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
                   config.num_key_value_heads, head_dim, config.intermediate_size, config.vocab_size,
                   config.rms_norm_eps, float(theta))


class AnchorLlama(nn.Module):
    """Llama decode for `batch` sequences of at most `max_len` positions; forward(tokens [B], positions [B]) writes
    each token's key and value at its position and returns the next-token logits [B, vocab]."""

    def __init__(self, shape: Shape, batch: int, max_len: int, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        s, make = shape, dict(dtype=dtype, device=device)
        self.shape = s
        qkv_rows = (s.heads + 2 * s.kv_heads) * s.head_dim
        self.embed = nn.Parameter(torch.empty(s.vocab, s.hidden, **make), requires_grad=False)
        self.wqkv = nn.ParameterList([torch.empty(qkv_rows, s.hidden, **make) for _ in range(s.layers)])
        self.wo = nn.ParameterList([torch.empty(s.hidden, s.heads * s.head_dim, **make) for _ in range(s.layers)])
        self.w13 = nn.ParameterList([torch.empty(2 * s.inter, s.hidden, **make) for _ in range(s.layers)])
        self.w2 = nn.ParameterList([torch.empty(s.hidden, s.inter, **make) for _ in range(s.layers)])
        self.attn_norm = nn.ParameterList([torch.ones(s.hidden, **make) for _ in range(s.layers)])
        self.mlp_norm = nn.ParameterList([torch.ones(s.hidden, **make) for _ in range(s.layers)])
        self.norm = nn.Parameter(torch.ones(s.hidden, **make), requires_grad=False)
        self.lm_head = nn.Parameter(torch.empty(s.vocab, s.hidden, **make), requires_grad=False)
        self.requires_grad_(False)
        cache = (s.layers, batch, s.kv_heads, max_len, s.head_dim)
        self.register_buffer("k_cache", torch.zeros(cache, **make))
        self.register_buffer("v_cache", torch.zeros(cache, **make))
        inv_freq = 1.0 / s.theta ** (torch.arange(0, s.head_dim, 2, dtype=torch.float32, device=device) / s.head_dim)
        angles = torch.outer(torch.arange(max_len, dtype=torch.float32, device=device), inv_freq)
        self.register_buffer("cos", angles.cos())
        self.register_buffer("sin", angles.sin())

    def randomize(self, seed: int = 0) -> AnchorLlama:
        """Weights of a trained model's scale (so activations stay finite in bf16); the KV cache random too."""
        torch.manual_seed(seed)
        for p in self.parameters():
            if p.dim() == 2:
                p.normal_(0.0, p.shape[1] ** -0.5)
        self.k_cache.normal_()
        self.v_cache.normal_()
        return self

    def load_hf(self, state: dict[str, torch.Tensor]) -> AnchorLlama:
        """Weights from a transformers Llama's state dict (q/k/v and gate/up concatenated)."""
        def get(name: str) -> torch.Tensor:
            return state[name].to(self.embed.dtype)

        self.embed.copy_(get("model.embed_tokens.weight"))
        self.lm_head.copy_(get("lm_head.weight" if "lm_head.weight" in state else "model.embed_tokens.weight"))
        self.norm.copy_(get("model.norm.weight"))
        for i in range(self.shape.layers):
            p = f"model.layers.{i}."
            self.wqkv[i].copy_(torch.cat([get(p + f"self_attn.{n}_proj.weight") for n in "qkv"]))
            self.wo[i].copy_(get(p + "self_attn.o_proj.weight"))
            self.w13[i].copy_(torch.cat([get(p + f"mlp.{n}_proj.weight") for n in ("gate", "up")]))
            self.w2[i].copy_(get(p + "mlp.down_proj.weight"))
            self.attn_norm[i].copy_(get(p + "input_layernorm.weight"))
            self.mlp_norm[i].copy_(get(p + "post_attention_layernorm.weight"))
        return self

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.shape.eps)).to(x.dtype)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        s, batch = self.shape, tokens.shape[0]
        rows = torch.arange(batch, device=tokens.device)
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        visible = torch.arange(self.k_cache.shape[3], device=tokens.device)[None, :] <= positions[:, None]
        mask = visible[:, None, None, :]  # [B, 1, 1, max_len]
        x = self.embed[tokens]
        for i in range(s.layers):
            q, k, v = (self._rms(x, self.attn_norm[i]) @ self.wqkv[i].t()).split(
                [s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], dim=-1)
            q = self._rope(q.view(batch, s.heads, s.head_dim), cos, sin)
            k = self._rope(k.view(batch, s.kv_heads, s.head_dim), cos, sin)
            self.k_cache[i][rows, :, positions] = k  # [B, Hkv, D], each row at its position
            self.v_cache[i][rows, :, positions] = v.view(batch, s.kv_heads, s.head_dim)
            out = F.scaled_dot_product_attention(q[:, :, None, :], self.k_cache[i], self.v_cache[i], attn_mask=mask,
                                                 enable_gqa=True)
            x = x + out.reshape(batch, s.heads * s.head_dim) @ self.wo[i].t()
            gate, up = (self._rms(x, self.mlp_norm[i]) @ self.w13[i].t()).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ self.w2[i].t()
        return self._rms(x, self.norm) @ self.lm_head.t()


def decode_ms(model: AnchorLlama, batch: int, start: int, steps: int, compiled: Any) -> float:
    """Mean ms a step over `steps` greedy steps from position `start` (after warm-up steps that compile and
    record the graph)."""
    device = model.embed.device
    tokens = torch.zeros(batch, dtype=torch.long, device=device)
    positions = torch.full((batch,), start, dtype=torch.long, device=device)

    def step() -> None:
        nonlocal tokens
        tokens = compiled(tokens, positions).argmax(-1)
        positions.add_(1)

    return eager_seconds(step, steps, warmup=3) * 1e3


def main() -> None:
    from kiln.models.loader.presets import preset_config

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama3-8b")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_anchor times CUDA graphs: it needs a GPU")
    print(stamp())
    ceilings = measure_ceilings()
    shape = Shape.of(preset_config(args.preset))
    max_len = PROMPT_LEN + args.steps + 16  # the context of kiln's decode rows, and room for the timed steps
    rows = []
    for batch in args.batches:
        model = AnchorLlama(shape, batch, max_len, torch.bfloat16, "cuda").randomize()
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
        ms = decode_ms(model, batch, PROMPT_LEN, args.steps, compiled)
        # kiln's decode floor (its bytes at the copy bandwidth)
        step_bytes = decode_step_bytes(weights, batch, shape.layers, shape.kv_heads, shape.head_dim)
        floor_ms = step_bytes / ceilings.copy_bytes_per_s * 1e3
        rows.append(dict(preset=args.preset, batch=batch, step_ms=ms, tokens_per_s=batch / ms * 1e3,
                         floor_ms=floor_ms, x_floor=ms / floor_ms))
        del model, compiled
        torch.compiler.reset()
        torch.cuda.empty_cache()
    print(table(["preset", "batch", "step ms", "tok/s", "floor ms", "x floor"],
                [[r["preset"], r["batch"], r["step_ms"], r["tokens_per_s"], r["floor_ms"], r["x_floor"]]
                 for r in rows]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"stamp": stamp(), "copy_bytes_per_s": ceilings.copy_bytes_per_s, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
