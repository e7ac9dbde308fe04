"""Our own Triton paged-attention backend: KV write, split-KV decode, and varlen prefill over the cache.

Uniform-decode steps run one fused kernel (KV write + split-KV attention: a small-batch decode layer is
latency-bound, so launches are what cost) and, with splits, a merge kernel (a program per head); a speculative
verify of at most 16 tokens (every request the same few) writes its keys, then runs the decode kernel token by
token and the same merge, so each token's attention is its decode's; every other step (prefill, chunked
prefill, prefix hits, mixed batches) runs the reshape-and-cache kernel and one varlen kernel with a causal mask
offset by the context already in the cache. Grids depend only on host sizes fixed by the batch descriptor
(padded tokens, requests), lengths are read on device, and the split workspace is persistent, so the
backend can be captured in CUDA graphs for any batch: GraphSupport.ALWAYS.

An fp8 cache (kv_cache_dtype='fp8') is a constexpr of every kernel (KV_FP8, from the cache's dtype), with
the layer's k/v scales passed as scalars: a graph captured for a layer replays with that layer's scales.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
import triton

from kiln.attention import triton_kernels as K
from kiln.attention.base import (
    AttentionBackend,
    AttentionLayout,
    CommonAttentionMetadata,
    GraphSupport,
)
from kiln.models.dense_gemm import TRITON_MAX_M
from kiln.models.forward_context import Rope
from kiln.models.pdl import pdl_launch

_LOG2E = 1.4426950408889634
_MAX_SPLITS = 32
_NARROW_TILE_MAX_REQS = 64  # decode batches up to this many requests take BLOCK_N keys a tile, larger BLOCK_N_WIDE
# a batch of requests with the same few new tokens (a speculative verify) goes to the decode kernel, token by
# token, up to this many tokens: as many as the projections' small-M GEMM takes (kiln.models.dense_gemm), so
# that a verified token's whole forward is a decode's, bit for bit; above it the varlen kernel is faster
# (bench_attention --verify, docs/attention.md) and cuBLAS's GEMMs round differently anyway
MAX_MULTI_TOKEN_TOKENS = TRITON_MAX_M
# the varlen kernel's tile for 16-bit head_dim <= 128: (rows = tokens x padded GQA group, keys, warps, stages)
VARLEN_TILE = (64, 64, 4, 2)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _merge_chunks(block_d: int) -> int:
    """KILN_DECODE_MERGE_CHUNKS: programs per head in the split merge, each BLOCK_D / chunks dims of at least 16; a
    power of two that divides BLOCK_D. Default 4 where the head has the dims for it (fewer below 64): against one
    program a head, the decode's kernel + merge took 12.5 / 13.5 / 18.9 -> 11.0 / 12.0 / 17.4 us at batch 1 and
    160 / 1024 / 4096 keys with Llama-3-8B's heads, 13.0 / 13.4 / 16.5 -> 11.1 / 11.6 / 14.8 with Qwen3-30B-A3B's,
    10.0 / 10.1 / 12.6 -> 9.4 / 9.6 / 12.1 with SmolLM2-135M's, and the same +-0.3 at batch 8 (one H200,
    2026-12-04, `bench_attention --sweep --vary waves merge_chunks`, docs/attention.md)."""
    chunks = int(os.environ.get("KILN_DECODE_MERGE_CHUNKS", min(4, max(1, block_d // 16))))
    if chunks < 1 or chunks & (chunks - 1) or block_d // chunks < 16:
        raise ValueError(f"KILN_DECODE_MERGE_CHUNKS={chunks}: a power of two leaving >= 16 of the {block_d} dims "
                         "to each program")
    return chunks


def _decode_overrides(defaults: dict[str, float]) -> dict[str, float]:
    """KILN_DECODE_CONFIG="BLOCK_N=64:num_stages=3": decode launch settings over the defaults (what
    `bench_attention --sweep` varies), for an end-to-end A/B of a swept configuration."""
    overrides = {}
    for item in filter(None, os.environ.get("KILN_DECODE_CONFIG", "").split(":")):
        key, _, value = item.partition("=")
        if key not in defaults:
            raise ValueError(f"KILN_DECODE_CONFIG: unknown key {key!r} (one of {sorted(defaults)})")
        overrides[key] = type(defaults[key])(float(value))
    return overrides


def _rope_args(rope: Rope | None, q: torch.Tensor) -> tuple:
    """The decode kernel's cos / sin cache, q / k norm weights, cache row stride and eps (placeholders without a
    rotation: the kernel never reads them). The position is the request's seq_len - 1, read in the kernel."""
    if rope is None:
        return q, q, q, 0, 0.0
    cache = rope.cos_sin_cache
    q_weight = rope.q_weight if rope.q_weight is not None else cache
    k_weight = rope.k_weight if rope.k_weight is not None else cache
    return cache, q_weight, k_weight, cache.stride(0), float(rope.eps)


