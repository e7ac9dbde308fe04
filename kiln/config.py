"""Runtime configuration: frozen dataclasses, resolved once at start-up.

Optimisation levels (-O0..-O3) only supply defaults; anything the user sets explicitly wins.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger("kiln")

DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
}


def resolve_device(device: str) -> torch.device:
    """A CUDA device always comes back with its index (the current device for 'auto' and 'cuda'):
    `torch.cuda.set_device` and friends refuse an index-less device (seen: `kiln serve --device auto` on
    an H200 failed with "Expected a torch.device with a specified index")."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but no CUDA device is available")
    if device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, model_dtype: torch.dtype | None, device: torch.device) -> torch.dtype:
    """`auto` takes the checkpoint's dtype on GPU and fp32 on CPU (bf16 matmuls are slow on most CPUs)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        return model_dtype if model_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(sorted(DTYPES))}; got {dtype!r}")
    return DTYPES[dtype]


# Programmatic dependent launch (Hopper and later; docs/cuda_graphs.md): every Triton kernel of a step, kiln's and
# Inductor's, may be scheduled while the kernel before it drains and waits on the device for its results. Decode at
# batch 1, one H200: SmolLM2-135M 0.90-0.93 -> 0.70 ms, Llama-3-8B 4.45-4.47 -> 4.32 ms (docs/BENCHMARKS.md).
# KILN_PDL=0 launches every kernel plainly.
PDL = os.environ.get("KILN_PDL", "1") != "0"


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with programmatic dependent launch: a CUDA GPU of compute capability 9
    or more, PDL not switched off, and compiled kernels (Triton's CPU interpreter has no launches to overlap)."""
    if not PDL or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _capability_major(device.index if device.index is not None else torch.cuda.current_device()) >= 9


@functools.lru_cache(maxsize=8)
def _capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


# Per-device defaults, chosen by measurement (docs/BENCHMARKS.md, "Defaults"). A GPU step costs about the
# same for 64 or 256 decoding sequences (decode reads the weights once either way), so more sequences is
# nearly free throughput; 8192 tokens keeps a prefill chunk large enough to saturate the matmuls. The CPU
# computes every token, so a bigger batch only lengthens each step.
DEVICE_DEFAULTS = {"cuda": {"max_num_seqs": 256, "max_num_batched_tokens": 8192},
                   "cpu": {"max_num_seqs": 64, "max_num_batched_tokens": 2048}}


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int | None = None  # None: per device (DEVICE_DEFAULTS), resolved at engine start
    max_num_batched_tokens: int | None = None  # None: per device
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    long_prefill_token_threshold: int = 0  # 0: a prefill may take the whole remaining budget
    # overlap a step's host work (schedule, input fill, token processing) with the previous step's forward.
    # None: on wherever it helps and is supported (a GPU, one rank); True where unsupported runs sync.
    async_scheduling: bool | None = None
    # the most sequences (n) one request may ask for: each is a full request in the batch and the KV cache.
    # 128 is OpenAI's own bound on n.
    max_n: int = 128

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_n < 1:
            raise ValueError(f"max_n must be >= 1, got {self.max_n}")


    def resolve(self, device: torch.device) -> SchedulerConfig:
        """Fill every None with this device's default; explicit values are kept."""
        defaults = DEVICE_DEFAULTS["cuda" if device.type == "cuda" else "cpu"]
        overlap = self.async_scheduling
        if overlap is None:
            # the CPU runs the forward on the host's own cores: there is no device queue to overlap with
            overlap = device.type == "cuda"
            if not overlap:
                logger.info("async scheduling off: on the CPU there is nothing to overlap (the forward runs on "
                            "the host's cores; docs/BENCHMARKS.md)")
        return dataclasses.replace(
            self, async_scheduling=overlap,
            max_num_seqs=self.max_num_seqs or defaults["max_num_seqs"],
            max_num_batched_tokens=self.max_num_batched_tokens or defaults["max_num_batched_tokens"])


# the KV cache's element type: None is the model's own dtype
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "fp8": torch.float8_e4m3fn}


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_bytes: int | None = None  # None: CPU 512 MiB, GPU from gpu_memory_utilization
    gpu_memory_utilization: float = 0.9
    num_blocks: int | None = None  # exact override, mostly for tests
    enable_prefix_caching: bool = True
    prefix_hash: str = "sha256"  # or "xxhash"-style fast builtin: "fast"
    prefix_hash_seed: int | None = None
    # "auto": the model's dtype; "fp8": float8_e4m3fn, half the bytes of bf16 per token (docs/cache.md)
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; "
                             f"got {self.kv_cache_dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError("num_blocks must be >= 2 (block 0 is the null block)")
        if self.prefix_hash not in ("sha256", "fast"):
            raise ValueError(f"prefix_hash must be 'sha256' or 'fast', got {self.prefix_hash!r}")

    def kv_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV cache's element type (kv_cache_dtype was checked at construction)."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or model_dtype


