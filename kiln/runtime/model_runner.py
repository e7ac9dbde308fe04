"""Turns a SchedulerOutput into one forward: flat inputs in persistent buffers, metadata, logits, tokens.

Every input the forward reads lives in a buffer allocated once at start-up; a step only copies into
them, so compiled pieces and CUDA graphs always see the same addresses. Attention metadata is set in
the forward context for the duration of the forward, never passed as a graph input.

`execute` only queues work on the device and returns: the host may fill the next step's buffers while this
step runs (overlapped scheduling). A request's newest token may then still be on the device; its input slot
is filled there from the previous step's sampled tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from kiln.attention.base import AttentionBackend, CommonAttentionMetadata
from kiln.compiler.cuda_graphs import BatchDescriptor, GraphDispatcher, GraphedCallable, RunMode, piecewise_graphs
from kiln.models.forward_context import ForwardContext, Rope, set_forward_context
from kiln.models.parallel import tp_size
from kiln.runtime import input_upload
from kiln.runtime.async_step import DeviceEvent, LaunchedStep, TokenReadback
from kiln.runtime.graph_head import ForwardOutput, with_head
from kiln.runtime.input_upload import ORDER, Counts, pack, staging_capacity, unpack
from kiln.runtime.outputs import TokenLogprobs
from kiln.runtime.request import Request
from kiln.runtime.sampler import Sampler, SamplingBatch, plain_greedy, score_prompt
from kiln.runtime.scheduler import SchedulerOutput
from kiln.runtime.spec_decode.verify import verify_step
from kiln.runtime.structured.bitmask import apply_token_mask

ForwardFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
_SCORE_ROWS = 256  # prompt-logprob rows scored at a time (each a vocabulary of fp32 log-softmax)


@dataclass(frozen=True)
class BatchShape:
    """The sizes of one step's flat batch: all a tensor-parallel worker needs besides the host buffers."""

    num_tokens: int  # real tokens
    num_padded_tokens: int  # what the forward runs on
    num_reqs: int
    num_sampling: int
    max_query_len: int
    max_seq_len: int
    uniform_decode: bool
    max_blocks: int  # block-table columns in use
    verify_len: int = 0  # > 1: every request verifies this many tokens in a FULL graph (speculative decoding)
    num_prompt_logits: int = 0  # rows of logits for prompt logprobs, beside the sampling ones

    @property
    def num_logits(self) -> int:
        """Rows of logits the forward computes: a request's prompt-logprob rows, then its sampling rows, in token
        order."""
        return self.num_sampling + self.num_prompt_logits


@dataclass(frozen=True)
class PromptRows:
    """A prefill chunk's positions whose logits give prompt logprobs (SamplingParams.prompt_logprobs): `count`
    logits rows from `first_row`, scoring the prompt tokens from position `first_target` on."""

    request: int  # scheduler index
    first_row: int
    first_target: int
    count: int


@dataclass
class HostBatch:
    """What `fill_host` wrote: the shape, which requests sample, and which logits rows score the prompt."""

    shape: BatchShape
    sampling_rows: list[int]  # scheduler indices of the requests that sample
    num_pending: int  # input tokens still on the device (filled there from the previous step's samples)
    prompt_rows: list[PromptRows]


@dataclass
class PreparedBatch:
    shape: BatchShape
    metadata: CommonAttentionMetadata
    logits_indices: torch.Tensor  # [shape.num_logits], device
    sampling_rows: list[int]  # scheduler indices of the requests that sample
    context: ForwardContext | None = None  # built ahead of the forward by `execute`
    # a FULL graph already captured replays it, reading only the input buffers: no attention metadata is built
    # (and, where the graph begins with the unpacking, none runs from the host)
    replays_graph: bool = False
    # tensor parallel, every sampling row plain greedy: each rank takes the argmax of its own vocabulary shard
    # and one tiny all-gather picks the winners (no logits gather to rank 0, no broadcast of its tokens)
    local_greedy: bool = False
    prompt_rows: list[PromptRows] = field(default_factory=list)

    def sample_logit_rows(self) -> list[int]:
        """Each sampling row's row of logits: those the prompt spans leave, in order."""
        scored = {r for span in self.prompt_rows for r in range(span.first_row, span.first_row + span.count)}
        return [r for r in range(self.shape.num_logits) if r not in scored]

    @property
    def num_padded_tokens(self) -> int:
        return self.shape.num_padded_tokens


