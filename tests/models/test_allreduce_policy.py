"""AllReducePolicy: which all-reduce serves a message size, and its environment switches."""

from __future__ import annotations

import pytest

from kiln.models.allreduce import AllReducePolicy


def test_auto_picks_one_shot_then_two_shot_then_nccl() -> None:
    policy = AllReducePolicy("auto", one_shot_max_bytes=256 << 10, two_shot_max_bytes=1 << 20)
    assert [policy.choose(n) for n in (8 << 10, 256 << 10, (256 << 10) + 16, 1 << 20, (1 << 20) + 16)] == \
        ["one_shot", "one_shot", "two_shot", "two_shot", "nccl"]
    assert policy.buffer_bytes == 1 << 20


def test_forced_kinds_and_nccl_only() -> None:
    assert AllReducePolicy("two_shot").choose(8 << 10) == "two_shot"
    assert AllReducePolicy("one_shot").choose(64 << 20) == "nccl"  # larger than the buffer
    assert AllReducePolicy("nccl").buffer_bytes == 0  # no symmetric memory at all


def test_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_TP_ALLREDUCE", "auto")
    monkeypatch.setenv("KILN_TP_ONE_SHOT_MAX_BYTES", "4096")
    monkeypatch.setenv("KILN_TP_TWO_SHOT_MAX_BYTES", "0")
    assert AllReducePolicy.from_env() == AllReducePolicy("auto", 4096, 0, 1 << 20)
    monkeypatch.setenv("KILN_TP_FUSED_NORM_MAX_BYTES", str(256 << 10))
    assert AllReducePolicy.from_env().fused_norm_max_bytes == 256 << 10
    monkeypatch.setenv("KILN_TP_ALLREDUCE", "multimem")
    with pytest.raises(ValueError, match="KILN_TP_ALLREDUCE"):
        AllReducePolicy.from_env()


def test_fused_norm_kernel_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    assert AllReducePolicy.from_env().fused_norm_kernel == "kiln"
    monkeypatch.setenv("KILN_TP_FUSED_NORM", "flashinfer")
    assert AllReducePolicy.from_env().fused_norm_kernel == "flashinfer"
    monkeypatch.setenv("KILN_TP_FUSED_NORM", "nvls")
    with pytest.raises(ValueError, match="KILN_TP_FUSED_NORM"):
        AllReducePolicy.from_env()
