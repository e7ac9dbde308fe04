"""Compiled end to end (-O2, Inductor C++ on CPU): greedy generation is identical with passes on and off.

Per model: all passes on vs passes disabled (same tokens, same logits, and the expected rewrite counts
from the real compile); on Qwen3, which has every pattern, each pass alone vs disabled; and the -O2
default pass set. Runtimes are built once per module: each costs a few Inductor compiles.
"""

from __future__ import annotations

import pytest

from kiln import Runtime, SamplingParams
from kiln.passes import ALL_PASSES, PassConfig, pass_manager_of
from kiln.passes.config import CUDA_ONLY_PASSES, level_defaults
from kiln.passes.manager import GRAPH_SCOPE
from tests.conftest import prompt_logits, random_prompts
from tests.passes.conftest import NUM_LAYERS, PRESETS

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = random_prompts([1, 6, 21, 40, 3], 256, seed=5)  # budget 32: chunked prefills mixed with decodes
OPTIONS = dict(level=2, device="cpu", dtype="fp32", max_num_batched_tokens=32, max_num_seqs=4, num_blocks=64,
               compile_sizes=())
# qk norms go into rope_kv, and so do the rotations qkv_rope (post-grad, on a GPU's kiln::dense_gemm) would take
GRAPH_COUNTS = {"noop": NUM_LAYERS, "rope_kv": NUM_LAYERS, "qk_norm_rope": 0}
# one rank: the model has no all-reduce, so allreduce_rmsnorm has nothing to match (its TP=2 counts are in
# tests/passes/test_allreduce_rmsnorm.py)
# no FP8 quantization in these models, and no kiln::dense_gemm on the CPU: silu_mul_quant, gate_up_silu_mul,
# gemm_add_rmsnorm and rmsnorm_gemm (which takes the ops of the last two) have nothing to match
PIECE_COUNTS = {"add_rmsnorm": 2 * NUM_LAYERS + 1, "silu_mul": NUM_LAYERS, "noop": 0, "allreduce_rmsnorm": 0,
                "silu_mul_quant": 0, "gate_up_silu_mul": 0, "gemm_add_rmsnorm": 0, "qkv_rope": 0, "rmsnorm_gemm": 0}


@pytest.fixture(scope="module")
def runtime(tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory):
    made: dict[tuple[str, tuple[str, ...] | None], Runtime] = {}

    def get(preset: str, passes: tuple[str, ...] | None) -> Runtime:
        """passes: () disables them, None takes the level's default set. With passes, the debug dump is on:
        it also turns Inductor's cache off, so every piece really runs the post-grad passes (and counts)."""
        if (preset, passes) not in made:
            extra: dict = {"enable_passes": False} if passes == () else {} if passes is None else {"passes": passes}
            if passes != ():
                extra["debug_dump_path"] = str(tmp_path_factory.mktemp("dump"))
            made[preset, passes] = Runtime(str(tiny_checkpoint(preset)[0]), **OPTIONS, **extra)
        return made[preset, passes]

    return get


def greedy(rt: Runtime) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in rt.generate(PROMPTS, GREEDY)]


def model_total(rt: Runtime, name: str) -> int:
    """Rewrites by a post-grad pass over every compiled piece of the model, for its one compile range."""
    compiled = rt.engine.worker.compiled
    manager = pass_manager_of(compiled)
    total = 0
    for piece_hash, group in compiled.capture.split.distinct().items():
        scopes = [s for s in manager.matches if s.startswith(piece_hash[:12])]
        assert len(scopes) == 1
        total += manager.matches[scopes[0]].get(name, 0) * len(group)
    return total


@pytest.mark.parametrize("preset", PRESETS)
def test_all_passes_on_vs_off(runtime, preset: str) -> None:
    on, off = runtime(preset, ALL_PASSES), runtime(preset, ())
    assert greedy(on) == greedy(off)
    prompt = random_prompts([19], 256, seed=1)[0]
    diff = (prompt_logits(on, prompt) - prompt_logits(off, prompt)).abs().max().item()
    assert diff < 1e-5, f"{preset}: max |logit diff| {diff:.2e}"
    manager = pass_manager_of(on.engine.worker.compiled)
    assert {n: c for n, c in manager.matches[GRAPH_SCOPE].items() if n in GRAPH_COUNTS} == GRAPH_COUNTS
    for name, expected in PIECE_COUNTS.items():
        assert model_total(on, name) == expected, name
    assert pass_manager_of(off.engine.worker.compiled) is None  # disabled: no hook installed at all
    dumps = manager.dump_dir
    assert (dumps / GRAPH_SCOPE / "01_rope_kv.after.txt").read_text().count("kiln.rope_attention") == NUM_LAYERS


# Only the passes that match something here, on one CPU rank (test_all_passes_on_vs_off has every pass on, each
# counted, the tokens compared): silu_mul_quant needs an FP8 model (tests/passes/test_silu_mul_quant.py),
# allreduce_rmsnorm two ranks (tests/passes/test_allreduce_rmsnorm.py), the CUDA-only ones kiln::dense_gemm
# (tests/passes/test_gemm_epilogue_passes.py)
@pytest.mark.parametrize("name", [n for n in ALL_PASSES
                                  if n not in ("silu_mul_quant", "allreduce_rmsnorm", *CUDA_ONLY_PASSES)])
def test_each_pass_alone_on_qwen3(runtime, name: str) -> None:
    on, off = runtime("tiny-qwen3", (name,)), runtime("tiny-qwen3", ())
    assert greedy(on) == greedy(off)
    manager = pass_manager_of(on.engine.worker.compiled)
    total = manager.matches[GRAPH_SCOPE][name] + model_total(on, name)
    assert total == {**PIECE_COUNTS, "noop": NUM_LAYERS, "rope_kv": NUM_LAYERS, "qk_norm_rope": NUM_LAYERS}[name]


def test_level_two_defaults(runtime) -> None:
    rt = runtime("tiny-llama", None)
    manager = pass_manager_of(rt.engine.worker.compiled)
    # the level's set for this device: off a GPU without the CUDA-only GEMM epilogues (they match nothing there)
    expected = PassConfig.from_names(level_defaults(2, on_gpu=rt.engine.worker.device.type == "cuda")).enabled
    assert tuple(p.name for p in manager.passes) == expected
    assert rt.engine.worker.device.type == "cuda" or not set(expected) & set(CUDA_ONLY_PASSES)
    assert greedy(rt) == greedy(runtime("tiny-llama", ()))
    # the hook Inductor keys its cache with names the pass manager
    hook = rt.engine.worker.compiled.backend.compiler.config_patches["post_grad_custom_post_pass"]
    assert hook.passes == [manager]
