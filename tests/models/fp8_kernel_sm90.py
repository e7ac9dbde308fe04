"""Compile kiln's FP8 GEMM kernel ahead of time for sm90 and print what the PTX holds, as JSON.

Run as its own process by tests/models/test_fp8_kernel.py: Triton must be imported with TRITON_INTERPRET
unset for a real compile (its own library functions are defined interpreted otherwise), and a test session
may have imported it under the interpreter.
    python -m tests.models.fp8_kernel_sm90 BLOCK_M SPLIT(0|1) PDL(0|1)
"""

from __future__ import annotations

import json
import sys


def compile_sm90(block_m: int, split: bool, pdl: bool) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kiln.models.quant.fp8_kernel import _fp8_gemm_kernel as kernel

    signature = {name: "i32" for name in ("M", "N", "K", "k_steps", "s_xm", "s_wn", "s_om", "s_op")}
    signature |= {"x_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "ws_ptr": "*fp32",
                  "out_ptr": "*fp32" if split else "*bf16"}
    constexprs = {"BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_K": 256, "SPLIT": split, "EVEN_K": True, "EVEN_N": True,
                  "SCALED": True, "PDL": pdl}
    signature |= dict.fromkeys(constexprs, "constexpr")
    signature = {name: signature[name] for name in kernel.arg_names}
    # what Triton assumes at a launch on real shapes: 16-byte aligned pointers, sizes and strides divisible by 16
    aligned = [i for i, name in enumerate(kernel.arg_names)
               if name not in ("M", "k_steps") and signature[name] != "constexpr"]
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs,
                       attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4, "num_stages": 4, "launch_pdl": pdl})
    ptx = compiled.asm["ptx"]
    return {"wgmma": "wgmma" in ptx, "e4m3": "e4m3" in ptx, "cp_async": "cp.async" in ptx,
            "shared": compiled.metadata.shared, "gdc_wait": "griddepcontrol.wait" in ptx,
            "gdc_launch": "griddepcontrol.launch_dependents" in ptx, "launch_pdl": bool(compiled.metadata.launch_pdl)}


if __name__ == "__main__":
    print(json.dumps(compile_sm90(int(sys.argv[1]), bool(int(sys.argv[2])), bool(int(sys.argv[3])))))
