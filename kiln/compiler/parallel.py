"""Independent Inductor compiles (distinct piece x range/size) at the same time, in worker processes.

Each compile depends only on the piece's graph, its CompileKey and the Inductor options (fakes.py gives
it fake inputs of its own), so compiles can run anywhere: a worker receives the pickled piece (FX graph
modules pickle as their code), its inputs' layouts as `fakes.input_specs`, the key and the config patches
(the post-grad hook pickles as its pass configuration, kiln/passes/manager.py; the nodes' module records travel
beside the piece, node_meta.py), compiles with
`standalone_compile` and returns the artifact in Inductor's binary format. The parent loads those bytes
(and saves them to the compile cache, which it alone writes, under its lock), exactly as it loads a cached
artifact, so a parallel start and a warm start run the same code.

Workers are kiln's own processes (process_pool.py), never forked (the parent has usually initialised CUDA)
and never multiprocessing children (those import the user's main script again: child_process.py). Anything
that cannot go to a worker (a graph or hook that does not pickle, a worker that fails, a hook whose uuid
differs there) compiles in the parent instead, serially, as with one worker.

A pool can be stopped mid-compile (`terminate`, for background compiles a process no longer needs): the
worker processes are killed, their running compiles fail and the ones not started are cancelled.

The worker count (`default_workers`) is half the host's cores, at most 16: each compile is mostly
single-threaded Python (lowering, scheduling, code generation), and the other half stays for the
compilers each worker starts (Triton / C++ kernel builds, `compile_threads` per worker). A 2-core CI host
gets one worker, i.e. the serial path; a 16-32 core GPU host 8-16.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sympy
from torch import fx

from kiln.cache import torch_key, triton_key, vec_isa
from kiln.compiler.process_pool import WorkerPool
from kiln.compiler.ranges import CompileKey

logger = logging.getLogger("kiln.compiler")

MAX_WORKERS = 16  # every worker on a GPU host holds a CUDA context of its own (a few hundred MiB)


def host_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def default_workers(num_jobs: int, cores: int | None = None) -> int:
    """Half the cores (the rest for each worker's kernel compilers), at most MAX_WORKERS and num_jobs."""
    cores = host_cores() if cores is None else cores
    return max(1, min(num_jobs, MAX_WORKERS, cores // 2))


@dataclass(frozen=True)
class CompileJob:
    piece_hash: str
    gm: fx.GraphModule
    key: CompileKey
    specs: list[Any] | None = None  # the gm's input layouts, if taken earlier (default: read from gm now)


@dataclass(frozen=True)
class CompileResult:
    job: CompileJob
    fn: Any  # the loaded artifact, taking the piece's inputs
    seconds: float  # the compile itself (in the worker, or here)
    in_worker: bool


class CompilePool:
    """A pool of worker processes for Inductor compiles; `compile(jobs)` falls back to the parent per job."""

    def __init__(self, compiler: Any, symbol: sympy.Symbol | None, workers: int) -> None:
        self.compiler = compiler
        self.symbol = symbol
        self.workers = workers
        self._pool: WorkerPool | None = None
        self._lock = threading.Lock()  # the pool is made and used on one thread, terminated from another
        self._stopped: Future = Future()  # done once terminated: wakes a thread waiting for a compile
        self._tasks: dict[int, bytes | None] = {}  # id(gm) -> pickled (gm, input specs), None: not picklable

    def __enter__(self) -> CompilePool:
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.shutdown()
        else:  # e.g. an interrupt: do not wait for the compiles still running
            self.terminate()

    @property
    def processes(self) -> list[Any]:
        return self._pool.processes if self._pool is not None else []

    def shutdown(self) -> None:
        with self._lock:
            pool = self._pool
        if pool is not None:
            pool.shutdown()

    @property
    def terminated(self) -> bool:
        return self._stopped.done()

    def terminate(self) -> None:
        """Stop now: drop the compiles not started, kill the workers running the others (their futures fail),
        and refuse new ones. Idempotent. The workers write nothing but Inductor's own cache, which it writes
        atomically; the compile cache is written by this process alone."""
        with self._lock:
            if self._stopped.done():
                return
            self._stopped.set_result(None)
            pool = self._pool
        if pool is not None:
            pool.terminate()

    def compile(self, jobs: Iterable[CompileJob], done: Callable[[CompileResult], Any] | None = None
                ) -> list[CompileResult]:
        """Compile every job (workers if > 1 and they can take it, else here); `done` is called as each ends."""
        jobs = list(jobs)
        results: list[CompileResult] = []

        def finish(result: CompileResult) -> None:
            results.append(result)
            if done is not None:
                done(result)

        futures: list[tuple[CompileJob, Future]] = []
        local: list[CompileJob] = []
        for job in jobs:
            future = self._submit(job) if self.workers > 1 and len(jobs) > 1 else None
            if future is None:
                local.append(job)
            else:
                futures.append((job, future))
        for job in local:  # while the workers compile theirs
            finish(self._compile_here(job))
        for job, future in futures:
            try:
                payload, seconds, matches = self._worker_result(future)
                fn = self.compiler.adopt(job.gm, job.key, job.piece_hash, payload)
                self._merge_matches(matches)
                finish(CompileResult(job, fn, seconds, True))
            except Exception as exc:  # noqa: BLE001 - any worker trouble: compile it here instead
                logger.warning("parallel compile of piece %s at %s failed in its worker (%s: %s); compiling "
                               "it in this process", job.piece_hash[:12], job.key, type(exc).__name__, exc)
                finish(self._compile_here(job))
        return results

    def compile_payloads(self, jobs: Iterable[CompileJob]) -> Iterable[tuple[CompileJob, bytes | None]]:
        """Worker processes only (never this process): each job's artifact bytes, None where it failed.

        A terminated pool ends the iteration early (at once, even with a compile in flight)."""
        submitted = []
        for job in jobs:
            future = self._submit(job, force=True)
            submitted.append((job, future))
        for job, future in submitted:
            if self.terminated:
                return
            if future is None:
                yield job, None
                continue
            wait((future, self._stopped), return_when=FIRST_COMPLETED)
            if self.terminated:
                return
            try:
                payload, _, _ = self._worker_result(future)
            except Exception as exc:  # noqa: BLE001 - the caller keeps serving without it
                logger.warning("compile of piece %s at %s failed in its worker (%s: %s)", job.piece_hash[:12],
                               job.key, type(exc).__name__, exc)
                yield job, None
                continue
            yield job, payload

    def _worker_result(self, future: Future) -> tuple[bytes, float, list[dict[str, dict[str, int]] | None]]:
        """(artifact bytes, seconds, the passes' rewrite counts) of a worker's compile; raises if it failed or
        its post-grad hook was not the parent's."""
        payload, seconds, matches, uuid = future.result()
        if uuid != self._hook_uuid():
            raise RuntimeError("the post-grad hook has a different uuid in the worker")
        return payload, seconds, matches

    def _compile_here(self, job: CompileJob) -> CompileResult:
        start = time.perf_counter()
        fn, _ = self.compiler.compile(job.gm, job.key, self.symbol, job.piece_hash, use_store=False)
        return CompileResult(job, fn, time.perf_counter() - start, False)

    def _submit(self, job: CompileJob, force: bool = False) -> Future | None:
        task = self._task(job.gm, job.specs)
        if task is None or (self.workers < 1 and not force):
            return None
        try:
            with self._lock:
                if self.terminated:
                    return None
                if self._pool is None:
                    self._pool = WorkerPool(
                        self.workers, "kiln-compile", initializer=_init_worker,
                        initargs=(_worker_env(), max(1, host_cores() // self.workers), torch_key.primed(),
                                  triton_key.primed(), vec_isa.primed()))
                return self._pool.submit(_compile_in_worker, task, job.key, self.symbol, job.piece_hash,
                                         self._patches_blob())
        except Exception as exc:  # noqa: BLE001 - no pool (e.g. a pickling error): compile here
            logger.warning("cannot compile in worker processes (%s); compiling serially", exc)
            self.workers = 0
            return None

    def prepare(self, job: CompileJob) -> None:
        """Pickle a piece for the workers now (on the caller's thread)."""
        self._task(job.gm, job.specs)

    def _task(self, gm: fx.GraphModule, specs: list[Any] | None = None) -> bytes | None:
        if id(gm) not in self._tasks:
            from kiln.compiler.fakes import input_specs
            from kiln.compiler.node_meta import module_stacks

            try:
                self._tasks[id(gm)] = pickle.dumps((gm, specs if specs is not None else input_specs(gm),
                                                    module_stacks(gm)))
            except Exception as exc:  # noqa: BLE001 - compile it here
                logger.info("piece cannot be sent to a compile worker (%s); compiling it here", exc)
                self._tasks[id(gm)] = None
        return self._tasks[id(gm)]

    def _patches_blob(self) -> bytes:
        return pickle.dumps(self.compiler.config_patches)

    def _hook_uuid(self) -> str | None:
        hook = self.compiler.config_patches.get("post_grad_custom_post_pass")
        return hook.uuid() if hook is not None else None

    def _merge_matches(self, matches: list[dict[str, dict[str, int]] | None]) -> None:
        """The passes' rewrite counts from the worker, into the parent's pass managers (tests, stats)."""
        hook = self.compiler.config_patches.get("post_grad_custom_post_pass")
        for graph_pass, counts in zip(getattr(hook, "passes", []), matches):
            target = getattr(graph_pass, "matches", None)
            if target is None or not counts:
                continue
            for scope, by_pass in counts.items():
                for name, n in by_pass.items():
                    target[scope][name] = target[scope].get(name, 0) + n


def restore_example_values(gm: fx.GraphModule, fake_mode: Any, inputs: list[Any]) -> None:
    """A pickled graph module comes back without node metadata; AOTAutograd's cache (which
    `CompiledArtifact.save` needs) only accepts method calls on nodes with an `example_value`, as Dynamo's
    graphs have. Propagating the fake inputs through the graph restores it."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    with fake_mode:
        FakeTensorProp(gm, fake_mode).propagate_dont_convert_inputs(*inputs)
    for node in gm.graph.nodes:
        if "val" in node.meta:
            node.meta.setdefault("example_value", node.meta["val"])


def _worker_env() -> dict[str, str]:
    """The parent's cache locations now (the compile cache points them under its key while compiling)."""
    names = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
    return {name: os.environ[name] for name in names if name in os.environ}


def _init_worker(env: dict[str, str], compile_threads: int, torch_value: bytes | None = None,
                 triton_value: str | None = None, vec_isa_memo: Path | None = None) -> None:
    os.environ.update(env)
    import torch
    import torch._inductor.config as inductor_config

    if torch_value is not None:  # the parent's: saves each worker Inductor's walk over torch's sources
        torch_key.set_torch_key(torch_value)
    if triton_value is not None:  # and Triton's hash of its sources and libtriton
        triton_key.set_triton_key(triton_value)
    if vec_isa_memo is not None:  # and the CPU vector-ISA checks that passed
        vec_isa.remember_checks(vec_isa_memo)

    torch.set_num_threads(compile_threads)
    inductor_config.compile_threads = compile_threads
    import kiln.models.allreduce  # noqa: F401 - kiln::all_reduce (tensor-parallel pieces)
    import kiln.models.attention_op  # noqa: F401 - registers torch.ops.kiln.* that pieces may call
    import kiln.models.dense_gemm  # noqa: F401 - kiln::dense_gemm (16-bit pieces on CUDA)
    import kiln.models.fused_moe.op  # noqa: F401 - kiln::fused_moe (mixture-of-experts pieces)
    import kiln.models.fused_moe.routing  # noqa: F401 - kiln::moe_route (their routing)
    import kiln.models.quant.fp8_gemm  # noqa: F401 - kiln::fp8_gemm (FP8 pieces on CUDA)
    import kiln.passes.ops  # noqa: F401


def _compile_in_worker(task: bytes, key: CompileKey, symbol: sympy.Symbol | None, piece_hash: str,
                       patches_blob: bytes) -> tuple[bytes, float, list[Any], str | None]:
    """-> (artifact bytes, compile seconds, each hook pass's rewrite counts, the hook's uuid here)."""
    import torch

    from kiln.cache.store import artifact_to_bytes
    from kiln.compiler.fakes import fake_inputs
    from kiln.compiler.inductor import compile_graph
    from kiln.compiler.node_meta import restore_module_stacks
    from kiln.passes.context import compiling

    gm, specs, stacks = pickle.loads(task)  # noqa: S301 - from our parent process
    restore_module_stacks(gm, stacks)  # the passes that find model modules by it
    patches = pickle.loads(patches_blob)  # noqa: S301
    hook = patches.get("post_grad_custom_post_pass")
    start = time.perf_counter()
    fake_mode, inputs = fake_inputs(specs, key, symbol)
    restore_example_values(gm, fake_mode, inputs)
    with compiling(f"{piece_hash[:12]}_{key}", key), torch._guards.tracing(torch._guards.TracingContext(fake_mode)):
        artifact = compile_graph(gm, inputs, patches)
    seconds = time.perf_counter() - start
    matches = [dict(getattr(p, "matches", {}) or {}) for p in getattr(hook, "passes", [])]
    return artifact_to_bytes(artifact), seconds, matches, hook.uuid() if hook is not None else None
