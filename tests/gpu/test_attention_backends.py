"""GPU attention backends (triton, flashinfer) against the torch reference, in and out of CUDA graphs,
and end to end through the Runtime."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kiln import Runtime, SamplingParams
from kiln.attention import AttentionLayout, select_backend
from kiln.attention.base import AttentionBackend, CommonAttentionMetadata
from tests.attention.paged_batch import PagedBatch, make_batch, reference, rel_err, run_backend
from tests.conftest import random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")

CUDA = torch.device("cuda")
BACKENDS = ["triton", "flashinfer"]
HEADS = 16
CASES = {  # (query lengths, contexts already cached): fresh prompts, chunks after long contexts, decodes
    "mixed": ([1, 2048, 37, 1, 300, 16, 700], [8000, 0, 5000, 100, 1500, 16, 2]),
    "decode": ([1] * 7, [0, 15, 16, 17, 4000, 8191, 600]),
    # decodes first, as the scheduler orders a mixed step: Triton sends 8 or more to its decode kernel
    "leading decodes": ([1] * 40 + [2048, 37, 1, 300], [(97 * i) % 3000 for i in range(40)] + [0, 5000, 100, 1500]),
}
TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-4}


def backend_for(name: str, layout: AttentionLayout) -> type[AttentionBackend]:
    try:
        return select_backend(name, layout, CUDA)
    except ValueError as e:  # flashinfer not installed, or fp32 (FlashInfer has no fp32 kernels)
        pytest.skip(str(e))


def poison(name: str) -> float:
    # unowned cache slots are NaN for our kernels (any stray read shows); FlashInfer may stage whole
    # pages into shared memory, so it gets a large finite value that still shows if attended to
    return float("nan") if name == "triton" else 100.0


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", BACKENDS)
def test_backend_matches_reference(name: str, dtype: torch.dtype, group: int, head_dim: int, case: str) -> None:
    cls = backend_for(name, AttentionLayout(HEADS, HEADS // group, head_dim, 1.0, 16, dtype))
    q_lens, contexts = CASES[case]
    batch = make_batch(q_lens, contexts, HEADS, HEADS // group, head_dim, dtype, CUDA, seed=group + head_dim,
                       poison=poison(name))
    out, cache = run_backend(cls(batch.layout, CUDA), batch)
    ref_out, ref_cache = reference(batch)
    err = rel_err(out, ref_out)
    assert err <= TOL[dtype], f"{name} {case}: relative error {err:.2e}"
    # block 0 is the null block: padded tokens write there in any order (or, in fused decode, not at all)
    cache, ref_cache = cache[1:].float(), ref_cache[1:].to(dtype).float()
    owned = ~ref_cache.isnan()
    assert torch.equal(cache[owned], ref_cache[owned])


def _copy_into(dst: PagedBatch, src: PagedBatch, cache: torch.Tensor) -> CommonAttentionMetadata:
    """Load `src` into `dst`'s device buffers (as the runner does each step); the step's common metadata."""
    for a, b in [(dst.q, src.q), (dst.k, src.k), (dst.v, src.v), (cache, src.kv_cache),
                 (dst.common.query_start_loc, src.common.query_start_loc), (dst.common.seq_lens, src.common.seq_lens),
                 (dst.common.block_tables, src.common.block_tables),
                 (dst.common.slot_mapping, src.common.slot_mapping)]:
        a.copy_(b)
    return dataclasses.replace(dst.common, num_tokens=src.common.num_tokens,
                               query_start_loc_cpu=src.common.query_start_loc_cpu,
                               seq_lens_cpu=src.common.seq_lens_cpu, max_query_len=src.common.max_query_len,
                               max_seq_len=src.common.max_seq_len)


@pytest.mark.parametrize("name,q_lens_a,q_lens_b", [
    ("triton", [1] * 5, [1] * 5),
    ("flashinfer", [1] * 5, [1] * 5),
    ("triton", [5, 1, 10, 1, 2], [1, 12, 3, 2, 1]),  # ALWAYS: mixed batches replay too
])
def test_graph_captured_step_replays_a_new_batch(name: str, q_lens_a: list[int], q_lens_b: list[int]) -> None:
    dtype = torch.bfloat16
    cls = backend_for(name, AttentionLayout(32, 8, 128, 1.0, 16, dtype))
    shape = dict(num_heads=32, num_kv_heads=8, head_dim=128, dtype=dtype, device=CUDA, num_blocks=600, width=100,
                 poison=poison(name))
    a = make_batch(q_lens_a, [10, 300, 17, 1000, 64], seed=1, **shape)
    b = make_batch(q_lens_b, [900, 2, 33, 15, 1200], seed=2, **shape)
    backend = cls(a.layout, CUDA)
    cache, out = a.kv_cache.clone(), torch.empty_like(a.q)
    metadata = backend.build_metadata(a.common)
    backend.forward(a.q, a.k, a.v, out, cache, metadata)  # compile/JIT outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.forward(a.q, a.k, a.v, out, cache, metadata)
    backend.build_metadata(_copy_into(a, b, cache))  # the next step: new lengths and blocks, same buffers
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    err = rel_err(out[: b.num_tokens], reference(b)[0])
    assert err <= TOL[dtype], f"{name}: relative error after replay {err:.2e}"


@pytest.fixture(scope="module")
def llama_d64(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 2-layer random Llama with head_dim 64 and GQA 4 (FlashInfer's shapes), logits well separated."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(1234)
    config = LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024, bos_token_id=1,
                         eos_token_id=2, tie_word_embeddings=False)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2 if "embed" in name or "lm_head" in name else 0.05)
    path = tmp_path_factory.mktemp("llama_d64")
    hf.save_pretrained(path)
    return str(path)


def _generate(backend: str, dtype: str, model: str, prompts: list[list[int]], **kwargs) -> tuple[list, list]:
    """Greedy token ids per prompt, and the logits of every step (spied on the runner)."""
    rt = Runtime(model, level=0, device="cuda", dtype=dtype, attention_backend=backend, num_blocks=1024, **kwargs)
    assert rt.engine.backend.name == backend
    steps: list[torch.Tensor] = []
    head = rt.engine.runner._head  # every step's logits pass through it (`forward` is not on the step's path)

    def spy(batch, out):
        logits, greedy = head(batch, out)
        steps.append(logits.float().cpu())
        return logits, greedy

    rt.engine.runner._head = spy
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    tokens = [o.outputs[0].token_ids for o in rt.generate(prompts, params)]
    del rt
    torch.cuda.empty_cache()
    return tokens, steps


def test_greedy_generation_identical_triton_vs_torch_fp32(tiny_checkpoint) -> None:
    model = str(tiny_checkpoint("tiny-llama")[0])
    prompts = random_prompts([5, 17, 40, 3, 33], 256, seed=1)
    # a small token budget forces chunked prefill and mixed prefill/decode steps
    ref, _ = _generate("torch", "fp32", model, prompts, max_num_batched_tokens=24)
    out, _ = _generate("triton", "fp32", model, prompts, max_num_batched_tokens=24)
    assert out == ref


@pytest.mark.parametrize("name", BACKENDS)
def test_bf16_logits_close_to_torch(name: str, llama_d64: str) -> None:
    backend_for(name, AttentionLayout(8, 2, 64, 1.0, 16, torch.bfloat16))
    prompts = random_prompts([50, 130, 7], 512, seed=2)
    ref_tokens, ref_steps = _generate("torch", "bf16", llama_d64, prompts, max_num_batched_tokens=96)
    tokens, steps = _generate(name, "bf16", llama_d64, prompts, max_num_batched_tokens=96)
    # compare step by step (prefill chunks, then decodes) until bf16 rounding first flips a greedy
    # choice: after that the two runs feed different tokens
    compared = 0
    for ref_logits, logits in zip(ref_steps, steps):
        if logits.numel() == 0:  # a prefill chunk that samples nothing
            continue
        err = rel_err(logits, ref_logits)
        assert err <= 3e-2, f"step {compared}: logits relative error {err:.2e}"
        compared += 1
        if not torch.equal(ref_logits.argmax(-1), logits.argmax(-1)):
            break
    print(f"{name}: {compared} steps compared; greedy tokens equal: {tokens == ref_tokens}")
    assert compared >= 1


def test_triton_fp8_cache_write_rounds_like_torch() -> None:
    """On a GPU (unlike the CPU interpreter) the Triton kernels' float -> e4m3 store rounds like torch's cast:
    arbitrary keys/values give the same cache bytes as the torch backend, for prefill and fused decode, and
    outputs within bf16 rounding of it (tests/attention/test_fp8_kv.py runs the exact-value cases)."""
    from kiln.attention.torch_backend import TorchAttentionBackend
    from kiln.attention.triton_backend import TritonAttentionBackend
    from tests.attention.test_fp8_kv import CASES, fp8_batch, run_fp8

    for q_lens, contexts in CASES:
        batch = fp8_batch(q_lens, contexts, 16, 4, 128, torch.bfloat16, seed=len(q_lens))
        out, cache = run_fp8(TritonAttentionBackend(batch.layout, CUDA), batch)
        ref_out, ref_cache = run_fp8(TorchAttentionBackend(batch.layout, CUDA), batch)
        assert rel_err(out, ref_out) <= 1e-2
        assert torch.equal(cache[1:].view(torch.uint8), ref_cache[1:].view(torch.uint8))


def test_flashinfer_refuses_an_fp8_cache() -> None:
    pytest.importorskip("flashinfer")
    layout = AttentionLayout(32, 8, 128, 1.0, 16, torch.bfloat16, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        select_backend("flashinfer", layout, CUDA)
    assert select_backend("auto", layout, CUDA).name == "triton"  # auto falls through to a backend that can


def test_auto_prefers_triton_with_flashinfer_installed() -> None:
    """`auto` takes the measured winner (docs/attention.md): Triton, even where FlashInfer could run the layout."""
    pytest.importorskip("flashinfer")
    layout = AttentionLayout(32, 8, 128, 1.0, 16, torch.bfloat16)
    assert select_backend("flashinfer", layout, CUDA).name == "flashinfer"
    assert select_backend("auto", layout, CUDA).name == "triton"
