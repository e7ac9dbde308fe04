"""Compile kiln's small-M GEMM kernels ahead of time for sm90 and print what the PTX holds, as JSON.

Run as its own process by tests/models/test_fp8_kernel.py: Triton must be imported with TRITON_INTERPRET
unset for a real compile (its own library functions are defined interpreted otherwise), and a test session
may have imported it under the interpreter.
    python -m tests.models.fp8_kernel_sm90 BLOCK_M SPLIT(0|1) PDL(0|1) [PROMOTE (default 128)]
    python -m tests.models.fp8_kernel_sm90 gate_up|qkv_rope|rows|rows_fp8|gemv_route|add_norm
    python -m tests.models.fp8_kernel_sm90 norm_rope KV_FP8(0|1)
                                                 the epilogue kernels (kiln/models/gemm_epilogues.py, gemv.py)
    python -m tests.models.fp8_kernel_sm90 token_down|token_down_fp8|sum_pairs|top_k
                                                 the MoE op's summing kernels (kiln/models/fused_moe/kernels.py),
                                                 the routing's top-k kernel (routing_triton.py)
"""

from __future__ import annotations

import inspect
import json
import re
import sys


def compile_sm90(kernel, pointers: dict[str, str], constexprs: dict, pdl: bool, num_warps: int = 4) -> dict:
    """Compile `kernel` for sm90: `pointers` its pointer arguments' types, every other argument an i32."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # a constexpr the caller leaves at its default is one, as at a launch (not an i32 branched on at run time)
    defaults = {p.name: p.default for p in kernel.params if p.is_constexpr and p.default is not inspect.Parameter.empty}
    constexprs = {**defaults, **constexprs, "PDL": pdl}
    signature = {name: pointers.get(name, "constexpr" if name in constexprs else "i32") for name in kernel.arg_names}
    # what Triton assumes at a launch on real shapes: 16-byte aligned pointers, sizes and strides divisible by 16
    aligned = [i for i, name in enumerate(kernel.arg_names)
               if name not in ("M", "k_steps") and signature[name] != "constexpr"]
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs,
                       attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": 4, "launch_pdl": pdl})
    ptx = compiled.asm["ptx"]
    return {"wgmma": "wgmma" in ptx, "e4m3": "e4m3" in ptx, "bf16": "bf16" in ptx, "cp_async": "cp.async" in ptx,
            "shared": compiled.metadata.shared, "gdc_wait": "griddepcontrol.wait" in ptx,
            "gdc_launch": "griddepcontrol.launch_dependents" in ptx, "launch_pdl": bool(compiled.metadata.launch_pdl),
            "add_f32": len(re.findall(r"\badd(\.rn)?\.f32\b", ptx)), "ld_v4": ptx.count("ld.global.v4.b32"),
            "ld_v4_before_wait": ptx.partition("griddepcontrol.wait")[0].count("ld.global.v4.b32"),
            "ld_before_wait": ptx.partition("griddepcontrol.wait")[0].count("ld.global"),
            # global loads past the first barrier after the wait (a K loop's or a reduction's): each is a DRAM or L2
            # round trip the program's end waits for
            "ld_after_barrier": ptx.split("griddepcontrol.wait", 1)[-1].partition("bar.sync")[2].count("ld.global")}


def fp8_gemm(block_m: int, split: bool, pdl: bool, promote: int = 128) -> dict:
    from kiln.models.quant.fp8_kernel import _fp8_gemm_kernel

    pointers = {"x_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "ws_ptr": "*fp32",
                "out_ptr": "*fp32" if split else "*bf16"}
    return compile_sm90(_fp8_gemm_kernel, pointers, {"BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_K": 256,
                                                     "SPLIT": split, "EVEN_K": True, "EVEN_N": True, "SCALED": True,
                                                     "PROMOTE": promote},
                        pdl)


def epilogue(name: str, *args: str) -> dict:
    """An epilogue kernel at a decode tile (16 tokens, 64 weight rows, K steps of 128 bf16), with PDL."""
    from kiln.models import gemm_epilogues

    tile = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "EVEN_K": True}
    if name in ("rows", "rows_fp8"):  # the add + norm row kernel after a split-K GEMM (4096 wide), FP8: quantizing
        fp8 = name == "rows_fp8"
        pointers = {**dict.fromkeys(("p_ptr", "xs_ptr", "ws_ptr", "scale_ptr"), "*fp32"),
                    **dict.fromkeys(("res_ptr", "w_ptr", "sum_ptr"), "*bf16"),
                    "out_ptr": "*fp8e4nv" if fp8 else "*bf16",
                    **dict.fromkeys(("eps", "fp8_max", "min_scale"), "fp32")}
        return compile_sm90(gemm_epilogues._add_rms_norm_rows_kernel, pointers,
                            {"SPLIT_K": 4, "SCALED": fp8, "QUANT": fp8, "BLOCK": 4096}, True)
    if name in ("add_norm", "norm_rope"):  # kiln/passes/kernels.py: the add + RMSNorm row kernel; the q/k norm +
        # RoPE kernel in its cache-writing form, the cache bf16 or (KV_FP8 1) e4m3
        from kiln.passes import kernels

        if name == "add_norm":
            pointers = {**dict.fromkeys(("x_ptr", "r_ptr", "w_ptr", "out_ptr", "sum_ptr"), "*bf16"), "eps": "fp32"}
            return compile_sm90(kernels._add_rms_norm_kernel, pointers, {"BLOCK": 4096, "ADD": True}, True, 16)
        kv_fp8 = bool(int(args[0]))
        pointers = {**{n: "*bf16" for n in kernels._norm_rope_kernel.arg_names if n.endswith("_ptr")},
                    "pos_ptr": "*i64", "cs_ptr": "*fp32", "slot_ptr": "*i64",
                    "cache_ptr": "*fp8e4nv" if kv_fp8 else "*bf16",
                    **dict.fromkeys(("eps", "k_scale", "v_scale"), "fp32")}
        return compile_sm90(kernels._norm_rope_kernel, pointers, {"HEAD_DIM": 128, "HALF": 64, "BLOCK": 64,
                                                                  "PAGE": 16, "NORM": True, "TO_CACHE": True,
                                                                  "KV_FP8": kv_fp8}, True)
    if name == "gemv_route":  # the matrix-vector kernel finishing a split-K projection's row, a router's sums out
        from kiln.models import gemv

        pointers = {**dict.fromkeys(("x_ptr", "out_ptr"), "*fp32"), "eps": "fp32",
                    **dict.fromkeys(("w_ptr", "res_ptr", "g_ptr", "h_ptr", "n_ptr"), "*bf16")}
        return compile_sm90(gemv._gemv_kernel, pointers, {"R": 4, "KP": 2048, "MODE": gemv.PARTIALS, "SPLITS": 4}, True)
    if name == "gate_up":
        pointers = dict.fromkeys(("x_ptr", "w_ptr", "out_ptr"), "*bf16")
        return compile_sm90(gemm_epilogues._gate_up_silu_mul_kernel, pointers, {**tile, "EVEN_N": True}, True)
    pointers = {**dict.fromkeys(("x_ptr", "w_ptr", "q_ptr", "k_ptr", "v_ptr"), "*bf16"), "pos_ptr": "*i64",
                "cs_ptr": "*fp32"}
    return compile_sm90(gemm_epilogues._qkv_rope_kernel, pointers,
                        {**tile, "NUM_HEADS": 32, "NUM_KV_HEADS": 8, "HEAD_DIM": 128}, True)


def moe(name: str) -> dict:
    """The pair path's down kernel at Qwen3-30B-A3B's one-token tile (8 slots, 2 rows, 4 KB a step; e4m3: 256 K),
    whole tiles; or the grouped path's sum over a token's 8 pair rows; or the top-k kernel over Qwen3-30B-A3B's 128
    experts from one split of the router's sums."""
    from kiln.models.fused_moe import kernels, routing_triton

    if name == "top_k":
        import triton.language as tl

        pointers = {"logits_ptr": "*fp32", "weights_ptr": "*fp32", "ids_ptr": "*i32"}
        constexprs = {"TOPK": 8, "K_POW2": 8, "E_POW2": 128, "RENORMALIZE": True, "SPLIT_K": 1,
                      "LOGIT_DTYPE": tl.bfloat16}
        return compile_sm90(routing_triton._moe_topk_kernel, pointers, constexprs, True, num_warps=1)

    if name == "sum_pairs":
        pointers = {"y_ptr": "*bf16", "ids_ptr": "*i32", "out_ptr": "*bf16"}
        constexprs = {"TOPK": 8, "BLOCK": kernels.SUM_BLOCK, "REMOTE": True}
        return compile_sm90(kernels._sum_pairs_kernel, pointers, constexprs, True, num_warps=1)
    fp8 = name == "token_down_fp8"
    pointers = {"h_ptr": "*bf16", "w_ptr": "*fp8e4nv" if fp8 else "*bf16", "ws_ptr": "*fp32", "tw_ptr": "*fp32",
                "ids_ptr": "*i32", "y_ptr": "*bf16"}
    return compile_sm90(kernels._token_down_kernel, pointers, {"TOPK": 8, "TOPK_POW2": 8, "BLOCK_N": 2,
                                                               "BLOCK_K": 256 if fp8 else 128, "SCALED": fp8,
                                                               "MASKED": False}, True)


if __name__ == "__main__":
    if sys.argv[1].startswith(("token_down", "sum_pairs", "top_k")):
        print(json.dumps(moe(sys.argv[1])))
    elif sys.argv[1].isdigit():
        print(json.dumps(fp8_gemm(int(sys.argv[1]), bool(int(sys.argv[2])), bool(int(sys.argv[3])),
                                  *map(int, sys.argv[4:5]))))
    else:
        print(json.dumps(epilogue(*sys.argv[1:])))
