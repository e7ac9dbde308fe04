"""Checkpoint -> GPU read rate, one process, loaders alternated (issue 14's load phase).

Reads every tensor of a safetensors checkpoint onto the device and reports GB/s for:
- `mmap`: safetensors' memory map copied into two pinned buffers and uploaded from them (kiln's loader
  before the parallel reads; kept here as the baseline);
- `preadv-N`: `kiln.models.loader.staged_upload` with N reader threads (the default is 8).
Each loader runs `--repeats` times, round-robin, so page-cache warmth is shared fairly after the first pass.

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args()
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
        Path(args.json).write_text(json.dumps({"stamp": stamp(), "rates_gb_s": rows}, indent=1))


if __name__ == "__main__":
    main()
