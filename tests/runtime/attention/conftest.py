"""Without a GPU, run the Triton kernels through Triton's CPU interpreter.

The flag is read when a kernel is decorated and again while it runs, so it is set while kiln's kernel
module is first imported and during each test of this folder, and removed otherwise: the rest of the
session (Inductor included) never sees it.
"""

import importlib.util
import os

import pytest
import torch

INTERPRET = not torch.cuda.is_available() and importlib.util.find_spec("triton") is not None

if INTERPRET:
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import importlib
        import sys

        # another test may have imported the kernels already, compiled for a GPU: define them again, interpreted
        for name in ("kiln.runtime.attention.triton_kernels", "kiln.runtime.attention.triton_backend"):
            if name in sys.modules:
                importlib.reload(sys.modules[name])
            else:
                importlib.import_module(name)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    if INTERPRET:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
