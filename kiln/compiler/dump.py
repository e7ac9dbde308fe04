"""`--compile-dump DIR`: what each stage of the compiler produced, as readable Python files.

    DIR/dynamo/                 depyf: Dynamo's transformed bytecode, decompiled, and the captured graph
    DIR/computation_graph.py    the split graph: the pieces in call order, each with its structural hash
    DIR/inductor/<piece>_<key>.py  Inductor's output code for each distinct piece and range/size

Inductor only writes output code when it actually generates it, so dumping turns its local caches off.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from kiln.compiler.ranges import Dispatcher
from kiln.compiler.split import SplitGraph

logger = logging.getLogger("kiln.compiler")


class DebugDump:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser().resolve()
        (self.root / "inductor").mkdir(parents=True, exist_ok=True)

    @property
    def config_patches(self) -> dict[str, Any]:
        return {"fx_graph_cache": False}

    def dynamo(self) -> contextlib.AbstractContextManager[Any]:
        """Wraps the first call of the compiled forward (depyf must see the trace happen)."""
        try:
            import depyf
        except ImportError:
            logger.warning("depyf is not installed (pip install depyf): %s gets no Dynamo bytecode dump",
                           self.root)
            return contextlib.nullcontext()
        return depyf.prepare_debug(str(self.root / "dynamo"))

    def write_split_graph(self, split: SplitGraph, dispatcher: Dispatcher) -> None:
        # 12 hash characters: the inductor/<piece>_<key>.py names beside it
        text = split.as_text(12, f"compiled for {dispatcher.describe()}")
        (self.root / "computation_graph.py").write_text(text)

    @contextlib.contextmanager
    def inductor_output(self, name: str) -> Iterator[None]:
        from torch._inductor.graph import GraphLowering

        codes: list[str] = []
        previous = GraphLowering.save_output_code
        GraphLowering.save_output_code = staticmethod(codes.append)  # type: ignore[assignment]
        try:
            with torch._functorch.config.patch(enable_autograd_cache=False):
                yield
        finally:
            GraphLowering.save_output_code = previous  # type: ignore[assignment]
        text = "\n\n# ---- next output code ----\n\n".join(codes) or "# (no output code was generated)\n"
        (self.root / "inductor" / f"{name}.py").write_text(text)
