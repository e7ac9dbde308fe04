"""The LM head and the greedy argmax at the end of small FULL CUDA graphs.

Why: a small model's decode step is its host's. Outside the graph, each step's LM head is an eager call and the
greedy argmax a Triton launch through its Python launcher; inside it they cost one replay, which the graph does
anyway. The graph computes every padded row's logits (decode and uniform verify batches sample at every token)
and their argmax; a step whose rows are all plain greedy with nothing editing the logits (no grammar mask) takes
the argmax as its tokens, any other step samples from the graph's logits.

Bounded (`KILN_GRAPH_HEAD_MAX_TOKENS`, 0: never): a graph keeps its outputs for its replays, so each captured size
holds its rows of logits (a 128k vocabulary: 256 KB a row); sizes up to 32 hold 87 rows. Not under tensor
parallelism, whose greedy steps take each rank's argmax without gathering the logits (`greedy_tokens`).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from kiln.models.greedy_argmax import greedy_argmax
from kiln.models.parallel import tp_size

MAX_TOKENS = int(os.environ.get("KILN_GRAPH_HEAD_MAX_TOKENS", "32"))


class ForwardOutput(NamedTuple):  # a tuple: graph wrappers treat its tensors as the captured outputs
    hidden: torch.Tensor  # every padded token's final hidden state
    logits: torch.Tensor | None = None  # every padded token's logits, where the graph computed them
    greedy: torch.Tensor | None = None  # their argmax


def with_head(model: torch.nn.Module, hidden: torch.Tensor) -> ForwardOutput:
    """`hidden`, and for a batch of up to MAX_TOKENS tokens on one rank its logits and their argmax."""
    if hidden.shape[0] > MAX_TOKENS or tp_size() > 1:
        return ForwardOutput(hidden)
    logits = model.compute_logits(hidden)
    return ForwardOutput(hidden, logits, greedy_argmax(logits))
