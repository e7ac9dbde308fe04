"""The Triton backend under TRITON_INTERPRET=1 (CPU) against the torch reference on random paged layouts."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kiln.attention.base import CommonAttentionMetadata  # noqa: E402
from kiln.attention.triton_backend import TritonAttentionBackend, build_page_indices  # noqa: E402
from tests.attention.paged_batch import make_batch, reference, rel_err, run_backend  # noqa: E402

# on a CPU machine conftest.py imported the kernels under Triton's interpreter; they then take CPU tensors
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HEADS = 8


def check(q_lens: list[int], contexts: list[int], group: int, head_dim: int, dtype: torch.dtype = torch.float32,
          tol: float = 1e-4, seed: int = 0, mixed_decode_min: int | None = None, **decode_cfg: int) -> None:
    batch = make_batch(q_lens, contexts, HEADS, HEADS // group, head_dim, dtype, DEVICE, seed=seed)
    backend = TritonAttentionBackend(batch.layout, torch.device(DEVICE))
    backend.decode_cfg.update(decode_cfg)
    if mixed_decode_min is not None:
        backend.mixed_decode_min = mixed_decode_min
    out, cache = run_backend(backend, batch)
    ref_out, ref_cache = reference(batch)
    assert rel_err(out, ref_out) <= tol, (q_lens, contexts, group, head_dim, rel_err(out, ref_out))
    # block 0 is the null block: padded tokens write there in any order (or, in fused decode, not at all)
    cache, ref_cache = cache[1:].float(), ref_cache[1:].to(dtype).float()
    assert torch.equal(cache.isnan(), ref_cache.isnan())
    assert torch.equal(cache.nan_to_num(), ref_cache.nan_to_num())


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_mixed_batch_prefill_chunks_and_decodes(group: int, head_dim: int) -> None:
    # a fresh prompt, a chunk after a prefix hit, decodes, a long chunk; contexts cross many blocks
    check([37, 1, 64, 5, 1], [0, 200, 130, 17, 333], group, head_dim, seed=group * head_dim)


@pytest.mark.parametrize(("q_lens", "contexts", "least"), [
    ([1, 1, 1, 37, 1, 64], [95, 0, 300, 0, 40, 130], 2),  # three leading decodes: decode kernel, varlen rest
    ([1] * 20 + [21, 3], list(range(3, 63, 3)) + [0, 90], 8),  # 20: past the first varlen q-block
])
def test_mixed_batch_with_leading_decodes(q_lens: list[int], contexts: list[int], least: int) -> None:
    # the scheduler puts running decodes first: at or above the threshold they go to the split-KV decode
    # kernel (which writes their K/V) and the varlen kernel starts at the first longer request
    batch = make_batch(q_lens, contexts, HEADS, 2, 64, torch.float32, DEVICE, seed=least)
    backend = TritonAttentionBackend(batch.layout, torch.device(DEVICE))
    leading = next(i for i, n in enumerate(q_lens) if n != 1)
    for threshold, split in ((least, leading), (leading + 1, 0), (0, 0)):  # below the threshold, or off: no split
        backend.mixed_decode_min = threshold
        head = backend.build_metadata(batch.common).leading_decodes
        assert (head.common.num_reqs if head else 0) == split
    check(q_lens, contexts, 4, 64, seed=least, mixed_decode_min=least)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_uniform_decode_with_splits(group: int, head_dim: int) -> None:
    check([1, 1, 1], [0, 95, 300], group, head_dim, seed=7 + group)


def test_decode_tile_up_to_64_requests_and_above(monkeypatch: pytest.MonkeyPatch) -> None:
    """16-bit decode tiles hold 32 keys at every batch; KILN_DECODE_CONFIG sets the tile up to 64 requests
    (BLOCK_N) and above (BLOCK_N_WIDE) apart. With 64 keys above the bound, a decode batch on each side of it is
    the reference's attention."""
    layout = make_batch([1], [40], HEADS, HEADS // 4, 64, torch.float16, DEVICE).layout
    assert {TritonAttentionBackend(layout, torch.device(DEVICE)).decode_block_n(n) for n in (1, 64, 65, 256)} == {32}
    monkeypatch.setenv("KILN_DECODE_CONFIG", "BLOCK_N_WIDE=64")
    backend = TritonAttentionBackend(layout, torch.device(DEVICE))
    assert (backend.decode_block_n(1), backend.decode_block_n(64), backend.decode_block_n(65)) == (32, 32, 64)
    contexts = [(37 * i) % 70 for i in range(65)]  # up to 70 keys: past the first tile of either width
    for requests in (64, 65):  # one KV head, one split: the interpreter pays per program
        check([1] * requests, contexts[:requests], HEADS, 64, dtype=torch.float16, tol=1e-2, seed=requests,
              one_split_waves=0)
    monkeypatch.setenv("KILN_DECODE_CONFIG", "BLOCK_N=64:one_split_waves=2")
    cfg = TritonAttentionBackend(layout, torch.device(DEVICE)).decode_cfg
    assert (cfg["BLOCK_N"], cfg["BLOCK_N_WIDE"], cfg["one_split_waves"]) == (64, 32, 2.0)
    monkeypatch.setenv("KILN_DECODE_CONFIG", "keys=64")
    with pytest.raises(ValueError, match="KILN_DECODE_CONFIG: unknown key 'keys'"):
        TritonAttentionBackend(layout, torch.device(DEVICE))


def test_a_merge_cut_along_the_head_dims_gives_the_one_program_merge(monkeypatch: pytest.MonkeyPatch) -> None:
    """merge_chunks programs a head, each merging its share of the dims with the same weights: the output is the
    one-program merge's up to the order of the sum over the splits (on a GPU it follows the tile's layout, so the
    last bits may differ: seen on an H100, 2026-12-07), and the reference's within tolerance."""
    batch = make_batch([1, 1, 1], [0, 95, 300], HEADS, HEADS // 4, 64, torch.float32, DEVICE, seed=3)
    outs = []
    for setting in (1, 4):  # 4: 16 dims a program
        monkeypatch.setenv("KILN_DECODE_MERGE_CHUNKS", str(setting))
        backend = TritonAttentionBackend(batch.layout, torch.device(DEVICE))
        assert backend.decode_cfg["merge_chunks"] == setting and backend.num_splits(3) > 1
        outs.append(run_backend(backend, batch)[0])
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
    assert rel_err(outs[1], reference(batch)[0]) <= 1e-4
    monkeypatch.delenv("KILN_DECODE_MERGE_CHUNKS")  # the default: 4 where 16 dims are left to each, fewer below
    assert TritonAttentionBackend(batch.layout, torch.device(DEVICE)).decode_cfg["merge_chunks"] == 4
    small = make_batch([1], [40], 4, 1, 32, torch.float32, DEVICE, seed=3).layout
    assert TritonAttentionBackend(small, torch.device(DEVICE)).decode_cfg["merge_chunks"] == 2
    monkeypatch.setenv("KILN_DECODE_MERGE_CHUNKS", "8")  # 8 dims a program: under the 16 a tile needs
    with pytest.raises(ValueError, match="KILN_DECODE_MERGE_CHUNKS=8"):
        TritonAttentionBackend(batch.layout, torch.device(DEVICE))


@pytest.mark.parametrize("min_tiles", [2, 5])
def test_uniform_decode_with_a_floor_on_tiles_per_split(min_tiles: int) -> None:
    # contexts of 1, 6 and 19 tiles (16 keys each in fp32) over splits of >= min_tiles tiles: the later
    # splits of a short context are empty and must weigh nothing in the merge
    check([1, 1, 1], [0, 95, 300], 4, 64, seed=min_tiles, min_tiles=min_tiles)

@pytest.mark.parametrize(("group", "head_dim"), [(1, 64), (4, 128), (8, 64)])
def test_uniform_multi_token_requests_run_the_split_decode_kernel(group: int, head_dim: int) -> None:
    # a speculative verify batch: every request k + 1 = 5 new tokens, each seeing the context up to itself;
    # contexts of none, ~6 and ~19 tiles split over many programs, some starting past a row's position
    batch = make_batch([5, 5, 5], [0, 95, 300], HEADS, HEADS // group, head_dim, torch.float32, DEVICE)
    assert TritonAttentionBackend(batch.layout, torch.device(DEVICE)).build_metadata(batch.common).query_len == 5
    check([5, 5, 5], [0, 95, 300], group, head_dim, seed=17 + group)


def test_multi_token_requests_whose_tokens_straddle_split_bounds() -> None:
    # 16 new tokens (k = 15) on contexts ending just before and after a tile edge: a split holding some of the
    # new tokens has tokens that see none of its keys (they weigh nothing in the merge); splits of 3 tiles;
    # one split
    check([16], [15], 4, 64, seed=1)
    check([16], [113], 4, 64, seed=2, min_tiles=3)
    batch = make_batch([8, 8], [40, 7], HEADS, 2, 64, torch.float32, DEVICE, seed=9)
    backend = TritonAttentionBackend(batch.layout, torch.device(DEVICE))
    backend.num_splits = lambda n: 1  # type: ignore[method-assign]
    assert rel_err(run_backend(backend, batch)[0], reference(batch)[0]) <= 1e-4


# (k + 1, GQA group, context, dtype). On the H200 the 16-bit dtypes (what serves) are exact; fp32's IEEE dots
# there were not (two cases off by ~1e-7 at 90572b9, not diagnosed)
EXACT_CASES = [(5, 4, 95, torch.float32), (4, 2, 300, torch.float16)] if DEVICE == "cpu" else [
    (5, 4, 95, torch.bfloat16), (16, 4, 0, torch.bfloat16), (4, 8, 130, torch.bfloat16), (9, 2, 300, torch.bfloat16),
    (9, 2, 300, torch.float16)]


@pytest.mark.parametrize(("q_len", "group", "context", "dtype"), EXACT_CASES)
def test_a_verified_token_attends_as_its_decode_would_bit_for_bit(q_len: int, group: int, context: int,
                                                                  dtype: torch.dtype) -> None:
    """Speculation must not change greedy tokens: row t of a verify batch equals a decode of token t at its
    position (the cache holding the tokens before it), exactly, not just within a tolerance."""
    batch = make_batch([q_len], [context], HEADS, HEADS // group, 64, dtype, DEVICE, seed=q_len + group)
    backend = TritonAttentionBackend(batch.layout, torch.device(DEVICE))
    out, cache = run_backend(backend, batch)  # the verify: all q_len new keys written, then attended
    common = batch.common
    for t in range(q_len):
        pos = context + t
        decode = CommonAttentionMetadata(
            num_reqs=1, num_tokens=1, query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
            seq_lens=torch.tensor([pos + 1], dtype=torch.int32, device=DEVICE), block_tables=common.block_tables,
            slot_mapping=common.slot_mapping[t:t + 1], query_start_loc_cpu=torch.tensor([0, 1], dtype=torch.int32),
            seq_lens_cpu=torch.tensor([pos + 1], dtype=torch.int32), max_query_len=1, max_seq_len=pos + 1,
            uniform_decode=True)
        one = torch.full_like(batch.q[:1], float("nan"))
        backend.forward(batch.q[t:t + 1], batch.k[t:t + 1], batch.v[t:t + 1], one, cache.clone(),
                        backend.build_metadata(decode))
        assert torch.equal(one[0], out[t]), (t, (one[0].float() - out[t].float()).abs().max().item())


def test_multi_token_batches_past_the_small_gemm_bound_stay_on_varlen() -> None:
    # 2 x 16 tokens: more than the projections' small-M GEMM takes; unequal lengths: a prefill
    for q_lens, group in (([16, 16], 8), ([5, 4], 4)):
        batch = make_batch(q_lens, [30, 60], HEADS, HEADS // group, 64, torch.float32, DEVICE)
        assert TritonAttentionBackend(batch.layout, torch.device(DEVICE)).build_metadata(batch.common).query_len == 1
        check(q_lens, [30, 60], group, 64, seed=group)


def test_decode_state_is_clean_between_steps() -> None:
    # the partial workspace is reused by the next step: it must not see stale state
    first = make_batch([1, 1], [300, 40], HEADS, 2, 64, torch.float32, DEVICE, seed=1)
    second = make_batch([1, 1], [20, 290], HEADS, 2, 64, torch.float32, DEVICE, seed=2)
    backend = TritonAttentionBackend(first.layout, torch.device(DEVICE))
    for batch in (first, second, first):
        assert rel_err(run_backend(backend, batch)[0], reference(batch)[0]) <= 1e-4


def test_decode_without_splits_and_odd_shapes() -> None:
    # many requests -> one split (the direct-write path); GQA group 3 and head_dim 80 (padded tiles)
    batch_q, ctx = [1] * 40, [(13 * i) % 70 for i in range(40)]
    batch = make_batch(batch_q, ctx, 6, 2, 80, torch.float32, DEVICE, seed=3)
    backend = TritonAttentionBackend(batch.layout, torch.device(DEVICE))
    assert backend.num_splits(40) == 4 and backend.num_splits(200) == 1
    # one split once the requests' programs fill `one_split_waves` (1.5) waves of the (here 132) SMs
    assert [backend.num_splits(n) for n in (65, 66, 98, 99, 132)] == [3, 2, 2, 1, 1]
    backend.decode_cfg["one_split_waves"] = 1
    assert [backend.num_splits(n) for n in (40, 65, 66)] == [4, 3, 1]
    backend.num_splits = lambda n: 1  # type: ignore[method-assign]
    out, _ = run_backend(backend, batch)
    assert rel_err(out, reference(batch)[0]) <= 1e-4
    mixed = make_batch([3, 20, 1], [5, 40, 9], 6, 2, 80, torch.float32, DEVICE, seed=4)
    out, _ = run_backend(TritonAttentionBackend(mixed.layout, torch.device(DEVICE)), mixed)
    assert rel_err(out, reference(mixed)[0]) <= 1e-4


def test_single_request_and_block_size_8() -> None:
    batch = make_batch([50], [70], 4, 2, 64, torch.float32, DEVICE, block_size=8, seed=5)
    out, _ = run_backend(TritonAttentionBackend(batch.layout, torch.device(DEVICE)), batch)
    assert rel_err(out, reference(batch)[0]) <= 1e-4


def test_half_precision() -> None:
    check([9, 1, 30], [40, 64, 0], 4, 64, dtype=torch.float16, tol=1e-2, seed=11)
    check([5, 5], [40, 200], 4, 64, dtype=torch.float16, tol=1e-2, seed=12)  # a verify batch


def test_page_indices() -> None:
    batch = make_batch([1, 4, 1], [40, 0, 15], 4, 4, 64, torch.float32, DEVICE)
    common = batch.common
    out = torch.full((64,), -1, dtype=torch.int32, device=DEVICE)
    build_page_indices(common.block_tables, common.seq_lens, out, 16)
    expected = torch.cat([common.block_tables[i, : -(-int(s) // 16)] for i, s in enumerate(common.seq_lens_cpu)])
    assert torch.equal(out[: len(expected)], expected)
    assert (out[len(expected):] == -1).all()


def _rope_inputs(batch, norm: bool, seed: int):
    """Each token's position (its request's seq_len - 1; padded tokens 0), a cos / sin cache and q / k norm weights."""
    from kiln.models.forward_context import Rope

    positions = torch.zeros(batch.q.shape[0], dtype=torch.long, device=DEVICE)
    positions[: batch.common.num_reqs] = batch.common.seq_lens.long() - 1
    dim = batch.layout.head_dim
    angles = torch.arange(512, dtype=torch.float32)[:, None] * 10000.0 ** (-torch.arange(0, dim, 2) / dim)
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1).to(DEVICE)
    g = torch.Generator().manual_seed(seed)
    weights = [(torch.rand(dim, generator=g) + 0.5).to(batch.q.dtype).to(DEVICE) if norm else None for _ in "qk"]
    return Rope(positions, cos_sin, *weights, eps=1e-6)


@pytest.mark.parametrize(("dtype", "norm"), [(torch.float32, False), (torch.float32, True), (torch.float16, True)])
def test_the_decode_kernel_rotates_q_and_the_new_key_itself(dtype: torch.dtype, norm: bool) -> None:
    """forward_rope on a decode step (RoPE, with Qwen3's q/k norms, inside the decode kernel) against rotating first
    (the torch reference of kiln's norm + RoPE kernel) and then forward(): the same output and cache, to rounding;
    without norms, bit for bit what rotating in kiln's norm + RoPE kernel first gives."""
    import dataclasses

    from kiln.passes.ops import norm_rope_ref

    batch = make_batch([1, 1, 1], [0, 95, 300], HEADS, 2, 64, dtype, DEVICE, seed=11)
    rope = _rope_inputs(batch, norm, seed=5)
    backend = TritonAttentionBackend(batch.layout, torch.device(DEVICE))
    cache, out = batch.kv_cache.clone(), torch.full_like(batch.q, float("nan"))
    assert backend.forward_rope(batch.q, batch.k, batch.v, out, cache, backend.build_metadata(batch.common), rope)
    q_rot, k_rot = norm_rope_ref(batch.q, batch.k, rope.positions, rope.cos_sin_cache, rope.q_weight, rope.k_weight,
                                 rope.eps)
    rotated = dataclasses.replace(batch, q=q_rot, k=k_rot)
    ref_out, ref_cache = run_backend(backend, rotated)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    assert rel_err(out[: batch.num_tokens], ref_out) <= tol
    assert rel_err(out[: batch.num_tokens], reference(rotated)[0]) <= tol
    written = ~ref_cache[1:].isnan()
    torch.testing.assert_close(cache[1:][written].float(), ref_cache[1:][written].float(), atol=tol, rtol=tol)
    if not norm:  # kiln's norm + RoPE kernel (a verify's, a prefill's) rounds the rotation as the decode kernel does
        from kiln.passes.kernels import norm_rope_triton

        q_k, k_k = norm_rope_triton(batch.q, batch.k, rope.positions, rope.cos_sin_cache, None, None, 0.0)
        kernel_out, kernel_cache = run_backend(backend, dataclasses.replace(batch, q=q_k, k=k_k))
        assert torch.equal(cache[1:].nan_to_num(), kernel_cache[1:].nan_to_num())
        assert torch.equal(out[: batch.num_tokens], kernel_out)


def test_only_a_decode_step_rotates_in_the_kernel() -> None:
    """A step with a prompt chunk is the caller's to rotate (forward_rope declines and touches nothing)."""
    batch = make_batch([5, 1], [0, 40], HEADS, 2, 64, torch.float32, DEVICE, seed=12)
    backend = TritonAttentionBackend(batch.layout, torch.device(DEVICE))
    cache, out = batch.kv_cache.clone(), torch.full_like(batch.q, float("nan"))
    assert not backend.forward_rope(batch.q, batch.k, batch.v, out, cache, backend.build_metadata(batch.common),
                                    _rope_inputs(batch, False, seed=6))
    assert out.isnan().all() and torch.equal(cache.isnan(), batch.kv_cache.isnan())