def _is_fp8(kv_cache: torch.Tensor) -> bool:
    return kv_cache.dtype == torch.float8_e4m3fn


def reshape_and_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write k/v ([T, Hkv, D]) at slot_mapping[:T] of kv_cache ([num_blocks, 2, block_size, Hkv, D]), quantized
    with the layer's scales if the cache is fp8."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    K.reshape_and_cache_kernel[(num_tokens,)](
        k, v, kv_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), num_kv_heads,
        float(k_scale), float(v_scale), HEAD_DIM=head_dim, PAGE=kv_cache.shape[2],
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        KV_FP8=_is_fp8(kv_cache), num_warps=4, **pdl_launch(k.device))


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def build_page_indices(block_tables: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor,
                       block_size: int) -> None:
    """out[indptr[i]:indptr[i+1]] = block_tables[i, :ceil(seq_lens[i] / block_size)], on device."""
    num_reqs = block_tables.shape[0]
    if num_reqs == 0:
        return
    K.page_indices_kernel[(num_reqs,)](block_tables, seq_lens, out, block_tables.stride(0), PAGE=block_size,
                                       BLOCK_R=triton.next_power_of_2(num_reqs), BLOCK=256, num_warps=4,
                                       **pdl_launch(out.device))


@dataclass
class TritonMetadata:
    common: CommonAttentionMetadata
    num_splits: int  # decode only; fixed by the request count, so graph-stable
    part_out: torch.Tensor | None  # [num_reqs, Hq, num_splits, D] fp32 partials (decode with splits)
    part_lse: torch.Tensor | None  # [num_reqs, Hq, num_splits] fp32
    # a mixed batch run eagerly: its leading one-token requests, attended by the decode kernel
    leading_decodes: TritonMetadata | None = None
    query_len: int = 1  # > 1: every request has this many new tokens, attended by the decode kernel (a verify)


def query_lens(common: CommonAttentionMetadata) -> np.ndarray:
    """Each request's new tokens (padded requests included), from the host copy of the query offsets."""
    return np.diff(common.query_start_loc_cpu[: common.num_reqs + 1].numpy())


def uniform_query_len(common: CommonAttentionMetadata) -> int:
    """The new tokens of every request where all requests (padded ones included) have the same number, else 0."""
    q_lens = query_lens(common)
    return int(q_lens[0]) if len(q_lens) and (q_lens == q_lens[0]).all() else 0


def leading_decode_count(common: CommonAttentionMetadata) -> int:
    """How many requests at the front of the batch have one new token (the scheduler puts decodes first)."""
    q_lens = query_lens(common)
    longer = np.flatnonzero(q_lens != 1)
    return int(longer[0]) if len(longer) else common.num_reqs


