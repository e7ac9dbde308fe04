"""Tensor parallelism: process-group set-up, the per-step broadcast of the batch, a worker's loop, and the
ordered tear-down of the groups.

Rank 0 runs the scheduler and samples; every rank holds a model shard, a KV-cache shard and a model
runner. Each step rank 0 broadcasts the flat batch it prepared (a fixed header of sizes, then one int64
payload) over a CPU (gloo) group, so the workers fill their own persistent buffers and run the same
forward, whose collectives (NCCL on GPU, gloo on CPU) are traced into the compiled graph. Under async
scheduling rank 0 also broadcasts the sampled token ids over the device group, so a worker fills the
next step's pending input tokens from its own device copy exactly as rank 0 does (docs/distributed.md).

Rendezvous is always torch's env:// (MASTER_ADDR/MASTER_PORT, RANK, WORLD_SIZE): processes kiln spawns
on one host get those variables set, and processes started by `torchrun` across hosts already have them.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import logging
import os
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from kiln.config import RuntimeConfig, resolve_device
from kiln.models.parallel import TPGroup, set_tp_group
from kiln.runtime.model_runner import BatchShape, ModelRunner

logger = logging.getLogger("kiln")

_CMD_STEP, _CMD_STOP = 1, 0
_HEADER = 3 + len(dataclasses.fields(BatchShape))  # command, pending tokens, samples shared, the shape


class EngineDeadError(RuntimeError):
    """The engine cannot continue (e.g. a tensor-parallel worker died); every request fails with it."""


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def init_tensor_parallel(rank: int, world: int, device: torch.device) -> dist.ProcessGroup:
    """Join the group (env:// rendezvous) and publish it to the model layers; returns the CPU group."""
    if after := float(os.environ.get("KILN_DUMP_STACKS_AFTER", "0")):
        # debugging a hang: every rank prints all its threads' Python stacks every `after` seconds
        faulthandler.dump_traceback_later(after, repeat=True)
    timeout = timedelta(seconds=float(os.environ.get("KILN_TP_TIMEOUT", "300")))
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world, timeout=timeout)
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else dist.group.WORLD
    set_tp_group(TPGroup(rank, world, dist.group.WORLD))
    return cpu_group


def agree_min(value: int, group: dist.ProcessGroup) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


@dataclasses.dataclass(frozen=True)
class StepHeader:
    shape: BatchShape
    num_pending: int  # input tokens the previous step sampled (async scheduling): filled on the device
    share_samples: bool  # rank 0 broadcasts this step's sampled ids after its forward


