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


# The interpreter pays per program, and a decode launches (request, KV head x new token, split) programs: at the
# GPU's 32 splits a 16-token verify of one request took 60 s of the CI's time. Four splits still give every case
# here splits that hold keys, splits past a context's end (empty) and splits straddling the new tokens; the GPU
# runs the full count (tests/gpu/test_attention_backends.py).
INTERPRETED_MAX_SPLITS = 4


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    if INTERPRET:
        from kiln.attention import triton_backend

        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setattr(triton_backend, "_MAX_SPLITS", INTERPRETED_MAX_SPLITS)
