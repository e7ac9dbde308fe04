"""Turns one step's logits into next tokens (and logprobs), with vLLM/OpenAI semantics.

Order: raw logprobs -> allowed_token_ids -> bad words -> min_tokens mask -> logit bias -> repetition/presence/
frequency penalties -> greedy argmax, or
temperature -> top-k -> top-p -> min-p -> sample. Everything is batched over rows except the random draw of
seeded rows: a seeded request must reproduce no matter what shares its batch, so it draws exactly one
exponential per vocab entry from its own generator each step (an exponential race, equivalent to sampling
from the softmax).

Nothing here waits for the device (except logprobs, which are read back at once): small per-row tensors go
up through pinned memory without blocking, and `sample` leaves the tokens on the device, so the host can
prepare the next step while this one still runs.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch

from kiln.models.greedy_argmax import greedy_argmax
from kiln.runtime.outputs import Logprob, TokenLogprobs
from kiln.runtime.sampling_params import SamplingParams

_NEG_INF = float("-inf")


@dataclass
class SamplingBatch:
    """One row per request that samples this step (built by the model runner)."""

    params: list[SamplingParams]
    generators: list[torch.Generator | None]  # on the logits' device; None: use the default generator
    prompt_token_ids: list[list[int]]  # for the repetition penalty
    output_token_ids: list[list[int]]  # generated so far, as known on the host (penalties, min_tokens)
    eos_token_ids: frozenset[int]  # the model's EOS ids
    # per row, generated tokens not on the host yet (overlapped scheduling): they count towards min_tokens
    num_pending_tokens: list[int] | None = None
    # per row, SamplingParams.bad_words as token sequences (bad_word_sequences); None: no row has any
    bad_words: list[tuple[tuple[int, ...], ...]] | None = None


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # None for rows whose params.logprobs is None


def needs_output_tokens(params: SamplingParams) -> bool:
    """Sampling reads the values of earlier generated tokens, so they must all be on the host first."""
    return (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
            or bool(params.bad_words))


class Sampler:
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        tokens, logprobs = self.sample(logits, batch)
        return SamplerOutput(token_ids=tokens.tolist(), logprobs=logprobs)

    def sample(self, logits: torch.Tensor, batch: SamplingBatch,
               greedy: torch.Tensor | None = None) -> tuple[torch.Tensor, list[TokenLogprobs | None]]:
        """Token ids per row, left on the logits' device (no sync), and logprobs (read back at once). `greedy`:
        the logits' argmax if already computed (in the step's CUDA graph), the tokens of plain greedy rows."""
        params = batch.params
        if logits.dim() != 2 or logits.shape[0] != len(params):
            raise ValueError(f"logits {tuple(logits.shape)} do not match a batch of {len(params)} rows")
        if all(plain_greedy(p) for p in params):
            # argmax of the model-dtype logits is the argmax of their fp32 copy (the cast is exact and
            # monotone); the copy kernel alone was 0.10 ms of an 8B step at 256 rows on the H200
            return greedy if greedy is not None else greedy_argmax(logits), [None] * len(params)
        # A copy even when already fp32: everything below edits in place and must not touch the caller's.
        logits = logits.to(torch.float32, copy=True)
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        # Logprobs describe the model's own distribution, before any penalty or filter (OpenAI/vLLM).
        raw_logprobs = torch.log_softmax(logits[lp_rows], dim=-1) if lp_rows else None

        apply_allowed_tokens(logits, batch.params)
        apply_bad_words(logits, batch)
        apply_min_tokens(logits, batch)
        apply_logit_bias(logits, batch.params)
        apply_penalties(logits, batch)

        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if len(sampled) == len(params):
            tokens = _sample(logits, params, batch.generators)
        else:
            tokens = logits.argmax(dim=-1)
            if sampled:
                rows = _device_tensor(sampled, torch.long, logits.device)
                tokens[rows] = _sample(logits[rows], [params[i] for i in sampled],
                                       [batch.generators[i] for i in sampled])

        logprobs: list[TokenLogprobs | None] = [None] * len(params)
        if raw_logprobs is not None:
            top = [params[i].logprobs for i in lp_rows]
            for row, entry in zip(lp_rows, gather_logprobs(raw_logprobs, tokens[lp_rows], top)):
                logprobs[row] = entry
        return tokens, logprobs


def plain_greedy(p: SamplingParams) -> bool:
    """Greedy with nothing that edits or reports the logits: the raw argmax is the token."""
    return (p.greedy and p.logprobs is None and p.min_tokens == 0 and p.repetition_penalty == 1.0
            and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0 and not p.logit_bias
            and p.allowed_token_ids is None and not p.bad_words)


def apply_min_tokens(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """Forbid ending (EOS, stop_token_ids) while a row has fewer than min_tokens outputs."""
    rows: list[int] = []
    cols: list[int] = []
    pending = batch.num_pending_tokens or [0] * len(batch.params)
    for i, p in enumerate(batch.params):
        if len(batch.output_token_ids[i]) + pending[i] >= p.min_tokens:
            continue
        # ignore_eos rows never stop on EOS anyway (the caller handles that), so EOS stays samplable.
        banned = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids) | batch.eos_token_ids
        rows += [i] * len(banned)
        cols += sorted(banned)
    _ban(logits, rows, cols)


def _ban(logits: torch.Tensor, rows: list[int], cols: list[int]) -> None:
    """logits[rows[j], cols[j]] = -inf for each pair whose id is a column of the logits."""
    keep = [j for j, c in enumerate(cols) if 0 <= c < logits.shape[1]]
    if keep:
        index = (_device_tensor([rows[j] for j in keep], torch.long, logits.device),
                 _device_tensor([cols[j] for j in keep], torch.long, logits.device))
        logits[index] = _NEG_INF


def apply_allowed_tokens(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """A row with allowed_token_ids keeps only those ids' logits (the rest -inf): its sample is one of them."""
    for row, p in enumerate(params):
        if p.allowed_token_ids is not None:
            keep = _device_tensor(list(p.allowed_token_ids), torch.long, logits.device)
            allowed = logits[row, keep]
            logits[row].fill_(_NEG_INF)
            logits[row, keep] = allowed