class GraphSupport(enum.IntEnum):
    """How much of a step an attention backend can run inside a CUDA graph (ordered: min() degrades)."""

    NEVER = 0
    UNIFORM_DECODE = 1
    ALWAYS = 2


class CUDAGraphMode:
    NONE = "NONE"
    PIECEWISE = "PIECEWISE"
    FULL = "FULL"
    FULL_DECODE_ONLY = "FULL_DECODE_ONLY"
    FULL_AND_PIECEWISE = "FULL_AND_PIECEWISE"
    ALL = (NONE, PIECEWISE, FULL, FULL_DECODE_ONLY, FULL_AND_PIECEWISE)


_UNSET = None


@dataclass(frozen=True)
class CompilationConfig:
    """What the compiler does. Fields left as None take the level's default in `resolve`."""

    level: int = 2
    compile_sizes: tuple[int, ...] | None = None  # exact token counts compiled with static shapes
    # extra range end points inside [1, max_num_batched_tokens]: (16,) -> ranges [1, 16] and [17, max]
    compile_ranges: tuple[int, ...] = ()
    cudagraph_mode: str | None = None
    cudagraph_capture_sizes: tuple[int, ...] | None = None
    # sizes of the PIECEWISE graphs (mixed batches); None: default_piecewise_sizes where FULL graphs serve
    # decode, every capture size otherwise
    cudagraph_piecewise_sizes: tuple[int, ...] | None = None
    max_cudagraph_capture_size: int = 512
    enable_passes: bool | None = None
    passes: tuple[str, ...] | None = None  # explicit pass list; None: the level's default set
    max_autotune: bool | None = None
    # exact sizes compiled after the runtime is ready and swapped in at a step boundary (-O3's sizes above the
    # capture sizes by default; docs/compiler.md)
    background_compile_sizes: tuple[int, ...] | None = None
    # worker processes for Inductor compiles; None: from the host's cores (kiln/compiler/parallel.py)
    compile_workers: int | None = None
    # Inductor rounds where eager rounds (docs/models.md, FP8 numerics): set for quantized models by the worker
    emulate_precision_casts: bool = False
    # extra Inductor config entries, e.g. {"combo_kernels": True}: part of the compile-cache key (a dict is
    # accepted and kept as sorted (name, value) pairs, so the config stays hashable)
    inductor_options: tuple[tuple[str, Any], ...] = ()
    debug_dump_path: str | None = None
    debug_check_graph_inputs: bool = False

    def __post_init__(self) -> None:
        if self.level not in (0, 1, 2, 3):
            raise ValueError(f"level must be 0, 1, 2 or 3, got {self.level!r}")
        if self.cudagraph_mode is not None and self.cudagraph_mode not in CUDAGraphMode.ALL:
            raise ValueError(f"cudagraph_mode must be one of {CUDAGraphMode.ALL}, got {self.cudagraph_mode!r}")
        if self.passes is not None:
            from kiln.passes.config import ALL_PASSES  # a leaf module (no torch): the pass names

            unknown = [p for p in self.passes if p.partition("<=")[0] not in ALL_PASSES]
            if unknown:
                raise ValueError(f"unknown passes {unknown}; passes: {', '.join(ALL_PASSES)}")
        if self.compile_workers is not None and self.compile_workers < 1:
            raise ValueError(f"compile_workers must be >= 1, got {self.compile_workers}")
        for name in ("compile_sizes", "compile_ranges", "cudagraph_capture_sizes", "cudagraph_piecewise_sizes",
                     "background_compile_sizes"):
            sizes = getattr(self, name)
            if sizes is not None and any(int(s) < 1 for s in sizes):
                raise ValueError(f"{name} must be positive integers, got {sizes}")
            if isinstance(sizes, list):  # lists from the CLI or kwargs: keep the config hashable
                object.__setattr__(self, name, tuple(sizes))
        options = dict(self.inductor_options)
        if any(not isinstance(k, str) or not k for k in options):
            raise ValueError(f"inductor_options must map Inductor config names to values: {self.inductor_options!r}")
        object.__setattr__(self, "inductor_options", tuple(sorted(options.items())))

    def resolve(self, device: torch.device, max_num_batched_tokens: int,
                background_supported: bool = True) -> CompilationConfig:
        """Fill every None with the level's default for this device; explicit values are kept.

        `background_supported=False` (tensor parallelism: every rank would have to swap at the same step)
        compiles the background sizes up front instead."""
        on_gpu = device.type == "cuda"
        level = self.level
        capture = self.cudagraph_capture_sizes
        if capture is None:
            capture = default_capture_sizes(min(self.max_cudagraph_capture_size, max_num_batched_tokens))
        capture = tuple(sorted({int(s) for s in capture if int(s) <= max_num_batched_tokens}))
        piecewise = self.cudagraph_piecewise_sizes
        if piecewise is not None:
            piecewise = tuple(sorted({int(s) for s in piecewise if int(s) <= max_num_batched_tokens}))
        if self.cudagraph_mode is not None:
            mode = self.cudagraph_mode
        elif not on_gpu or level == 0:
            mode = CUDAGraphMode.NONE
        elif level == 1:
            mode = CUDAGraphMode.PIECEWISE
        else:
            mode = CUDAGraphMode.FULL_AND_PIECEWISE
        if not on_gpu and mode != CUDAGraphMode.NONE:
            mode = CUDAGraphMode.NONE  # CUDA graphs need CUDA; the CPU runs compiled pieces directly
        sizes = self.compile_sizes
        background = self.background_compile_sizes
        if sizes is None:
            if level < 2 or (on_gpu and level == 2):
                sizes = ()
            else:  # -O3 on a GPU: every capture size, up front; -O2/-O3 on a CPU: one token
                sizes = capture if on_gpu else (1,)
        if background is None:  # -O3's extras: not needed to serve, so compiled after the runtime is ready
            background = () if level < 3 else ((1024, 2048) if on_gpu else (2, 4))
        sizes = {int(s) for s in sizes if int(s) <= max_num_batched_tokens}
        background = {int(s) for s in background if int(s) <= max_num_batched_tokens} - sizes
        if not background_supported:
            sizes, background = sizes | background, set()
        sizes, background = tuple(sorted(sizes)), tuple(sorted(background))
        enable_passes = level >= 1 and (self.enable_passes if self.enable_passes is not None else level >= 2)
        # an end point at or above the budget would make an empty range; a post-grad pass bounded to N tokens
        # ("name<=N") applies only to compile ranges within N, so N cuts a range of its own (decode sizes, say)
        passes = self.passes
        if enable_passes and passes is None:  # the level's, for this device (CUDA-only passes off a GPU)
            from kiln.passes.config import level_defaults  # a leaf module (no torch)

            passes = level_defaults(level, on_gpu)
        bounds = pass_bounds(passes) if enable_passes else ()
        ranges = tuple(sorted({int(p) for p in (*self.compile_ranges, *bounds) if int(p) < max_num_batched_tokens}))
        options = dict(self.inductor_options)
        if on_gpu and level >= 2:
            # Inductor's kernels take part in programmatic dependent launch as kiln's do (kiln/models/pdl.py)
            pdl = {"triton.enable_pdl": True} if pdl_enabled(device) else {}
            options = {**dict(GPU_INDUCTOR_OPTIONS), **pdl, **options}
        return dataclasses.replace(
            self,
            inductor_options=tuple(sorted(options.items())),
            compile_sizes=sizes if level >= 1 else (),
            background_compile_sizes=background if level >= 1 else (),
            compile_ranges=ranges if level >= 1 else (),
            cudagraph_mode=mode,
            cudagraph_capture_sizes=capture if mode != CUDAGraphMode.NONE else (),
            cudagraph_piecewise_sizes=piecewise,
            # -O0 compiles nothing, so passes and autotuning cannot apply whatever was asked for
            enable_passes=enable_passes,
            passes=passes,
            max_autotune=level >= 1 and (self.max_autotune if self.max_autotune is not None else level >= 3),
        )


