"""`PassConfig`: which of kiln's fusion passes run, and for which token counts.

Resolved once from the `CompilationConfig` (`enable_passes`, `passes`, `level`). The level defaults list
only passes whose measured gain justifies them (docs/passes.md, docs/BENCHMARKS.md); every other pass is
still selectable by name with `passes=(...)`.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Any

# In the order the manager runs them: graph-level passes first (they change what is split out), then the
# post-grad ones; `noop` runs last in post-grad so it also tidies what the fusions leave behind.
# allreduce_rmsnorm and gemm_add_rmsnorm precede add_rmsnorm, which would otherwise take their norms alone.
# silu_mul_quant and gate_up_silu_mul precede silu_mul for the same reason.
# qkv_rope follows rope_kv and qk_norm_rope, which take the rotations they match first.
# rmsnorm_gemm follows gemm_add_rmsnorm and gate_up_silu_mul, whose ops it matches.
ALL_PASSES: tuple[str, ...] = ("noop", "rope_kv", "qk_norm_rope", "qkv_rope", "allreduce_rmsnorm", "gemm_add_rmsnorm",
                               "add_rmsnorm", "silu_mul_quant", "gate_up_silu_mul", "rmsnorm_gemm", "silu_mul")

# Passes that rewrite only the captured graph, which serves every token count: a token bound cannot gate them.
GRAPH_ONLY_PASSES: tuple[str, ...] = ("rope_kv", "qk_norm_rope")

# Passes whose ops run on CUDA only (kiln's Triton GEMM epilogues): on a CPU they match nothing, and a token bound
# of theirs would only cut the compile range, so the level defaults leave them out there.
CUDA_ONLY_PASSES: tuple[str, ...] = ("qkv_rope", "gemm_add_rmsnorm", "gate_up_silu_mul", "rmsnorm_gemm")

# -O2/-O3 defaults. Only passes with a measured gain belong here (docs/passes.md, docs/BENCHMARKS.md).
# allreduce_rmsnorm (tensor parallel only; it matches nothing with one rank): one kernel for the all-reduce,
# residual add and norm at decode sizes (kiln/models/p2p_norm.py); 2x H200, benchmarks/bench_tp.py off vs
# on: Llama-3-70B TP=2 20.5 -> 20.4 ms at batch 1, 24.14 -> 24.06 at batch 64. Its earlier form (torch's
# all-reduce, then a Triton add + norm) gained nothing. gemm_add_rmsnorm and gate_up_silu_mul at decode sizes
# (<= 16 tokens: the range above keeps Inductor's kernels, which prefill needs): one H200, 2026-12-04, decode at
# batch 1 / 8 / 64, SmolLM2-135M 0.680 / 0.703 / 1.096 -> 0.638 / 0.652 / 1.093 ms, Llama-3-8B 4.26 / 4.38 / 5.56
# -> 4.21 / 4.30 / 5.57, FP8 8B 3.02 / 3.09 -> 2.99 / 3.06 (gemm_add_rmsnorm), prefill of 1024 tokens equal.
# A mixture of experts takes them too since its op sums the experts' rows itself (Inductor's kernel adding them to the
# residual had slowed batch 8 from 8.00 to 8.85 ms with gemm_add_rmsnorm, one H200, 2026-12-04): Qwen3-30B-A3B at
# batch 1 / 8 / 64, one process per arm in one call, 3.17 / 10.05 / 21.73 ms (`0ec82d9`, none) -> 2.99 / 10.01 /
# 21.58 (gemm_add_rmsnorm<=16 alone) and 2.99 / 10.00 / 21.57 (all four) (one H100, 2026-12-07).
# silu_mul_quant (FP8 models only: the SiLU-mul and the down projection's activation quantization as one Triton
# program a row, where Inductor made three kernels at decode sizes) at decode sizes: one H200, 2026-12-04, FP8 8B
# two rounds of one process per arm, 2.933 / 2.922 -> 2.895 / 2.894 ms at batch 1, 3.000 / 3.004 -> 2.968 / 2.973 at
# batch 8 (its kernel in programmatic dependent launch; before PDL it measured 1.00x, and 0.92x at prefill, so it
# stays out of the range above 16).
# On the H200 (smollm2-135m, triton attention) add_rmsnorm and silu_mul slow prefill down and leave decode
# as it was; on CPU rope_kv and noop are slower. With the flashinfer backend rope_kv rotates and writes the cache in
# one kernel before attention (unmeasured there).
# rope_kv on a GPU (the Triton decode kernel rotates q and the new key itself, with Qwen3's q/k norms: qk_norm_rope
# lets rope_kv take them; noop drops the copy of v that Inductor's RoPE kernel used to absorb): one H200, 2026-12-04,
# `bench_profile` at batch 1 in one call, a step 4.162 -> 4.134 ms on Llama-3-8B (327 -> 295 kernels), GPU busy
# 0.602 -> 0.562 ms on SmolLM2-135M (0.674 -> 0.588 at batch 8), Qwen3-30B-A3B 2.887 -> 2.839 (without noop).
_ROPE_IN_ATTENTION = ("noop", "rope_kv", "qk_norm_rope")
# rmsnorm_gemm (the next small projection finishes the add + norm row itself, where it runs the one-token
# matrix-vector kernel; a graph whose next weights that kernel never takes is left as it is), SmolLM2-135M with
# the kernel on, one process per arm: 0.521, 0.515, 0.509, 0.515 -> 0.521 (host 0.49), 0.452, 0.595 (host 0.57),
# 0.437 ms at batch 1 (one H100, 2026-12-06, docs/models.md).
_DECODE_EPILOGUES = ("gemm_add_rmsnorm<=16", "gate_up_silu_mul<=16", "silu_mul_quant<=16", "rmsnorm_gemm<=16")
LEVEL_DEFAULTS: dict[int, tuple[str, ...]] = {
    0: (),
    1: (),
    2: ("allreduce_rmsnorm", *_DECODE_EPILOGUES, *_ROPE_IN_ATTENTION),
    3: ("allreduce_rmsnorm", *_DECODE_EPILOGUES, *_ROPE_IN_ATTENTION),
}


def level_defaults(level: int, on_gpu: bool = True) -> tuple[str, ...]:
    """The level's default passes, or those KILN_PASSES names (separated by "," or "+"; empty: none): an A/B of a
    pass at otherwise default settings, where no `passes=` is given. The pass list is in the compile-cache key.
    Off a GPU, without the CUDA-only ones, rope_kv's and the decode-size epilogues (whose bound would cut a CPU's
    one compile range in two)."""
    names = os.environ.get("KILN_PASSES")
    if names is None:
        chosen = LEVEL_DEFAULTS.get(level, ())
        if not on_gpu:  # on a CPU (the torch backend) rope_kv and noop are slower
            chosen = tuple(n for n in chosen if n not in (*_DECODE_EPILOGUES, *_ROPE_IN_ATTENTION))
    else:
        chosen = tuple(n.strip() for n in re.split(r"[,+]", names) if n.strip())
    return chosen if on_gpu else tuple(n for n in chosen if n.partition("<=")[0].strip() not in CUDA_ONLY_PASSES)


@dataclass(frozen=True)
class PassConfig:
    noop: bool = False
    rope_kv: bool = False
    qk_norm_rope: bool = False
    qkv_rope: bool = False  # 16-bit weights on CUDA only: matches kiln::dense_gemm (post-grad since 2026-12-04)
    allreduce_rmsnorm: bool = False  # tensor parallel only: matches nothing with one rank
    gemm_add_rmsnorm: bool = False  # CUDA only: matches kiln::dense_gemm and kiln::fp8_gemm
    add_rmsnorm: bool = False
    silu_mul_quant: bool = False  # FP8 models only: matches nothing without the activation quantization
    gate_up_silu_mul: bool = False  # 16-bit weights on CUDA only: matches kiln::dense_gemm
    rmsnorm_gemm: bool = False  # CUDA only: matches kiln::gemm_add_rms_norm into kiln::dense_gemm / gate_up_silu_mul
    silu_mul: bool = False
    # pass name -> largest token count it is compiled for; a compile range is covered only when its upper
    # end is within the bound (post-grad passes only: graph-level passes see one graph for every count)
    max_tokens: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        unknown = [name for name, _ in self.max_tokens if name not in ALL_PASSES]
        if unknown:
            raise ValueError(f"max_tokens names unknown passes {unknown}; passes: {', '.join(ALL_PASSES)}")
        if isinstance(self.max_tokens, dict):  # accept a dict, keep the config hashable
            object.__setattr__(self, "max_tokens", tuple(sorted(self.max_tokens.items())))

    @classmethod
    def from_names(cls, names: tuple[str, ...] | list[str], **kwargs: Any) -> PassConfig:
        """Names as in `--passes`: "add_rmsnorm" or, bounded to small token counts, "add_rmsnorm<=64"."""
        flags, bounds = {}, dict(kwargs.pop("max_tokens", ()))
        for entry in names:
            name, _, bound = entry.partition("<=")
            name = name.strip()
            if name not in ALL_PASSES:
                raise ValueError(f"unknown compiler pass {name!r}; choose from {', '.join(ALL_PASSES)}")
            flags[name] = True
            if bound:
                if not bound.strip().isdigit() or int(bound) < 1:
                    raise ValueError(f"pass bound must be a positive token count: {entry!r}")
                if name in GRAPH_ONLY_PASSES:
                    raise ValueError(f"{entry!r}: {name} rewrites the captured graph, which serves every token "
                                     "count, so it takes no bound")
                bounds[name] = int(bound)
        return cls(**flags, max_tokens=tuple(sorted(bounds.items())), **kwargs)

    @classmethod
    def from_compilation(cls, config: Any) -> PassConfig:
        """From a resolved CompilationConfig: nothing unless passes are enabled, else its list (resolve() has
        put the level's defaults for the device and model kind there)."""
        if not getattr(config, "enable_passes", False):
            return cls()
        if config.passes is None:
            raise ValueError("PassConfig.from_compilation needs a resolved CompilationConfig (passes is None)")
        return cls.from_names(tuple(config.passes))

    @property
    def enabled(self) -> tuple[str, ...]:
        return tuple(n for n in ALL_PASSES if getattr(self, n))

    def token_bound(self, name: str) -> int | None:
        return dict(self.max_tokens).get(name)

    def without(self, name: str) -> PassConfig:
        return dataclasses.replace(self, **{name: False})

    def describe(self) -> str:
        bounds = ", ".join(f"{n}<={b}" for n, b in self.max_tokens)
        return f"passes [{', '.join(self.enabled) or 'none'}]" + (f" (token bounds: {bounds})" if bounds else "")