class StepChannel:
    """Rank 0 -> workers: one step's header and the host buffers it describes (CPU group), and under async
    scheduling the step's sampled token ids (device group, queued on the stream: the host does not wait)."""

    def __init__(self, group: dist.ProcessGroup, device_group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.device_group = device_group

    @staticmethod
    def _views(runner: ModelRunner, shape: BatchShape, num_pending: int) -> list[torch.Tensor]:
        n, r = shape.num_padded_tokens, shape.num_reqs
        return [runner.input_ids_cpu[:n], runner.positions_cpu[:n], runner.slot_mapping_cpu[:n],
                runner.query_start_loc_cpu[: r + 1], runner.seq_lens_cpu[:r],
                runner.block_tables_cpu[:r, : shape.max_blocks], runner.logits_indices_cpu[: shape.num_sampling],
                runner.pending_dst_cpu[:num_pending], runner.pending_src_cpu[:num_pending]]

    def send(self, runner: ModelRunner, header: StepHeader) -> None:
        shape = header.shape
        values = [_CMD_STEP, header.num_pending, int(header.share_samples), *dataclasses.astuple(shape)]
        dist.broadcast(torch.tensor(values, dtype=torch.int64), 0, group=self.group)
        views = self._views(runner, shape, header.num_pending)
        payload = torch.cat([v.reshape(-1).to(torch.int64) for v in views])
        dist.broadcast(payload, 0, group=self.group)

    def send_stop(self) -> None:
        dist.broadcast(torch.zeros(_HEADER, dtype=torch.int64), 0, group=self.group)

    def share_samples(self, tokens: torch.Tensor) -> None:
        dist.broadcast(tokens, 0, group=self.device_group)

    def recv(self, runner: ModelRunner) -> StepHeader | None:
        raw = torch.empty(_HEADER, dtype=torch.int64)
        dist.broadcast(raw, 0, group=self.group)
        if int(raw[0]) == _CMD_STOP:
            return None
        values = raw[3:].tolist()
        shape = BatchShape(*[bool(v) if f.type in (bool, "bool") else int(v)
                             for v, f in zip(values, dataclasses.fields(BatchShape))])
        header = StepHeader(shape, int(raw[1]), bool(raw[2]))
        views = self._views(runner, shape, header.num_pending)
        payload = torch.empty(sum(v.numel() for v in views), dtype=torch.int64)
        dist.broadcast(payload, 0, group=self.group)
        runner.wait_host_buffers_free()  # the previous step's non-blocking uploads read them
        offset = 0
        for view in views:
            view.copy_(payload[offset:offset + view.numel()].view(view.shape))
            offset += view.numel()
        return header

    def recv_samples(self, num: int, device: torch.device) -> torch.Tensor:
        tokens = torch.empty(num, dtype=torch.int64, device=device)
        dist.broadcast(tokens, 0, group=self.device_group)
        return tokens


def worker_main(config: RuntimeConfig, rank: int, world: int) -> bool:
    """A worker rank: build this rank's shard, run every step rank 0 broadcasts until told to stop, then
    tear down in order. Returns whether the process groups were destroyed in time."""
    from kiln.runtime.worker import Worker

    device = resolve_device(config.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    group = init_tensor_parallel(rank, world, device)
    worker = Worker(config, device, agree_num_blocks=lambda n: agree_min(n, group))
    worker.warm_up()
    channel = StepChannel(group, dist.group.WORLD)
    runner = worker.runner
    while (header := channel.recv(runner)) is not None:
        runner.execute_replica(header.shape, header.num_pending)
        share = header.share_samples and header.shape.num_sampling > 0
        runner.last_sampled = channel.recv_samples(header.shape.num_sampling, device) if share else None
    return close_tensor_parallel(worker, shutdown_timeout())


def shutdown_timeout() -> float:
    return float(os.environ.get("KILN_TP_SHUTDOWN_TIMEOUT", "30"))


def close_tensor_parallel(worker, timeout: float) -> bool:
    """This rank's tear-down, after its last step: wait for the device, drop the CUDA graphs and their memory
    pool (they hold captured NCCL kernels, and destroying communicators under live graphs can hang:
    pytorch/pytorch#115388), then destroy every process group. Every rank does this at the same time (rank 0
    before it joins its workers: NCCL's communicator tear-down may wait for the peers). All of it runs on a
    thread bounded by `timeout` (the device sync too: a collective whose peer died never completes); returns
    False (and logs) when it did not finish, so the caller can leave without waiting on it. The peer-to-peer
    all-reduce buffers go after the graphs that captured them and before the groups they were built on."""
    done = threading.Event()

    def tear_down() -> None:
        try:
            try:
                if worker is not None:
                    if worker.device.type == "cuda":  # a new thread starts on device 0
                        torch.cuda.set_device(worker.device)
                    worker.release_graphs()
            finally:
                set_tp_group(TPGroup())
            dist.destroy_process_group()
        except Exception as exc:  # a peer that is already gone must not make shutdown fail
            logger.warning("tearing down the tensor-parallel process groups failed: %s", exc)
        finally:
            done.set()

    threading.Thread(target=tear_down, name="kiln-tp-tear-down", daemon=True).start()
    if done.wait(timeout):
        return True
    logger.error("releasing CUDA graphs and destroying the tensor-parallel process groups did not finish within "
                 "%.0f s; leaving them behind", timeout)
    return False
