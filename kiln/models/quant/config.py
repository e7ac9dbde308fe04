"""Which quantization a model runs with: the `quantization` option and the checkpoint's quantization_config.

kiln runs one scheme, FP8 e4m3 linear weights with per-channel or per-tensor scales and FP8 activations
(dynamic per token, or a static per-tensor input scale). Checkpoints come in the two layouts published
for Llama-3 FP8 models: `quant_method: "fp8"` (activation_scheme dynamic|static, per-tensor
weight_scale) and `quant_method: "compressed-tensors"` (config_groups whose weights are 8-bit floats with
strategy channel|tensor). Anything else - block-wise scales, integer or 4-bit weights, other methods -
is refused here, by name, before any weight is read.
"""

from __future__ import annotations

from typing import Any

from kiln.models.quant.fp8 import Fp8Scheme

QUANTIZATIONS = ("fp8",)
# layers a checkpoint may leave unquantized: kiln keeps the LM head (and embeddings) in the model dtype anyway
_IGNORABLE = ("lm_head",)


def resolve_quantization(option: str | None, hf_config: Any) -> Fp8Scheme | None:
    """The scheme for this model: the checkpoint's when it is quantized, else online FP8 when asked."""
    if option is not None and option not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)} (or unset); got {option!r}")
    qconfig = getattr(hf_config, "quantization_config", None)
    if qconfig is not None and not isinstance(qconfig, dict):
        qconfig = qconfig.to_dict() if hasattr(qconfig, "to_dict") else vars(qconfig)
    if not qconfig:
        return Fp8Scheme(source="online") if option == "fp8" else None
    method = qconfig.get("quant_method")
    if method == "fp8":
        return _fp8_method(qconfig)
    if method == "compressed-tensors":
        return _compressed_tensors(qconfig)
    raise ValueError(f"unsupported checkpoint quant_method {method!r}: kiln runs FP8 checkpoints of the "
                     "'fp8' or 'compressed-tensors' kind")


def _check_ignored(names: list[str] | None, field: str) -> None:
    kept = [n for n in names or [] if not any(n.endswith(i) or n == f"re:.*{i}" for i in _IGNORABLE)]
    if kept:
        raise ValueError(f"unsupported quantization_config.{field} {kept[:4]}: kiln quantizes every linear "
                         "layer of the decoder (only the LM head may be left out)")


def _fp8_method(qconfig: dict) -> Fp8Scheme:
    if qconfig.get("weight_block_size"):
        raise ValueError(f"unsupported FP8 checkpoint: block-wise weight scales (weight_block_size "
                         f"{qconfig['weight_block_size']}); kiln supports per-tensor and per-channel scales")
    scheme = qconfig.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"unsupported FP8 activation_scheme {scheme!r} (supported: dynamic, static)")
    _check_ignored(qconfig.get("ignored_layers") or qconfig.get("modules_to_not_convert"), "ignored_layers")
    return Fp8Scheme(source="fp8", static_input=scheme == "static")


def _compressed_tensors(qconfig: dict) -> Fp8Scheme:
    groups = qconfig.get("config_groups") or {}
    if not groups:
        raise ValueError("unsupported compressed-tensors checkpoint: no config_groups")
    statics = set()
    for name, group in groups.items():
        weights = group.get("weights") or {}
        where = f"compressed-tensors config_groups.{name}"
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise ValueError(f"unsupported {where}.weights: {weights.get('num_bits')}-bit {weights.get('type')} "
                             "(kiln runs 8-bit float weights only)")
        if weights.get("strategy") not in ("channel", "tensor"):
            raise ValueError(f"unsupported {where}.weights.strategy {weights.get('strategy')!r} "
                             "(supported: channel, tensor)")
        acts = group.get("input_activations")
        if acts is None:  # weight-only FP8: kiln still quantizes activations, dynamically per token
            statics.add(False)
            continue
        if acts.get("type") != "float" or acts.get("num_bits") != 8:
            raise ValueError(f"unsupported {where}.input_activations: {acts.get('num_bits')}-bit {acts.get('type')}")
        dynamic = bool(acts.get("dynamic"))
        strategy = acts.get("strategy")
        if (dynamic and strategy != "token") or (not dynamic and strategy != "tensor"):
            raise ValueError(f"unsupported {where}.input_activations: dynamic={dynamic} strategy={strategy!r} "
                             "(supported: dynamic per token, static per tensor)")
        statics.add(not dynamic)
    if len(statics) > 1:
        raise ValueError("unsupported compressed-tensors checkpoint: groups mix static and dynamic activations")
    _check_ignored(qconfig.get("ignore"), "ignore")
    return Fp8Scheme(source="compressed-tensors", static_input=statics.pop())
