"""Resolve a model argument (None, an HF directory, or a preset name) and build the model on a device.

The model is built on the meta device and materialised once on the target device, so weights are
never held twice; safetensors are streamed to the device one tensor at a time (through pinned staging
buffers on a GPU: staged_upload.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kiln.config import resolve_dtype
from kiln.models.base import ModelSpec
from kiln.models.loader.config_view import json_config_view
from kiln.models.loader.dummy import dummy_weights
from kiln.models.loader.presets import PRESETS, preset_view
from kiln.models.loader.staged_upload import StagedUploader
from kiln.models.quant.config import resolve_quantization
from kiln.models.registry import model_class

logger = logging.getLogger("kiln")


class WeightStream:
    """A materialised model's weights copied in on a thread, while the caller goes on (compiling, capturing:
    neither reads weight values, only their shapes and addresses). Every loader copies into the existing
    parameters in place (tests/models/test_weight_stream.py), so nothing traced or captured meanwhile goes
    stale. `wait()` joins and raises the thread's exception, if any."""

    def __init__(self, fill: Any, device: torch.device) -> None:
        self.seconds = 0.0
        self._fill = fill
        self._device = device
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kiln-weights", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        start = time.perf_counter()
        try:
            if self._device.type == "cuda":  # a new thread's current device is device 0
                torch.cuda.set_device(self._device)
            self._fill()
        except BaseException as exc:  # noqa: BLE001 - re-raised by wait() on the caller's thread
            self._error = exc
        finally:
            self.seconds = time.perf_counter() - start

    def wait(self) -> float:
        """Block until every weight is in; the thread's seconds."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self.seconds


@dataclass
class LoadedModel:
    model: nn.Module
    spec: ModelSpec
    hf_config: Any  # a ConfigView of config.json, or the transformers config where that was needed
    model_dir: Path | None  # None for preset (dummy) models: no tokenizer on disk
    dtype: torch.dtype
    load_seconds: float
    config_seconds: float = 0.0  # of load_seconds: reading the config (json; transformers only as the fallback)
    weights: WeightStream | None = None  # weights still streaming in (load_model(background=True))

    def wait_for_weights(self) -> None:
        """Return once every weight is in the model (at once where they were loaded in line)."""
        if self.weights is not None:
            stream, self.weights = self.weights, None
            stream.wait()
            self.load_seconds += stream.seconds


def model_directory(model: str | None) -> Path | None:
    """The model argument's HF directory (None for a preset), without reading the config."""
    if model is None:
        from kiln.models.loader.gguf_import import embedded_model_dir

        model = str(embedded_model_dir())
    if model in PRESETS:
        return None
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model {model!r} is neither a directory with a config.json nor a preset "
            f"({', '.join(sorted(PRESETS))}); kiln cannot download weights"
        )
    return path


def resolve_model_source(model: str | None) -> tuple[Path | None, Any]:
    """-> (directory or None for a preset, its config: a ConfigView of config.json where that is enough,
    else the transformers config; see config_view.py)."""
    path = model_directory(model)
    if path is None:
        return None, preset_view(model)
    view, reason = json_config_view(path)
    if view is not None:
        return path, view
    logger.debug("reading %s through transformers' AutoConfig: %s", path / "config.json", reason)
    from transformers import AutoConfig

    return path, AutoConfig.from_pretrained(path)


def safetensors_weights(model_dir: Path, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no .safetensors files in {model_dir}")
    if device.type == "cuda":  # parallel reads into pinned buffers, then async uploads (staged_upload.py)
        uploader = StagedUploader(device)
        try:
            for name in files:
                yield from uploader.tensors(model_dir / name)
        finally:
            uploader.close()
        return
    for name in files:
        with safe_open(str(model_dir / name), framework="pt", device=str(device)) as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def load_model(model: str | None, *, device: torch.device, dtype: str | torch.dtype = "auto",
               load_format: str = "auto", seed: int = 0, quantization: str | None = None,
               background: bool = False, expert_parallel: bool = False) -> LoadedModel:
    """`background=True`: return once the model is materialised, the weights streaming in on a thread
    (`LoadedModel.wait_for_weights()`); not for quantized models, whose loaders build new parameters.
    `expert_parallel`: a mixture-of-experts model places whole experts on the tensor-parallel ranks."""
    start = time.perf_counter()
    model_dir, hf_config = resolve_model_source(model)
    config_seconds = time.perf_counter() - start
    if load_format == "dummy" or model_dir is None:
        load_format = "dummy"
    cls = model_class(hf_config)
    spec = ModelSpec.from_hf(hf_config)
    moe = dataclasses.replace(spec.moe, expert_parallel=expert_parallel) if spec.moe else None
    spec = dataclasses.replace(spec, quantization=resolve_quantization(quantization, hf_config), moe=moe)
    ckpt_dtype = getattr(torch, spec.torch_dtype, None) if spec.torch_dtype else None
    torch_dtype = resolve_dtype(dtype, ckpt_dtype, device)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype)
    try:
        with torch.device("meta"):
            net = cls(spec)
    finally:
        torch.set_default_dtype(previous)
    # torch.empty, not to_empty's empty_like: a meta tensor's empty_like goes through Python references that
    # import sympy (~1.8 s on the H200), which the compiler imports on a thread meanwhile (runtime/compiler_imports.py)
    net = net._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    if spec.tie_word_embeddings:  # materialising breaks the tie; restore it
        net.lm_head.weight = net.embed_tokens.weight
    for module in net.modules():
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()
    if load_format == "dummy":
        weights = dummy_weights(spec, device, torch_dtype, seed)
    else:
        weights = safetensors_weights(model_dir, device)
    net.eval()  # before anything is traced: Dynamo guards on the training flag
    quant = f", fp8 linears ({spec.quantization.source})" if spec.quantization else ""
    description = f"{spec.architecture} ({load_format}, {torch_dtype}{quant}) on {device}"

    def fill() -> None:
        loaded = net.load_weights(weights)
        expected = {n for n, _ in net.named_parameters(remove_duplicate=False)}
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint {model_dir or model} is missing weights: {', '.join(missing[:8])}")

    if background and spec.quantization is None:
        logger.info("materialised %s in %.2fs (config %.2fs); weights streaming in on a thread", description,
                    time.perf_counter() - start, config_seconds)
        return LoadedModel(net, spec, hf_config, model_dir, torch_dtype, time.perf_counter() - start,
                           config_seconds, WeightStream(fill, device))
    fill()
    seconds = time.perf_counter() - start
    logger.info("loaded %s in %.2fs (config %.2fs)", description, seconds, config_seconds)
    return LoadedModel(net, spec, hf_config, model_dir, torch_dtype, seconds, config_seconds)
