"""One rank's share of the work: its model shard, KV cache, attention backend and model runner.

The engine (rank 0) owns a Worker and the scheduler; with tensor parallelism every other rank runs a
Worker alone, driven by the batches rank 0 broadcasts (kiln/runtime/distributed.py).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from kiln.attention import AttentionLayout, select_backend
from kiln.config import RuntimeConfig
from kiln.models.base import ModelSpec
from kiln.models.kv_quant import is_fp8
from kiln.models.loader.load import LoadedModel, load_model
from kiln.models.parallel import tp_size
from kiln.passes import PassConfig
from kiln.runtime.kernel_warmup import KernelWarmup
from kiln.runtime.kv.sizing import kv_cache_num_blocks, return_cached_memory
from kiln.runtime.model_runner import ModelRunner
from kiln.runtime.startup import StartupClock

logger = logging.getLogger("kiln")

# where the weights stream in on a thread beside the compile phase (kiln/models/loader/load.py WeightStream);
# elsewhere they load in line (on a CPU the compile phase is the same cores' Python work: nothing to overlap);
# KILN_WEIGHT_STREAM=0 loads them in line on the GPU too (the A/B's other arm)
BACKGROUND_WEIGHT_DEVICES = frozenset() if os.environ.get("KILN_WEIGHT_STREAM", "1") == "0" else frozenset({"cuda"})


def resolve_max_model_len(config: RuntimeConfig, spec: ModelSpec) -> int:
    asked = config.scheduler.max_model_len
    if asked and asked > spec.max_position_embeddings:
        raise ValueError(f"max_model_len {asked} exceeds the model's max_position_embeddings "
                         f"{spec.max_position_embeddings}")
    return asked or spec.max_position_embeddings


def fp8_kv_scales(model: torch.nn.Module, num_layers: int) -> tuple[tuple[float, float], ...]:
    """One (k_scale, v_scale) per layer for an fp8 cache: an FP8 checkpoint's calibrated scales where it has
    them, else 1.0 (no calibration is done here; docs/runtime.md says why 1.0 serves)."""
    found: dict[int, list[float]] = getattr(model, "kv_cache_scales", {})
    for layer, (k_scale, v_scale) in found.items():
        if not (k_scale > 0 and v_scale > 0) or layer >= num_layers:
            raise ValueError(f"the checkpoint's KV-cache scales of layer {layer} are invalid: {k_scale}, {v_scale}")
    if found:
        logger.info("fp8 KV cache: k/v scales of %d of %d layers from the checkpoint", len(found), num_layers)
    return tuple(tuple(found.get(i, (1.0, 1.0))) for i in range(num_layers))  # type: ignore[misc]


class Worker:
    """Built in two steps: the constructor loads the model (on a GPU the weights stream in on a thread) and
    sets up the runner; `warm_up` compiles, then waits for the weights, sizes and allocates the KV cache, and
    captures the CUDA graphs. Tracing and compiling need the weights' shapes only, so the load runs beside
    them (docs/startup.md)."""

    def __init__(self, config: RuntimeConfig, device: torch.device, loaded: LoadedModel | None = None,
                 agree_num_blocks=None, clock: StartupClock | None = None) -> None:
        self.config = config
        self.device = device
        self.clock = clock or StartupClock(device)
        if device.type == "cuda":
            return_cached_memory(device)
        with self.clock.phase("load"):
            self.loaded = loaded or load_model(config.model, device=device, dtype=config.dtype,
                                               load_format=config.load_format, seed=config.seed,
                                               quantization=config.quantization,
                                               expert_parallel=config.enable_expert_parallel,
                                               background=device.type in BACKGROUND_WEIGHT_DEVICES)
        spec = self.loaded.spec
        self.model = self.loaded.model
        self.max_model_len = resolve_max_model_len(config, spec)
        world = tp_size()
        self.num_heads, self.num_kv_heads = spec.num_heads // world, max(1, spec.num_kv_heads // world)
        kv_dtype = config.cache.kv_dtype(self.loaded.dtype)
        self.layout = AttentionLayout(self.num_heads, self.num_kv_heads, spec.head_dim, spec.head_dim ** -0.5,
                                      config.cache.block_size, self.loaded.dtype, kv_dtype)
        backend_cls = select_backend(config.attention_backend, self.layout, device)
        self.backend = backend_cls(self.layout, device)
        sched = config.scheduler
        self.graph_pool = None  # set by warm_up when CUDA graphs are captured
        self._agree_num_blocks = agree_num_blocks
        self.num_blocks = 0
        self.kv_cache: torch.Tensor | None = None  # allocated by warm_up, once the weights are in
        self.kernel_warmup: KernelWarmup | None = None  # warm_up's kiln-kernel warm-up (GPU, cold starts), for stats
        self.runner = ModelRunner(self.model, self.backend, None, config.cache.block_size,
                                  sched.max_num_seqs, sched.max_num_batched_tokens, self.max_model_len,
                                  device, frozenset(spec.eos_token_ids), block_ids_of=lambda req: [],
                                  matrix_vector=config.speculative_config is None)

    def _allocate_kv_cache(self) -> None:
        """Wait for the weights (their memory counts as in use), size the KV cache and hand it to the runner."""
        with self.clock.phase("load"):  # the part of the load the compile phase did not cover
            self.loaded.wait_for_weights()
        config, spec, layout = self.config, self.loaded.spec, self.layout
        with self.clock.phase("kv"):
            num_blocks = kv_cache_num_blocks(config.cache, spec, self.device, self.model,
                                             config.scheduler.max_num_batched_tokens, layout, self.max_model_len,
                                             self.backend.materializes_scores)
            if self._agree_num_blocks is not None:  # every rank must page the same block ids
                num_blocks = self._agree_num_blocks(num_blocks)
            self.num_blocks = num_blocks
            try:
                self.kv_cache = torch.zeros(spec.num_layers, num_blocks, 2, config.cache.block_size,
                                            self.num_kv_heads, spec.head_dim, dtype=layout.cache_dtype,
                                            device=self.device)
            except RuntimeError as exc:  # the CPU allocator's error, or CUDA's OutOfMemoryError
                if config.cache.kv_cache_bytes is None and config.cache.num_blocks is None:
                    raise  # sized from what is free: not the user's number
                raise ValueError(f"kv_cache_bytes / num_blocks: a KV cache of {num_blocks} blocks does not fit in "
                                 f"{self.device} memory; ask for less") from exc
        self.runner.kv_cache = self.kv_cache
        self.runner.kv_scales = fp8_kv_scales(self.model, spec.num_layers) if is_fp8(layout.cache_dtype) else None

    def warm_up(self) -> None:
        """Start-up work every rank does identically before serving (compilation, KV cache, graph capture)."""
        # -O1..-O3: trace, compile every range/size and run each once now, so no request waits on a compile
        from kiln.compiler import CompileStats, install_compiler

        # CUDA graphs stay on under tensor parallelism: the all-reduces are captured with the rest of the step
        # background compiles swap artifacts on this rank alone: under tensor parallelism they compile up front
        self.compilation = self.config.compilation.resolve(self.device, self.config.scheduler.max_num_batched_tokens,
                                                           background_supported=tp_size() == 1)
        if self.loaded.spec.quantization is not None:
            # Fused kernels keep a bf16 op's fp32 result and skip eager's downcast; an FP8 activation scale then
            # comes from the unrounded RMSNorm output and -O2's greedy tokens left -O0's (3 of 6 SmolLM2 prompts,
            # CPU, 2026-11-30; 6 of 6 agree with Inductor emulating the casts). bf16 models keep the fusion.
            self.compilation = dataclasses.replace(self.compilation, emulate_precision_casts=True)
        from kiln.cache import store_factory
        from kiln.models.parallel import tp_rank

        factory = store_factory(spec=self.loaded.spec, dtype=self.loaded.dtype, compilation=self.compilation,
                                max_num_tokens=self.runner.max_num_tokens, device=self.device,
                                attention_backend=self.backend.name, rank=tp_rank(), tp_size=tp_size())
        if factory is None:
            self.kernel_warmup = self._start_kernel_warmup()
        else:
            factory = self._kernel_warmup_unless_cached(factory)
        with self.clock.phase("compile"):
            self.compiled = install_compiler(self.runner, self.compilation, store_factory=factory)
        self.compile_stats = self.compiled.stats if self.compiled is not None else CompileStats(level=0)
        self.clock.move(self.compile_stats.trace_seconds, "compile", "trace")  # Dynamo runs in the first forward
        from kiln.compiler.cuda_graphs import install_cuda_graphs

        with self.clock.phase("capture"):
            if self.kernel_warmup is not None:  # no launch of its may overlap a capture, nor its memory the KV sizing
                self.kernel_warmup.join()
        self._allocate_kv_cache()
        with self.clock.phase("capture"):
            self.graph_pool = install_cuda_graphs(self.runner, self.compilation, self.compiled,
                                                  verify_len=self._verify_len())
        if self.compiled is not None and self.compiled.background is not None:
            self.compiled.background.start()  # after the capture, whose cores its workers would take

    def _verify_len(self) -> int:
        """Tokens a request verifies in a speculative step (k + 1), for FULL graphs of uniform verify batches;
        0 without speculation or where they would not fit one block (the null block pads those batches)."""
        spec = self.config.speculative_config
        if spec is None or spec.num_speculative_tokens + 1 > self.config.cache.block_size:
            return 0
        return spec.num_speculative_tokens + 1

    def _kernel_warmup_unless_cached(self, factory: Callable[..., Any]) -> Callable[..., Any]:
        """The store factory, starting the kernel warm-up as soon as the store is known to be cold (before any
        compile): a ready compile cache means the start that filled it compiled kiln's kernels into Triton's
        cache too, so a warm start has none to compile."""
        def make(*args: Any) -> Any:
            store = factory(*args)
            if not store.ready:
                self.kernel_warmup = self._start_kernel_warmup()
            return store

        return make

    def _start_kernel_warmup(self) -> KernelWarmup | None:
        """On a GPU, kiln's Triton kernels at the sizes the capture will run, in a warm-up process beside the
        compile phase (kernel_warmup.py); KILN_KERNEL_WARMUP=0 leaves them to the capture."""
        if (self.device.type != "cuda" or self.compilation.level < 1
                or os.environ.get("KILN_KERNEL_WARMUP", "1").strip().lower() in ("0", "false", "no", "off")):
            return None
        capture = self.compilation.cudagraph_capture_sizes or ()
        return KernelWarmup(self.model, self.backend, (*capture, *(self.compilation.compile_sizes or ())),
                            [s for s in capture if s <= self.runner.max_num_seqs], self.runner.max_blocks_per_seq,
                            PassConfig.from_compilation(self.compilation).enabled)

    def release_graphs(self) -> None:
        """Drop every captured CUDA graph and its memory pool, after the device has finished the last step.
        Done before a tensor-parallel rank destroys its process groups: the graphs hold captured NCCL work.
        The runner then runs without graphs."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.graph_pool is not None:
            self.graph_pool.release()
        self.graph_pool = None
        self.runner.graphs = self.runner.full_graph = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
