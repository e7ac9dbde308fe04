"""The -O0..-O3 resolution table, explicit overrides, and how levels reach the config (fast, no compile)."""

from __future__ import annotations

import argparse

import pytest
import torch

from kiln.config import CompilationConfig, CUDAGraphMode, default_capture_sizes
from kiln.entrypoints.cli.main import add_runtime_args, runtime_kwargs
from kiln.runtime.runtime import build_config

CPU, GPU = torch.device("cpu"), torch.device("cuda")  # resolve() only looks at the device type
BUDGET = 2048


def resolve(device: torch.device = CPU, budget: int = BUDGET, **kwargs) -> CompilationConfig:
    return CompilationConfig(**kwargs).resolve(device, budget)


# level -> (compile_sizes, background_compile_sizes, enable_passes, max_autotune) on CPU
CPU_TABLE = {
    0: ((), (), False, False),
    1: ((), (), False, False),
    2: ((1,), (), True, False),
    3: ((1,), (2, 4), True, True),  # -O3's extra sizes compile after the runtime is ready
}


@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_cpu_level_defaults(level: int) -> None:
    c = resolve(level=level)
    assert (c.compile_sizes, c.background_compile_sizes, c.enable_passes, c.max_autotune) == CPU_TABLE[level]
    assert c.cudagraph_mode == CUDAGraphMode.NONE and c.cudagraph_capture_sizes == ()
    assert c.compile_ranges == ()


def test_gpu_level_defaults() -> None:
    capture = default_capture_sizes(512)
    o0, o1, o2, o3 = (resolve(GPU, level=lv) for lv in range(4))
    assert (o0.cudagraph_mode, o0.compile_sizes, o0.enable_passes, o0.max_autotune) == ("NONE", (), False, False)
    assert (o1.cudagraph_mode, o1.compile_sizes, o1.enable_passes, o1.max_autotune) == ("PIECEWISE", (), False,
                                                                                       False)
    assert o1.cudagraph_capture_sizes == capture
    assert (o2.cudagraph_mode, o2.enable_passes, o2.max_autotune) == ("FULL_AND_PIECEWISE", True, False)
    # the range artifact serves (and CUDA graphs capture) every size: no exact size, up front or after ready
    assert o2.compile_sizes == () and o2.background_compile_sizes == ()
    tp = CompilationConfig(level=2).resolve(GPU, BUDGET, background_supported=False)
    assert tp.compile_sizes == () and tp.background_compile_sizes == ()
    tp3 = CompilationConfig(level=3).resolve(GPU, BUDGET, background_supported=False)
    assert tp3.compile_sizes == tuple(sorted(set(capture) | {1024, 2048})) and tp3.background_compile_sizes == ()
    # Inductor's combo kernels at -O2/-O3 on a GPU only, unless the user says otherwise
    assert dict(o2.inductor_options) == dict(o3.inductor_options) == {"combo_kernels": True}
    assert o1.inductor_options == () and resolve(level=2).inductor_options == ()
    off = resolve(GPU, level=2, inductor_options={"combo_kernels": False, "aggressive_fusion": True})
    assert dict(off.inductor_options) == {"combo_kernels": False, "aggressive_fusion": True}
    # -O3 compiles every capture size up front (graphs capture them) and the sizes above them afterwards
    assert o3.compile_sizes == capture and o3.max_autotune
    assert o3.background_compile_sizes == (1024, 2048)


# Issue 14: -O2 compiled all 51 capture sizes exactly (3 pieces x 52 = 156 Inductor compiles, 170 s cold on an
# 8B model); issue 14 kept 4 small decode sizes, compiled after ready, and issue 27 measured those no faster in
# one process (benchmarks/bench_exact_sizes.py): -O2 on a GPU compiles ranges alone, the decode sizes (<= 16
# tokens, where its default GEMM-epilogue passes apply) apart from the rest; a CPU compiles one range.
@pytest.mark.parametrize("budget", [64, 512, 2048, 8192])
def test_o2_gpu_plan_compiles_the_ranges_alone(budget: int) -> None:
    from kiln.compiler import build_dispatcher

    ranges = [(1, 16), (17, budget)]
    c = resolve(GPU, budget=budget, level=2)
    assert c.compile_sizes == () and c.background_compile_sizes == () and len(c.cudagraph_capture_sizes) > 1
    assert [(k.lo, k.hi) for k in build_dispatcher(c, budget).keys] == ranges  # artifacts per distinct piece
    # tensor parallelism (no background swap) compiles the same
    tp = CompilationConfig(level=2).resolve(GPU, budget, background_supported=False)
    assert tp.compile_sizes == () and [(k.lo, k.hi) for k in build_dispatcher(tp, budget).keys] == ranges
    assert c.passes == ("allreduce_rmsnorm", "gemm_add_rmsnorm<=16", "gate_up_silu_mul<=16", "silu_mul_quant<=16",
                        "rmsnorm_gemm<=16", "noop", "rope_kv", "qk_norm_rope")
    cpu = resolve(budget=budget, level=2)
    assert cpu.compile_ranges == () and cpu.passes == ("allreduce_rmsnorm",)  # silu_mul_quant runs on a CPU too