def bad_word_sequences(tokenizer: Any, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """Each bad word as token sequences: as written (leading space dropped) and after a space, as vLLM tokenizes
    them; distinct sequences only."""
    out: list[tuple[int, ...]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
            if ids and ids not in out:
                out.append(ids)
    return tuple(out)


def apply_bad_words(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """Ban the token that would complete a bad word: a one-token word always, a longer one where the output ends
    with the rest of it."""
    rows: list[int] = []
    cols: list[int] = []
    for i, sequences in enumerate(batch.bad_words or ()):
        output = batch.output_token_ids[i]
        for seq in sequences:
            head = len(seq) - 1
            if head == 0 or (len(output) >= head and tuple(output[len(output) - head:]) == seq[:-1]):
                rows.append(i)
                cols.append(seq[-1])
    _ban(logits, rows, cols)


def apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """Add each row's logit_bias to its tokens' logits (ids were checked against the vocabulary on admission)."""
    rows = [i for i, p in enumerate(params) for _ in p.logit_bias]
    if not rows:
        return
    cols = [token for p in params for token, _ in p.logit_bias]
    bias = [value for p in params for _, value in p.logit_bias]
    index = (_device_tensor(rows, torch.long, logits.device), _device_tensor(cols, torch.long, logits.device))
    logits.index_put_(index, _device_tensor(bias, logits.dtype, logits.device), accumulate=True)


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """Repetition (HF, over prompt + output) then presence/frequency (OpenAI, over output) penalties."""
    params = batch.params
    rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rep_rows:
        index = _token_index(logits, rep_rows, batch.prompt_token_ids, batch.output_token_ids)
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[index] = True
        penalty = _row_tensor(logits, [p.repetition_penalty for p in params])
        # HF semantics: dividing a negative logit would raise it, so negatives are multiplied instead.
        scale = torch.where(logits > 0, penalty.reciprocal(), penalty)
        logits.mul_(torch.where(seen, scale, 1.0))

    pf_rows = [i for i, p in enumerate(params)
               if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0) and batch.output_token_ids[i]]
    if pf_rows:
        index = _token_index(logits, pf_rows, batch.output_token_ids)
        ones = torch.ones(index[0].numel(), device=logits.device)
        counts = torch.zeros_like(logits).index_put_(index, ones, accumulate=True)
        frequency = _row_tensor(logits, [p.frequency_penalty for p in params])
        presence = _row_tensor(logits, [p.presence_penalty for p in params])
        logits.sub_(counts * frequency + (counts > 0) * presence)


def _sample(logits: torch.Tensor, params: list[SamplingParams],
            generators: list[torch.Generator | None]) -> torch.Tensor:
    """Sample one token per row of (already penalized) logits; edits logits in place."""
    logits.div_(_row_tensor(logits, [p.temperature for p in params]))
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        logits = _top_k_top_p(logits, params)
    if any(p.min_p > 0.0 for p in params):
        # prob < min_p * max_prob is logit < max_logit + log(min_p): no softmax needed.
        log_min_p = _row_tensor(logits, [math.log(p.min_p) if p.min_p > 0.0 else _NEG_INF for p in params])
        logits.masked_fill_(logits < logits.amax(dim=-1, keepdim=True) + log_min_p, _NEG_INF)
    probs = logits.softmax(dim=-1)

    # Exponential race: argmax(p_i / q_i) with q_i ~ Exp(1) is a draw from p, and each row's draw uses
    # only its own noise, so a seeded row's result cannot depend on its neighbours.
    noise = torch.empty_like(probs)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if len(unseeded) == len(generators):
        noise.exponential_()
    elif unseeded:
        rows = _device_tensor(unseeded, torch.long, probs.device)
        noise[rows] = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_()
    for i, generator in enumerate(generators):
        if generator is not None:
            noise[i].exponential_(generator=generator)
    # exponential_ may return exactly 0, and 0/0 = NaN would let argmax pick a filtered-out token.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return probs.div_(noise).argmax(dim=-1)


def _top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask to the top_k tokens, then to the smallest set whose mass reaches top_p (one shared sort)."""
    vocab = logits.shape[1]
    ascending, order = logits.sort(dim=-1)
    if any(p.top_k > 0 for p in params):
        k = _device_tensor([min(p.top_k, vocab) or vocab for p in params], torch.long, logits.device)
        kth_largest = ascending.gather(1, (vocab - k).unsqueeze(1))
        ascending.masked_fill_(ascending < kth_largest, _NEG_INF)
    if any(p.top_p < 1.0 for p in params):
        top_p = _row_tensor(logits, [p.top_p for p in params])
        # Drop the low tail whose total stays within 1 - top_p; the most likely token always survives.
        tail = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1.0 - top_p
        tail[:, -1] = False
        ascending.masked_fill_(tail, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, ascending)


def gather_logprobs(logprobs: torch.Tensor, tokens: torch.Tensor, top_counts: list[int]) -> list[TokenLogprobs]:
    """Per row of log-probabilities [rows, vocab]: the logprob and rank of `tokens[row]` and the `top_counts[row]`
    most likely tokens (read back now)."""
    chosen = logprobs.gather(1, tokens.unsqueeze(1))
    # Rank 1 is the most likely token; ties share the better rank, as in vLLM.
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    k = min(max(top_counts, default=0), logprobs.shape[1])
    top_values, top_ids = logprobs.topk(k, dim=-1)
    chosen_l, ranks_l, tokens_l = chosen.squeeze(1).tolist(), ranks.tolist(), tokens.tolist()
    top_values_l, top_ids_l = top_values.tolist(), top_ids.tolist()
    out = []
    for j, n_top in enumerate(top_counts):
        top = [Logprob(token_id=t, logprob=v, rank=r + 1)
               for r, (t, v) in enumerate(zip(top_ids_l[j][:n_top], top_values_l[j][:n_top]))]
        out.append(TokenLogprobs(sampled=Logprob(tokens_l[j], chosen_l[j], ranks_l[j]), top=top))
    return out


def score_prompt(logits: torch.Tensor, targets: list[int], top_counts: list[int]) -> list[TokenLogprobs]:
    """Prompt logprobs: row j of `logits` is the position before prompt token `targets[j]`; its raw logprob, rank
    and the top `top_counts[j]`, as `logprobs` reports a sampled token's."""
    raw = torch.log_softmax(logits.float(), dim=-1)
    return gather_logprobs(raw, _device_tensor(targets, torch.long, logits.device), top_counts)


def _token_index(logits: torch.Tensor, rows: list[int],
                 *sources: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) index pairs for every token of each row in sources, for scatter into [rows, vocab]."""
    per_row = [[source[r] for source in sources] for r in rows]
    lengths = torch.tensor([sum(len(ids) for ids in lists) for lists in per_row])
    row_idx = torch.repeat_interleave(torch.tensor(rows), lengths)
    col_idx = torch.tensor(list(itertools.chain.from_iterable(itertools.chain.from_iterable(per_row))),
                           dtype=torch.long)
    # Out-of-range ids (e.g. a tokenizer larger than the logits) would be a device-side assert on CUDA.
    keep = (col_idx >= 0) & (col_idx < logits.shape[1])
    return _to_device(row_idx[keep], logits.device), _to_device(col_idx[keep], logits.device)


def _row_tensor(logits: torch.Tensor, values: list[float]) -> torch.Tensor:
    """A per-row parameter as a [rows, 1] fp32 column that broadcasts against the logits."""
    return _device_tensor(values, torch.float32, logits.device).unsqueeze(1)


def _device_tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return _to_device(torch.tensor(values, dtype=dtype), device)


def _to_device(cpu: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A blocking copy from pageable memory would wait for the whole stream (the forward) to finish: go
    through pinned memory and let the copy queue behind it instead."""
    if device.type != "cuda":
        return cpu
    return cpu.pin_memory().to(device, non_blocking=True)
