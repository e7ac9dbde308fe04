"""A compile worker must know every kiln:: op a piece may call: a piece naming an unregistered op fails in the
worker and is compiled again in the parent (seen on the H200 under tensor parallelism, 2026-11-30: every
TP piece fell back, because the workers lacked kiln::all_reduce)."""

from __future__ import annotations

import json
import subprocess
import sys

_LIST_OPS = "import torch, json; print(json.dumps(sorted(n for n in torch._C._dispatch_get_all_op_names() " \
            "if n.startswith('kiln::'))))"


def _ops_after(statements: str) -> set[str]:
    code = f"{statements}\n{_LIST_OPS}"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_compile_worker_registers_every_kiln_op_the_models_and_passes_define() -> None:
    in_worker = _ops_after("from kiln.compiler.parallel import _init_worker\n_init_worker({}, 1)")
    everything = _ops_after("import kiln.models.llama, kiln.models.allreduce, kiln.models.dense_gemm, "
                            "kiln.models.quant.fp8_gemm, kiln.models.attention_op, kiln.passes.ops, "
                            "kiln.runtime.engine")
    assert "kiln::all_reduce" in everything and "kiln::dense_gemm" in everything
    assert everything <= in_worker, sorted(everything - in_worker)
