"""kiln: a compiler-first LLM inference runtime on torch.compile/Inductor."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Runtime", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput"]

if TYPE_CHECKING:
    from kiln.runtime.outputs import CompletionOutput, RequestOutput
    from kiln.runtime.runtime import Runtime
    from kiln.runtime.sampling_params import SamplingParams
    from kiln.runtime.structured.params import StructuredOutputsParams

_LAZY = {
    "Runtime": "kiln.runtime.runtime",
    "SamplingParams": "kiln.runtime.sampling_params",
    "StructuredOutputsParams": "kiln.runtime.structured.params",
    "RequestOutput": "kiln.runtime.outputs",
    "CompletionOutput": "kiln.runtime.outputs",
}


def __getattr__(name: str) -> Any:
    # keeps `import kiln` cheap: torch and the engine load on first use
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kiln' has no attribute {name!r}")
