"""A mixture-of-experts feed-forward layer: the router, then the routed experts as one `kiln::fused_moe` call.

The router is `kiln::moe_route` (its GEMM, then top-k, softmax and renormalisation where the config asks for it in
one kernel); the experts' weights are stacked per layer at load time, w13 [E, 2I, H] (each expert's gate rows,
then its up rows) and w2 [E, H, I], the layout the op's kernels read.

Tensor parallelism, by default, splits every expert's intermediate dim over the ranks (the dense MLP's column-
then row-parallel split, per expert): each rank computes a partial output for every token and the ranks sum
them. With `expert_parallel` whole experts are placed on ranks instead (E / world each, in order): each rank runs
only the pairs routed to its experts (the others are marked E_local, which the op skips) and the same sum
combines them. Every rank sees every token either way, so the step needs no other collective.

FP8 (quantization="fp8"): expert weights are quantized at load to e4m3 with one scale per (expert, output
channel), over the whole input dim before any sharding, as the dense layers are; the kernels widen them to the
activation's dtype (weight-only FP8: half the bytes streamed). FP8 checkpoints' pre-quantized experts are refused.
"""

from __future__ import annotations

import torch
from torch import nn

import kiln.models.fused_moe.op  # noqa: F401 - registers kiln::fused_moe
import kiln.models.fused_moe.routing  # noqa: F401 - registers kiln::moe_route
from kiln.models.base import ModelSpec
from kiln.models.layers import _copy_checked
from kiln.models.parallel import all_reduce, tp_rank, tp_size
from kiln.models.quant.fp8 import FP8_DTYPE, quantize_weight

EXPERT_KINDS = ("gate", "up", "down")


class SparseMoeBlock(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        moe = spec.moe
        assert moe is not None
        world = tp_size()
        self.num_experts, self.top_k, self.norm_topk_prob = moe.num_experts, moe.top_k, moe.norm_topk_prob
        self.expert_parallel = moe.expert_parallel and world > 1
        if self.expert_parallel:
            if moe.num_experts % world:
                raise ValueError(f"num_experts {moe.num_experts} is not divisible by tensor parallel size {world} "
                                 "(enable_expert_parallel)")
            self.num_local, self.inter = moe.num_experts // world, moe.intermediate_size
        else:
            if moe.intermediate_size % world:
                raise ValueError(f"moe_intermediate_size {moe.intermediate_size} is not divisible by tensor "
                                 f"parallel size {world}")
            self.num_local, self.inter = moe.num_experts, moe.intermediate_size // world
        self.first_expert = tp_rank() * self.num_local if self.expert_parallel else 0
        self.quant = spec.quantization
        if self.quant is not None and self.quant.source != "online":
            raise ValueError(f"FP8 checkpoints ({self.quant.source}) of mixture-of-experts models are not supported: "
                             "load the 16-bit checkpoint with quantization='fp8' instead")
        h = spec.hidden_size
        self.gate = nn.Linear(h, moe.num_experts, bias=False)  # the router, full precision on every rank
        dtype = FP8_DTYPE if self.quant is not None else None
        self.w13_weight = nn.Parameter(torch.empty(self.num_local, 2 * self.inter, h, dtype=dtype),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(self.num_local, h, self.inter, dtype=dtype), requires_grad=False)
        self.w13_scale = self.w2_scale = None
        if self.quant is not None:
            self.w13_scale = nn.Parameter(torch.empty(self.num_local, 2 * self.inter, dtype=torch.float32),
                                          requires_grad=False)
            self.w2_scale = nn.Parameter(torch.empty(self.num_local, h, dtype=torch.float32), requires_grad=False)
        self._received: set[tuple[str, int]] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = torch.ops.kiln.moe_route(x, self.gate.weight, self.top_k, self.norm_topk_prob)
        if self.expert_parallel:  # global ids -> this rank's; another rank's experts -> num_local (skipped)
            ids = ids - self.first_expert
            ids = ids.masked_fill((ids < 0) | (ids >= self.num_local), self.num_local)
        out = torch.ops.kiln.fused_moe(x, self.w13_weight, self.w2_weight, weights, ids,
                                       self.w13_scale, self.w2_scale, self.expert_parallel)
        return all_reduce(out)

    # -- loading ------------------------------------------------------------------------------------------------

    def load_expert_weight(self, kind: str, expert: int | None, loaded: torch.Tensor) -> None:
        """kind: gate | up ([I, H]), down ([H, I]) of one expert, or gate_up ([E, 2I, H]) / down ([E, H, I])
        of every expert stacked (expert None); full checkpoint tensors, of which this rank keeps its part."""
        if loaded.dtype == FP8_DTYPE:
            raise ValueError("pre-quantized FP8 expert weights are not supported: load the 16-bit checkpoint "
                             "with quantization='fp8'")
        if expert is not None:
            self._load_one(kind, expert, loaded)
            return
        if loaded.dim() != 3 or loaded.shape[0] != self.num_experts:
            raise ValueError(f"stacked expert weight ({kind}) has shape {tuple(loaded.shape)}, expected "
                             f"{self.num_experts} experts along dim 0")
        for e in range(self.num_experts):
            if kind == "gate_up":
                gate, up = loaded[e].chunk(2, dim=0)
                self._load_one("gate", e, gate)
                self._load_one("up", e, up)
            else:
                self._load_one(kind, e, loaded[e])

    def _load_one(self, kind: str, expert: int, weight: torch.Tensor) -> None:
        if kind not in EXPERT_KINDS or not 0 <= expert < self.num_experts:
            raise ValueError(f"expert weight {kind} of expert {expert}: no such expert weight "
                             f"({self.num_experts} experts: gate, up, down)")
        self._received.add((kind, expert))
        local = expert - self.first_expert
        if not 0 <= local < self.num_local:  # another rank's expert
            return
        scale = None
        if self.quant is not None:  # over the whole input dim, before sharding: every rank's scales are the same
            weight, scale = quantize_weight(weight)
        part = 0 if self.expert_parallel else tp_rank()
        if kind == "down":  # [H, I]: this rank's columns; the per-row scale is whole
            _copy_checked(self.w2_weight.data[local], weight.narrow(1, part * self.inter, self.inter), "down")
            if scale is not None:
                self.w2_scale.data[local].copy_(scale)
            return
        rows = slice(0, self.inter) if kind == "gate" else slice(self.inter, 2 * self.inter)
        _copy_checked(self.w13_weight.data[local, rows], weight.narrow(0, part * self.inter, self.inter), kind)
        if scale is not None:
            self.w13_scale.data[local, rows].copy_(scale.narrow(0, part * self.inter, self.inter))

    def missing_experts(self) -> list[str]:
        """Expert weights the checkpoint has not given (yet), as 'kind[expert]'."""
        return [f"{k}[{e}]" for e in range(self.num_experts) for k in EXPERT_KINDS if (k, e) not in self._received]
