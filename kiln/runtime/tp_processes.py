"""The worker processes rank 0 spawns on one host: start, start-up handshake, liveness, and a bounded stop.

Rank 0 must never wait on a worker that is gone. Three places could: the env:// rendezvous (a TCP
store that waits for every rank until the group timeout), the per-step broadcast, and the join at
shutdown. So rank 0 waits for each worker's hello (kiln imported) before the rendezvous: a worker that dies
before that makes rank 0 fail at once instead of after KILN_TP_TIMEOUT; every step checks liveness first;
and the shutdown join is bounded, escalating to SIGTERM and SIGKILL with an error in the log.

The workers start from kiln's own entry point (kiln/compiler/child_process.py), not as multiprocessing
children, which would import the user's main script again: a plain script that builds
`Runtime(tensor_parallel_size=2)` at top level needs no `if __name__ == "__main__":`. A worker still running
when rank 0's interpreter exits (a runtime never shut down) is terminated then, as multiprocessing did with
its daemonic children.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass

from kiln.compiler.child_process import ChildProcess
from kiln.config import RuntimeConfig

logger = logging.getLogger("kiln")


RANK0_PID_ENV = "KILN_TP_RANK0_PID"  # set in the workers rank 0 starts (their parent's pid)
UNCLEAN_EXIT = 3  # a worker whose process groups were not destroyed within KILN_TP_SHUTDOWN_TIMEOUT


class WorkerStartError(RuntimeError):
    """A tensor-parallel worker died before joining the group."""


@dataclass
class LocalWorkers:
    """Ranks 1..world-1 on this host (procs[i] is rank i+1)."""

    procs: list[ChildProcess]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def in_local_worker() -> bool:
    """Whether this process is a tensor-parallel rank that rank 0 started on its host."""
    return RANK0_PID_ENV in os.environ


def watch_parent(parent_pid: int, poll: float = 1.0) -> None:
    """A spawned worker leaves when rank 0 (its parent) is gone, wherever it waits: the step channel notices
    that too, but a collective whose peer died may never return (NCCL waits until the group's timeout)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll)
        logger.error("tensor-parallel rank 0 (pid %d) exited; this worker leaves", parent_pid)
        sys.stderr.flush()
        os._exit(UNCLEAN_EXIT)

    threading.Thread(target=watch, name="kiln-tp-parent-watch", daemon=True).start()


def _spawned_worker(config: RuntimeConfig, rank: int, world: int, env: dict[str, str]) -> None:
    watch_parent(int(env[RANK0_PID_ENV]))
    os.environ.update(env)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    from kiln.runtime.distributed import worker_main

    if not worker_main(config, rank, world):
        # the process groups did not go away in time: leave without running the interpreter's exit hooks,
        # which could wait on the same communicators; the exit code tells rank 0 (and tests) it happened
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(UNCLEAN_EXIT)


def spawn_workers(config: RuntimeConfig, world: int) -> LocalWorkers:
    """Start ranks 1..world-1 on this host (rank 0 is the caller) with an env:// rendezvous."""
    # a fresh port per group: a port from an earlier group in this process may still be held or half-closed
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(_free_port())
    env = {"MASTER_ADDR": os.environ["MASTER_ADDR"], "MASTER_PORT": os.environ["MASTER_PORT"],
           "WORLD_SIZE": str(world), RANK0_PID_ENV: str(os.getpid())}
    workers = LocalWorkers([])
    for rank in range(1, world):
        proc = ChildProcess(f"kiln-tp-rank{rank}")
        workers.procs.append(proc)
        proc.start(_spawned_worker, config, rank, world, {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)})
    atexit.register(_terminate_at_exit, list(workers.procs))
    return workers


def wait_until_started(workers: LocalWorkers, timeout: float) -> None:
    """Return once every worker is past its imports; raise WorkerStartError as soon as one dies before that."""
    deadline = time.monotonic() + timeout
    for rank, proc in enumerate(workers.procs, start=1):
        if not proc.wait_ready(max(0.0, deadline - time.monotonic())):
            if proc.is_alive():
                raise WorkerStartError(f"tensor-parallel workers did not start within {timeout:.0f} s")
            proc.join(1.0)
            raise WorkerStartError(f"tensor-parallel worker rank {rank} exited (code {proc.exitcode}) before it "
                                   "started (its error is above)")


def _terminate_at_exit(procs: list[ChildProcess]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.join(5.0)


def watch_start_up(procs: list[ChildProcess], ready: threading.Event) -> None:
    """Until `ready`, report a worker that dies during start-up (after the rendezvous: its model load or
    warm-up). Rank 0's pending gloo collective then fails when the peer's connection closes; an NCCL one
    only at the group's timeout (KILN_TP_TIMEOUT), so the log names the cause first."""

    def watch() -> None:
        while not ready.wait(1.0):
            for rank, proc in enumerate(procs, start=1):
                if not proc.is_alive():
                    logger.error("tensor-parallel worker rank %d exited during start-up (code %s); rank 0 fails "
                                 "when its pending collective fails or times out (KILN_TP_TIMEOUT=%s s)", rank,
                                 proc.exitcode, os.environ.get("KILN_TP_TIMEOUT", "300"))
                    return

    threading.Thread(target=watch, name="kiln-tp-start-up-watch", daemon=True).start()


def check_workers(procs: list[ChildProcess]) -> None:
    from kiln.runtime.distributed import EngineDeadError

    for rank, proc in enumerate(procs, start=1):
        if not proc.is_alive():
            raise EngineDeadError(f"tensor-parallel worker rank {rank} exited (code {proc.exitcode}); "
                                  "the engine has stopped")


def stop_workers(procs: list[ChildProcess], timeout: float) -> list[int]:
    """Join every worker within `timeout` seconds in all; one still running is terminated, then killed.
    Returns the ranks that had to be ended that way (logged as errors: their shutdown hung)."""
    deadline = time.monotonic() + timeout
    forced = []
    for rank, proc in enumerate(procs, start=1):
        proc.join(timeout=max(deadline - time.monotonic(), 0.1))
        if not proc.is_alive():
            if proc.exitcode == UNCLEAN_EXIT:
                logger.error("tensor-parallel worker rank %d could not destroy its process groups in time and "
                             "left without them", rank)
            continue
        forced.append(rank)
        logger.error("tensor-parallel worker rank %d (pid %s) did not exit within %.0f s of shutdown; terminating "
                     "it (set KILN_DUMP_STACKS_AFTER=S to see where it waits)", rank, proc.pid, timeout)
        proc.terminate()
        proc.join(timeout=5)
        if proc.is_alive():
            logger.error("tensor-parallel worker rank %d ignored SIGTERM; killing it", rank)
            proc.kill()
            proc.join(timeout=5)
        if proc.is_alive():
            logger.error("tensor-parallel worker rank %d (pid %s) survived SIGKILL (stuck in the driver?)", rank,
                         proc.pid)
    return forced
