"""One Inductor compile of one piece for one CompileKey, and the Inductor options each level implies.

`torch._inductor.standalone_compile` is used because its artifacts can be saved and loaded without a
Dynamo trace (the compile cache builds on that); `compile_fx` is the fallback where it is missing.
An optional `ArtifactStore` is consulted first, so the cache can plug in without touching this code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import sympy
import torch
import torch._inductor
import torch.utils._pytree as pytree
from torch import fx

from kiln.compiler.dump import DebugDump
from kiln.compiler.fakes import example_inputs
from kiln.compiler.pass_hook import PostGradPassHook
from kiln.compiler.ranges import CompileKey
from kiln.config import CompilationConfig
from kiln.passes.context import compiling

CompiledFn = Callable[..., Any]


class ArtifactStore(Protocol):
    """Where compiled artifacts live between processes (kiln/cache implements it)."""

    def load(self, piece_hash: str, key: CompileKey) -> CompiledFn | None: ...

    def save(self, piece_hash: str, key: CompileKey, artifact: Any) -> None: ...


def inductor_config_patches(config: CompilationConfig, pass_hook: PostGradPassHook | None) -> dict[str, Any]:
    """Inductor config for a resolved CompilationConfig; the same dict goes into cache keys."""
    patches: dict[str, Any] = {}
    if config.emulate_precision_casts:
        patches["emulate_precision_casts"] = True
    if config.enable_passes and pass_hook is not None:
        patches["post_grad_custom_post_pass"] = pass_hook
    if config.max_autotune:
        patches["max_autotune"] = True
        patches["coordinate_descent_tuning"] = True
    if config.inductor_options:
        import torch._inductor.config as inductor_config

        unknown = [name for name, _ in config.inductor_options if not hasattr(inductor_config, name)]
        if unknown:
            raise ValueError(f"inductor_options: {unknown} are not Inductor config entries")
        patches.update(config.inductor_options)
    return patches


class InductorCompiler:
    def __init__(self, config_patches: dict[str, Any], dump: DebugDump | None = None,
                 store: ArtifactStore | None = None) -> None:
        self.config_patches = dict(config_patches)
        if dump is not None:
            self.config_patches.update(dump.config_patches)
        self.dump = dump
        self.store = store

    def load(self, gm: fx.GraphModule, key: CompileKey, piece_hash: str) -> CompiledFn | None:
        """The cached artifact only (None without a store or on a miss)."""
        loaded = self.store.load(piece_hash, key) if self.store is not None else None
        return with_output_structure(gm, loaded) if loaded is not None else None

    def compile(self, gm: fx.GraphModule, key: CompileKey, symbol: sympy.Symbol | None,
                piece_hash: str, use_store: bool = True) -> tuple[CompiledFn, bool]:
        """-> (callable taking the piece's inputs, whether Inductor actually compiled: False on a store hit).

        `use_store=False`: the caller has already looked in the store (and missed)."""
        loaded = self.load(gm, key, piece_hash) if use_store else None
        if loaded is not None:
            return loaded, False
        fake_mode, inputs = example_inputs(gm, key, symbol)
        dump = self.dump.inductor_output(f"{piece_hash[:12]}_{key}") if self.dump else contextlib.nullcontext()
        scope = compiling(f"{piece_hash[:12]}_{key}", key)  # which range/size the post-grad passes serve
        with dump, scope, torch._guards.tracing(torch._guards.TracingContext(fake_mode)):
            artifact = compile_graph(gm, inputs, self.config_patches)
        if self.store is not None:
            self.store.save(piece_hash, key, artifact)
        return artifact, True

    def adopt(self, gm: fx.GraphModule, key: CompileKey, piece_hash: str, payload: bytes,
              save: bool = True) -> CompiledFn:
        """An artifact compiled elsewhere (a worker process), as bytes: saved to the store, then loaded the
        way a cached one is."""
        from kiln.cache.store import artifact_from_bytes

        save_payload = getattr(self.store, "save_payload", None)
        if save and save_payload is not None:
            save_payload(piece_hash, key, payload)
        return with_output_structure(gm, artifact_from_bytes(payload))


def compile_graph(gm: fx.GraphModule, inputs: list[Any], patches: dict[str, Any]) -> CompiledFn:
    standalone = getattr(torch._inductor, "standalone_compile", None)
    if standalone is not None:
        # "from_tracing_context": the fake mode we just entered, with our own token-count symbol
        return standalone(gm, inputs, dynamic_shapes="from_tracing_context", options={"config_patches": patches})
    import copy

    from torch._inductor.compile_fx import compile_fx

    return compile_fx(copy.deepcopy(gm), inputs, config_patches=patches)  # compile_fx may mutate its graph


def with_output_structure(gm: fx.GraphModule, fn: CompiledFn) -> CompiledFn:
    """A loaded artifact returns a flat list of outputs, whereas a fresh compile returns the graph's own
    structure (compile_fx re-nests the outputs of a graph that does not return a flat tuple)."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]
    leaves, spec = pytree.tree_flatten(out)
    if isinstance(out, (tuple, list)) and len(leaves) == len(out):
        return fn
    return lambda *args: pytree.tree_unflatten(list(fn(*args)), spec)
