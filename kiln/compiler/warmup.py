"""Start-up warm-up: trace, compile every range and size, and run each once, before the first request.

The forwards run on the runner's own input buffers with attention replaced by a no-op: what matters is
that every compiled artifact has been built and executed once (kernels loaded, allocations seen), not
what the model computes, and the KV cache must stay untouched.
"""

from __future__ import annotations

import time

import torch

from kiln.compiler.capture import CompiledForward
from kiln.compiler.ranges import Dispatcher
from kiln.models.forward_context import ForwardContext, set_forward_context

# The token count the trace runs at. Odd and prime, so it is unlikely to equal a model dimension (which
# Dynamo's duck sizing could unify with the token count); capped by the budget.
TRACE_TOKENS = 13


def _no_attention(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
    out.zero_()


def warmup_token_counts(dispatcher: Dispatcher) -> list[int]:
    """The trace's count first, then one count that dispatches to each range and exact size.

    A range is represented by its smallest count that is not an exact size (exact sizes win dispatch):
    small counts keep the warm-up forwards cheap on CPU.
    """
    counts = [min(TRACE_TOKENS, dispatcher.max_num_tokens)]
    for key in dispatcher.keys:
        n = next((n for n in range(key.lo, key.hi + 1) if dispatcher.select(n) == key), None)
        if n is not None:  # None: a range made only of exact sizes, which the sizes cover
            counts.append(n)
    return list(dict.fromkeys(counts))


def warm_up(forward: CompiledForward, input_ids: torch.Tensor, positions: torch.Tensor,
            dispatcher: Dispatcher) -> None:
    start = time.perf_counter()
    context = ForwardContext(attention=_no_attention)
    with torch.inference_mode(), set_forward_context(context):
        for n in warmup_token_counts(dispatcher):
            context.num_tokens = n
            forward(input_ids[:n], positions[:n])
    forward.stats.mark_warm(time.perf_counter() - start)