# -O2 on a GPU compiles each piece for its token-count range alone: every capture size is served, and captured,
# from the range artifact. Exact decode sizes (1, 2, 4, 8, compiled after ready) measured no faster inside CUDA
# graphs in one process on an H200 (benchmarks/bench_exact_sizes.py, docs/compiler.md) and cost 12 more 8B
# compiles; -O3 still compiles every capture size exactly.
# Inductor options -O2 and -O3 set on a GPU: combo kernels launch independent kernels of a piece as one (the
# RoPE of q and of k and v's copy before attention), measured faster (docs/compiler.md); an explicit
# inductor_options entry of the same name wins.
GPU_INDUCTOR_OPTIONS = (("combo_kernels", True),)


def pass_bounds(passes: tuple[str, ...]) -> tuple[int, ...]:
    """The token bounds of the passes a config runs."""
    from kiln.passes.config import PassConfig  # a leaf module (no torch)

    return tuple(bound for _, bound in PassConfig.from_names(tuple(passes)).max_tokens)


def default_piecewise_sizes(capture_sizes: Sequence[int]) -> tuple[int, ...]:
    """PIECEWISE graph sizes where FULL graphs serve uniform decode, so that PIECEWISE ones serve only mixed
    batches (a prefill chunk with or without decodes): the capture sizes up to 16, the multiples of 32 up to 256
    and of 64 above, and the largest. A mixed batch is padded further (a few dozen tokens beside its prefill
    work), and an 8B model captures 17 x 33 pieces instead of 51 x 33 (docs/cuda_graphs.md)."""
    keep = {s for s in capture_sizes if s <= 16 or s % (32 if s <= 256 else 64) == 0}
    return tuple(sorted(keep | ({max(capture_sizes)} if capture_sizes else set())))