def test_background_sizes_may_be_captured_sizes() -> None:
    # graphs at a swapped size are captured again (cuda_graphs.recapture), so any size may wait for the swap;
    # a size given both ways compiles up front
    c = resolve(GPU, level=2, compile_sizes=(), background_compile_sizes=(8, 24, 1024))
    assert c.compile_sizes == () and c.background_compile_sizes == (8, 24, 1024)
    c = resolve(GPU, level=2, compile_sizes=(8,), background_compile_sizes=(8, 24))
    assert c.compile_sizes == (8,) and c.background_compile_sizes == (24,)
    assert resolve(CPU, level=2, background_compile_sizes=(8, 1)).background_compile_sizes == (8,)
    # an explicit compile plan is the whole plan: no background sizes are added to it
    assert resolve(GPU, level=2, compile_sizes=()).background_compile_sizes == ()


def test_default_level_is_2() -> None:
    assert CompilationConfig().level == 2
    assert build_config("tiny-llama").compilation.level == 2


def test_capture_sizes_respect_the_budget() -> None:
    c = resolve(GPU, budget=48, level=3)
    assert c.cudagraph_capture_sizes == (1, 2, 4, 8, 16, 24, 32, 40, 48)
    assert c.compile_sizes == c.cudagraph_capture_sizes
    assert resolve(GPU, budget=1536, level=3).background_compile_sizes == (1024,)


def test_explicit_options_override_the_level() -> None:
    assert resolve(level=2, compile_sizes=()).compile_sizes == ()
    assert resolve(GPU, level=2, compile_sizes=[]).compile_sizes == ()
    assert resolve(level=1, compile_sizes=(8, 1)).compile_sizes == (1, 8)
    assert resolve(level=3, max_autotune=False).max_autotune is False
    assert resolve(level=1, max_autotune=True).max_autotune is True
    assert resolve(level=1, enable_passes=True).enable_passes is True
    assert resolve(level=2, enable_passes=False).enable_passes is False
    assert resolve(GPU, level=2, cudagraph_mode="PIECEWISE").cudagraph_mode == "PIECEWISE"
    assert resolve(GPU, level=1, cudagraph_capture_sizes=(4, 1)).cudagraph_capture_sizes == (1, 4)


def test_what_cannot_apply_is_resolved_away() -> None:
    # no CUDA graphs on CPU, nothing compiled at -O0, nothing above the token budget
    assert resolve(CPU, level=2, cudagraph_mode="FULL").cudagraph_mode == "NONE"
    o0 = resolve(level=0, compile_sizes=(1, 2), enable_passes=True, max_autotune=True, compile_ranges=(8,))
    assert (o0.compile_sizes, o0.compile_ranges, o0.enable_passes, o0.max_autotune) == ((), (), False, False)
    assert resolve(budget=64, level=2, compile_sizes=(1, 64, 65, 512)).compile_sizes == (1, 64)
    assert resolve(budget=64, level=1, compile_ranges=[64, 16, 8, 16, 100]).compile_ranges == (8, 16)


def test_invalid_values_are_rejected() -> None:
    with pytest.raises(ValueError, match="level must be 0, 1, 2 or 3"):
        CompilationConfig(level=4)
    with pytest.raises(ValueError, match="compile_sizes must be positive"):
        CompilationConfig(compile_sizes=(0, 4))
    with pytest.raises(ValueError, match="compile_ranges must be positive"):
        CompilationConfig(compile_ranges=(-1,))
    with pytest.raises(ValueError, match="compile_workers"):
        CompilationConfig(compile_workers=0)
    with pytest.raises(ValueError, match="cudagraph_mode"):
        CompilationConfig(cudagraph_mode="SOMETIMES")
    assert CompilationConfig(compile_sizes=[2, 1]).compile_sizes == (2, 1)  # lists become hashable tuples
    hash(CompilationConfig(compile_sizes=[2, 1], compile_ranges=[8]))
    with pytest.raises(ValueError, match="inductor_options"):
        CompilationConfig(inductor_options={"": 1})


