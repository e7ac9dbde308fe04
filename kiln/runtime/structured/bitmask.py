"""A step's token mask: filled on the host from the rows' matchers, applied to the logits on their device.

One bit per vocabulary id (xgrammar's packed int32 layout). Rows without a grammar are all ones, so the mask
applies to the whole [rows, vocab] logits in one kernel, in place, after the (graphed) forward and before
sampling: greedy, sampling, penalties and logprobs all see the constrained distribution, as in vLLM. The host
buffer is pinned and the upload does not block, so the fill overlaps the forward already queued on the GPU.

The fill runs on one thread by default: a JSON-schema row takes ~5-15 us (xgrammar's precomputed masks), so 64
rows fit well inside one decode step. xgrammar's "auto" pool (half the hardware threads) competed with the
engine's host thread: on a 16-core H200 machine a 16-row fill took 4.7 ms with it and 0.19 ms on one thread,
and the constrained step went from 2.56x the free one to 1.01x (docs/BENCHMARKS.md, "Structured outputs").
KILN_GRAMMAR_FILL_THREADS sets another count.
"""

from __future__ import annotations

import os

import torch

from kiln.runtime.structured.matcher import GrammarState


class TokenBitmask:
    def __init__(self, max_rows: int, vocab_size: int, device: torch.device) -> None:
        import xgrammar as xgr

        self._batch_matcher = xgr.BatchGrammarMatcher(max_threads=int(os.environ.get("KILN_GRAMMAR_FILL_THREADS", "1")))
        self.host = xgr.allocate_token_bitmask(max_rows, vocab_size)
        if device.type == "cuda":
            self.host = self.host.pin_memory()
        self.device_buffer = self.host.to(device) if device.type != "cpu" else self.host
        self.device = device

    def fill(self, states: list[GrammarState | None]) -> torch.Tensor:
        """The mask for one step's sampling rows (row i: states[i]; None or a terminated matcher: all allowed)."""
        rows = len(states)
        host = self.host[:rows]
        host.fill_(-1)
        matchers, indices = [], []
        for i, state in enumerate(states):
            if state is not None and state.matcher is not None and not state.terminated:
                matchers.append(state.matcher)
                indices.append(i)
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(host, indices[0])
        elif matchers:
            self._batch_matcher.batch_fill_next_token_bitmask(matchers, host, indices)
        if self.device.type == "cpu":
            return host
        return self.device_buffer[:rows].copy_(host, non_blocking=True)


def apply_token_mask(logits: torch.Tensor, mask: torch.Tensor) -> None:
    """Disallowed ids -> -inf in place (xgrammar's kernel: Triton on CUDA, C++ on CPU). The mask spans the
    logits: ids the tokenizer lacks (a padded embedding) are disallowed bits, not skipped columns."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=min(logits.shape[1], mask.shape[1] * 32))
