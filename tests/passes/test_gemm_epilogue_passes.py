"""The passes that hand an element-wise step to the GEMM before it (kiln/models/gemm_epilogues.py):

- gate_up_silu_mul: `silu(gate) * up` over the halves of `kiln::dense_gemm(x, W_gate_up)` becomes
  `kiln::gate_up_silu_mul(x, W_gate_up)` (post-grad);
- qkv_rope: the RoPE of q and k split from `kiln::dense_gemm(x, W_qkv)` becomes `kiln::qkv_rope` (post-grad, the
  rotation found by its module record);
- gemm_add_rmsnorm: `rms_norm(kiln::dense_gemm(x, W) + residual)`, the sum kept too, becomes
  `kiln::gemm_add_rms_norm(x, W, residual, w_norm, eps)` (post-grad).

kiln::dense_gemm appears only in CUDA graphs (16-bit projections), so here a 16-bit tiny model is traced with the
op let onto the CPU (its torch.mm path) and the rewritten graphs run against the originals; the kernels and the
ops' dispatch are checked in tests/models/test_gemm_epilogues.py, the passes on a GPU in test_gpu_passes.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from kiln import Runtime
from kiln.compiler.ranges import CompileKey
from kiln.models import dense_gemm
from kiln.passes import PassConfig
from kiln.passes.base import PassEnv
from kiln.passes.gate_up_silu_mul import GateUpSiluMulPass
from kiln.passes.gemm_add_rmsnorm import GemmAddRMSNormPass
from kiln.passes.manager import PassManager
from kiln.passes.ops import rms_norm_ref
from tests.passes.conftest import NUM_LAYERS, PROMPT
from tests.passes.harness import capture, each_piece_with

INTER = 48


def mlp_head(x: torch.Tensor, w_gate_up: torch.Tensor, w_other: torch.Tensor) -> tuple[torch.Tensor, ...]:
    gate_up = torch.ops.kiln.dense_gemm(x, w_gate_up)
    gate, up = gate_up.reshape(-1, 2 * INTER).split(INTER, dim=-1)
    other = torch.ops.kiln.dense_gemm(x, w_other)  # a GEMM of something else: left alone
    return F.silu(gate) * up, other


def run_pass(fn, *args: torch.Tensor, kind: type = GateUpSiluMulPass) -> tuple[torch.fx.GraphModule, int]:
    import kiln.models.dense_gemm  # noqa: F401 - registers kiln::dense_gemm
    import kiln.models.quant.fp8_gemm  # noqa: F401 - registers kiln::fp8_gemm

    gm = make_fx(fn, tracing_mode="fake")(*args)
    count = kind(PassConfig(), PassEnv()).apply_post_grad(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return gm, count


def test_the_gate_up_gemm_takes_the_silu_mul_and_numbers_stay() -> None:
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(20, 32, generator=g), torch.randn(2 * INTER, 32, generator=g) * 0.2,
            torch.randn(8, 32, generator=g) * 0.2)  # 20 tokens: the ops' torch.mm paths, on the CPU
    gm, count = run_pass(mlp_head, *args)
    assert count == 1
    code = gm.code
    assert code.count("kiln.gate_up_silu_mul") == 1 and code.count("kiln.dense_gemm.") == 1
    assert "silu" not in code.replace("gate_up_silu_mul", "") and "aten.mul" not in code
    for got, want in zip(gm(*args), mlp_head(*args)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_gate_up_output_with_another_user_is_left_alone() -> None:
    def both(x: torch.Tensor, w_gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate_up = torch.ops.kiln.dense_gemm(x, w_gate_up)
        gate, up = gate_up.split(INTER, dim=-1)
        return F.silu(gate) * up, gate_up.sum()

    assert run_pass(both, torch.randn(20, 32), torch.randn(2 * INTER, 32))[1] == 0


def into_the_residual(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor,
                      norm_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A projection joining the residual stream and the next layer's norm, as the model's RMSNorm(x, residual)."""
    summed = residual + torch.ops.kiln.dense_gemm(x, w).reshape(residual.shape)
    return rms_norm_ref(summed, norm_weight, 1e-5), summed


