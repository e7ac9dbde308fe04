"""Rank 0's side of tensor parallelism: it starts or joins the group, sends each step to the workers, and tears
the group down in the order every rank follows (docs/distributed.md).

The engine holds one `TensorParallelLeader` when `tensor_parallel_size > 1` and none otherwise, so the
single-GPU engine carries no group, channel or worker list. `kiln.runtime.distributed` (torch.distributed) is
imported only here and only under tensor parallelism: a single-GPU start does not pay for it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from kiln.config import RuntimeConfig
from kiln.runtime import tp_processes

logger = logging.getLogger("kiln")


def _check_heads_split(model: str | None, world: int) -> None:
    """The attention heads must split evenly over the ranks: said before any worker starts, not by every rank's
    load failing alike."""
    from kiln.models.loader.load import resolve_model_source

    try:
        _, config = resolve_model_source(model)
    except (ValueError, OSError):
        return  # rank 0's own load says what is wrong with the model
    heads = getattr(config, "num_attention_heads", None)  # a ConfigView or transformers' config
    if isinstance(heads, int) and heads % world:
        raise ValueError(f"num_attention_heads {heads} is not divisible by tensor parallel size {world}")


class TensorParallelLeader:
    """Rank 0 of a group: built before the worker (the rendezvous), `open_channel` after the worker's warm-up
    (the workers open theirs after their own), then `send_step` / `share_samples` per step and `shutdown`."""

    def __init__(self, config: RuntimeConfig, device: torch.device, ready: threading.Event) -> None:
        """Spawn the local workers (or, under torchrun, serve as rank 0 of the ranks it started; any other rank
        serves rank 0 here and then exits) and join the group. `ready`: set by the engine once built, it ends the
        watch over the workers' start-up. `device` is rank 0's device (LOCAL_RANK's GPU under torchrun)."""
        from kiln.runtime import distributed as tp

        world = config.tensor_parallel_size
        self.procs: list = []  # the local workers kiln spawned (none under torchrun)
        self.channel: Any = None  # the step channel, from `open_channel` until `shutdown`
        if tp.launched_by_torchrun():
            rank = int(os.environ["RANK"])
            if int(os.environ["WORLD_SIZE"]) != world:
                raise ValueError(f"tensor_parallel_size={world} but torchrun started {os.environ['WORLD_SIZE']} ranks")
            if rank != 0:  # the same entry point on every rank: the others serve rank 0 and then exit
                if not tp.worker_main(config, rank, world):
                    os._exit(tp_processes.UNCLEAN_EXIT)  # its groups hang in their tear-down: exit hooks would too
                raise SystemExit(0)
        else:
            _check_heads_split(config.model, world)
            workers = tp_processes.spawn_workers(config, world)
            self.procs = workers.procs
            try:  # before the rendezvous, which would wait for a dead worker until the group's timeout
                tp_processes.wait_until_started(workers, timeout=float(os.environ.get("KILN_TP_TIMEOUT", "300")))
            except tp_processes.WorkerStartError:
                tp_processes.stop_workers(self.procs, timeout=1.0)
                raise
            tp_processes.watch_start_up(self.procs, ready)
        self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if device.type == "cuda" else device
        self.group = tp.init_tensor_parallel(0, world, self.device)

    def agree_num_blocks(self) -> Callable[[int], int]:
        """The KV block count every rank can hold: the smallest of the ranks' own."""
        from kiln.runtime import distributed as tp

        return lambda n: tp.agree_min(n, self.group)

    def open_channel(self, runner: Any) -> None:
        from kiln.runtime import distributed as tp

        self.channel = tp.open_step_channel(0, self.group, runner, self.device, local_workers=bool(self.procs),
                                            check_workers=lambda: tp_processes.check_workers(self.procs))

    def send_step(self, runner: Any, shape: Any, num_pending: int, local_greedy: bool,
                  async_scheduling: bool) -> None:
        """The step's header and inputs to every worker; the workers must be alive (a dead one raises here)."""
        from kiln.runtime.step_channel import StepHeader

        tp_processes.check_workers(self.procs)
        # greedy ids computed on every rank need no broadcast; otherwise async workers need rank 0's
        share = async_scheduling and not local_greedy
        self.channel.send(runner, StepHeader(shape, num_pending, share, local_greedy))

    def share_samples(self, tokens: torch.Tensor) -> None:
        self.channel.share_samples(tokens)

    def shutdown(self, worker: Any) -> None:
        """Stop the workers' step loop, destroy rank 0's groups while they destroy theirs, then join them with a
        bound (a worker still alive after KILN_TP_SHUTDOWN_TIMEOUT seconds is terminated, loudly)."""
        from kiln.runtime import distributed as tp

        try:
            self.channel.send_stop()
        except Exception as exc:  # a dead worker must not make shutdown fail
            logger.warning("could not stop tensor-parallel workers cleanly: %s", exc)
        self.channel.close()
        self.channel = None
        timeout, start = tp.shutdown_timeout(), time.perf_counter()
        clean = tp.close_tensor_parallel(worker, timeout)
        closed = time.perf_counter()
        forced = tp_processes.stop_workers(self.procs, timeout)
        logger.info("tensor-parallel shutdown: rank 0's groups %s in %.1f s, workers joined in %.1f s%s",
                    "destroyed" if clean else "NOT destroyed", closed - start, time.perf_counter() - closed,
                    f" (ranks {forced} had to be terminated)" if forced else "")
