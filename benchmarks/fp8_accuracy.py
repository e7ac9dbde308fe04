"""FP8 accuracy on real text: teacher-forced next-token distributions of FP8 models against bf16 and fp32.

Every model reads the same passages (the eval passages of data/fp8_accuracy_text.json,
~900 tokens of public-domain English) as one
prefill per passage through kiln's runner (its buffers, forward_fn, attention backend and LM head: what
kiln serves), and every position's distribution is compared with the reference's: top-1 agreement (the
share of positions whose argmax matches) and mean KL(ref || model) in nats; the text's perplexity is
printed beside them. FP8 granularities, on the same (embedded, by default) weights:

- channel/token: one weight scale per output channel, activations scaled per token at run time: what
  `quantization="fp8"` does to a full-precision checkpoint;
- tensor/token, channel/static, tensor/static: FP8 checkpoints written here with one weight scale per
  tensor and/or a static per-tensor input scale (calibrated on its calibration passage, never on the
  text scored), loaded the way published FP8 checkpoints are;
- channel/token + fp8 lm_head: the first model with its LM head also in FP8 (per-vocab-row scales, the
  final hidden per token), computed from the same hidden states: kiln keeps the head in the model dtype,
  and this row says what an FP8 head would cost in accuracy; "+ fp8 lm_head weights": the head's weights
  alone in FP8 (widened back to the model dtype, the hidden unquantized), what a weight-only head would read.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from kiln import Runtime, SamplingParams
from kiln.models.quant.fp8 import FP8_DTYPE, FP8_MAX, dequantize, fp8_linear, quantize_weight

GRANULARITIES = ("channel/token", "tensor/token", "channel/static", "tensor/static")
LM_HEAD_ROWS = {"channel/token + fp8 lm_head": "w8a8", "channel/token + fp8 lm_head weights": "weights"}
# kiln's fused projections and the checkpoint tensors that feed them (they share one input)
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
          "o_proj": ("o_proj",), "down_proj": ("down_proj",)}



# public-domain passages, shipped as data so the measurement needs no download
_TEXT = json.loads((Path(__file__).parent / "data" / "fp8_accuracy_text.json").read_text())
EVAL: tuple[str, ...] = tuple(_TEXT["eval"])
CALIBRATION = tuple(_TEXT["calibration"]) if isinstance(_TEXT["calibration"], list) else _TEXT["calibration"]


def passage_tokens(runtime: Runtime, texts: Sequence[str] = EVAL) -> list[list[int]]:
    return [runtime.tokenizer.encode(t, add_special_tokens=False) for t in texts]


def final_hidden(runtime: Runtime, tokens: list[int]) -> torch.Tensor:
    """The last decoder layer's normed output at every position: one prefill through the runner."""
    from kiln.models.forward_context import set_forward_context
    from kiln.runtime.request import Request
    from kiln.runtime.scheduler import SchedulerOutput

    engine = runtime.engine
    req = Request("fp8-accuracy", tokens, SamplingParams(), engine.eos_token_ids, engine.max_model_len)
    if not engine.kv.allocate(req, len(tokens)):
        raise RuntimeError(f"no KV blocks for a {len(tokens)}-token passage")
    try:
        batch = engine.runner.prepare(SchedulerOutput([req], [len(tokens)]))
        n = batch.num_padded_tokens
        with torch.inference_mode(), set_forward_context(engine.runner.forward_context(batch.metadata, n)):
            return engine.runner.forward_fn(engine.runner.input_ids[:n], engine.runner.positions[:n])[: len(tokens)]
    finally:
        engine.kv.free(req)


def final_hiddens(runtime: Runtime, passages: list[list[int]]) -> list[torch.Tensor]:
    """The final hidden at each position that predicts a token of the text, per passage."""
    return [final_hidden(runtime, tokens)[:-1] for tokens in passages]


def head_logits(runtime: Runtime, hiddens: list[torch.Tensor], fp8_lm_head: str | None = None) -> list[torch.Tensor]:
    """fp32 logits [len - 1, vocab] per passage from its final hiddens. fp8_lm_head (LM_HEAD_ROWS' values): "w8a8"
    the head and the hidden in FP8, "weights" the head's weights alone; None the model's own head."""
    model = runtime.engine.model
    head = quantize_weight(model.lm_head.weight) if fp8_lm_head else None
    widened = dequantize(*head, model.lm_head.weight.dtype) if fp8_lm_head == "weights" else None
    out = []
    with torch.inference_mode():
        for hidden in hiddens:
            if head is None:
                logits = model.compute_logits(hidden)
            elif widened is None:
                logits = fp8_linear(hidden, *head)
            else:
                logits = torch.nn.functional.linear(hidden, widened)
            out.append(logits.float().cpu())
    return out


def compare(ref: list[torch.Tensor], other: list[torch.Tensor]) -> dict:
    """Top-1 agreement and mean KL(ref || other) over all positions of all passages."""
    ref_all, other_all = torch.cat(ref), torch.cat(other)
    log_p, log_q = ref_all.log_softmax(-1), other_all.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return dict(top1=(ref_all.argmax(-1) == other_all.argmax(-1)).float().mean().item(),
                mean_kl=kl.mean().item(), p99_kl=kl.quantile(0.99).item(), positions=len(kl))


