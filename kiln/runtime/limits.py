"""Does a request fit? The prompt, max_tokens and n against max_model_len and max_n, checked at admission.

Refusing up front (a ValueError naming the field; a 400 from the server) instead of clamping: a client
asking for 100000 tokens of an 8192-token model would otherwise be accepted and hold the engine until
the context ends, and it is told neither that nor why. The message states the numbers, as vLLM's does.
"""

from __future__ import annotations

from kiln.runtime.sampling_params import SamplingParams


def check_request_fits(num_prompt_tokens: int, params: SamplingParams, max_model_len: int, max_n: int) -> None:
    if num_prompt_tokens >= max_model_len:
        raise ValueError(f"prompt has {num_prompt_tokens} tokens; max_model_len is {max_model_len} "
                         "(the prompt plus at least one generated token must fit)")
    if params.max_tokens is not None and num_prompt_tokens + params.max_tokens > max_model_len:
        raise ValueError(
            f"max_tokens {params.max_tokens} plus the prompt's {num_prompt_tokens} tokens is "
            f"{num_prompt_tokens + params.max_tokens} tokens, beyond this model's maximum context length "
            f"(max_model_len) of {max_model_len}: lower max_tokens to at most "
            f"{max_model_len - num_prompt_tokens}, shorten the prompt, or leave max_tokens unset for the rest "
            "of the context")
    if params.n > max_n:
        raise ValueError(f"n {params.n} is more than the {max_n} sequences one request may ask for (max_n)")
