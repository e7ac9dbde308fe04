"""Tensor parallelism: process-group set-up, the choice of step channel, a worker's loop, and the ordered
tear-down of the groups.

Rank 0 runs the scheduler and samples; every rank holds a model shard, a KV-cache shard and a model
runner. Each step rank 0 sends the flat batch it prepared (a fixed header of sizes, then the host buffers)
through a step channel (kiln/runtime/step_channel.py: shared memory when kiln spawned every rank on this
host, gloo broadcasts otherwise), so the workers fill their own persistent buffers and run the same
forward, whose collectives (NCCL on GPU, gloo on CPU) are traced into the compiled graph. Under async
scheduling rank 0 also broadcasts the sampled token ids over the device group, so a worker fills the
next step's pending input tokens from its own device copy exactly as rank 0 does (docs/distributed.md).

Rendezvous is always torch's env:// (MASTER_ADDR/MASTER_PORT, RANK, WORLD_SIZE): processes kiln spawns
on one host get those variables set, and processes started by `torchrun` across hosts already have them.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from kiln.config import RuntimeConfig, resolve_device
from kiln.models.parallel import TPGroup, set_tp_group
from kiln.runtime.errors import EngineDeadError
from kiln.runtime.model_runner import ModelRunner
from kiln.runtime.step_channel import GlooStepChannel, StepChannel

__all__ = ["EngineDeadError", "StepChannel", "open_step_channel", "worker_main"]

logger = logging.getLogger("kiln")


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


def step_channel_kind(local_workers: bool) -> str:
    """Rank 0's choice: shared memory when it spawned every worker on its own host, else gloo (torchrun,
    possibly across hosts). KILN_TP_STEP_CHANNEL=gloo forces gloo (e.g. to compare the two)."""
    asked = os.environ.get("KILN_TP_STEP_CHANNEL", "auto")
    if asked not in ("auto", "shm", "gloo"):
        raise ValueError(f"KILN_TP_STEP_CHANNEL must be auto, shm or gloo; got {asked!r}")
    if asked == "shm" and not local_workers:
        raise ValueError("KILN_TP_STEP_CHANNEL=shm needs workers kiln spawned on this host (not torchrun)")
    return "gloo" if asked == "gloo" or not local_workers else "shm"


def _check_shm_space(nbytes: int) -> None:
    """tmpfs allocates pages on first touch: a segment larger than what /dev/shm has left (64 MB in a default
    Docker container) would be created fine and then kill a process with SIGBUS mid-step."""
    if os.path.isdir("/dev/shm"):
        stat = os.statvfs("/dev/shm")
        free = stat.f_bavail * stat.f_frsize
        if free < nbytes:
            raise OSError(f"/dev/shm has {free} bytes free, the step channel needs {nbytes}")


def open_step_channel(rank: int, group: dist.ProcessGroup, runner: ModelRunner, device: torch.device,
                      local_workers: bool = False, check_workers=None) -> StepChannel:
    """Every rank calls this once, after its warm-up. Rank 0 picks the channel and, for shared memory, creates
    the segment sized for the runner's largest batch; the workers map it; once all did, rank 0 unlinks its
    name, so no /dev/shm entry outlives the set-up whatever happens later (docs/distributed.md)."""
    from kiln.runtime.step_channel_shm import ShmLayout, ShmStepChannel

    world = dist.get_world_size(group)
    timeout = float(os.environ.get("KILN_TP_TIMEOUT", "300"))
    spin_ms = float(os.environ.get("KILN_TP_SHM_SPIN_MS", "50" if device.type == "cuda" else "2"))
    options = {"device_group": dist.group.WORLD, "spin_s": spin_ms / 1000}
    channel: StepChannel | None = None
    offer = [None]
    if rank == 0:
        kind = step_channel_kind(local_workers)
        if kind == "shm":
            layout = ShmLayout.for_runner(runner, world - 1)
            try:  # a failure here must not leave the workers waiting for an offer: fall back instead
                _check_shm_space(layout.total_bytes)
                channel = ShmStepChannel.create(layout, check_workers or (lambda: None), timeout_s=timeout,
                                                **options)
            except (OSError, ValueError) as exc:
                logger.warning("shared-memory step channel unavailable (%s); using gloo broadcasts", exc)
                kind = "gloo"
        offer = [(kind, channel.name, os.getpid(), layout)] if channel is not None else [("gloo", None, None, None)]
    try:
        dist.broadcast_object_list(offer, src=0, group=group)
        kind, name, rank0_pid, layout = offer[0]
        ok = 1
        if rank != 0 and kind == "shm":
            try:
                if layout != ShmLayout.for_runner(runner, world - 1):
                    raise ValueError(f"rank {rank}'s host buffers differ from rank 0's: {layout}")
                channel = ShmStepChannel.attach(name, layout, rank, rank0_pid, **options)
            except Exception:
                logger.exception("worker rank %d could not map the shared-memory step channel", rank)
                ok = 0
        if agree_min(ok, group) == 0:  # every worker mapped the segment (or one failed: all ranks raise)
            raise RuntimeError("a tensor-parallel rank could not map the shared-memory step channel")
    except BaseException:
        if channel is not None:
            channel.close()
        raise
    finally:
        if rank == 0 and channel is not None:
            channel.unlink()
    if kind == "gloo":
        channel = GlooStepChannel(group, dist.group.WORLD)
    logger.info("tensor-parallel rank %d: %s step channel%s", rank, kind,
                f" ({layout.total_bytes / 2**20:.1f} MiB, {layout.num_slots} slots)" if kind == "shm" else "")
    return channel


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
    runner = worker.runner
    channel = open_step_channel(rank, group, runner, device)
    try:
        while (header := channel.recv(runner)) is not None:
            tokens = runner.execute_replica(header.shape, header.num_pending, header.local_greedy)
            share = header.share_samples and header.shape.num_sampling > 0
            runner.last_sampled = tokens if header.local_greedy else (
                channel.recv_samples(header.shape.num_sampling, device) if share else None)
    except EngineDeadError as exc:  # rank 0 is gone: its groups cannot be torn down with it
        logger.error("%s", exc)
        return False
    finally:
        channel.close()
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