def head_of(common: CommonAttentionMetadata, rows: int) -> CommonAttentionMetadata:
    """The first `rows` requests of a batch whose first `rows` requests are one-token decodes."""
    seq_lens_cpu = common.seq_lens_cpu[:rows]
    return CommonAttentionMetadata(
        num_reqs=rows, num_tokens=rows, query_start_loc=common.query_start_loc[: rows + 1],
        seq_lens=common.seq_lens[:rows], block_tables=common.block_tables[:rows],
        slot_mapping=common.slot_mapping[:rows], query_start_loc_cpu=common.query_start_loc_cpu[: rows + 1],
        seq_lens_cpu=seq_lens_cpu, max_query_len=1, max_seq_len=int(seq_lens_cpu.max()), uniform_decode=True)


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    graph_support = GraphSupport.ALWAYS
    supported_devices = ("cuda",)
    supports_fp8_kv = True
    # its kernels read seq_lens, block tables and slots from the runner's buffers; split counts and workspaces are
    # fixed per captured size
    replay_needs_metadata = False
    supports_rope = True  # the decode kernel rotates (and norms) q and the new key itself

    @classmethod
    def unsupported_reason(cls, layout: AttentionLayout, device: torch.device) -> str | None:
        reason = super().unsupported_reason(layout, device)
        if reason:
            return reason
        if layout.head_dim > 256:
            return f"triton supports head_dim <= 256, not {layout.head_dim}"
        if layout.num_heads % layout.num_kv_heads:
            return "num_heads must be a multiple of num_kv_heads"
        if (layout.cache_dtype == torch.float8_e4m3fn and device.type == "cuda"
                and torch.cuda.get_device_capability(device) < (8, 9)):
            return ("kv_cache_dtype='fp8' needs e4m3 conversions, which Triton has from compute capability 8.9 "
                    "(Ada, Hopper)")
        return None

    def __init__(self, layout: AttentionLayout, device: torch.device) -> None:
        super().__init__(layout, device)
        self.group = layout.num_heads // layout.num_kv_heads
        self.block_d = triton.next_power_of_2(max(16, layout.head_dim))
        self.ieee = layout.dtype == torch.float32  # tf32 would miss the fp32 tolerance
        self.num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
                        if device.type == "cuda" else 132)
        # Persistent split workspace, grown outside graphs. Replaced buffers are kept alive because a
        # captured graph may still point at them.
        self._part_out = torch.empty(0, dtype=torch.float32, device=device)
        self._part_lse = torch.empty(0, dtype=torch.float32, device=device)
        self._retired: list[torch.Tensor] = []
        self._prefill_cfg = self._prefill_config()
        # a mixed batch with at least this many leading decodes sends them to the decode kernel: in the
        # varlen kernel each takes a whole q-tile of BLOCK_Q token rows per KV head for one token (0: never;
        # fewer than ~32 do not pay for the extra launch, bench_attention.py --mixed)
        self.mixed_decode_min = int(os.environ.get("KILN_MIXED_DECODE_MIN", "32"))
        # decode launch: BLOCK_N keys per tile, warps, pipeline stages, the program waves the split count
        # aims for, the waves of (request, KV head) programs from which a decode takes one split (no merge),
        # the fewest tiles a split takes, and the programs a head's merge is cut into along its dims (one
        # until measured: KILN_DECODE_MERGE_CHUNKS; benchmarks/bench_attention.py --sweep measures the alternatives).
        # 16-bit tiles of 32 keys at every batch: BLOCK_N up to 64 requests, BLOCK_N_WIDE above (docs/attention.md)
        self.decode_cfg = dict(BLOCK_N=16 if self.ieee else 32, BLOCK_N_WIDE=16 if self.ieee else 32,
                               num_warps=8 if self.ieee else 4, num_stages=2, waves=2,
                               one_split_waves=float(os.environ.get("KILN_DECODE_ONE_SPLIT_WAVES", "1.5")),
                               min_tiles=1, merge_chunks=_merge_chunks(self.block_d))
        self.decode_cfg.update(_decode_overrides(self.decode_cfg))

    def _prefill_config(self) -> dict[str, int]:
        """Tile sizes: rows of a tile are BLOCK_Q tokens x the padded GQA group."""
        group_pad = triton.next_power_of_2(self.group)
        # chosen from ptxas reports for sm_90 (no spills); fp32 needs small tiles for its ieee dots; 16-bit
        # head_dim <= 128 from `bench_attention.py --mixed` on the H200 (docs/attention.md)
        if _interpreting():
            rows, block_n, warps, stages = 32, 32, 4, 1  # the interpreter pays per program, not per element
        elif self.layout.dtype == torch.float32:
            rows, block_n, warps, stages = 32, 16, 4, 2
        elif self.block_d > 128:
            rows, block_n, warps, stages = 64, 32, 8, 2
        else:
            rows, block_n, warps, stages = VARLEN_TILE
        rows = max(rows, group_pad, 16)
        return dict(GROUP_PAD=group_pad, BLOCK_Q=rows // group_pad, BLOCK_N=block_n, num_warps=warps,
                    num_stages=stages)

    def decode_block_n(self, num_reqs: int) -> int:
        """Keys a decode tile: BLOCK_N up to 64 requests, BLOCK_N_WIDE above, 32 both (16-bit). Against 64 keys
        (one H200, 2026-12-06), 32 made the kernel 1.1-1.4x faster at batch 1-64 and 160-600 keys on Llama-3-8B's
        heads and Llama-3-8B's decode 4.17 / 4.29 / 5.52 -> 4.12 / 4.24 / 5.31 ms at batch 1 / 8 / 64; above 64
        requests (one H100, 2026-12-07) the kernel 1.02-1.13x faster at 128-256 requests over 160-4096 keys on
        Llama-3-8B's heads, 1.02-1.23x on Qwen3-30B-A3B's. The two stay separate knobs (KILN_DECODE_CONFIG) until
        the H200, where 64 keys won above 64 requests on 2026-11-30's kernel, is measured again."""
        return self.decode_cfg["BLOCK_N" if num_reqs <= _NARROW_TILE_MAX_REQS else "BLOCK_N_WIDE"]

    def decode_kernel_key(self, num_reqs: int) -> tuple[int, int]:
        """What the decode kernel of a batch of num_reqs compiles for, besides the layout: (split count, tile)."""
        return self.num_splits(num_reqs), self.decode_block_n(num_reqs)

    def num_splits(self, num_reqs: int) -> int:
        """Enough (request, kv_head, split) programs for the configured waves, one split once the requests'
        programs alone fill `one_split_waves` waves; a function of the request count only.

        Why 1.5: at 256 programs on 132 SMs (Llama-3-8B's 8 KV heads at batch 32, a 4-KV-head layout at 64)
        one split ran 6-21% faster than two at 160-4096 keys, with no merge kernel; at 132-136 programs it was
        up to 3% slower at 1024 keys and at 192 even (bench_attention --sweep --vary one_split_waves, H200,
        2026-12-04): past ~1.5 waves a second split no longer shortens the programs' last wave."""
        programs = max(1, num_reqs * self.layout.num_kv_heads)
        if programs >= self.decode_cfg["one_split_waves"] * self.num_sms:
            return 1
        return max(1, min(_MAX_SPLITS, triton.cdiv(int(self.decode_cfg["waves"] * self.num_sms), programs)))

    def build_metadata(self, common: CommonAttentionMetadata) -> TritonMetadata:
        if common.uniform_decode:
            return self._decode_metadata(common, self.num_splits(common.num_reqs))
        # every request with the same few new tokens (a speculative verify batch): the split-KV decode kernel,
        # a decode's programs per token; the varlen kernel would give each KV head one program for the context
        few = common.num_reqs * common.max_query_len <= MAX_MULTI_TOKEN_TOKENS
        query_len = uniform_query_len(common) if few else 0
        if query_len > 1:
            return self._decode_metadata(common, self.num_splits(common.num_reqs), query_len)
        metadata = TritonMetadata(common, 1, None, None)
        least = self.mixed_decode_min
        rows = leading_decode_count(common) if 0 < least < common.num_reqs else 0
        # Graph-stable grids (ALWAYS) hold for what a graph may capture: the split below depends on the
        # batch's contents, so it is only taken where attention runs eagerly (mixed batches never replay
        # inside FULL graphs; PIECEWISE runs attention between the graphs).
        if rows >= least > 0 and not _capturing(self.device):
            # split counts of power-of-two batches: the decode sizes kiln's kernel warm-up compiled
            splits = self.num_splits(triton.next_power_of_2(rows))
            metadata.leading_decodes = self._decode_metadata(head_of(common, rows), splits)
        return metadata

    def _decode_metadata(self, common: CommonAttentionMetadata, splits: int, query_len: int = 1) -> TritonMetadata:
        if splits == 1:
            return TritonMetadata(common, 1, None, None, query_len=query_len)
        rows = common.num_reqs * query_len * self.layout.num_heads * splits
        if self._part_lse.numel() < rows:
            self._retired += [self._part_out, self._part_lse]
            self._part_out = torch.empty(rows * self.layout.head_dim, dtype=torch.float32, device=self.device)
            self._part_lse = torch.empty(rows, dtype=torch.float32, device=self.device)
        return TritonMetadata(common, splits, self._part_out, self._part_lse, query_len=query_len)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                kv_cache: torch.Tensor, metadata: TritonMetadata, k_scale: float = 1.0, v_scale: float = 1.0,
                rope: Rope | None = None) -> None:
        """`rope`: forward_rope's decode step, q and k before their rotation."""
        common = metadata.common
        assert out.stride(-1) == 1
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        scales = (float(k_scale), float(v_scale)) if _is_fp8(kv_cache) else (1.0, 1.0)
        if common.uniform_decode and common.num_reqs > 0:
            self._decode(q, k, v, out, kv_cache, metadata, *scales, rope=rope)  # writes the new K/V itself
            return
        if metadata.query_len > 1:  # the decode kernel reads every new key from the cache
            reshape_and_cache(k, v, kv_cache, common.slot_mapping, *scales)
            self._decode(q, k, v, out, kv_cache, metadata, *scales)
            return
        head = metadata.leading_decodes
        if head is not None:  # the decode kernel for the leading decodes (writing their K/V), varlen the rest
            n = head.common.num_reqs
            self._decode(q[:n], k[:n], v[:n], out[:n], kv_cache, head, *scales)
            reshape_and_cache(k[n:], v[n:], kv_cache, common.slot_mapping[n:], *scales)
            self._varlen(q, out, kv_cache, common, *scales, first_req=n)
            return
        reshape_and_cache(k, v, kv_cache, common.slot_mapping, *scales)
        if common.num_reqs > 0:
            self._varlen(q, out, kv_cache, common, *scales)

    def forward_rope(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     kv_cache: torch.Tensor, metadata: TritonMetadata, rope: Rope, k_scale: float = 1.0,
                     v_scale: float = 1.0) -> bool:
        """A decode step's kernel rotates (and norms) q and the new key itself; other steps are the caller's."""
        common = metadata.common
        if not (common.uniform_decode and common.num_reqs > 0 and metadata.query_len == 1) \
                or rope.cos_sin_cache.shape[-1] != self.layout.head_dim or self.layout.head_dim % 2:
            return False
        self.forward(q, k, v, out, kv_cache, metadata, k_scale, v_scale, rope=rope)
        return True

    def _common_args(self, kv_cache: torch.Tensor, common: CommonAttentionMetadata) -> tuple:
        return (kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
                common.block_tables.stride(0))

    def _varlen(self, q: torch.Tensor, out: torch.Tensor, kv_cache: torch.Tensor, common: CommonAttentionMetadata,
                k_scale: float, v_scale: float, first_req: int = 0) -> None:
        """The requests from `first_req` on; those before it are one-token decodes (so q-block
        first_req // BLOCK_Q is the first one this launch needs)."""
        layout, cfg, r = self.layout, self._prefill_cfg, first_req
        qb0 = r // cfg["BLOCK_Q"]
        # q.shape[0] is the padded token count: a graph-stable bound on every request's q-blocks
        grid = (q.shape[0] // cfg["BLOCK_Q"] - qb0 + common.num_reqs - r, layout.num_kv_heads)
        K.varlen_attention_kernel[grid](
            q, out, kv_cache, common.block_tables[r:], common.seq_lens[r:], common.query_start_loc[r:],
            common.num_reqs - r, qb0, layout.scale * _LOG2E * k_scale, q.stride(0), q.stride(1), out.stride(0),
            out.stride(1),
            *self._common_args(kv_cache, common), v_scale, GROUP=self.group, HEAD_DIM=layout.head_dim,
            BLOCK_D=self.block_d, PAGE=layout.block_size, IEEE=self.ieee, KV_FP8=_is_fp8(kv_cache), **cfg,
            **pdl_launch(q.device))

    def _decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, kv_cache: torch.Tensor,
                metadata: TritonMetadata, k_scale: float, v_scale: float, rope: Rope | None = None) -> None:
        # padded tokens past num_reqs get no K/V write: theirs would only land in the null block
        layout, common, splits, cfg = self.layout, metadata.common, metadata.num_splits, self.decode_cfg
        part_out = metadata.part_out if metadata.part_out is not None else out
        part_lse = metadata.part_lse if metadata.part_lse is not None else out
        K.decode_attention_kernel[(common.num_reqs, layout.num_kv_heads * metadata.query_len, splits)](
            q, k, v, out, part_out, part_lse, kv_cache, common.block_tables, common.seq_lens,
            common.slot_mapping, layout.scale * _LOG2E * k_scale, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            v.stride(0), v.stride(1), out.stride(0), out.stride(1), *self._common_args(kv_cache, common),
            k_scale, v_scale, *_rope_args(rope, q), GROUP=self.group,
            BLOCK_H=max(16, triton.next_power_of_2(self.group)), HEAD_DIM=layout.head_dim,
            BLOCK_D=self.block_d, BLOCK_N=self.decode_block_n(common.num_reqs), PAGE=layout.block_size,
            NUM_SPLITS=splits, MIN_TILES=cfg["min_tiles"], IEEE=self.ieee, KV_FP8=_is_fp8(kv_cache),
            QLEN=metadata.query_len,
            ROPE=rope is not None, NORM=rope is not None and rope.q_weight is not None and rope.k_weight is not None,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_launch(q.device))
        if splits > 1:
            chunks = cfg["merge_chunks"]
            K.merge_splits_kernel[(common.num_reqs * metadata.query_len, layout.num_heads, chunks)](
                part_out, part_lse, out, out.stride(0), out.stride(1), HEAD_DIM=layout.head_dim,
                BLOCK_D=self.block_d // chunks, NUM_SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits),
                num_warps=cfg["num_warps"], **pdl_launch(q.device))
