"""Pydantic models of the OpenAI-compatible wire format (requests in, responses and stream chunks out).

Request models accept unknown fields (OpenAI clients send options kiln does not implement, such as
`user`); the serving code rejects the ones whose absence would change the answer.
"""

from __future__ import annotations

import time
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


def _unicode_text(value: Any) -> None:
    """Raises where a string holds a lone UTF-16 surrogate: JSON can spell one ("\\udc80"), but it is no character,
    and the tokenizer cannot encode it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"text holds a lone UTF-16 surrogate ({value[exc.start]!r}), which is not a "
                             "character") from None
    elif isinstance(value, (list, tuple)):
        for item in value:
            _unicode_text(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            _unicode_text(key)
            _unicode_text(item)


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """OpenAI clients send null for an option their caller left as None: for a field that takes no null,
        that is its default (as in vLLM's optional fields); a field that takes null keeps it."""
        if not isinstance(data, dict):
            return data
        return {key: value for key, value in data.items()
                if value is not None or key not in cls.model_fields or cls.model_fields[key].is_required()
                or type(None) in get_args(cls.model_fields[key].annotation)}

    @field_validator("*")
    @classmethod
    def _text_is_unicode(cls, value: Any) -> Any:
        _unicode_text(value)
        return value


# -- requests ---------------------------------------------------------------------------------------------
class StreamOptions(_Lenient):
    include_usage: bool = True  # vLLM's default once stream_options is given
    continuous_usage_stats: bool = False  # vLLM: every chunk carries the usage so far


class _SamplingRequest(_Lenient):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI names plus vLLM's extensions)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None
    cache_salt: str | None = None
    user: str | None = None
    response_format: dict[str, Any] | None = None  # {"type": "text" | "json_object" | "json_schema", ...}
    structured_outputs: dict[str, Any] | None = None  # vLLM: one of json, json_object, regex, choice, grammar
    prompt_logprobs: int | None = None  # vLLM: each prompt token's logprob and the top k, from the second token on
    use_beam_search: bool = False  # vLLM's, refused when true: kiln has no beam search
    allowed_token_ids: list[int] | None = None  # vLLM: sample only among these
    truncate_prompt_tokens: int | None = None  # vLLM: keep the prompt's last k tokens
    bad_words: list[str] | None = None  # vLLM: never complete these words


class CompletionRequest(_SamplingRequest):
    # list[int] before list[str]: a token-id prompt must not be read as one prompt per token
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM: the tokenizer's special tokens (e.g. BOS) around a text prompt


class TextContentPart(_Lenient):
    type: str
    text: str | None = None


class ChatMessage(_Lenient):
    role: str
    content: str | list[TextContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True  # false: at most one call (the grammar of "required" allows one)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM: the last (assistant) message is continued, not closed
    echo: bool = False  # vLLM: a response continuing the last message's role starts with that message
    chat_template: str | None = None  # vLLM's, refused: kiln renders with the model's own template
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(_Lenient):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True


class DetokenizeRequest(_Lenient):
    model: str | None = None
    tokens: list[int]


# -- responses --------------------------------------------------------------------------------------------
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kiln"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs: per prompt position, None (the first) or {token id: its logprob}, the prompt's own token
# first, then the top k
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or token id that ended it (vLLM extension)
    prompt_logprobs: PromptLogprobs | None = None  # vLLM extension


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM extension


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str