def perplexity(logits: list[torch.Tensor], passages: list[list[int]]) -> float:
    targets = torch.cat([torch.tensor(p[1:]) for p in passages])
    return torch.nn.functional.cross_entropy(torch.cat(logits), targets).exp().item()


def calibrate_input_amax(runtime: Runtime) -> dict[str, float]:
    """Largest |input| of every decoder projection over CALIBRATION, by checkpoint tensor name (eager model)."""
    amax: dict[str, float] = {}
    hooks = []
    for name, module in runtime.engine.model.named_modules():
        prefix, _, leaf = name.rpartition(".")
        for ckpt in _FUSED.get(leaf, ()):
            def record(module, args, key=f"model.{prefix}.{ckpt}"):
                amax[key] = max(amax.get(key, 0.0), args[0].abs().max().item())
            hooks.append(module.register_forward_pre_hook(record))
    try:
        for tokens in passage_tokens(runtime, CALIBRATION):
            final_hidden(runtime, tokens)
    finally:
        for hook in hooks:
            hook.remove()
    return amax


def write_checkpoint(source: Path, target: Path, granularity: str, input_amax: dict[str, float]) -> None:
    """`source` (a full-precision HF checkpoint directory) as a compressed-tensors FP8 checkpoint."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    weights, activations = granularity.split("/")
    leaves = {c for names in _FUSED.values() for c in names}
    tensors = {}
    with safe_open(str(source / "model.safetensors"), "pt") as f:
        for name in f.keys():
            value, module = f.get_tensor(name), name.removesuffix(".weight")
            if not (name.endswith(".weight") and module.rpartition(".")[2] in leaves):
                tensors[name] = value
                continue
            w = value.float()
            amax = w.abs().amax(-1, keepdim=True) if weights == "channel" else w.abs().max().reshape(1)
            scale = amax.clamp(min=1e-12) / FP8_MAX
            tensors[name] = (w / scale.reshape(-1, 1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
            tensors[module + ".weight_scale"] = scale
            if activations == "static":
                tensors[module + ".input_scale"] = torch.tensor([input_amax[module] / FP8_MAX])
    target.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(target / "model.safetensors"))
    for extra in source.iterdir():
        if extra.name not in ("model.safetensors", "config.json") and extra.is_file():
            shutil.copy(extra, target / extra.name)
    config = json.loads((source / "config.json").read_text())
    acts = ({"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
            if activations == "static" else
            {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True})
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": acts, "weights": {
            "num_bits": 8, "type": "float", "strategy": weights, "dynamic": False, "symmetric": True}}}}
    (target / "config.json").write_text(json.dumps(config))


def measure(model: str | None = None, *, dtype: str = "bf16", device: str = "cpu",
            granularities: Sequence[str] = GRANULARITIES, lm_head: bool = True, fp32_reference: bool = True,
            texts: Sequence[str] = EVAL) -> dict:
    """Rows {model, top1/KL against the references, perplexity}; FP8 models run in `dtype` (bf16: as served)."""
    options = dict(level=0, device=device, max_num_batched_tokens=512)
    start = time.perf_counter()
    refs: dict[str, list[torch.Tensor]] = {}
    rows: list[dict] = []

    def add(name: str, logits: list[torch.Tensor]) -> None:
        row: dict = dict(model=name, perplexity=perplexity(logits, passages))
        for ref_name, ref in refs.items():
            row[ref_name] = compare(ref, logits)
        rows.append(row)
        print(row, flush=True)

    static = any(g.endswith("/static") for g in granularities)
    input_amax: dict[str, float] = {}  # calibrated on the fp32 model, for the static input scales
    for ref_dtype in (("fp32",) if fp32_reference and dtype != "fp32" else ()) + (dtype,):
        rt = Runtime(model, dtype=ref_dtype, **options)
        passages, source = passage_tokens(rt, texts), Path(rt.engine.loaded.model_dir)
        if static and ref_dtype == "fp32":
            input_amax = calibrate_input_amax(rt)
        logits = head_logits(rt, final_hiddens(rt, passages))
        del rt
        add(ref_dtype, logits)
        refs[ref_dtype] = logits
    if static and not input_amax:
        input_amax = calibrate_input_amax(Runtime(model, dtype="fp32", **options))
    with tempfile.TemporaryDirectory(prefix="kiln-fp8-acc-") as tmp:
        for granularity in granularities:
            if granularity == "channel/token":  # online quantization, what --quantization fp8 does
                rt = Runtime(model, dtype=dtype, quantization="fp8", **options)
            else:
                path = Path(tmp) / granularity.replace("/", "-")
                write_checkpoint(source, path, granularity, input_amax)
                rt = Runtime(str(path), dtype=dtype, **options)
            hiddens = final_hiddens(rt, passages)  # one forward a passage serves every head below
            add(granularity, head_logits(rt, hiddens))
            if granularity == "channel/token" and lm_head:
                for row, head in LM_HEAD_ROWS.items():
                    add(row, head_logits(rt, hiddens, fp8_lm_head=head))
            del rt
            shutil.rmtree(Path(tmp) / granularity.replace("/", "-"), ignore_errors=True)
    return dict(dtype=dtype, device=device, passages=len(passages), tokens=sum(map(len, passages)),
                references=list(refs), rows=rows, seconds=time.perf_counter() - start)