class ModelRunner:
    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, kv_cache: torch.Tensor | None,
                 block_size: int, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 device: torch.device, eos_token_ids: frozenset[int],
                 block_ids_of: Callable[[Request], list[int]],
                 kv_scales: tuple[tuple[float, float], ...] | None = None, matrix_vector: bool = True) -> None:
        self.model = model
        # one-token projections of small weights may take the matrix-vector kernel (kiln/models/gemv.py, CUDA only);
        # not where a speculative verify must equal a decode bit for bit
        self.matrix_vector = matrix_vector or device.type != "cuda"
        # per layer (k_scale, v_scale) of an fp8 cache (kiln/models/kv_quant.py); None: 1.0 everywhere
        self.kv_scales = kv_scales
        self.block_ids_of = block_ids_of
        self._row_owner: list[list[int] | None] = [None] * max_num_seqs  # whose block ids each row holds
        self._row_blocks: list[int] = [0] * max_num_seqs  # how many of its block ids are written there
        self.backend = backend
        self.kv_cache = kv_cache  # [num_layers, num_blocks, 2, block_size, Hkv, D]; None until the worker sizes it
        self.block_size = block_size
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.max_num_seqs = max_num_seqs
        self.max_num_tokens = max_num_batched_tokens
        self.max_blocks_per_seq = math.ceil(max_model_len / block_size)
        self.forward_fn: ForwardFn = model.forward  # the compiler replaces this
        self.graphs: GraphDispatcher | None = None  # set when CUDA graphs are installed
        self.full_graph: GraphedCallable | None = None
        # tensor parallel (rank 0): send each step's batch (and its pending-token count) to the workers, and
        # hand them the sampled ids on the device (async scheduling)
        self.on_batch: Callable[[BatchShape, int, bool], None] | None = None
        self.on_sampled: Callable[[torch.Tensor], None] | None = None
        self.sampler = Sampler()
        pin = device.type == "cuda"
        n, s = self.max_num_tokens, self.max_num_seqs

        def buffers(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
            cpu = torch.zeros(shape, dtype=dtype, pin_memory=pin)
            return cpu, torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids_cpu, self.input_ids = buffers((n,), torch.int64)
        self.positions_cpu, self.positions = buffers((n,), torch.int64)
        self.slot_mapping_cpu, self.slot_mapping = buffers((n,), torch.int64)
        self.query_start_loc_cpu, self.query_start_loc = buffers((s + 1,), torch.int32)
        self.seq_lens_cpu, self.seq_lens = buffers((s,), torch.int32)
        self.block_tables_cpu, self.block_tables = buffers((s, self.max_blocks_per_seq), torch.int32)
        # one per sampling request, or per token of a speculative verify (k + 1 per request): up to every token
        self.logits_indices_cpu, self.logits_indices = buffers((max(s, n),), torch.int64)
        # input_ids positions whose token is still on the device, and its row in the previous step's samples
        self.pending_dst_cpu = torch.zeros(s, dtype=torch.int64)
        self.pending_src_cpu = torch.zeros(s, dtype=torch.int64)
        # the used part of every array above, packed for one upload a step (kiln/runtime/input_upload.py); only the
        # block-table columns in use travel (at 256 requests ~70 KB of 512 KB, 0.17 ms of copy a step on an H200)
        self.staged_cpu, self.staged = buffers((staging_capacity(n, s, self.max_blocks_per_seq),), torch.int32)
        # the previous launch's sampled tokens, on the device (a tensor-parallel worker receives rank 0's)
        self.last_sampled: torch.Tensor | None = None
        self._last_rows: dict[str, int] = {}  # request id -> its row there
        # numpy views of the host buffers, made once: a tensor setitem is two aten ops, and at batch 1 the fill's
        # torch-side writes and `.numpy()` calls were half of its ~33 us on the CPU
        self._np = {name: getattr(self, f"{name}_cpu").numpy() for name in (
            "input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables",
            "logits_indices", "pending_dst", "pending_src", "staged")}
        self._device_inputs = {name: getattr(self, name) for name in (*ORDER, "block_tables")}
        # The host buffers are uploaded without blocking: the next fill must wait until the copies ran.
        self._inputs_consumed = DeviceEvent(device)
        self._readback = TokenReadback(s, device)

    # -- input preparation -------------------------------------------------------------------------
    def prepare(self, sched: SchedulerOutput) -> PreparedBatch:
        """Host buffers filled (and sent to tensor-parallel workers), copied to the device, pending tokens in."""
        host = self.fill_host(sched)
        sampling_rows = host.sampling_rows
        # a constrained row needs its logits masked on rank 0, prompt logprobs need whole rows: no local argmax
        local_greedy = tp_size() > 1 and bool(sampling_rows) and not host.prompt_rows and all(
            plain_greedy(sched.requests[i].params) and sched.requests[i].grammar is None for i in sampling_rows)
        if self.on_batch is not None:
            self.on_batch(host.shape, host.num_pending, local_greedy)
        batch = self.to_device(host.shape, sampling_rows, host.num_pending)
        batch.local_greedy = local_greedy
        batch.prompt_rows = host.prompt_rows
        return batch

    def wait_host_buffers_free(self) -> None:
        """The previous step's non-blocking uploads have read the host buffers: they may be overwritten."""
        self._inputs_consumed.synchronize()

    def fill_host(self, sched: SchedulerOutput) -> HostBatch:
        """Write the step's flat inputs into the host buffers."""
        self.wait_host_buffers_free()
        num_reqs, num_tokens = len(sched.requests), sched.total_tokens
        if num_reqs > self.max_num_seqs or num_tokens > self.max_num_tokens:
            raise RuntimeError(f"batch of {num_reqs} requests / {num_tokens} tokens exceeds the runner's buffers")
        uniform_decode = all(n == 1 for n in sched.num_new_tokens)
        verify_len = self._uniform_verify_len(sched) if sched.num_spec_tokens else 0
        mode = self.run_mode(num_tokens, uniform_decode, verify_len)
        verify_len = verify_len if mode is RunMode.FULL else 0
        padded = self.graphs.padded_size(num_tokens, mode, verify_len) if self.graphs is not None else num_tokens
        views = self._np
        ids, pos, slots = views["input_ids"], views["positions"], views["slot_mapping"]
        qsl, seq_lens, tables = views["query_start_loc"], views["seq_lens"], views["block_tables"]
        pending_dst, pending_src = views["pending_dst"], views["pending_src"]
        logits_indices = views["logits_indices"]
        bs = self.block_size
        sampling_rows: list[int] = []
        # logits rows in token order: a request's prompt-logprob rows, then its sampling row(s)
        prompt_rows: list[PromptRows] = []
        num_logits = 0
        qsl[0] = 0
        cursor = max_blocks = num_pending = 0
        owners = self._row_owner
        for i, (req, n) in enumerate(zip(sched.requests, sched.num_new_tokens)):
            start = req.num_computed_tokens
            block_ids = self.block_ids_of(req)
            # a request that keeps its row from the last step only needs its new blocks copied; rows are keyed
            # by the block-id list itself, which the KV manager replaces when a request's blocks are freed
            written = self._row_blocks[i] if owners[i] is block_ids else 0
            if written < len(block_ids):
                tables[i, written:len(block_ids)] = block_ids[written:]
            owners[i], self._row_blocks[i] = block_ids, len(block_ids)
            max_blocks = max(max_blocks, len(block_ids))
            if n == 1:  # decode: scalar writes beat building numpy arrays
                if start < req.num_tokens:
                    ids[cursor] = req.token_ids[start]
                else:  # sampled by the step in flight: filled on the device
                    ids[cursor] = 0
                    pending_dst[num_pending], pending_src[num_pending] = cursor, self._last_rows[req.request_id]
                    num_pending += 1
                pos[cursor] = start
                slots[cursor] = 0 if start < req.num_shared_tokens else block_ids[start // bs] * bs + start % bs
            else:
                known = req.token_ids[start:start + n]
                if start == req.num_tokens:  # a verify chunk behind the step in flight: that step's token first
                    pending_dst[num_pending], pending_src[num_pending] = cursor, self._last_rows[req.request_id]
                    num_pending += 1
                    known = [0]  # filled on the device
                # speculative proposals follow the known tokens (the scheduler trimmed them to the chunk)
                ids[cursor:cursor + n] = known if len(known) == n else known + req.spec_token_ids
                p = np.arange(start, start + n)
                pos[cursor:cursor + n] = p
                s = np.asarray(block_ids, dtype=np.int64)[p // bs] * bs + p % bs
                # tokens whose block is shared and already cached keep their K/V: their write goes to null
                s[p < req.num_shared_tokens] = 0
                slots[cursor:cursor + n] = s
            cursor += n
            qsl[i + 1] = cursor
            seq_lens[i] = start + n
            scored = min(start + n, req.num_prompt_tokens - 1) - start if req.prompt_logprobs is not None else 0
            if scored > 0:  # position p's logits score prompt token p + 1 (the last one's are the sampling row's)
                prompt_rows.append(PromptRows(i, num_logits, start + 1, scored))
                logits_indices[num_logits:num_logits + scored] = np.arange(cursor - n, cursor - n + scored)
                num_logits += scored
            if sched.samples(i):
                drafts = sched.num_drafts(i) if sched.num_spec_tokens else 0
                if drafts:  # a verify chunk: logits at the last known token and at each proposal, a row each
                    logits_indices[num_logits:num_logits + drafts + 1] = np.arange(cursor - 1 - drafts, cursor)
                    sampling_rows += [i] * (drafts + 1)
                    num_logits += drafts + 1
                else:  # scalar writes: this runs for every decoding request every step
                    logits_indices[num_logits] = cursor - 1
                    sampling_rows.append(i)
                    num_logits += 1
        ids[num_tokens:padded] = 0
        pos[num_tokens:padded] = 0
        slots[num_tokens:padded] = 0  # padding writes into the null block
        if mode is RunMode.FULL:  # a FULL graph runs 1 (decode) or verify_len tokens a request: pad the requests
            num_reqs = self._pad_requests(num_reqs, padded // max(verify_len, 1), max(verify_len, 1))
        shape = BatchShape(num_tokens, padded, num_reqs, len(sampling_rows), max(sched.num_new_tokens, default=0),
                           int(seq_lens[:num_reqs].max()) if num_reqs else 0, uniform_decode, max_blocks, verify_len,
                           num_logits - len(sampling_rows))
        return HostBatch(shape, sampling_rows, num_pending, prompt_rows)

    def run_mode(self, num_tokens: int, uniform_decode: bool, verify_len: int = 0) -> RunMode:
        if self.graphs is None:
            return RunMode.NONE
        return self.graphs.mode_for(num_tokens, uniform_decode, verify_len)

    def _uniform_verify_len(self, sched: SchedulerOutput) -> int:
        """k + 1 where every request verifies the same number of tokens, all within one block (padded requests
        attend to the null block alone); else 0."""
        first = sched.num_new_tokens[0]
        if first > self.block_size or any(n != first for n in sched.num_new_tokens):
            return 0
        return first

    def _pad_requests(self, num_reqs: int, padded: int, query_len: int = 1) -> int:
        """Padded requests: query_len tokens each, attending to the first slots of the null block (valid but
        empty)."""
        if padded == num_reqs:
            return padded
        views = self._np
        qsl = views["query_start_loc"]
        qsl[num_reqs + 1: padded + 1] = np.arange(1, padded - num_reqs + 1) * query_len + qsl[num_reqs]
        views["seq_lens"][num_reqs:padded] = query_len
        views["block_tables"][num_reqs:padded, 0] = 0
        for i in range(num_reqs, padded):
            self._row_owner[i] = None
        return padded

    def dummy_shape(self, num_tokens: int, decode: bool, query_len: int = 1) -> BatchShape:
        """A batch touching only the null block, for capturing graphs: `num_tokens` one-token requests (with
        `query_len`: num_tokens / query_len requests of query_len tokens, a verify batch), or one request of
        `num_tokens` tokens."""
        self.input_ids_cpu[:num_tokens] = 0
        self.slot_mapping_cpu[:num_tokens] = 0
        self.query_start_loc_cpu[0] = 0
        blocks = -(-num_tokens // self.block_size)
        if decode and query_len > 1:
            self.positions_cpu[:num_tokens] = torch.arange(num_tokens) % query_len
            num_reqs = self._pad_requests(0, num_tokens // query_len, query_len)
            return BatchShape(num_tokens, num_tokens, num_reqs, 0, query_len, query_len, False, 1, query_len)
        if decode:
            self.positions_cpu[:num_tokens] = 0
            self._pad_requests(0, num_tokens)
            return BatchShape(num_tokens, num_tokens, num_tokens, 0, 1, 1, True, 1)
        self.positions_cpu[:num_tokens] = torch.arange(num_tokens)
        self.query_start_loc_cpu[1] = num_tokens
        self.seq_lens_cpu[0] = num_tokens
        self.block_tables_cpu[0, :blocks] = 0
        self._row_owner[0] = None
        return BatchShape(num_tokens, num_tokens, 1, 0, num_tokens, num_tokens, False, blocks)

    def to_device(self, shape: BatchShape, sampling_rows: list[int], num_pending: int = 0) -> PreparedBatch:
        """Upload the host buffers into the device ones (with the `num_pending` input tokens the step in flight
        samples, from `last_sampled`) and describe them for attention."""
        num_reqs, padded = shape.num_reqs, shape.num_padded_tokens
        replays = self._replays_without_metadata(*self._descriptor(shape))
        self._upload(Counts(padded, num_reqs, shape.num_logits, shape.max_blocks), num_pending,
                     replays and self._graph_unpacks())
        metadata = CommonAttentionMetadata(
            num_reqs=num_reqs,
            num_tokens=shape.num_tokens,
            query_start_loc=self.query_start_loc[: num_reqs + 1],
            seq_lens=self.seq_lens[:num_reqs],
            block_tables=self.block_tables[:num_reqs],
            slot_mapping=self.slot_mapping[:padded],
            query_start_loc_cpu=self.query_start_loc_cpu[: num_reqs + 1],
            seq_lens_cpu=self.seq_lens_cpu[:num_reqs],
            max_query_len=shape.max_query_len,
            max_seq_len=shape.max_seq_len,
            uniform_decode=shape.uniform_decode,
        )
        return PreparedBatch(shape, metadata, self.logits_indices[: shape.num_logits], sampling_rows,
                             replays_graph=replays)

    def _upload(self, counts: Counts, num_pending: int, in_graph: bool = False) -> None:
        """One copy of the packed inputs and one unpacking kernel (kiln/runtime/input_upload.py), or, `in_graph`,
        none: the FULL graph the step replays begins with it. Pending tokens land over their placeholders in the
        same kernel; the step in flight wrote `last_sampled` earlier on this stream."""
        views, sampled = self._np, self.last_sampled if num_pending else None
        if sampled is not None and sampled.dtype != torch.int64 and self._graph_unpacks():
            sampled = self.last_sampled = sampled.long()  # what the header's address is read as
        size = pack(views["staged"], views, counts, views["pending_dst"][:num_pending],
                    views["pending_src"][:num_pending], sampled.data_ptr() if sampled is not None else 0)
        staged = self.staged[:size].copy_(self.staged_cpu[:size], non_blocking=self.device.type == "cuda")
        if not in_graph:
            unpack(staged, self._device_inputs, counts, sampled)

    def _graph_unpacks(self) -> bool:
        """Whether FULL graphs begin with the unpacking kernel (KILN_UNPACK_IN_GRAPH; a backend that plans
        attention from the host's arrays outside the graph keeps it eager)."""
        return input_upload.IN_GRAPH and not self.backend.replay_needs_metadata

    # -- forward -------------------------------------------------------------------------------------
    def forward_context(self, metadata: CommonAttentionMetadata, num_tokens: int) -> ForwardContext:
        backend_metadata = self.backend.build_metadata(metadata)
        kv_cache, backend, kv_scales = self.kv_cache, self.backend, self.kv_scales

        def run_attention(layer_idx: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                          out: torch.Tensor) -> None:
            scales = kv_scales[layer_idx] if kv_scales is not None else (1.0, 1.0)
            backend.forward(q, k, v, out, kv_cache[layer_idx], backend_metadata, *scales)

        def run_rope_attention(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                               rope: Rope) -> bool:
            scales = kv_scales[layer_idx] if kv_scales is not None else (1.0, 1.0)
            return backend.forward_rope(q, k, v, out, kv_cache[layer_idx], backend_metadata, rope, *scales)

        return ForwardContext(attention=run_attention, metadata=backend_metadata, num_tokens=num_tokens,
                              kv_caches=kv_cache, slot_mapping=metadata.slot_mapping,
                              cache_only_attention=backend.supports_cache_only,
                              rope_attention=run_rope_attention if backend.supports_rope else None, kv_scales=kv_scales)

    @torch.inference_mode()
    def forward(self, batch: PreparedBatch) -> torch.Tensor:
        """Hidden states of the sampling tokens -> logits [num sampling requests, vocab]."""
        return self._head(batch, self.run_model(batch))[0]

    def _head(self, batch: PreparedBatch, out: ForwardOutput) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The logits rows' logits, and their argmax where the graph computed both (every token samples)."""
        n = batch.shape.num_tokens
        if out.logits is not None and batch.shape.num_logits == n:
            return out.logits[:n], out.greedy[:n]
        return self.model.compute_logits(self._sampling_rows(batch, out.hidden)), None

    @torch.inference_mode()
    def forward_greedy(self, batch: PreparedBatch) -> torch.Tensor:
        """Greedy ids of the sampling tokens, the same on every tensor-parallel rank (no logits gathered)."""
        return self.model.greedy_tokens(self._sampling_rows(batch, self.run_model(batch).hidden))

    @staticmethod
    def _sampling_rows(batch: PreparedBatch, hidden: torch.Tensor) -> torch.Tensor:
        """The hidden rows that get logits. Where every token samples (decode, a verify of whole chunks) they
        are the first rows in order: a view, not a gather kernel."""
        shape = batch.shape
        if shape.num_logits == shape.num_tokens:
            return hidden[: shape.num_tokens]
        return hidden[batch.logits_indices]

    def _descriptor(self, shape: BatchShape) -> tuple[BatchDescriptor, RunMode]:
        desc = BatchDescriptor(shape.num_padded_tokens, shape.num_reqs, shape.uniform_decode, shape.verify_len)
        return desc, self.graphs.dispatch(desc) if self.graphs is not None else RunMode.NONE

    def _replays_without_metadata(self, desc: BatchDescriptor, mode: RunMode) -> bool:
        """The step replays a FULL graph already captured, of a backend whose graphs read only the input buffers:
        its attention metadata is never read, so it is not built."""
        return (mode is RunMode.FULL and not self.backend.replay_needs_metadata
                and self.full_graph is not None and desc in self.full_graph.entries)

    def _build_context(self, batch: PreparedBatch) -> None:
        """The step's forward context, unless its graph replays without one. Built before the inputs-consumed
        event, not inside the forward: a backend may copy from the pinned host buffers while planning (flashinfer
        copies query_start_loc_cpu non-blocking), and the next fill must wait for that too."""
        if not batch.replays_graph:
            batch.context = self.forward_context(batch.metadata, batch.num_padded_tokens)

    def run_model(self, batch: PreparedBatch) -> ForwardOutput:
        """The forward over the padded batch, as a FULL graph (small ones end with the LM head and the greedy
        argmax: kiln/runtime/graph_head.py), PIECEWISE graphs, or compiled/eager pieces."""
        if self.matrix_vector:
            return self._run_model(batch)
        from kiln.models import gemv  # triton: CUDA only

        with gemv.suspended():  # the kernels a graph captures, too
            return self._run_model(batch)

    def _run_model(self, batch: PreparedBatch) -> ForwardOutput:
        n = batch.num_padded_tokens
        desc, mode = self._descriptor(batch.shape)
        ids, pos = self.input_ids[:n], self.positions[:n]

        def forward() -> ForwardOutput:
            if self._graph_unpacks():  # the graph begins with the step's unpacking (`_upload`)
                from kiln.runtime.input_upload_triton import unpack_from_header

                unpack_from_header(self.staged, self._device_inputs, staging_capacity(n, n, self.max_blocks_per_seq))
            return with_head(self.model, self.forward_fn(ids, pos))

        def graphed() -> ForwardOutput:
            return self.full_graph(desc, forward, (ids, pos))

        if batch.context is None and batch.replays_graph:
            return graphed()
        context = batch.context if batch.context is not None else self.forward_context(batch.metadata, n)
        with set_forward_context(context):
            if mode is RunMode.FULL:
                return graphed()
            if mode is RunMode.NONE and self.full_graph is not None:
                self.full_graph.pool.stats.replays["NONE"] += 1  # steps that ran without any graph
            with piecewise_graphs(n if mode is RunMode.PIECEWISE else None):
                return ForwardOutput(self.forward_fn(ids, pos))

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput,
                grammar_mask: Callable[[list[Request]], torch.Tensor | None] | None = None) -> LaunchedStep:
        """Queue one step (inputs, forward, sampling, token read-back) on the device without waiting for it.

        `grammar_mask` (structured outputs): called with the sampling requests once the forward is queued, so
        the host fills the mask while the device runs it; the mask applies to the logits before sampling."""
        return self.launch(self.prepare_step(sched), sched, grammar_mask)

    @torch.inference_mode()
    def prepare_step(self, sched: SchedulerOutput) -> PreparedBatch:
        """A step's inputs queued for the device and its context built, the forward not yet: `launch` runs it.
        A prepared batch that is never launched leaves nothing behind (the next step's inputs overwrite its own),
        except under tensor parallelism, where the workers run each batch they are sent."""
        batch = self.prepare(sched)
        self._build_context(batch)
        self._inputs_consumed.record()
        return batch

    @torch.inference_mode()
    def launch(self, batch: PreparedBatch, sched: SchedulerOutput,
               grammar_mask: Callable[[list[Request]], torch.Tensor | None] | None = None) -> LaunchedStep:
        """The forward, sampling and read-back of a step `prepare_step` prepared (see `execute`)."""
        if batch.local_greedy:
            return self._read_back(sched, batch.sampling_rows, self.forward_greedy(batch), None)
        logits, greedy = self._head(batch, self.run_model(batch))
        scored: dict[int, tuple[int, list[TokenLogprobs]]] = {}
        if batch.prompt_rows:  # read back now (synchronous, as logprobs are); the sampling rows' logits go on
            scored = self._score_prompt(logits, batch.prompt_rows, sched)
            logits, greedy = logits[batch.sample_logit_rows()], None
        step = self._sample(batch, sched, logits, grammar_mask, greedy)
        step.prompt_logprobs = scored
        return step

    @staticmethod
    def _score_prompt(logits: torch.Tensor, spans: list[PromptRows],
                      sched: SchedulerOutput) -> dict[int, tuple[int, list[TokenLogprobs]]]:
        """scheduler index -> (the first prompt position scored, its logprobs and the next ones')."""
        rows, targets, top = [], [], []
        for span in spans:
            req = sched.requests[span.request]
            rows += range(span.first_row, span.first_row + span.count)
            targets += req.prompt_token_ids[span.first_target:span.first_target + span.count]
            top += [req.params.prompt_logprobs] * span.count
        entries = []
        for at in range(0, len(rows), _SCORE_ROWS):  # bounded fp32 copies: a row is a whole vocabulary
            part = slice(at, at + _SCORE_ROWS)
            entries += score_prompt(logits[rows[part]], targets[part], top[part])
        out, at = {}, 0
        for span in spans:
            out[span.request] = (span.first_target, entries[at:at + span.count])
            at += span.count
        return out

    def _sample(self, batch: PreparedBatch, sched: SchedulerOutput, logits: torch.Tensor,
                grammar_mask: Callable[[list[Request]], torch.Tensor | None] | None,
                greedy: torch.Tensor | None = None) -> LaunchedStep:
        """`greedy`: the logits' argmax, computed in the step's graph (used where every row is plain greedy)."""
        if sched.num_spec_tokens:  # synchronous: how many tokens each request gets is read back here
            self.last_sampled = None
            return verify_step(self.sampler, sched, batch.sampling_rows, logits, self.eos_token_ids)
        reqs = [sched.requests[i] for i in batch.sampling_rows]
        if not reqs:
            self._last_rows = {}
            self.last_sampled = None
            return LaunchedStep(sched, [], [])
        mask = grammar_mask(reqs) if grammar_mask is not None else None
        if mask is not None:
            apply_token_mask(logits, mask)
            greedy = None
        tokens, logprobs = self.sampler.sample(logits, SamplingBatch(
            params=[r.params for r in reqs],
            generators=[r.generator for r in reqs],
            prompt_token_ids=[r.prompt_token_ids for r in reqs],
            output_token_ids=[r.output_token_ids for r in reqs],
            eos_token_ids=self.eos_token_ids,
            num_pending_tokens=[r.num_pending_tokens for r in reqs],
            bad_words=[r.bad_words_token_ids for r in reqs] if any(r.bad_words_token_ids for r in reqs) else None,
        ), greedy)
        if self.on_sampled is not None:
            self.on_sampled(tokens)
        return self._read_back(sched, batch.sampling_rows, tokens, logprobs)

    def _read_back(self, sched: SchedulerOutput, rows: list[int], tokens: torch.Tensor,
                   logprobs: list[TokenLogprobs | None] | None) -> LaunchedStep:
        """Keep the sampled tokens on the device for the next step's inputs and start their copy to the host."""
        self._last_rows = {sched.requests[i].request_id: j for j, i in enumerate(rows)}
        self.last_sampled = tokens
        host, landed = self._readback.start(tokens)
        return LaunchedStep(sched, rows, logprobs if logprobs is not None else [None] * len(rows), host, landed)

    @torch.inference_mode()
    def execute_replica(self, shape: BatchShape, num_pending: int, local_greedy: bool = False) -> torch.Tensor | None:
        """A tensor-parallel worker's step: the host buffers hold rank 0's batch; run the same forward (its
        collectives pair with rank 0's) and discard the logits, or, `local_greedy`, return the greedy tokens
        every rank computes alike. Pending input tokens come from `last_sampled`, this rank's copy of the
        previous step's samples."""
        batch = self.to_device(shape, [], num_pending)
        self._build_context(batch)
        self._inputs_consumed.record()
        if local_greedy:
            return self.forward_greedy(batch)
        self.forward(batch)
        return None
