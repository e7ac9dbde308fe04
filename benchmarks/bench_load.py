"""Checkpoint -> GPU read rate, one process, loaders alternated (issue 14's load phase).

Reads every tensor of a safetensors checkpoint onto the device and reports GB/s for:
- `mmap`: safetensors' memory map copied into two pinned buffers and uploaded from them (kiln's loader
  before the parallel reads; kept here as the baseline);
- `preadv-N`: `kiln.models.loader.staged_upload` with N reader threads (the default is 8).
Each loader runs `--repeats` times, round-robin, so page-cache warmth is shared fairly after the first pass.
First, the rest of the load phase on a fresh process: CUDA context creation, then materialising the
meta-built model on the device three ways (`Module.to_empty`, one `torch.empty` per parameter, one flat
allocation for all of them).

    python -m benchmarks.bench_load /tmp/kiln-bench-startup/llama3-8b-bf16 --json load.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.common import stamp, table
from kiln.models.loader.staged_upload import StagedUploader

BUFFER = 256 * 2**20


def mmap_pinned(files: list[Path], device: torch.device) -> int:
    from safetensors import safe_open

    buffers = [torch.empty(BUFFER, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    done = [torch.cuda.Event() for _ in range(2)]
    turn, total, keep = 0, 0, []
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():
                flat = f.get_tensor(key).reshape(-1).view(torch.uint8)
                out = torch.empty_like(flat, device=device)
                for start in range(0, flat.numel(), BUFFER):
                    chunk = flat[start:start + BUFFER]
                    done[turn].synchronize()
                    buffers[turn][:chunk.numel()].copy_(chunk)
                    out[start:start + chunk.numel()].copy_(buffers[turn][:chunk.numel()], non_blocking=True)
                    done[turn].record()
                    turn ^= 1
                total += flat.numel()
                keep = [out]  # one tensor alive at a time, like the weight loader
    del keep
    return total


def preadv(files: list[Path], device: torch.device, threads: int) -> int:
    uploader = StagedUploader(device, threads=threads)
    total = 0
    try:
        for path in files:
            for _, tensor in uploader.tensors(path):
                total += tensor.numel() * tensor.element_size()
    finally:
        uploader.close()
    return total


def allocation_times(preset: str) -> dict[str, float]:
    """Seconds for: the CUDA context, and materialising `preset`'s parameters on the GPU three ways."""
    from kiln.models.base import ModelSpec
    from kiln.models.loader.presets import preset_config
    from kiln.models.registry import model_class

    start = time.perf_counter()
    torch.cuda.init()
    torch.empty(1, device="cuda")
    times = {"cuda_init_s": time.perf_counter() - start}
    config = preset_config(preset)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)

    def meta_model() -> torch.nn.Module:
        with torch.device("meta"):
            return model_class(config)(ModelSpec.from_hf(config))

    def timed(name: str, materialise) -> None:
        net = meta_model()
        torch.cuda.synchronize()
        start = time.perf_counter()
        keep = materialise(net)
        torch.cuda.synchronize()
        times[name] = time.perf_counter() - start
        del keep, net
        torch.cuda.empty_cache()

    try:
        timed("to_empty_s", lambda net: net.to_empty(device="cuda"))
        timed("empty_per_param_s", lambda net: [torch.empty(p.shape, dtype=p.dtype, device="cuda")
                                                for p in net.parameters()])
        timed("one_flat_buffer_s", lambda net: torch.empty(sum(p.numel() for p in net.parameters()),
                                                           dtype=torch.bfloat16, device="cuda"))
    finally:
        torch.set_default_dtype(previous)
    print(times, flush=True)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json")
    parser.add_argument("--preset", default="llama3-8b", help="the model materialised for the allocation times")
    args = parser.parse_args()
    allocation = allocation_times(args.preset)
    device = torch.device("cuda")
    files = sorted(Path(args.checkpoint).glob("*.safetensors"))
    loaders = {"mmap": lambda: mmap_pinned(files, device)}
    loaders.update({f"preadv-{n}": (lambda n=n: preadv(files, device, n)) for n in args.threads})
    rows: dict[str, list[float]] = {name: [] for name in loaders}
    for _ in range(args.repeats):
        for name, load in loaders.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            nbytes = load()
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            rows[name].append(nbytes / seconds / 1e9)
            print(f"{name}: {nbytes / 1e9:.2f} GB in {seconds:.2f} s", flush=True)
    print(table(["loader", *[f"pass {i + 1} GB/s" for i in range(args.repeats)]],
                [[name, *rates] for name, rates in rows.items()]))
    if args.json:
        Path(args.json).write_text(json.dumps({"stamp": stamp(), "allocation": allocation, "rates_gb_s": rows},
                                              indent=1))


if __name__ == "__main__":
    main()