def test_the_projection_takes_the_add_and_norm_after_it_and_numbers_stay() -> None:
    g = torch.Generator().manual_seed(3)
    args = (torch.randn(20, 32, generator=g), torch.randn(24, 32, generator=g) * 0.2, torch.randn(20, 24, generator=g),
            1 + 0.1 * torch.randn(24, generator=g))  # 20 tokens: the ops' torch.mm paths, on the CPU
    gm, count = run_pass(into_the_residual, *args, kind=GemmAddRMSNormPass)
    assert count == 1
    code = gm.code
    assert code.count("kiln.gemm_add_rms_norm") == 1 and "kiln.dense_gemm" not in code and "rsqrt" not in code
    for got, want in zip(gm(*args), into_the_residual(*args)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


class Fp8IntoTheResidual(torch.nn.Module):
    """An FP8 projection (fp8_linear's CUDA form) joining the residual stream, the next norm and its quantization;
    `twice`: the normalised row also feeds something else."""

    def __init__(self, twice: bool = False) -> None:
        super().__init__()
        from kiln.models.layers import RMSNorm
        from kiln.models.quant.fp8 import quantize_weight

        g = torch.Generator().manual_seed(4)
        self.norm = RMSNorm(24, 1e-5).to(torch.bfloat16)
        torch.nn.init.normal_(self.norm.weight, 1.0, 0.1)
        self.wq, self.ws = quantize_weight(torch.randn(24, 32, generator=g) * 0.2)
        self.twice = twice

    def forward(self, xq: torch.Tensor, xs: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, ...]:
        from kiln.models.quant.fp8 import quantize_per_token

        y = torch.ops.kiln.fp8_gemm(xq, self.wq, xs, self.ws, torch.bfloat16)
        normed, summed = self.norm(y, residual)
        return (*quantize_per_token(normed), summed, *((normed.sum(),) if self.twice else ()))


@pytest.mark.parametrize("twice", [False, True])
def test_an_fp8_projection_takes_the_add_norm_and_quantization_after_it(twice: bool) -> None:
    """FP8 (post-grad, as Inductor normalises it): the GEMM, add, norm and per-token quantization become
    kiln::fp8_gemm_add_rms_norm_quant, whose CPU path runs the same torch ops (the same values); a normalised row
    with another user besides the quantization is left alone."""
    import kiln.models.quant.fp8_gemm  # noqa: F401 - registers kiln::fp8_gemm
    from kiln.models.quant.fp8 import quantize_per_token
    from kiln.passes.gemm_add_rmsnorm import GemmAddRMSNormPass  # noqa: F401 - the pass the manager runs
    from tests.passes.harness import post_grad

    gm_box: dict = {}

    def backend(gm, inputs):
        gm_box["gm"], gm_box["inputs"] = gm, list(inputs)
        return gm.forward

    xq, xs = quantize_per_token(torch.randn(7, 32, generator=torch.Generator().manual_seed(5)))
    residual = torch.randn(7, 24).bfloat16()
    torch._dynamo.reset()
    torch.compile(Fp8IntoTheResidual(twice), backend=backend, fullgraph=True)(xq, xs, residual)
    torch._dynamo.reset()
    manager = PassManager(PassConfig.from_names(["gemm_add_rmsnorm"]))
    before, after = post_grad(gm_box["gm"], CompileKey.size(7), manager)
    assert manager.matches["piece"].get("gemm_add_rmsnorm", 0) == (0 if twice else 1)
    if twice:
        return
    code = after.code
    assert code.count("kiln.fp8_gemm_add_rms_norm_quant") == 1 and "kiln.fp8_gemm." not in code
    assert "amax" not in code and "rsqrt" not in code
    with torch.inference_mode():
        for got, want in zip(after(*gm_box["inputs"]), before(*gm_box["inputs"])):
            assert torch.equal(got.float(), want.float())


def test_a_sum_with_no_gemm_or_a_shared_gemm_is_left_alone() -> None:
    def shared(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor):
        y = torch.ops.kiln.dense_gemm(x, w)
        summed = residual + y
        return rms_norm_ref(summed, norm_weight, 1e-5), summed, y.sum()

    def no_gemm(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor):
        summed = residual + x @ w.t()
        return rms_norm_ref(summed, norm_weight, 1e-5), summed

    args = (torch.randn(20, 32), torch.randn(24, 32), torch.randn(20, 24), torch.ones(24))
    assert run_pass(shared, *args, kind=GemmAddRMSNormPass)[1] == 0
    assert run_pass(no_gemm, *args, kind=GemmAddRMSNormPass)[1] == 0


@pytest.fixture
def captured_16_bit(tiny_checkpoint, monkeypatch: pytest.MonkeyPatch):
    """preset -> its bf16 graph captured on the CPU with kiln::dense_gemm let onto it (its torch.mm path)."""
    monkeypatch.setattr(dense_gemm, "applies", lambda x, bias: bias is None and x.dtype == torch.bfloat16)
    monkeypatch.setattr(dense_gemm, "TRITON_MAX_M", 0)  # the capture's eager run takes torch.mm

    def get(preset: str):
        runtime = Runtime(str(tiny_checkpoint(preset)[0]), level=0, device="cpu", dtype="bf16",
                          max_num_batched_tokens=32, max_num_seqs=4, num_blocks=8)
        return capture(runtime, PROMPT)

    return get


@pytest.mark.parametrize("key", [CompileKey.size(len(PROMPT)), CompileKey.range(1, 32)], ids=["size", "range"])
def test_matches_once_per_layer_in_a_16_bit_models_graph(captured_16_bit, key: CompileKey) -> None:
    total = 0
    for before, after, matched, copies in each_piece_with(captured_16_bit("tiny-llama").gm, key, "gate_up_silu_mul"):
        total += matched * copies
        assert str(after.graph).count("kiln.gate_up_silu_mul") == matched
        assert str(after.graph).count("kiln.dense_gemm.") == str(before.graph).count("kiln.dense_gemm.") - matched
    assert total == NUM_LAYERS


# tiny-qwen3-moe: three o projections, and the dense middle layer's down projection; an expert layer's rows
# summed over its top k are no GEMM's
@pytest.mark.parametrize("preset,expected", [("tiny-llama", 2 * NUM_LAYERS), ("tiny-qwen3", 2 * NUM_LAYERS),
                                             ("tiny-qwen3-moe", 3 + 1)])
def test_gemm_add_rmsnorm_takes_both_norms_after_the_first(captured_16_bit, preset: str, expected: int) -> None:
    """Each layer's o projection into its post-attention norm, each down projection into the next layer's input
    norm (the last one into the final norm): 2 a layer, the first layer's input norm (of the embedding) left."""
    total = 0
    for before, after, matched, copies in each_piece_with(captured_16_bit(preset).gm, CompileKey.range(1, 32),
                                                          "gemm_add_rmsnorm"):
        total += matched * copies
        assert str(after.graph).count("kiln.gemm_add_rms_norm") == matched
        assert str(after.graph).count("kiln.dense_gemm.") == str(before.graph).count("kiln.dense_gemm.") - matched
    assert total == expected


# qkv_rope: every layer of a Llama; none where q and k pass a norm first (Qwen3: qk_norm_rope's) or the qkv
# projection has a bias (Qwen2: F.linear, no kiln::dense_gemm)
@pytest.mark.parametrize("preset,expected", [("tiny-llama", NUM_LAYERS), ("tiny-qwen3", 0), ("tiny-qwen2", 0)])
def test_qkv_rope_takes_each_layers_rotation(captured_16_bit, preset: str, expected: int) -> None:
    total = 0
    for before, after, matched, copies in each_piece_with(captured_16_bit(preset).gm, CompileKey.range(1, 32),
                                                          "qkv_rope"):
        total += matched * copies
        code, old = str(after.graph), str(before.graph)
        assert code.count("kiln.qkv_rope") == matched
        assert code.count("kiln.dense_gemm.") == old.count("kiln.dense_gemm.") - matched
        if matched:  # no rotation (its cache lookup), split or V copy left beside the op
            assert "aten.index.Tensor" not in code and "split_with_sizes" not in code and "clone" not in code
    assert total == expected


def test_kiln_passes_replaces_the_levels_defaults_for_an_ab(monkeypatch: pytest.MonkeyPatch) -> None:
    """KILN_PASSES (an A/B at default settings) stands in for the level's set; an explicit `passes=` still wins."""
    from types import SimpleNamespace

    from kiln import config as kiln_config
    from kiln.passes.config import LEVEL_DEFAULTS

    monkeypatch.setattr(kiln_config, "pdl_enabled", lambda device: False)  # no CUDA query on a CPU machine

    def level_two(**kwargs) -> PassConfig:  # a GPU's -O2, resolved as the worker resolves it
        resolved = kiln_config.CompilationConfig(level=2, **kwargs).resolve(torch.device("cuda"), 8192)
        return PassConfig.from_compilation(resolved)

    assert level_two() == PassConfig.from_names(LEVEL_DEFAULTS[2])
    monkeypatch.setenv("KILN_PASSES", "qkv_rope+gate_up_silu_mul")
    assert level_two().enabled == ("qkv_rope", "gate_up_silu_mul")
    assert level_two(passes=("noop",)).enabled == ("noop",)
    monkeypatch.setenv("KILN_PASSES", "")
    assert level_two().enabled == ()
    monkeypatch.setenv("KILN_PASSES", "qkv_rope,fast")
    with pytest.raises(ValueError, match="unknown compiler pass 'fast'"):
        level_two()
    with pytest.raises(ValueError, match="resolved"):  # an unresolved config names no list
        PassConfig.from_compilation(SimpleNamespace(enable_passes=True, passes=None, level=2))


@pytest.mark.slow
def test_qkv_rope_through_a_real_compile_keeps_greedy_tokens(tiny_checkpoint, monkeypatch, tmp_path) -> None:
    """-O2 end to end on the CPU (kiln::dense_gemm let onto it): the rewritten post-grad graphs compile and run (the
    op's outputs carry fake values of the graph's own fake mode), and generate the tokens they generate without the
    pass."""
    from kiln import SamplingParams
    from kiln.passes import pass_manager_of

    monkeypatch.setattr(dense_gemm, "applies", lambda x, bias: bias is None and x.dtype == torch.bfloat16)
    monkeypatch.setattr(dense_gemm, "TRITON_MAX_M", 0)
    options = dict(level=2, device="cpu", dtype="bf16", max_num_batched_tokens=32, max_num_seqs=4, num_blocks=64,
                   compile_sizes=())
    path, greedy = str(tiny_checkpoint("tiny-llama")[0]), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [PROMPT, PROMPT[:3], list(range(40, 61))]
    outs = {}
    # the debug dump turns the compile caches off: the capture really runs the pass
    for label, extra in (("off", {"enable_passes": False}),
                         ("on", {"passes": ("qkv_rope",), "debug_dump_path": str(tmp_path)})):
        rt = Runtime(path, **options, **extra)
        outs[label] = [o.outputs[0].token_ids for o in rt.generate(prompts, greedy)]
        if label == "on":
            assert pass_manager_of(rt.engine.worker.compiled).total("qkv_rope") >= NUM_LAYERS
    assert outs["on"] == outs["off"]


@pytest.mark.slow
def test_qkv_rope_matches_in_compile_workers(tiny_checkpoint, monkeypatch, tmp_path) -> None:
    """A GPU host compiles pieces in worker processes, which receive them pickled: the pass still finds the rotations
    by the module records that travel beside them (kiln/compiler/node_meta.py; without, it matched nothing there)."""
    from kiln.passes import pass_manager_of

    monkeypatch.setattr(dense_gemm, "applies", lambda x, bias: bias is None and x.dtype == torch.bfloat16)
    monkeypatch.delenv("KILN_DISABLE_COMPILE_CACHE", raising=False)  # workers serve the compile cache's misses
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))  # an empty cache: every piece compiles, in a worker
    rt = Runtime(str(tiny_checkpoint("tiny-llama")[0]), level=2, device="cpu", dtype="bf16", max_num_batched_tokens=32,
                 max_num_seqs=4, num_blocks=8, compile_sizes=(), compile_workers=2, passes=("qkv_rope",))
    assert rt.compile_stats.worker_compiles == rt.compile_stats.inductor_compiles > 0
    assert pass_manager_of(rt.engine.worker.compiled).total("qkv_rope") == NUM_LAYERS
