"""Capture-time checks that make skipping Dynamo's guards safe (Dynamo only, no Inductor)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kiln.compiler import compile_model
from kiln.compiler.capture import _private_forward
from kiln.config import CompilationConfig
from kiln.models.attention_op import attention
from kiln.models.forward_context import ForwardContext, set_forward_context


class Branchy(nn.Module):
    """Attention plus a branch on the token count: one graph cannot serve every count."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Parameter(torch.randn(16, 4))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed[input_ids]
        out = torch.empty_like(x)
        attention(x.view(-1, 2, 2), x.view(-1, 2, 2), x.view(-1, 2, 2).contiguous(), out.view(-1, 2, 2), 0)
        if input_ids.shape[0] > 4:
            return out * 2
        return out + positions[:, None]


def test_a_forward_that_branches_on_the_token_count_is_rejected() -> None:
    config = CompilationConfig(level=1).resolve(torch.device("cpu"), 16)
    forward = compile_model(Branchy(), config, 16, progress=False)
    ids = torch.zeros(13, dtype=torch.long)
    with torch.inference_mode(), set_forward_context(ForwardContext(attention=lambda i, q, k, v, o: o.zero_())):
        with pytest.raises(Exception, match="depends on the token count"):
            forward(ids, torch.arange(13))
    assert forward.stats.inductor_compiles == 0


def test_each_compiled_forward_gets_its_own_code_object() -> None:
    # Dynamo caches per code object: sharing one across engines would share one recompile budget
    a, b = Branchy(), Branchy()
    fa, fb = _private_forward(a), _private_forward(b)
    assert fa.__func__.__code__ is not fb.__func__.__code__
    assert fa.__func__.__code__ is not Branchy.forward.__code__
    ids = torch.tensor([1, 2, 3])
    with set_forward_context(ForwardContext(attention=lambda i, q, k, v, o: o.copy_(q))):
        torch.testing.assert_close(fa(ids, torch.arange(3)), a(ids, torch.arange(3)))