def test_inductor_options_reach_the_compile_and_its_cache_key() -> None:
    from kiln.compiler.inductor import inductor_config_patches

    c = CompilationConfig(inductor_options={"combo_kernels": True, "aggressive_fusion": False})
    assert c.inductor_options == (("aggressive_fusion", False), ("combo_kernels", True))  # hashable, ordered
    hash(c)
    patches = inductor_config_patches(c.resolve(CPU, BUDGET), None)
    assert patches["combo_kernels"] is True and patches["aggressive_fusion"] is False
    assert inductor_config_patches(CompilationConfig().resolve(CPU, BUDGET), None) == {}
    with pytest.raises(ValueError, match="not_an_option"):
        inductor_config_patches(CompilationConfig(inductor_options={"not_an_option": 1}), None)


def test_runtime_kwargs_reach_the_compilation_config() -> None:
    config = build_config("tiny-llama", level=3, compile_sizes=[4], compile_ranges=[16], max_autotune=False,
                          debug_dump_path="/tmp/x")
    c = config.compilation
    assert (c.level, c.compile_sizes, c.compile_ranges, c.max_autotune, c.debug_dump_path) == \
        (3, (4,), (16,), False, "/tmp/x")


def test_cli_inductor_options() -> None:
    parser = argparse.ArgumentParser()
    add_runtime_args(parser)
    args = parser.parse_args(["--inductor-option", "combo_kernels=false", "--inductor-option", "max_fusion_size=32"])
    kwargs = runtime_kwargs(args)
    assert kwargs["inductor_options"] == {"combo_kernels": False, "max_fusion_size": 32}
    config = build_config("tiny-llama", **kwargs).compilation.resolve(GPU, BUDGET)
    assert dict(config.inductor_options) == {"combo_kernels": False, "max_fusion_size": 32}  # the user's wins
    assert "inductor_options" not in runtime_kwargs(parser.parse_args([]))
    for bad in ("combo_kernels", "=1", "combo_kernels=yes please"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--inductor-option", bad])


@pytest.mark.parametrize("argv, level", [([], None), (["-O0"], 0), (["-O1"], 1), (["-O3"], 3)])
def test_cli_level_flags(argv: list[str], level: int | None) -> None:
    parser = argparse.ArgumentParser()
    add_runtime_args(parser)
    kwargs = runtime_kwargs(parser.parse_args(argv + ["--compile-dump", "/tmp/d"]))
    assert kwargs.get("level") == level  # unset: the CompilationConfig default (2) applies
    assert kwargs["debug_dump_path"] == "/tmp/d"
    assert build_config(None, **kwargs).compilation.level == (2 if level is None else level)


def test_cli_compile_and_parallel_flags_reach_the_config() -> None:
    parser = argparse.ArgumentParser()
    add_runtime_args(parser)
    argv = ["-O1", "--cudagraph-mode", "PIECEWISE", "--cudagraph-capture-sizes", "1", "8", "--compile-sizes",
            "--passes", "silu_mul", "--tensor-parallel-size", "2"]
    config = build_config("tiny-llama", **runtime_kwargs(parser.parse_args(argv)))
    c = config.compilation
    assert (c.cudagraph_mode, c.cudagraph_capture_sizes, c.compile_sizes) == ("PIECEWISE", (1, 8), ())
    assert (c.passes, c.enable_passes, config.tensor_parallel_size) == (("silu_mul",), True, 2)
    plain = build_config("tiny-llama", **runtime_kwargs(parser.parse_args([])))
    assert plain.tensor_parallel_size == 1 and plain.compilation.passes is None
    off = runtime_kwargs(parser.parse_args(["--passes"]))
    assert off["enable_passes"] is False
    tuned = runtime_kwargs(parser.parse_args(["--compile-workers", "4", "--background-compile-sizes", "1024"]))
    c = build_config("tiny-llama", **tuned).compilation
    assert (c.compile_workers, c.background_compile_sizes) == (4, (1024,))
    assert plain.compilation.compile_workers is None  # default: from the host's cores
    with pytest.raises(SystemExit):  # argparse rejects an unknown graph mode
        parser.parse_args(["--cudagraph-mode", "SOMETIMES"])