def residual_into_the_next_gemm(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                                w_next: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """After gemm_add_rmsnorm: the normalised row into a dense projection and into a gate_up one; a third row
    (another projection's) also feeds a sum, so it stays; a fourth into a MoE router and the experts (its rows
    scaled here)."""
    import kiln.models.fused_moe.routing  # noqa: F401 - registers kiln::moe_route

    normed, summed = torch.ops.kiln.gemm_add_rms_norm(x, w, residual, norm_weight, 1e-5)
    qkv = torch.ops.kiln.dense_gemm(normed, w_next)
    normed2, summed2 = torch.ops.kiln.gemm_add_rms_norm(x, w, summed, norm_weight, 1e-5)
    act = torch.ops.kiln.gate_up_silu_mul(normed2, w_next)
    normed3, _ = torch.ops.kiln.gemm_add_rms_norm(x, w, summed2, norm_weight, 1e-5)
    normed4, summed4 = torch.ops.kiln.gemm_add_rms_norm(x, w, summed2, norm_weight, 1e-5)
    weights, ids = torch.ops.kiln.moe_route(normed4, w_next, 3, True)
    return (qkv, act, summed2, torch.ops.kiln.dense_gemm(normed3, w_next), normed3.sum(), weights, ids,
            normed4 * weights.sum(-1, keepdim=True).to(normed4.dtype), summed4)


def test_the_next_projection_takes_the_norm_and_numbers_stay() -> None:
    """rmsnorm_gemm: a normalised row whose one user is the next projection's GEMM becomes kiln::gemm_add_rms_norm_gemm,
    one into a router (whatever else reads it) kiln::gemm_add_rms_norm_route (their CPU path is the two ops: the same
    values); a row with another user is left alone, and so is every row whose next weight the matrix-vector kernel
    never takes (fp32 here)."""
    from kiln.passes.rmsnorm_gemm import RMSNormGemmPass

    g = torch.Generator().manual_seed(6)
    args = (torch.randn(20, 32, generator=g), torch.randn(24, 32, generator=g) * 0.2, torch.randn(20, 24, generator=g),
            1 + 0.1 * torch.randn(24, generator=g), torch.randn(2 * INTER, 24, generator=g) * 0.2)
    assert run_pass(residual_into_the_next_gemm, *args, kind=RMSNormGemmPass)[1] == 0
    args = tuple(a.to(torch.bfloat16) for a in args)
    gm, count = run_pass(residual_into_the_next_gemm, *args, kind=RMSNormGemmPass)
    assert count == 3
    code = gm.code
    assert code.count("kiln.gemm_add_rms_norm_gemm") == 2 and code.count("kiln.gemm_add_rms_norm.") == 1
    assert "gate_up_silu_mul" not in code and code.count("kiln.dense_gemm") == 1
    assert code.count("kiln.gemm_add_rms_norm_route") == 1 and "moe_route" not in code.replace("norm_route", "")
    for got, want in zip(gm(*args), residual_into_the_next_gemm(*args)):
        assert torch.equal(got, want)


def test_rmsnorm_gemm_takes_each_norm_but_the_final_one(captured_16_bit) -> None:
    """After gemm_add_rmsnorm and gate_up_silu_mul: each post-attention norm into the gate_up GEMM and each layer's
    input norm into its qkv GEMM but the first's (of the embedding); the final norm feeds no projection here."""
    total = 0
    pieces = each_piece_with(captured_16_bit("tiny-llama").gm, CompileKey.range(1, 32), "rmsnorm_gemm",
                             after=("gemm_add_rmsnorm", "gate_up_silu_mul"))
    for _, after, matched, copies in pieces:
        total += matched * copies
        assert str(after.graph).count("kiln.gemm_add_rms_norm_gemm") == matched
    assert total == 2 * NUM_LAYERS - 1


def test_rmsnorm_gemm_takes_each_routers_norm(captured_16_bit) -> None:
    """tiny-qwen3-moe (expert, dense, expert layers): each expert layer's post-attention norm into its router, which
    the experts then read from the new op; the dense layer's into its gate_up, and the last layer's input norm
    (after the dense layer's down projection) into its qkv. An expert layer's output is no GEMM's: the next input
    norm stays."""
    routes = gemms = 0
    pieces = each_piece_with(captured_16_bit("tiny-qwen3-moe").gm, CompileKey.range(1, 32), "rmsnorm_gemm",
                             after=("gemm_add_rmsnorm", "gate_up_silu_mul"))
    for _, after, matched, copies in pieces:
        code = str(after.graph)
        assert code.count("kiln.gemm_add_rms_norm_route") + code.count("kiln.gemm_add_rms_norm_gemm") == matched
        assert "kiln.moe_route" not in code or "kiln.fused_moe" not in code  # no router left beside its experts
        routes += code.count("kiln.gemm_add_rms_norm_route") * copies
        gemms += code.count("kiln.gemm_add_rms_norm_gemm") * copies
    assert (routes, gemms) == (2, 2)
