"""The compiler: capture the model once with Dynamo, split at attention, compile the pieces with Inductor
per token-count range and exact size, and dispatch by token count at run time (docs/compiler.md).

The runtime uses `install_compiler`; everything else is here for tests, benchmarks and the cache.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kiln.compiler.ranges import CompileKey, Dispatcher, TokenCountError, build_ranges
from kiln.compiler.stats import CompileStats
from kiln.config import CompilationConfig

if TYPE_CHECKING:  # the rest pulls in Dynamo and Inductor (seconds): only when something is compiled
    from torch import nn

    from kiln.compiler.capture import CompiledForward
    from kiln.compiler.inductor import ArtifactStore
    from kiln.compiler.pass_hook import PostGradPassHook

__all__ = ["CompileKey", "CompileStats", "CompiledForward", "Dispatcher", "TokenCountError", "build_dispatcher",
           "compile_model", "install_compiler"]

logger = logging.getLogger("kiln.compiler")


def __getattr__(name: str) -> Any:
    if name == "CompiledForward":
        from kiln.compiler.capture import CompiledForward

        return CompiledForward
    raise AttributeError(f"module 'kiln.compiler' has no attribute {name!r}")


def build_dispatcher(config: CompilationConfig, max_num_tokens: int) -> Dispatcher:
    return Dispatcher(build_ranges(max_num_tokens, config.compile_ranges), config.compile_sizes or ())


def compile_model(model: nn.Module, config: CompilationConfig, max_num_tokens: int, *, progress: bool = True,
                  store: ArtifactStore | None = None, pass_hook: PostGradPassHook | None = None,
                  attention_backend: Any = None) -> CompiledForward:
    """A CompiledForward for a resolved config; nothing is traced or compiled until its first call.

    `attention_backend` (class or instance) tells the passes what the attention op can do (kiln/passes)."""
    from kiln.compiler.backend import KilnBackend
    from kiln.compiler.capture import CompiledForward
    from kiln.compiler.dump import DebugDump
    from kiln.compiler.inductor import InductorCompiler, inductor_config_patches

    if config.level < 1:
        raise ValueError("compile_model needs level >= 1; -O0 runs the model eagerly")
    dump = DebugDump(config.debug_dump_path) if config.debug_dump_path else None
    if pass_hook is None:
        pass_hook = default_pass_hook(config, attention_backend)
    compiler = InductorCompiler(inductor_config_patches(config, pass_hook), dump, store)
    backend = KilnBackend(build_dispatcher(config, max_num_tokens), compiler, CompileStats(level=config.level),
                          dump, progress, graph_passes=pass_hook.run_graph_passes if config.enable_passes else None,
                          compile_workers=config.compile_workers)
    return CompiledForward(model, backend, dump)


def default_pass_hook(config: CompilationConfig, attention_backend: Any = None) -> PostGradPassHook:
    """The post-grad hook running kiln's pass manager for this config and attention backend."""
    from kiln.compiler.pass_hook import PostGradPassHook
    from kiln.passes import build_pass_manager

    return PostGradPassHook([build_pass_manager(config, attention_backend)])


def install_compiler(runner: Any, config: CompilationConfig, *, progress: bool = True,
                     store_factory: Callable[[PostGradPassHook, dict[str, Any]], Any] | None = None,
                     ) -> CompiledForward | None:
    """Compile the runner's model and warm it up; the runner then runs the compiled forward.

    `config` must be resolved. The runner keeps exact token counts (no padding): without CUDA graphs an
    exact-size artifact is only worth using on an exact match, and any other count has its range.
    `store_factory(pass_hook, inductor_patches)` gives the artifact cache's store (kiln.cache): it needs
    the hook because the passes' uuid is part of the cache key. The config's background sizes compile after
    the caller's `background.start()` (CompilationConfig.resolve compiles them up front where no swap is
    possible, as under tensor parallelism).
    """
    logger.info("compilation config (resolved): %s", config)
    if config.level < 1:
        return None
    from kiln.compiler.warmup import warm_up

    attention = getattr(runner, "backend", None)
    pass_hook = store = None
    if store_factory is not None:
        from kiln.compiler.inductor import inductor_config_patches

        pass_hook = default_pass_hook(config, attention)
        store = store_factory(pass_hook, inductor_config_patches(config, pass_hook))
    compiled = compile_model(runner.model, config, runner.max_num_tokens, progress=progress, store=store,
                             pass_hook=pass_hook, attention_backend=attention)
    try:
        with store.own_caches() if store is not None else contextlib.nullcontext():
            warm_up(compiled, runner.input_ids, runner.positions, compiled.backend.dispatcher)
    finally:  # never leave the cache's lock held (or a half-filled key marked ready) on failure
        if store is not None and not compiled.stats.warm:
            store.close()
    if store is not None:
        _finish_store(store, compiled)
    runner.forward_fn = compiled
    if config.background_compile_sizes and compiled.capture is not None:
        from kiln.compiler.background import BackgroundCompiles

        compiled.background = BackgroundCompiles(compiled, config.background_compile_sizes, config.compile_workers)
        compiled.background.swap_if_done()  # all from the cache (a warm start): in now, before any graph
    logger.info("compiler ready: %s", compiled.stats.summary())
    return compiled


def _finish_store(store: Any, compiled: CompiledForward) -> None:
    from kiln.cache.store import ARTIFACT_HASH_CHARS

    stats = compiled.stats
    capture = compiled.backend.capture
    # the split graph's text is only written by a start that fills the key (print_readable: ~0.25 s at 8B)
    text = (lambda: capture.split.as_text(ARTIFACT_HASH_CHARS)) if capture is not None else None
    store.finish(text, stats.warmup_seconds, capture.saved if capture is not None else None)
    stats.cache_key = store.key
    stats.cache_hits, stats.cache_saves, stats.cache_recovered = store.hits, store.saves, store.recovered
    stats.cold_warmup_seconds = store.cold_seconds
