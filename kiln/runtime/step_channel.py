"""Rank 0 -> tensor-parallel workers: each step's header and the host buffers it describes.

Every step rank 0 hands its workers the flat batch it prepared (a fixed header of sizes, then the slices of
its host input buffers that the header describes); a worker copies them into its own host buffers and runs
the same forward. `StepChannel` is the interface the engine and the worker loop use; two implementations
carry the bytes: `GlooStepChannel` (two broadcasts over the CPU process group: works across hosts, used
under torchrun) and `ShmStepChannel` (kiln/runtime/step_channel_shm.py: a shared-memory ring, used when
kiln spawned every rank on its own host; no TCP round trip on rank 0's host per step). Under async
scheduling the step's sampled token ids travel over the device group in both (queued on the stream, the
host does not wait): that part is the base class's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from kiln.runtime.model_runner import BatchShape, ModelRunner

CMD_STOP, CMD_STEP = 0, 1
HEADER_LEN = 4 + len(dataclasses.fields(BatchShape))  # command, pending tokens, samples shared, local greedy, shape
# the host buffers a step sends, in order (their slices are given by `host_views`)
HOST_BUFFERS = ("input_ids_cpu", "positions_cpu", "slot_mapping_cpu", "query_start_loc_cpu", "seq_lens_cpu",
                "block_tables_cpu", "logits_indices_cpu", "pending_dst_cpu", "pending_src_cpu")


@dataclasses.dataclass(frozen=True)
class StepHeader:
    shape: BatchShape
    num_pending: int  # input tokens the previous step sampled (async scheduling): filled on the device
    share_samples: bool  # rank 0 broadcasts this step's sampled ids after its forward
    local_greedy: bool = False  # every rank computes the greedy ids itself (ModelRunner.execute_replica)


_SHAPE_FIELDS = tuple(f.name for f in dataclasses.fields(BatchShape))


def encode_header(header: StepHeader) -> list[int]:
    shape = header.shape  # not dataclasses.astuple: it deep-copies, and this runs every step
    return [CMD_STEP, header.num_pending, int(header.share_samples), int(header.local_greedy),
            *[int(getattr(shape, f)) for f in _SHAPE_FIELDS]]


def decode_header(values: list[int]) -> StepHeader | None:
    """None for the stop command."""
    if values[0] == CMD_STOP:
        return None
    shape = BatchShape(*[bool(v) if f.type in (bool, "bool") else int(v)
                         for v, f in zip(values[4:], dataclasses.fields(BatchShape))])
    return StepHeader(shape, int(values[1]), bool(values[2]), bool(values[3]))


def step_slices(buffers: Sequence[Any], shape: BatchShape, num_pending: int) -> list[Any]:
    """The slices that one step fills of `buffers` (the `HOST_BUFFERS`, in order: tensors or numpy arrays)."""
    ids, pos, slots, qsl, seq_lens, tables, logits_idx, pending_dst, pending_src = buffers
    n, r = shape.num_padded_tokens, shape.num_reqs
    return [ids[:n], pos[:n], slots[:n], qsl[: r + 1], seq_lens[:r], tables[:r, : shape.max_blocks],
            logits_idx[: shape.num_logits], pending_dst[:num_pending], pending_src[:num_pending]]


def host_views(runner: ModelRunner, shape: BatchShape, num_pending: int) -> list[torch.Tensor]:
    """The slices of the runner's host buffers that one step fills."""
    return step_slices([getattr(runner, name) for name in HOST_BUFFERS], shape, num_pending)


class StepChannel:
    """The engine calls `send` every step and `send_stop` once; a worker calls `recv` until it returns None.
    The sampled-id broadcast (async scheduling) goes over the device group whatever carries the header."""

    kind = "base"

    def __init__(self, device_group: dist.ProcessGroup | None) -> None:
        self.device_group = device_group

    def send(self, runner: ModelRunner, header: StepHeader) -> None:
        raise NotImplementedError

    def send_stop(self) -> None:
        raise NotImplementedError

    def recv(self, runner: ModelRunner) -> StepHeader | None:
        """The next step's header with the runner's host buffers filled, or None when rank 0 said stop."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the channel holds (idempotent)."""

    def share_samples(self, tokens: torch.Tensor) -> None:
        dist.broadcast(tokens, 0, group=self.device_group)

    def recv_samples(self, num: int, device: torch.device) -> torch.Tensor:
        tokens = torch.empty(num, dtype=torch.int64, device=device)
        dist.broadcast(tokens, 0, group=self.device_group)
        return tokens


class GlooStepChannel(StepChannel):
    """Two broadcasts over the CPU group per step: the fixed-size header, then one int64 payload."""

    kind = "gloo"

    def __init__(self, group: dist.ProcessGroup, device_group: dist.ProcessGroup | None = None) -> None:
        super().__init__(device_group)
        self.group = group

    def send(self, runner: ModelRunner, header: StepHeader) -> None:
        dist.broadcast(torch.tensor(encode_header(header), dtype=torch.int64), 0, group=self.group)
        views = host_views(runner, header.shape, header.num_pending)
        payload = torch.cat([v.reshape(-1).to(torch.int64) for v in views])
        dist.broadcast(payload, 0, group=self.group)

    def send_stop(self) -> None:
        dist.broadcast(torch.zeros(HEADER_LEN, dtype=torch.int64), 0, group=self.group)

    def recv(self, runner: ModelRunner) -> StepHeader | None:
        raw = torch.empty(HEADER_LEN, dtype=torch.int64)
        dist.broadcast(raw, 0, group=self.group)
        header = decode_header(raw.tolist())
        if header is None:
            return None
        views = host_views(runner, header.shape, header.num_pending)
        payload = torch.empty(sum(v.numel() for v in views), dtype=torch.int64)
        dist.broadcast(payload, 0, group=self.group)
        runner.wait_host_buffers_free()  # the previous step's non-blocking uploads read them
        offset = 0
        for view in views:
            view.copy_(payload[offset:offset + view.numel()].view(view.shape))
            offset += view.numel()
        return header
