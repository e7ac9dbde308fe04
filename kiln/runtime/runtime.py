"""`kiln.Runtime`: the Python API (generate, stream, chat) over one Engine."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterator, Sequence
from numbers import Integral
from typing import TYPE_CHECKING, Any

from kiln.config import CacheConfig, CompilationConfig, RuntimeConfig, SchedulerConfig
from kiln.runtime.engine import Engine
from kiln.runtime.output_router import OutputRouter
from kiln.runtime.outputs import RequestOutput
from kiln.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kiln.compiler.stats import CompileStats
    from kiln.runtime.startup import StartupTimes

logger = logging.getLogger("kiln")

Prompt = str | Sequence[int]


def build_config(model: str | None = None, **kwargs: Any) -> RuntimeConfig:
    """Split flat keyword arguments over the config dataclasses; unknown names are a ValueError."""
    sections = {"scheduler": SchedulerConfig, "cache": CacheConfig, "compilation": CompilationConfig}
    top = {f.name for f in dataclasses.fields(RuntimeConfig)} - set(sections)
    picked: dict[str, dict[str, Any]] = {name: {} for name in sections}
    values: dict[str, Any] = {"model": model}
    for key, value in kwargs.items():
        if key in top:
            _check_option_type(key, value, RuntimeConfig)
            values[key] = value
            continue
        if key in sections and isinstance(value, sections[key]):
            values[key] = value
            continue
        for name, cls in sections.items():
            if key in {f.name for f in dataclasses.fields(cls)}:
                _check_option_type(key, value, cls)
                picked[name][key] = value
                break
        else:
            raise ValueError(f"unknown Runtime option {key!r}")
    for name, cls in sections.items():
        if picked[name]:
            base = values.get(name, cls())
            values[name] = dataclasses.replace(base, **picked[name])
    return RuntimeConfig(**values)


_SIMPLE_TYPES: dict[str, Any] = {"int": int, "float": (int, float), "bool": bool, "str": (str, os.PathLike),
                                 "None": type(None), "tuple[int, ...]": (list, tuple), "tuple[str, ...]": (list, tuple)}


def _check_option_type(key: str, value: Any, section: type) -> None:
    """An option whose declared type is plain (int, float, bool, str, a tuple of ints or strings, or None) must
    be given as one: a bool is not an int, "4" not a number, "noop" not a tuple of passes. Richer types (dtype
    also takes a torch.dtype) are checked where they are read."""
    declared = next(str(f.type) for f in dataclasses.fields(section) if f.name == key)
    parts = [part.strip() for part in declared.split("|")]
    if key == "dtype" or not all(part in _SIMPLE_TYPES for part in parts):
        return
    if any(isinstance(value, _SIMPLE_TYPES[part]) and not (isinstance(value, bool) and part in ("int", "float"))
           for part in parts):
        return
    raise ValueError(f"{key} must be {declared}, got {value!r}")


class Runtime:
    """Runtime(model=None -> embedded SmolLM2-135M-Instruct, level=..., device="auto", dtype="auto", ...)."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.config = build_config(model, **kwargs)
        self.engine = Engine(self.config)
        self._router = OutputRouter(self.engine)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def compile_stats(self) -> CompileStats:
        """Dynamo traces, Inductor compiles, seconds and per-piece detail (all zero at -O0)."""
        return self.engine.worker.compile_stats

    @property
    def startup_times(self) -> StartupTimes:
        """Seconds per start-up phase (load, tokenizer, trace, compile, kv, capture) and the total to ready."""
        return self.engine.startup_times

    def finish_background_compiles(self, timeout: float | None = None) -> bool:
        """Block until the compiles left to the background are done and swapped in (docs/compiler.md)."""
        return self.engine.finish_background_compiles(timeout)

    def shutdown(self) -> None:
        """Release what the runtime runs beside the caller: background compiles still running are cancelled
        (their worker processes terminated, not waited for) and tensor-parallel workers stopped. Idempotent;
        the runtime is unusable afterwards. A runtime never shut down has its background compiles cancelled at
        interpreter exit all the same; `with Runtime(...) as rt:` shuts down at the block's end."""
        self.engine.shutdown()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def stats(self) -> dict[str, Any]:
        """Engine counters: tokens, preemptions, KV usage, prefix-cache queries/hits/hit rate."""
        return self.engine.stats_snapshot()

    def _normalise(self, prompts: Prompt | Sequence[Prompt],
                   params: SamplingParams | Sequence[SamplingParams] | None) -> tuple[list, list]:
        if hasattr(prompts, "tolist"):  # a tensor or array: one prompt of ids (1-D) or one a row (2-D)
            prompts = prompts.tolist()
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts
                                        and isinstance(prompts[0], Integral)):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(params, dict):
            raise ValueError("sampling_params must be a SamplingParams (or a list of them), got a dict: use "
                             "SamplingParams(**values) or SamplingParams.from_dict(values)")
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        params = list(params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        return prompts, params

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run prompts to completion (batched together); outputs in prompt order.

        Bad input raises ValueError before anything is queued, so other requests are unaffected.
        """
        prompts, params = self._normalise(prompts, sampling_params)
        ids: list[str] = []
        try:  # nothing of this call stays queued or running once it returns or raises (an interrupt too)
            for prompt, p in zip(prompts, params):
                ids.append(self._router.add(prompt, p, final_only=True))
            outputs = []
            for request_id in ids:  # final_only: one output each, when it finishes
                outputs.append(self._router.take(request_id)[-1])
            return outputs
        finally:
            self._router.release(ids)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield outputs as tokens arrive; each carries delta_text / delta_token_ids since the last one."""
        request_id = self._router.add(prompt, sampling_params or SamplingParams())
        try:
            while True:
                for out in self._router.take(request_id):
                    yield out
                    if out.finished:
                        return
        finally:
            self._router.release([request_id])  # frees the blocks if the caller stopped early

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template")
        _check_messages(messages)
        return render_chat_template(self.tokenizer, messages)

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
             ) -> RequestOutput | list[RequestOutput]:
        """One conversation's answer; for a list of conversations (vLLM's batch form), their answers in order."""
        if isinstance(messages, list) and messages and all(isinstance(m, list) for m in messages):
            return self.generate([self.apply_chat_template(m) for m in messages], sampling_params)
        return self.generate([self.apply_chat_template(messages)], sampling_params)[0]


def _check_messages(messages: Any) -> None:
    """Chat messages as the templates expect them: a list of {"role": str, "content": str or a list of parts}."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"messages must be a non-empty list of {{'role', 'content'}} dicts, got {messages!r:.80}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}] must be a dict with a string 'role', got {message!r:.80}")
        if not isinstance(message.get("content"), (str, list)) and not message.get("tool_calls"):
            raise ValueError(f"messages[{i}].content must be a string or a list of parts, got "
                             f"{message.get('content')!r:.80}")


def render_chat_template(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                         **template_kwargs: Any) -> list[int]:
    """The prompt's token ids as the tokenizer's chat template renders the messages (Runtime.chat and the server);
    what the template refuses (the messages' shape, a template variable) is a ValueError naming messages."""
    from jinja2 import TemplateError

    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                            **template_kwargs)
    except (TemplateError, TypeError, KeyError, IndexError) as exc:
        raise ValueError(f"messages: the chat template cannot render them ({type(exc).__name__}: {exc})") from exc
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)
