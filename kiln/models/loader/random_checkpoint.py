"""Write a preset's random weights as an HF checkpoint directory: config.json plus sharded safetensors and
their index, as a model hub download lays them out.

Benchmarks use it to time start-up from real files (the path a user's start takes), not from in-memory
random weights. The tensors are the ones `load_format="dummy"` draws for the same preset and seed, so a
model loaded from the directory equals the dummy-loaded preset. They are drawn on `device` (on a GPU
that is much faster than on the host) and written shard by shard: at most one shard is in memory.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from kiln.models.base import ModelSpec
from kiln.models.loader.dummy import checkpoint_shapes, dummy_weights
from kiln.models.loader.presets import preset_config

INDEX_NAME = "model.safetensors.index.json"


def plan_shards(spec: ModelSpec, dtype: torch.dtype, max_shard_bytes: int) -> list[list[str]]:
    """Tensor names per shard, in checkpoint order; a shard closes before it would pass max_shard_bytes."""
    element = torch.empty((), dtype=dtype).element_size()
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in checkpoint_shapes(spec):
        nbytes = element * int(torch.Size(shape).numel())
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_random_checkpoint(preset: str, directory: str | os.PathLike, *, dtype: torch.dtype = torch.bfloat16,
                            device: str | torch.device = "cpu", seed: int = 0,
                            max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write `preset` with random weights to `directory` (replaced if present); returns the directory.

    The files are written into a sibling temporary directory that is renamed into place at the end, so a
    directory that exists is complete.
    """
    from safetensors.torch import save_file

    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    target = Path(directory)
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    config = preset_config(preset)
    config.dtype = str(dtype).removeprefix("torch.")
    config.save_pretrained(partial)
    spec = ModelSpec.from_hf(config)
    shards = plan_shards(spec, dtype, max_shard_bytes)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weights = dummy_weights(spec, torch.device(device), dtype, seed)
    weight_map: dict[str, str] = {}
    total = 0
    for file_name, members in zip(names, shards):
        tensors = {}
        for expected in members:
            name, tensor = next(weights)
            assert name == expected, (name, expected)  # one order: checkpoint_shapes
            tensors[name] = tensor
            total += tensor.numel() * tensor.element_size()
            weight_map[name] = file_name
        save_file(tensors, str(partial / file_name), metadata={"format": "pt"})
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (partial / INDEX_NAME).write_text(json.dumps(index, indent=1))
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    return target
