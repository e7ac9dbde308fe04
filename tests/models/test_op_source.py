"""kiln/models/op_source.py: torch.library registrations record their caller's "file:line" from the frame, as
torch's inspect-based get_source did, without the module walk."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import torch

import kiln.models  # noqa: F401 - installs the cheap get_source
from kiln.models.op_source import frame_source


def test_registrations_record_the_callers_file_and_line() -> None:
    import torch._library.simple_registry as registry
    import torch._library.utils as library_utils

    assert library_utils.get_source is frame_source

    torch.library.define("kiln_test_op_source::double", "(Tensor x) -> Tensor")
    torch.library.impl("kiln_test_op_source::double", "CompositeExplicitAutograd", lambda x: x * 2)
    line = inspect.currentframe().f_lineno + 1
    torch.library.register_fake("kiln_test_op_source::double", lambda x: torch.empty_like(x))
    source = registry.singleton.find("kiln_test_op_source::double").fake_impl.kernel.source
    assert source == f"{__file__}:{line}"
    assert torch.ops.kiln_test_op_source.double(torch.ones(2)).tolist() == [2.0, 2.0]


def test_the_same_string_as_torchs_own() -> None:
    """The replaced function against inspect.getframeinfo, at one and two frames up."""
    def torchs(stacklevel: int) -> str:
        info = inspect.getframeinfo(sys._getframe(stacklevel))
        return f"{info.filename}:{info.lineno}"

    def caller(get, level):
        return get(level)

    for level in (1, 2):
        assert caller(frame_source, level) == caller(torchs, level)


def test_switch_keeps_torchs() -> None:
    code = ("import kiln.models, torch._library.utils as u, kiln.models.op_source as s; "
            "print(u.get_source is s.frame_source)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "KILN_FAST_OP_SOURCE": "0"}).stdout.strip()
    assert out == "False"
