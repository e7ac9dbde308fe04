"""Tensor parallelism: process-group set-up, worker processes, and the per-step broadcast of the batch.

Rank 0 runs the scheduler and samples; every rank holds a model shard, a KV-cache shard and a model
runner. Each step rank 0 broadcasts the flat batch it prepared (a fixed header of sizes, then one int64
payload) over a CPU (gloo) group, so the workers fill their own persistent buffers and run the same
forward, whose collectives (NCCL on GPU, gloo on CPU) are traced into the compiled graph.

Rendezvous is always torch's env:// (MASTER_ADDR/MASTER_PORT, RANK, WORLD_SIZE): processes kiln spawns
on one host get those variables set, and processes started by `torchrun` across hosts already have them.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import logging
import multiprocessing as mp
import os
import socket
import sys
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from kiln.config import RuntimeConfig, resolve_device
from kiln.models.parallel import TPGroup, set_tp_group
from kiln.runtime.model_runner import BatchShape, ModelRunner

logger = logging.getLogger("kiln")

_CMD_STEP, _CMD_STOP = 1, 0
_HEADER = 1 + len(dataclasses.fields(BatchShape))


class EngineDeadError(RuntimeError):
    """The engine cannot continue (e.g. a tensor-parallel worker died); every request fails with it."""


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


class StepChannel:
    """Rank 0 -> workers: one step's BatchShape and the host buffers it describes."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    @staticmethod
    def _views(runner: ModelRunner, shape: BatchShape) -> list[torch.Tensor]:
        n, r = shape.num_padded_tokens, shape.num_reqs
        return [runner.input_ids_cpu[:n], runner.positions_cpu[:n], runner.slot_mapping_cpu[:n],
                runner.query_start_loc_cpu[: r + 1], runner.seq_lens_cpu[:r],
                runner.block_tables_cpu[:r, : shape.max_blocks], runner.logits_indices_cpu[: shape.num_sampling]]

    def send(self, runner: ModelRunner, shape: BatchShape) -> None:
        header = torch.tensor([_CMD_STEP, *dataclasses.astuple(shape)], dtype=torch.int64)
        dist.broadcast(header, 0, group=self.group)
        payload = torch.cat([v.reshape(-1).to(torch.int64) for v in self._views(runner, shape)])
        dist.broadcast(payload, 0, group=self.group)

    def send_stop(self) -> None:
        dist.broadcast(torch.zeros(_HEADER, dtype=torch.int64), 0, group=self.group)

    def recv(self, runner: ModelRunner) -> BatchShape | None:
        header = torch.empty(_HEADER, dtype=torch.int64)
        dist.broadcast(header, 0, group=self.group)
        if int(header[0]) == _CMD_STOP:
            return None
        values = header[1:].tolist()
        shape = BatchShape(*[bool(v) if f.type in (bool, "bool") else int(v)
                             for v, f in zip(values, dataclasses.fields(BatchShape))])
        views = self._views(runner, shape)
        payload = torch.empty(sum(v.numel() for v in views), dtype=torch.int64)
        dist.broadcast(payload, 0, group=self.group)
        offset = 0
        for view in views:
            view.copy_(payload[offset:offset + view.numel()].view(view.shape))
            offset += view.numel()
        return shape


def worker_main(config: RuntimeConfig, rank: int, world: int) -> None:
    """A worker rank: build this rank's shard, then run every step rank 0 broadcasts until told to stop."""
    from kiln.runtime.worker import Worker

    device = resolve_device(config.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    group = init_tensor_parallel(rank, world, device)
    worker = Worker(config, device, agree_num_blocks=lambda n: agree_min(n, group))
    worker.warm_up()
    channel = StepChannel(group)
    while (shape := channel.recv(worker.runner)) is not None:
        worker.runner.forward(worker.runner.to_device(shape, []))
    dist.destroy_process_group()


def _spawned_worker(config: RuntimeConfig, rank: int, world: int, env: dict[str, str]) -> None:
    os.environ.update(env)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    worker_main(config, rank, world)


def spawn_workers(config: RuntimeConfig, world: int) -> list[mp.Process]:
    """Start ranks 1..world-1 on this host (rank 0 is the caller) with an env:// rendezvous."""
    # a fresh port per group: a port from an earlier group in this process may still be held or half-closed
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(_free_port())
    env = {"MASTER_ADDR": os.environ["MASTER_ADDR"], "MASTER_PORT": os.environ["MASTER_PORT"],
           "WORLD_SIZE": str(world)}
    ctx = mp.get_context("spawn")
    procs = []
    for rank in range(1, world):
        proc = ctx.Process(target=_spawned_worker, args=(config, rank, world, {**env, "RANK": str(rank),
                                                                                 "LOCAL_RANK": str(rank)}),
                           name=f"kiln-tp-rank{rank}", daemon=True)
        proc.start()
        procs.append(proc)
    return procs


def watch_start_up(procs: list[mp.Process], ready: threading.Event) -> None:
    """Until `ready`, report a worker that dies at once: rank 0 would otherwise sit in a collective until
    the group's timeout (KILN_TP_TIMEOUT) with no hint of why."""

    def watch() -> None:
        while not ready.wait(1.0):
            for rank, proc in enumerate(procs, start=1):
                if not proc.is_alive():
                    logger.error("tensor-parallel worker rank %d exited during start-up (code %s); rank 0 fails "
                                 "when its pending collective times out (KILN_TP_TIMEOUT=%s s)", rank, proc.exitcode,
                                 os.environ.get("KILN_TP_TIMEOUT", "300"))
                    return

    threading.Thread(target=watch, name="kiln-tp-start-up-watch", daemon=True).start()


def check_workers(procs: list[mp.Process]) -> None:
    for rank, proc in enumerate(procs, start=1):
        if not proc.is_alive():
            raise EngineDeadError(f"tensor-parallel worker rank {rank} exited (code {proc.exitcode}); "
                                  "the engine has stopped")
