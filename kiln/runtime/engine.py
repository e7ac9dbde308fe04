"""The engine: owns the model, KV cache, scheduler and runner, and advances every request by one step.

`step()` = schedule -> prepare + forward + sample -> append tokens, detokenize, check stops -> outputs.
With async scheduling a step's host work overlaps the device: `step()` launches step k, then processes
step k-1 while k runs (see docs/runtime.md). A request with `n > 1` runs as n child requests sharing a
prompt (and its prefix-cache blocks).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.config import RuntimeConfig, resolve_device
from kiln.models.loader.load import LoadedModel, model_directory
from kiln.runtime.async_step import LaunchedStep
from kiln.runtime.compiler_imports import start_compiler_imports
from kiln.runtime.detokenizer import IncrementalDetokenizer
from kiln.runtime.kv.block_pool import BlockPool
from kiln.runtime.kv.hashing import block_hash_fn
from kiln.runtime.kv.manager import KVCacheManager
from kiln.runtime.limits import check_request_fits
from kiln.runtime.model_runner import PreparedBatch
from kiln.runtime.outputs import RequestOutput
from kiln.runtime.parent import ParentRequest
from kiln.runtime.request import Request, RequestStatus
from kiln.runtime.sampler import bad_word_sequences, needs_output_tokens
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import Scheduler, SchedulerOutput
from kiln.runtime.spec_decode.decoder import SpecDecoder, SpecDecodeStats, build_spec_decoder
from kiln.runtime.startup import StartupClock, StartupTimes
from kiln.runtime.structured.manager import StructuredOutputs
from kiln.runtime.tokenizer_load import BackgroundTokenizer, load_tokenizer
from kiln.runtime.tp_leader import TensorParallelLeader
from kiln.runtime.worker import Worker

logger = logging.getLogger("kiln")


@dataclass
class EngineStats:
    steps: int = 0  # launched
    overlapped_steps: int = 0  # launched while the previous step was still in flight (async scheduling)
    verify_behind_steps: int = 0  # of those, speculative verify steps (n-gram, docs/spec_decode.md)
    # n-gram verify steps prepared while the step in flight ran, on the lookup's guesses for its tokens, and
    # launched once those were seen to match (`Engine._verify_on_guess`); and those dropped for a wrong guess
    verify_on_guess_steps: int = 0
    guesses_missed: int = 0
    scheduled_tokens: int = 0  # tokens actually run through the model (prefix hits excluded)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_finished: dict[str, int] = field(default_factory=dict)


class Engine:
    def __init__(self, config: RuntimeConfig, loaded: LoadedModel | None = None,
                 clock: StartupClock | None = None) -> None:
        """`loaded`: weights the caller loaded already; then pass the `clock` it timed that load on (its
        "load" phase), or start-up times will not count the load (`kiln serve` does this for its progress bar)."""
        self.device = resolve_device(config.device)
        # per-device defaults (batch limits, async scheduling) are fixed here, before any worker sees the config
        config = dataclasses.replace(config, scheduler=config.scheduler.resolve(self.device))
        spec = config.speculative_config
        if spec is not None and config.scheduler.async_scheduling and spec.method != "ngram":
            # a draft model proposes every step: every step is synchronous (n-gram overlaps the steps without
            # proposals, docs/spec_decode.md; speculation under tensor parallelism is refused by the config)
            logger.info("async scheduling off: speculative decoding (%s) runs its steps synchronously", spec.method)
            config = dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler,
                                                                               async_scheduling=False))
        self.config = config
        if config.device == "auto" and self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        clock = clock or StartupClock(self.device)
        # the tokenizer (the first `import transformers`) loads on a thread while the model loads and compiles,
        # and the compiler's imports run on another beside the load
        tokenizer_job = self._start_tokenizer(config, loaded, clock)
        compiler_imports = start_compiler_imports(config.compilation.level, self.device)
        self._ready = threading.Event()  # set once built: ends the tensor-parallel start-up watch
        self.tp: TensorParallelLeader | None = None  # rank 0's side of the group under tensor parallelism
        if config.tensor_parallel_size > 1:
            self.tp = TensorParallelLeader(config, self.device, self._ready)
            self.device = self.tp.device
        self.worker = Worker(config, self.device, loaded, clock=clock,
                             agree_num_blocks=self.tp.agree_num_blocks() if self.tp is not None else None)
        if compiler_imports is not None:  # the compile phase imports the same modules: never both at once
            compiler_imports.join()
        self.worker.warm_up()
        if self.tp is not None:  # the workers open theirs after their warm-up too
            self.tp.open_channel(self.worker.runner)
        self.loaded, self.model = self.worker.loaded, self.worker.model
        self.backend, self.kv_cache, self.runner = self.worker.backend, self.worker.kv_cache, self.worker.runner
        self.max_model_len = self.worker.max_model_len
        with clock.phase("tokenizer"):  # the wait for the thread (or the whole load, where none was started)
            if tokenizer_job is not None and tokenizer_job.model_dir == self.loaded.model_dir:
                self.tokenizer = tokenizer_job.result()
            else:
                self.tokenizer = load_tokenizer(config.tokenizer, self.loaded.model_dir)
        self.eos_token_ids = frozenset(self.loaded.spec.eos_token_ids) | self._tokenizer_eos()
        self.pool = BlockPool(self.worker.num_blocks, config.cache.enable_prefix_caching)
        self.kv = KVCacheManager(self.pool, config.cache.block_size,
                                 block_hash_fn(config.cache.prefix_hash, config.cache.prefix_hash_seed))
        self.scheduler = Scheduler(config.scheduler, self.kv)
        self.runner.block_ids_of = self.kv.block_ids_of
        self.runner.eos_token_ids = self.eos_token_ids
        if self.tp is not None:
            self.runner.on_batch = self._send_step
            self.runner.on_sampled = self._share_samples
        # speculative decoding (None: off); may be switched between steps while nothing is in flight
        self.speculation: SpecDecoder | None = None
        if config.speculative_config is not None:
            self.speculation = build_spec_decoder(config, self.kv, self.loaded.spec.vocab_size, self.max_model_len,
                                                  self.device)
            graphs = self.runner.graphs
            self.speculation.pad_proposals = graphs is not None and graphs.full_verify_len > 0
        self.parents: dict[str, ParentRequest] = {}
        self._ids = itertools.count()
        self.stats = EngineStats()
        # May be switched between steps. Under tensor parallelism a step launched with it on also hands its
        # sampled ids to the workers on the device (the next step's pending input tokens).
        self.async_scheduling = bool(config.scheduler.async_scheduling)
        self._inflight: LaunchedStep | None = None  # launched, not yet processed (async scheduling only)
        # n-gram under async scheduling: verify behind the step in flight (False: drain it first, the A/B's arm)
        self.verify_behind_inflight = True
        self.structured: StructuredOutputs | None = None  # built by the first constrained request
        logger.info("KV cache: %d blocks x %d tokens = %d tokens (%s attention backend)", self.pool.num_usable,
                    config.cache.block_size, self.kv.capacity_tokens, self.backend.name)
        self.startup_times: StartupTimes = clock.finish()
        # the compiler's record carries it too (a plain dict: kiln.compiler does not import kiln.runtime)
        stats = self.worker.compile_stats
        stats.startup = self.startup_times.as_dict()
        pending = stats.background_pending
        logger.info("%s%s", self.startup_times.summary(),
                    f", {pending} background compile(s) pending" if pending else "")
        self._ready.set()

    # -- set-up helpers --------------------------------------------------------------------------------
    def _send_step(self, shape, num_pending: int, local_greedy: bool) -> None:
        self.tp.send_step(self.runner, shape, num_pending, local_greedy, self.async_scheduling)

    def _share_samples(self, tokens: torch.Tensor) -> None:
        if self.async_scheduling:  # the workers expect them exactly when the step's header said so
            self.tp.share_samples(tokens)

    def shutdown(self) -> None:
        """Cancel the background compiles and stop tensor-parallel workers; the engine is unusable afterwards.
        Idempotent.

        Background compiles still running are of no use to an engine that ends: their worker processes are
        terminated now rather than waited for (kiln/compiler/background.py; they also are at interpreter exit
        for an engine never shut down). Under tensor parallelism every rank tears down in the same order: leave
        the step loop, wait for the device, drop the CUDA graphs, destroy the process groups; rank 0 does its
        own while the workers do theirs, then joins them with a bound (a worker still alive after
        KILN_TP_SHUTDOWN_TIMEOUT seconds is terminated, loudly)."""
        background = getattr(self.worker.compiled, "background", None)
        if background is not None:
            background.cancel()
        if self.structured is not None:
            self.structured.shutdown()
        if self.tp is None or self.tp.channel is None:
            return
        self._inflight = None
        self.runner.on_batch = self.runner.on_sampled = None
        self.tp.shutdown(self.worker)

    @staticmethod
    def _start_tokenizer(config: RuntimeConfig, loaded: LoadedModel | None,
                         clock: StartupClock) -> BackgroundTokenizer | None:
        """Start loading the tokenizer in the background; None where it is left to the join point.

        The model directory is resolved here cheaply (no config read). Where that fails the load raises the
        same error later, as it always did, and the tokenizer is then loaded in line. Ranks other than 0 of
        a torchrun group leave in `TensorParallelLeader` and need none."""
        if config.tensor_parallel_size > 1 and os.environ.get("RANK", "0") != "0":
            return None
        if loaded is not None:
            model_dir = loaded.model_dir
        else:
            try:
                with clock.phase("load"):  # converting the embedded model, on its first use, is load time
                    model_dir = model_directory(config.model)
            except Exception:
                return None
        if config.tokenizer is None and model_dir is None:
            return None  # a preset: no tokenizer, nothing to wait for
        return BackgroundTokenizer(config.tokenizer, model_dir)

    def _tokenizer_eos(self) -> frozenset[int]:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return frozenset() if eos is None else frozenset([eos])

    @property
    def kv_capacity_tokens(self) -> int:
        return self.kv.capacity_tokens

    def finish_background_compiles(self, timeout: float | None = None) -> bool:
        """Wait for the background compiles (-O2's exact sizes on a GPU, -O3's extras) and swap them in now, as
        a step boundary would; False if they are still running after `timeout` seconds. For `kiln warmup` (the
        artifacts reach the cache) and benchmarks that time the tuned runtime. False also once cancelled
        (`shutdown`)."""
        background = getattr(self.worker.compiled, "background", None)
        if background is None:
            return True
        if not background.wait(timeout):
            return False
        background.swap_if_done()
        return not background.cancelled  # a cancel (shutdown) left them on their ranges

    @property
    def graph_replays(self) -> dict[str, int]:
        """CUDA graph replays by mode (FULL per step, PIECEWISE per piece) and steps run without graphs."""
        pool = getattr(self.worker, "graph_pool", None)
        return dict(pool.stats.replays) if pool is not None else {}

    def stats_snapshot(self) -> dict[str, Any]:
        """Counters and gauges for metrics and benchmarks (plain numbers, cheap to call every step)."""
        kv = self.kv
        return {
            "steps": self.stats.steps,
            "overlapped_steps": self.stats.overlapped_steps,
            "scheduled_tokens": self.stats.scheduled_tokens,
            "prompt_tokens": self.stats.prompt_tokens,
            "generation_tokens": self.stats.generation_tokens,
            "requests_finished": dict(self.stats.requests_finished),
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting) + (len(self.structured.held) if self.structured else 0),
            "preemptions": self.scheduler.num_preemptions,
            "kv_usage": self.pool.usage(),
            "kv_capacity_tokens": kv.capacity_tokens,
            "prefix_cache_queries": kv.queries,
            "prefix_cache_hits": kv.hits,
            "prefix_cache_hit_rate": kv.hits / kv.queries if kv.queries else 0.0,
            "prefix_cache_evictions": self.pool.evictions,
            **(self.speculation.stats if self.speculation is not None else SpecDecodeStats()).as_dict(),
        }

    # -- requests --------------------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer (a dummy-weight preset): pass token ids, not text")
        try:
            return self.tokenizer(prompt)["input_ids"]
        except TypeError as exc:  # what the fast tokenizer raises for text it cannot encode (a lone surrogate)
            raise ValueError(f"prompt holds text the tokenizer cannot encode ({exc})") from exc

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None,
                    final_only: bool = False) -> str:
        """Validate and queue a request; raises ValueError (naming the problem) without touching others.

        `final_only`: step() reports the request once, when it finishes (offline generate needs no
        per-token outputs, and building them costs the host ~10 us per request per step)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        text = prompt if isinstance(prompt, str) else None
        vocab = self.loaded.spec.vocab_size
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            token_ids = self.tokenize(prompt)
        else:
            token_ids = _token_ids(prompt)
            bad = [t for t in token_ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}")
        if not token_ids:
            raise ValueError("prompt must not be empty")
        if params.truncate_prompt_tokens is not None:  # the last k tokens (left truncation, as vLLM)
            # -1: as many as the model takes while one token is still generated
            k = self.max_model_len - 1 if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
            if k > self.max_model_len:
                raise ValueError(f"truncate_prompt_tokens {k} is greater than max_model_len {self.max_model_len}")
            token_ids = token_ids[-k:]
        for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]),
                          ("allowed_token_ids", params.allowed_token_ids or ()),
                          ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in ids if t >= vocab]
            if bad:  # an id past the logits would index out of bounds on the device
                raise ValueError(f"{name} token ids must be in [0, {vocab}); got {bad[:5]}")
        check_request_fits(len(token_ids), params, self.max_model_len, self.config.scheduler.max_n)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none (use stop_token_ids)")
        if params.bad_words and self.tokenizer is None:
            raise ValueError("bad_words need a tokenizer; this model has none (use logit_bias)")
        bad_words = bad_word_sequences(self.tokenizer, params.bad_words) if params.bad_words else ()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.structured_outputs is not None and self.structured is None:
            self.structured = StructuredOutputs(self.tokenizer, self.loaded.spec.vocab_size, self.eos_token_ids,
                                                self.config.scheduler.max_num_seqs, self.device)
        children, detoks = [], []
        for i in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            seed = None if params.seed is None else params.seed + i
            generator = None
            if seed is not None:
                generator = torch.Generator(device=self.device).manual_seed(seed)
            child = Request(child_id, token_ids, params, self.eos_token_ids, self.max_model_len, generator,
                            arrival_time)
            child.parent_id, child.child_index = request_id, i
            child.bad_words_token_ids = bad_words
            if params.structured_outputs is not None:
                child.grammar = self.structured.new_state(params.structured_outputs)
            children.append(child)
            detoks.append(None if self.tokenizer is None else IncrementalDetokenizer(
                self.tokenizer, token_ids, skip_special_tokens=params.skip_special_tokens, stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output))
        added: list[Request] = []
        try:
            for child in children:
                self.scheduler.check_fits(child)
                if child.grammar is not None:  # the scheduler sees it once its grammar is compiled
                    self.structured.held.append(child)
                else:
                    self.scheduler.add(child)
                added.append(child)
        except ValueError:
            for child in added:
                self.scheduler.finish(child, RequestStatus.FINISHED_ABORTED)
            raise
        self.stats.prompt_tokens += len(token_ids) * params.n
        self.parents[request_id] = ParentRequest(request_id, text, token_ids, children, detoks,
                                                 [0] * params.n, [0] * params.n, final_only)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Abort a waiting or running request; its blocks are freed at once."""
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return False
        for child in parent.children:
            self.scheduler.finish(child, RequestStatus.FINISHED_ABORTED)
        self._count_finished("abort", len(parent.children))
        return True

    def has_unfinished(self) -> bool:
        return bool(self.parents)

    # -- the step --------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step and return the outputs of the requests it advanced.

        Async scheduling: launch step k, then process step k-1 (append, stop checks, detokenize) while the
        device runs k, and return k-1's outputs; with nothing left to launch, finish the step in flight.
        """
        failed = self._release_compiled() if self.structured is not None and self.structured.held else []
        paused = False
        if self.speculation is not None:
            self.speculation.next_step()
            # a verify step samples without grammar masks: nothing speculates while a constrained request is
            # scheduled or may be (its prefill's last chunk samples too)
            paused = any(r.grammar is not None for r in (*self.scheduler.running, *self.scheduler.waiting))
            if self.async_scheduling:
                inflight = self._inflight
                if not paused and inflight is not None and not inflight.needs_drain and self.verify_behind_inflight \
                        and self.speculation.propose_ahead(self.scheduler.running):
                    return failed + self._launch_verify_behind()
                if not paused and self.speculation.wants_verify(self.scheduler.running):
                    if inflight is not None and not inflight.needs_drain and self.verify_behind_inflight:
                        guesses = self.speculation.propose_on_guess(self.scheduler.running)
                        if guesses:
                            return failed + self._verify_on_guess(guesses)
                    # a verify step's outcome sets the next step's inputs: it runs with nothing in flight
                    drained = self._complete(self._take_inflight()) if self._inflight is not None else []
                    return failed + drained + self._sync_step(paused)
                self.speculation.propose(self.scheduler.running, paused=True)  # an overlapped step verifies nothing
        if not self.async_scheduling:
            if self._inflight is not None:  # left over from before async scheduling was switched off
                return failed + self._complete(self._take_inflight())
            return failed + self._sync_step(paused)
        outputs: list[RequestOutput] = failed
        if self._inflight is not None and self._inflight.needs_drain:
            outputs += self._complete(self._take_inflight())  # penalties read those tokens' values on the host
        sched = self.scheduler.schedule()
        if sched.is_empty and self._inflight is not None:
            # nothing can launch before the in-flight tokens land (e.g. each is a request's last)
            outputs += self._complete(self._take_inflight())
            sched = self.scheduler.schedule()
        if sched.is_empty:
            return outputs
        previous, completed = self._inflight, []

        def complete_previous() -> None:  # constrained rows: their masks need the previous step's tokens
            nonlocal previous
            if previous is not None:
                completed.extend(self._complete(previous))
                previous = None

        overlapped = previous is not None
        self._inflight = self._launch(sched, complete_previous)
        if not overlapped:  # outputs (if any) came from a drain above, which left nothing in flight
            return outputs
        self.stats.overlapped_steps += 1
        return outputs + completed + (self._complete(previous) if previous is not None else [])

    def _sync_step(self, paused: bool) -> list[RequestOutput]:
        """Propose (when speculating), schedule, launch and complete one step."""
        if self.speculation is not None:
            self.speculation.propose(self.scheduler.running, paused=paused)
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        if self.async_scheduling and not sched.num_spec_tokens:
            # drained for proposals that its complete lookup did not find: nothing to verify, so the step stays
            # in flight and the next one overlaps it, as if no drain had happened
            self._inflight = self._launch(sched)
            return []
        return self._complete(self._launch(sched))

    def _launch_verify_behind(self) -> list[RequestOutput]:
        """Launch a verify step behind the plain step in flight (its first input per request is that step's token,
        copied on the device), so the device goes from one to the other without waiting for the host; the
        verify's read-back then completes both."""
        previous = self._take_inflight()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return self._complete(previous)
        step = self._launch(sched)
        self.stats.overlapped_steps += 1
        self.stats.verify_behind_steps += 1
        return self._complete(previous) + self._complete(step)

    def _verify_on_guess(self, guesses: dict[str, int]) -> list[RequestOutput]:
        """Prepare a verify step behind the plain step in flight on the lookup's guesses for its tokens (uploads
        queued behind it, `SpecDecoder.propose_on_guess`), then wait for those tokens: launch it if every guess
        was right, else drop it and propose from the complete context, as a drain would. The host prepares while
        the device still runs the step in flight, where a drain prepares with the device idle."""
        previous = self._take_inflight()
        running = len(self.scheduler.running)
        sched = self.scheduler.schedule()
        if not sched.is_empty:
            # a batch that admitted or preempted a request is launched whatever the guesses (the target's tokens
            # decide, as behind a step in flight); one of the running requests alone can be dropped without a trace
            droppable = not sched.preempted and len(self.scheduler.running) == running
            prepared = self.runner.prepare_step(sched)
            landed = {previous.sched.requests[row].request_id: token
                      for row, token in zip(previous.rows, previous.token_ids())} if droppable else {}
            if not droppable or all(landed.get(request_id) == guess for request_id, guess in guesses.items()):
                step = self._launch(sched, prepared=prepared)
                self.stats.verify_on_guess_steps += 1
                return self._complete(previous) + self._complete(step)
            self.stats.guesses_missed += 1  # the sync step's `propose` sets every request's proposals afresh
        return self._complete(previous) + self._sync_step(False)

    def _take_inflight(self) -> LaunchedStep:
        step, self._inflight = self._inflight, None
        assert step is not None
        return step

    def _release_compiled(self) -> list[RequestOutput]:
        """Requests whose grammar compiled join the scheduler; those whose grammar failed end (aborted). With
        nothing else to run, wait a little for a grammar instead of spinning."""
        ready, failed = self.structured.take_compiled()
        if not ready and not failed and not self.scheduler.has_unfinished() and self._inflight is None:
            self.structured.wait_for_any(0.05)
            ready, failed = self.structured.take_compiled()
        for req in ready:
            self.scheduler.add(req)
        outputs = []
        for req in failed:
            logger.warning("request %s: %s", req.request_id, req.grammar.error)
            self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
            self._count_finished("abort", 1)
            parent = self.parents[req.parent_id]
            if parent.finished:
                del self.parents[parent.request_id]
                outputs.append(parent.make_output())
        return outputs

    def _launch(self, sched: SchedulerOutput, before_mask: Callable[[], None] | None = None,
                prepared: PreparedBatch | None = None) -> LaunchedStep:
        """`before_mask`: run once the forward is queued and before a constrained row's mask is filled; `prepared`:
        the step's inputs, already queued (`ModelRunner.prepare_step`)."""
        background = getattr(self.worker.compiled, "background", None)
        # a step boundary: finished background compiles are swapped in here, unless this step's inputs are already
        # on the device (the swap's graph captures run dummy batches through the same input buffers)
        if background is not None and prepared is None:
            background.swap_if_done()
        mask_fn = None
        if self.structured is not None and any(r.grammar is not None for r in sched.requests):
            structured = self.structured

            def mask_fn(requests: list[Request]) -> torch.Tensor | None:
                if before_mask is not None:
                    before_mask()
                return structured.mask(requests)
        step = self.runner.execute(sched, mask_fn) if prepared is None else self.runner.launch(prepared, sched, mask_fn)
        self.scheduler.advance(sched)
        if step.verified:
            self.speculation.after_verify(sched, step)
        self.stats.steps += 1
        self.stats.scheduled_tokens += sched.total_tokens
        step.needs_drain = any(needs_output_tokens(sched.requests[row].params) for row in step.rows)
        return step

    def _complete(self, step: LaunchedStep) -> list[RequestOutput]:
        """Append a launched step's tokens (waiting for them), check stops, and build the outputs."""
        now = time.time()
        touched: dict[str, ParentRequest] = {}
        for row, (first, entries) in step.prompt_logprobs.items():
            if not step.sched.requests[row].finished:
                step.sched.requests[row].add_prompt_logprobs(first, entries)
        for row, token, logprobs in zip(step.rows, step.token_ids(), step.logprobs):
            req = step.sched.requests[row]
            req.num_pending_tokens -= 1
            if req.finished:  # stopped or aborted after this step launched: the token is void, its blocks freed
                continue
            req.append_output(token, logprobs)
            grammar_ended = req.grammar is not None and self.structured.accept(req, token)
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            self.stats.generation_tokens += 1
            parent = self.parents[req.parent_id]
            self._process_token(parent, req, grammar_ended)
            touched[parent.request_id] = parent
        outputs = []
        for parent in touched.values():
            finished = parent.finished
            if finished:
                del self.parents[parent.request_id]
            if finished or not parent.final_only:
                outputs.append(parent.make_output())
        return outputs

    def _process_token(self, parent: ParentRequest, req: Request, grammar_ended: bool = False) -> None:
        status = req.check_stop_token()
        # the text of an EOS or stop token id that ended the request is left out, unless asked for (vLLM); its id
        # stays in token_ids (a grammar's last token below is output, and keeps its text)
        keep_text = status is not RequestStatus.FINISHED_STOPPED or req.params.include_stop_str_in_output
        if status is None and grammar_ended:  # a complete constrained output (ignore_eos kept it going)
            status = RequestStatus.FINISHED_STOPPED
        detok = parent.detokenizers[req.child_index]
        if detok is not None and keep_text:
            # stop strings, like stop tokens, wait for min_tokens outputs (vLLM)
            stop = detok.update(req.output_token_ids[-1:], len(req.output_token_ids) >= req.params.min_tokens)
            if stop is not None and status is None:
                req.stop_reason = stop
                status = RequestStatus.FINISHED_STOPPED
        if status is not None:
            self.scheduler.finish(req, status)
            self._count_finished(status.value, 1)

    def _count_finished(self, reason: str, n: int) -> None:
        self.stats.requests_finished[reason] = self.stats.requests_finished.get(reason, 0) + n


def _token_ids(prompt: Any) -> list[int]:
    """A prompt given as token ids (a list, tuple, tensor or array of integers) -> a list of ints."""
    from numbers import Integral

    ids = prompt.tolist() if hasattr(prompt, "tolist") else prompt
    if isinstance(ids, (bytes, dict, set)) or not hasattr(ids, "__iter__"):
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    ids = list(ids)
    bad = [t for t in ids if not isinstance(t, Integral) or isinstance(t, bool)]
    if bad:
        raise ValueError(f"prompt token ids must be integers; got {bad[:5]}")
    return [int(t) for t in ids]
