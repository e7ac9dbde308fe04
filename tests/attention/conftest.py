"""Without a GPU, run the Triton kernels through Triton's CPU interpreter.

The flag is read when a kernel is decorated and again while it runs, so it is set while kiln's kernel
module is first imported and during each test of this folder, and removed otherwise: the rest of the
session (Inductor included) never sees it.
"""

import importlib.util

import pytest
import torch

from tests.conftest import define_interpreted

INTERPRET = not torch.cuda.is_available() and importlib.util.find_spec("triton") is not None

if INTERPRET:  # another test may have imported the kernels already, compiled for a GPU
    define_interpreted("kiln.attention.triton_kernels", "kiln.attention.triton_backend")


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    if INTERPRET:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
