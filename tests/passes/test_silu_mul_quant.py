"""silu_mul_quant on an FP8 model (CPU): it matches the SiLU-mul + per-token quantization once per layer in the
post-grad graph (for an exact size and for a range), its op computes the unfused graph's arithmetic, and a
compiled runtime with it gives the eager model's greedy tokens and logits. The op's Triton kernel is checked
in test_kernels.py."""

from __future__ import annotations

import pytest
import torch

from kiln import Runtime, SamplingParams
from kiln.compiler.ranges import CompileKey
from kiln.models.quant.fp8 import quantize_per_token
from tests.conftest import prompt_logits
from tests.passes.conftest import NUM_LAYERS, PROMPT
from tests.passes.harness import capture, each_piece_with

FP8 = dict(device="cpu", dtype="bf16", quantization="fp8", max_num_batched_tokens=32, max_num_seqs=4, num_blocks=16)


@pytest.mark.parametrize("key", [CompileKey.size(len(PROMPT)), CompileKey.range(1, 32)], ids=["size", "range"])
def test_matches_once_per_layer(tiny_checkpoint, key: CompileKey) -> None:
    cap = capture(Runtime(str(tiny_checkpoint("tiny-llama")[0]), level=0, **FP8), PROMPT)
    total = 0
    for before, after, matched, copies in each_piece_with(cap.gm, key, "silu_mul_quant"):
        total += matched * copies
        assert str(after.graph).count("kiln.silu_mul_quant") == matched
        # the quantization's own amax went with it; the others' (the norms before q/k/v and gate_up) stay
        assert str(after.graph).count("aten.amax") == str(before.graph).count("aten.amax") - matched
    assert total == NUM_LAYERS


def test_op_is_the_unfused_arithmetic() -> None:
    import kiln.passes.ops  # noqa: F401 - registers the op

    x = (torch.randn(5, 2 * 48, generator=torch.Generator().manual_seed(0)) * 3).to(torch.bfloat16)
    gate, up = x.chunk(2, -1)
    q, scale = torch.ops.kiln.silu_mul_quant(x)
    ref_q, ref_scale = quantize_per_token(torch.nn.functional.silu(gate.float()).to(x.dtype) * up)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (5, 1)
    torch.testing.assert_close(scale, ref_scale, atol=0, rtol=2 ** -8)  # silu's decomposition: within an ulp
    assert ((q.float() - ref_q.float()).abs() <= ref_q.float().abs() * 2 ** -3 + 2 ** -9).all()


@pytest.mark.slow
def test_compiled_with_the_pass_gives_eager_tokens(tiny_checkpoint, tmp_path) -> None:
    from kiln.passes import pass_manager_of

    path, params = str(tiny_checkpoint("tiny-llama")[0]), SamplingParams(max_tokens=6, temperature=0.0)
    prompts = [PROMPT, PROMPT[:5], list(range(40, 61))]
    eager = Runtime(path, level=0, **FP8)
    # the debug dump turns Inductor's cache off: the pieces really run the pass here
    fused = Runtime(path, level=2, passes=("silu_mul_quant",), compile_sizes=(), debug_dump_path=str(tmp_path),
                    **FP8)
    matches = pass_manager_of(fused.engine.worker.compiled).matches
    assert sum(m.get("silu_mul_quant", 0) for m in matches.values()) >= 1
    assert [o.outputs[0].token_ids for o in fused.generate(prompts, params)] == \
        [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    torch.testing.assert_close(prompt_logits(fused, PROMPT), prompt_logits(eager, PROMPT), atol=0.05, rtol=0)
