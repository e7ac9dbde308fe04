"""Programmatic dependent launch: where it is on (kiln.config.pdl_enabled), that Inductor's kernels join kiln's
(the -O2/-O3 GPU options), and that kernels and launches agree (kiln/models/pdl.py). The compiled kernel's PTX is
checked by tests/models/test_fp8_kernel.py (sm90, ahead of time); greedy tokens with and without it on the GPU by
tests/gpu/test_cuda_graphs.py."""

from __future__ import annotations

import pytest
import torch

import kiln.config as config
from kiln.config import CompilationConfig
from kiln.models.pdl import pdl_launch

GPU = torch.device("cuda", 0)


@pytest.fixture
def hopper(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """A compute capability 9 GPU at index 0, real (not interpreted) Triton kernels, PDL switched on."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(config, "PDL", True)
    monkeypatch.setattr(config, "_capability_major", lambda index: 9)
    return monkeypatch


def test_on_for_hopper_kernels_and_inductor(hopper: pytest.MonkeyPatch) -> None:
    assert config.pdl_enabled(GPU)
    assert pdl_launch(GPU) == {"PDL": True, "launch_pdl": True}
    o2 = CompilationConfig(level=2).resolve(GPU, 2048)
    assert dict(o2.inductor_options) == {"combo_kernels": True, "triton.enable_pdl": True}
    # levels that set no GPU options leave it out; a user's explicit entry wins
    assert CompilationConfig(level=1).resolve(GPU, 2048).inductor_options == ()
    off = CompilationConfig(level=2, inductor_options={"triton.enable_pdl": False}).resolve(GPU, 2048)
    assert dict(off.inductor_options)["triton.enable_pdl"] is False


@pytest.mark.parametrize("why", ["switched off", "ampere", "interpreter", "cpu"])
def test_off(hopper: pytest.MonkeyPatch, why: str) -> None:
    device = GPU
    if why == "switched off":
        hopper.setattr(config, "PDL", False)
    elif why == "ampere":
        hopper.setattr(config, "_capability_major", lambda index: 8)
    elif why == "interpreter":
        hopper.setenv("TRITON_INTERPRET", "1")
    else:
        device = torch.device("cpu")
    assert not config.pdl_enabled(device)
    assert pdl_launch(device) == {"PDL": False}  # no launch option: Triton launches plainly
    if device.type == "cuda":
        o2 = CompilationConfig(level=2).resolve(device, 2048)
        assert dict(o2.inductor_options) == {"combo_kernels": True}


def test_inductor_knows_the_option() -> None:
    """kiln names Inductor's own switch; a torch without it would fail every -O2 GPU compile by name."""
    import torch._inductor.config as inductor_config

    assert hasattr(inductor_config, "triton.enable_pdl")
