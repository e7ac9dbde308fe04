"""An HF model's config.json read with `json`, as a read-only attribute view: no `import transformers`.

The first `import transformers` in a process costs seconds (8-10 s on the H200 host, docs/startup.md), and
reading config.json through `AutoConfig` made it the first thing every start paid, before any weight was
read. kiln reads only a handful of fields (`ModelSpec.from_hf`, `model_class`, `resolve_quantization`), so
the JSON itself serves, wherever it states every field whose transformers class default could differ from
what `ModelSpec.from_hf` assumes when the field is absent. A config that does not (older checkpoints that
lean on class defaults, rope schemes transformers rewrites on load, a model type kiln does not know) is
read through `AutoConfig` as before: `json_config_view` returns None and the caller falls back, so no model
is built differently. tests/models/test_config_view.py checks the spec both ways for every preset and every
kind of tiny checkpoint the tests write.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

# the model types ModelSpec.from_hf has been checked against (their transformers config classes' defaults)
KNOWN_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral"})
# read by ModelSpec.from_hf and defaulted by the transformers classes to values that from_hf would not
# guess (e.g. Qwen2/Qwen3 num_key_value_heads=32, Llama eos_token_id=2): the JSON must state them
REQUIRED_FIELDS = ("architectures", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                   "intermediate_size", "vocab_size", "rms_norm_eps", "max_position_embeddings",
                   "tie_word_embeddings", "eos_token_id")
# Qwen3's class default head_dim is 128, not hidden_size // num_attention_heads as from_hf assumes
HEAD_DIM_REQUIRED = frozenset({"qwen3", "qwen3_moe"})
# the routing fields MoeSpec.from_hf reads without a default (Qwen3-MoE's expert count under either name)
MOE_REQUIRED = {"qwen3_moe": ("num_experts_per_tok", "moe_intermediate_size"), "mixtral": ("num_experts_per_tok",)}
EXPERT_COUNT = ("num_experts", "num_local_experts")
# rope schemes transformers keeps as written (apart from adding rope_theta): checked by the tests
PLAIN_ROPE_TYPES = frozenset({"default", "llama3"})


class ConfigView(Mapping[str, Any]):
    """Frozen attribute access over a config dict: `view.hidden_size`, `getattr(view, "head_dim", None)`."""

    __slots__ = ("_values",)

    def __init__(self, values: Mapping[str, Any]) -> None:
        object.__setattr__(self, "_values", MappingProxyType(copy.deepcopy(dict(values))))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_values":  # not set yet (copy/pickle probing): no recursion
            raise AttributeError(name)
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"config has no field {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"ConfigView is read-only (setting {name!r})")

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __reduce__(self) -> tuple:
        return ConfigView, (dict(self._values),)

    def __repr__(self) -> str:
        return f"ConfigView({dict(self._values)!r})"

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(dict(self._values))


def _missing(values: Mapping[str, Any]) -> str | None:
    """Why the JSON alone may not give the transformers spec (None when it does)."""
    model_type = values.get("model_type")
    if model_type not in KNOWN_MODEL_TYPES:
        return f"model_type {model_type!r}"
    absent = [f for f in REQUIRED_FIELDS if f not in values]
    if model_type in HEAD_DIM_REQUIRED and "head_dim" not in values:
        absent.append("head_dim")
    if model_type in MOE_REQUIRED:
        absent += [f for f in MOE_REQUIRED[model_type] if f not in values]
        if not any(f in values for f in EXPERT_COUNT):
            absent.append("num_experts")
    if absent:
        return f"no {', '.join(absent)}"
    if not isinstance(values["architectures"], list) or not values["architectures"]:
        return "architectures is not a non-empty list"
    if "rope_parameters" in values and "rope_scaling" in values:
        return "both rope_parameters and rope_scaling"
    rope = values.get("rope_parameters") or values.get("rope_scaling") or {}
    if not isinstance(rope, dict) or "type" in rope or rope.get("rope_type", "default") not in PLAIN_ROPE_TYPES:
        return f"rope {rope!r}"
    if "rope_theta" not in values and "rope_theta" not in rope:
        return "no rope_theta"
    dtypes = {values[k] for k in ("dtype", "torch_dtype") if values.get(k) is not None}
    if len(dtypes) > 1 or not all(isinstance(d, str) for d in dtypes):
        return f"dtype {sorted(map(str, dtypes))}"
    return None


def json_config_view(model_dir: Path) -> tuple[ConfigView | None, str | None]:
    """-> (the view, None), or (None, why not) when the config must be read through transformers."""
    try:
        values = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:  # transformers then raises its own error for it, as it always did
        return None, f"unreadable config.json ({exc})"
    if not isinstance(values, dict):
        return None, "config.json is not an object"
    reason = _missing(values)
    return (None, reason) if reason else (ConfigView(values), None)
