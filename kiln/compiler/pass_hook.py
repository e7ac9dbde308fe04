"""Kiln's slot in Inductor's post-grad pipeline.

`passes` holds kiln's pass manager (kiln/passes, built by `compile_model`). Its uuid — which names
exactly which passes run, with what configuration — is part of Inductor's cache key and of kiln's
compile-cache key. Passes that must see the whole captured graph (across the attention split) also run
once before the split, through `run_graph_passes`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

GraphPass = Callable[[fx.Graph], None]

HOOK_VERSION = 1  # bump when the hook itself changes what it does to a graph


class PostGradPassHook(CustomGraphPass):
    def __init__(self, passes: Sequence[GraphPass] = ()) -> None:
        self.passes = list(passes)

    def __call__(self, graph: fx.Graph) -> None:
        for graph_pass in self.passes:
            graph_pass(graph)

    def run_graph_passes(self, gm: fx.GraphModule) -> fx.GraphModule:
        """Before the split: each pass that has a graph-level stage (`run_graph_passes`) rewrites gm."""
        for graph_pass in self.passes:
            run = getattr(graph_pass, "run_graph_passes", None)
            if run is not None:
                gm = run(gm)
        return gm

    def uuid(self) -> str:
        parts = [f"kiln-post-grad-v{HOOK_VERSION}"]
        for graph_pass in self.passes:
            ident = getattr(graph_pass, "uuid", None)
            parts.append(f"{type(graph_pass).__qualname__}:{ident() if callable(ident) else ''}")
        return hashlib.sha256("|".join(parts).encode()).hexdigest()
