"""A request's state as the scheduler sees it: tokens known, tokens computed, and why it ended."""

from __future__ import annotations

import enum
import time
from collections.abc import Hashable
from typing import TYPE_CHECKING

import torch

from kiln.runtime.outputs import RequestMetrics, TokenLogprobs
from kiln.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kiln.runtime.structured.matcher import GrammarState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    def __init__(self, value: str) -> None:
        # a plain attribute, set once per member: the engine asks every request every step
        self.finished = value in ("stop", "length", "abort")


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: frozenset[int], max_model_len: int, generator: torch.Generator | None = None,
                 arrival_time: float | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.generator = generator
        self.token_ids: list[int] = list(prompt_token_ids)  # prompt + output, in order
        self.output_token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
        # per prompt position, its token's logprob given the positions before (the first has none)
        self.prompt_logprobs: list[TokenLogprobs | None] | None = [None] if params.prompt_logprobs is not None \
            else None
        self.num_computed_tokens = 0
        # tokens sampled by a launched step whose values have not reached the host yet (overlapped scheduling)
        self.num_pending_tokens = 0
        # positions below this already sit in shared, cached blocks: their K/V must not be rewritten
        self.num_shared_tokens = 0
        self.num_cached_tokens = 0  # prefix-cache hit at first admission (reported)
        # speculative proposals to verify after the known tokens (kiln/runtime/spec_decode); the scheduler
        # trims them to what it schedules, preemption drops them
        self.spec_token_ids: list[int] = []
        self.block_hashes: list[Hashable] = []
        self.status = RequestStatus.WAITING
        self.stop_reason: str | int | None = None
        self.num_preemptions = 0
        # max_tokens=None: the rest of the context. Engine.add_request refuses prompt + max_tokens > max_model_len,
        # so the min only matters for requests built directly (tests, tools)
        wanted = max_model_len if params.max_tokens is None else len(prompt_token_ids) + params.max_tokens
        self.max_total_tokens = min(wanted, max_model_len)
        self.metrics = RequestMetrics(arrival_time=arrival_time if arrival_time is not None else time.time())
        # which user request this is a sample of (Engine.add_request sets both for n > 1)
        self.parent_id = request_id
        self.child_index = 0
        self.grammar: GrammarState | None = None  # structured outputs: this sample's matcher (Engine.add_request)
        # SamplingParams.bad_words as token sequences (Engine.add_request tokenizes them)
        self.bad_words_token_ids: tuple[tuple[int, ...], ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        """Known tokens plus those still on the device: what the scheduler computes towards."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.status.finished

    def append_output(self, token_id: int, logprobs: TokenLogprobs | None) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.append(logprobs)

    def add_prompt_logprobs(self, first: int, entries: list[TokenLogprobs]) -> None:
        """Entries for prompt positions first, first + 1, ...; positions already held (a prefill run again after
        preemption) are skipped."""
        assert self.prompt_logprobs is not None and first <= len(self.prompt_logprobs)
        self.prompt_logprobs += entries[len(self.prompt_logprobs) - first:]

    def check_stop_token(self) -> RequestStatus | None:
        """After a new token: EOS / stop token ids / max_tokens / max_model_len."""
        last = self.output_token_ids[-1]
        if len(self.output_token_ids) >= self.params.min_tokens:
            if last in self.params.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
            if not self.params.ignore_eos and last in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if self.num_tokens >= self.max_total_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, pending={self.num_pending_tokens})")
