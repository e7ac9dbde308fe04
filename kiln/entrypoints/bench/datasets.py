"""Benchmark workloads: random prompts of a given length, or conversations from a ShareGPT-format file.

With a tokenizer, random prompts are decoded random token ids of exactly the requested length (as vLLM's
benchmark does) and ShareGPT output lengths are the reference replies' token counts. Without one (a
remote server of unknown tokenizer), prompts are random common words, about one token each, and the
server's reported usage gives the real token counts.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
          "government company number group problem fact water room mother area money story month lot right study "
          "book word business issue side kind head house service friend father power hour game line end member "
          "law car city community name president team minute idea kid body information back parent face others "
          "level office door health art war history party result change morning reason research girl guy moment "
          "air teacher force education").split()


@dataclass
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int  # tokens (or words, without a tokenizer)
    output_len: int


def random_requests(num: int, input_len: int, output_len: int, range_ratio: float = 0.0, seed: int = 0,
                    tokenizer: Any = None, vocab_size: int | None = None) -> list[BenchRequest]:
    """Lengths are drawn uniformly from [len * (1 - range_ratio), len * (1 + range_ratio)].

    With vocab_size (and no tokenizer) prompts are raw token ids, for offline runs on dummy-weight models.
    """
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    for name, value in (("input_len", input_len), ("output_len", output_len)):
        if value < 1:  # a length of 0 would be drawn as 1: a run that is not the one asked for
            raise ValueError(f"{name} must be >= 1, got {value}")
    rng = random.Random(seed)

    def length(center: int) -> int:
        low, high = max(1, int(center * (1 - range_ratio))), max(1, int(center * (1 + range_ratio)))
        return rng.randint(low, high)

    requests = []
    for _ in range(num):
        n_in, n_out = length(input_len), length(output_len)
        if tokenizer is not None:
            ids = [rng.randrange(len(tokenizer)) for _ in range(n_in)]
            special = set(getattr(tokenizer, "all_special_ids", []) or [])
            ids = [t if t not in special else rng.randrange(len(tokenizer)) for t in ids]
            prompt: str | list[int] = tokenizer.decode(ids)
        elif vocab_size is not None:
            prompt = [rng.randrange(3, vocab_size) for _ in range(n_in)]  # skip the usual special ids
        else:
            prompt = " ".join(rng.choice(_WORDS) for _ in range(n_in))
        requests.append(BenchRequest(prompt, n_in, n_out))
    return requests


def _count(text: str, tokenizer: Any) -> int:
    if tokenizer is not None:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])
    return max(1, round(len(text.split()) * 4 / 3))  # ~1.33 tokens per English word


def sharegpt_requests(path: str | Path, num: int, seed: int = 0, tokenizer: Any = None,
                      output_len: int | None = None, max_prompt_len: int = 1024,
                      max_total_len: int = 2048) -> list[BenchRequest]:
    """First human turn -> prompt, the reply's length -> output_len (unless fixed), as vLLM's benchmark does."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of {{'conversations': [...]}} records")
    rng = random.Random(seed)
    rng.shuffle(data)
    requests: list[BenchRequest] = []
    for record in data:
        if len(requests) >= num:
            break
        turns = (record.get("conversations") or record.get("conversation") or []) if isinstance(record, dict) else []
        if not isinstance(turns, list) or len(turns) < 2 or not all(isinstance(t, dict) for t in turns[:2]):
            continue  # not a ShareGPT record: skipped like one without a reply
        prompt, reply = str(turns[0].get("value", "")), str(turns[1].get("value", ""))
        n_in = _count(prompt, tokenizer)
        n_out = output_len if output_len is not None else _count(reply, tokenizer)
        if n_in < 4 or n_out < 4 or n_in > max_prompt_len or n_in + n_out > max_total_len:
            continue  # too short to time, or too long for a typical context (vLLM's filter)
        requests.append(BenchRequest(prompt, n_in, n_out))
    if not requests:
        raise ValueError(f"{path}: no usable conversations (need a prompt and a reply of >= 4 tokens each)")
    return requests
