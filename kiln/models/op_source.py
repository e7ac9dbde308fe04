"""Where a torch.library registration was made, from the caller's frame alone (start-up time).

Every `register_fake`, `torch.library.impl` and custom-op definition records its caller's "file:line" through
`torch._library.utils.get_source`, which asks `inspect.getframeinfo`: that reads the caller's source file and,
to find the module that owns it, resolves the real path of every module in sys.modules not seen before
(`inspect.getmodule`). A start registers ~160 ops, many after the compiler stack is imported, so the walk
covers thousands of modules: 0.26 s of a warm start of the embedded model on the 2-core CPU machine (cProfile,
2026-12-03) and ~0.6 s of a sampled warm 8B start on the H200 (docs/startup.md), for a string that only error
messages show. The frame's own file and line are that string. `KILN_FAST_OP_SOURCE=0` keeps torch's (an A/B knob).
"""

from __future__ import annotations

import os
import sys


def frame_source(stacklevel: int) -> str:
    """torch's get_source: "file:line" of the frame `stacklevel` calls up from this function's caller."""
    frame = sys._getframe(stacklevel)
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


def install() -> None:
    """Swap torch's get_source for frame_source (torch calls it through its module, so every later
    registration takes the cheap path)."""
    if os.environ.get("KILN_FAST_OP_SOURCE", "1") == "0":
        return
    import torch._library.utils as library_utils

    if callable(getattr(library_utils, "get_source", None)):
        library_utils.get_source = frame_source