def default_capture_sizes(max_size: int) -> tuple[int, ...]:
    """1, 2, 4, multiples of 8 up to 256, then multiples of 16, all <= max_size."""
    sizes = [1, 2, 4] + list(range(8, 257, 8)) + list(range(272, max(max_size, 272) + 1, 16))
    return tuple(s for s in sizes if s <= max_size)


SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config`: who proposes tokens and how many (docs/spec_decode.md). Checked here for what
    needs no model; a draft whose vocabulary differs from the target's fails when the engine starts."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4  # ngram: the longest suffix looked up earlier in the context
    prompt_lookup_min: int = 1  # ngram: the shortest
    model: str | None = None  # draft_model: an HF directory or a preset

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config method must be one of {', '.join(SPECULATIVE_METHODS)}; "
                             f"got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"speculative_config {name} must be an integer >= 1, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("speculative_config prompt_lookup_min / prompt_lookup_max must satisfy min <= max, "
                             f"got {self.prompt_lookup_min} / {self.prompt_lookup_max}")
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"speculative_config model must be a path or preset name, got {self.model!r}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config model: method 'draft_model' needs a draft model (HF dir or preset)")

    @classmethod
    def from_value(cls, value: SpeculativeConfig | dict[str, Any] | None) -> SpeculativeConfig | None:
        """A dict as users write it for vLLM (unknown keys are a ValueError naming them), or the config itself.
        vLLM's shorthands hold: `model` "ngram" / "[ngram]" (or `method` "[ngram]") means ngram, a `model` without
        a `method` a draft model, and one lookup bound given sets the other to the same length."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(value).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        value = {k: v for k, v in value.items() if v is not None}
        if value.get("model") in ("ngram", "[ngram]") or value.get("method") == "[ngram]":
            value = {**value, "method": "ngram"}
            value.pop("model", None)
        elif "model" in value:
            value.setdefault("method", "draft_model")
        if "method" not in value or "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs 'num_speculative_tokens' and a 'method' (or a draft 'model')")
        lookup = ("prompt_lookup_min", "prompt_lookup_max")
        given = [name for name in lookup if name in value]
        if len(given) == 1 and type(value[given[0]]) is int:  # not a bad value: __post_init__ names that one
            value = {**value, **{name: value[given[0]] for name in lookup}}
        return cls(**value)


@dataclass(frozen=True)
class RuntimeConfig:
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    load_format: str = "auto"  # auto | safetensors | dummy
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    attention_backend: str = "auto"
    tokenizer: str | None = None
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    compilation: CompilationConfig = field(default_factory=CompilationConfig)
    tensor_parallel_size: int = 1
    quantization: str | None = None  # "fp8": FP8 linear weights (an FP8 checkpoint is used as it is)
    enable_expert_parallel: bool = False  # MoE models: whole experts per rank instead of split experts
    # speculative decoding (a dict as vLLM takes it is converted): docs/spec_decode.md
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative_config", SpeculativeConfig.from_value(self.speculative_config))
        if self.speculative_config is not None and self.tensor_parallel_size > 1:
            raise ValueError("speculative_config is not supported with tensor_parallel_size > 1")
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"quantization must be 'fp8' or None, got {self.quantization!r}")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"load_format must be auto, safetensors or dummy; got {self.load_format!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be >= 1")
