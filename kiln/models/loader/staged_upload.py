"""Host -> device upload of safetensors shards through reusable pinned staging buffers, read in parallel.

safetensors' own `device="cuda"` path copies each tensor from its memory map with a pageable, blocking
host-to-device copy; on the H200 that streamed an 8B checkpoint at ~1.6 GB/s (10 s of a warm start,
2026-11-30). A copy from the memory map into pinned buffers reads 25-34 GB/s on a quiet H200 host but 8 GB/s
while another process keeps its cores busy (a read-rate script, since removed; a shared host). So the
shard is not mapped: its header is parsed here (8-byte length, JSON), consecutive tensors are grouped up to
one buffer's size, and each group's byte span is read with `os.preadv` straight into a pinned buffer by 8
threads at once (preadv releases the GIL; the kernel copies out of the page cache: 21-25 GB/s, busy host or
not), then uploaded without blocking, so the next group's read overlaps this one's upload. A buffer is
reused only once its previous upload has finished. Each group lands in one device allocation and its tensors
are views of it (a tensor larger than a buffer goes up in pieces). The tensors are ordered on the current
stream, so a weight loader that copies them into parameters on that stream needs no synchronisation. On the
CPU the same code runs unpinned (for tests).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_BUFFER_BYTES = 256 * 2**20
_MIN_PIECE_BYTES = 4 * 2**20  # below this a read is not worth a thread hand-off

# safetensors dtype names (the format's spec) -> torch
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # byte offsets in the file
    end: int


def read_header(path: Path) -> list[TensorEntry]:
    """The shard's tensors in file order."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    data_start = 8 + size
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in DTYPES:
            raise ValueError(f"{path.name}: tensor {name!r} has dtype {info['dtype']}, which kiln cannot load")
        begin, end = info["data_offsets"]
        entries.append(TensorEntry(name, DTYPES[info["dtype"]], tuple(info["shape"]), data_start + begin,
                                   data_start + end))
    return sorted(entries, key=lambda e: e.begin)


def _groups(entries: list[TensorEntry], limit: int) -> Iterator[list[TensorEntry]]:
    group: list[TensorEntry] = []
    for entry in entries:
        if group and entry.end - group[0].begin > limit:
            yield group
            group = []
        group.append(entry)
    if group:
        yield group


def _pread_into(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        got = os.preadv(fd, [view], offset)
        if got == 0:
            raise EOFError(f"checkpoint file ended {len(view)} bytes early")
        view, offset = view[got:], offset + got


class StagedUploader:
    def __init__(self, device: torch.device, buffer_bytes: int = DEFAULT_BUFFER_BYTES,
                 threads: int | None = None) -> None:
        self.device = device
        pin = device.type == "cuda"
        self.buffers = [torch.empty(buffer_bytes, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
        self.done = [torch.cuda.Event() if pin else None for _ in range(2)]
        self.turn = 0
        self.threads = threads or min(8, os.cpu_count() or 1)
        self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="kiln-read")

    def close(self) -> None:
        self.pool.shutdown()

    def tensors(self, path: Path) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, device tensor) for every tensor of one safetensors file, in file order."""
        fd = os.open(path, os.O_RDONLY)
        try:
            for group in _groups(read_header(path), self.buffers[0].numel()):
                span = self._upload_span(fd, group[0].begin, group[-1].end - group[0].begin)
                for entry in group:
                    raw = span[entry.begin - group[0].begin:entry.end - group[0].begin]
                    if raw.storage_offset() % entry.dtype.itemsize:  # packed after an odd-sized tensor
                        raw = raw.clone()
                    yield entry.name, raw.view(entry.dtype).view(entry.shape)
        finally:
            os.close(fd)

    def _upload_span(self, fd: int, offset: int, nbytes: int) -> torch.Tensor:
        out = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        step = self.buffers[0].numel()
        for start in range(0, nbytes, step):
            n = min(step, nbytes - start)
            slot = self.turn
            self.turn ^= 1
            if self.done[slot] is not None:
                self.done[slot].synchronize()  # its previous upload has read the buffer
            staging = self.buffers[slot][:n]
            self._read(fd, memoryview(staging.numpy()), offset + start)
            out[start:start + n].copy_(staging, non_blocking=True)
            if self.done[slot] is not None:
                self.done[slot].record()
        return out

    def _read(self, fd: int, view: memoryview, offset: int) -> None:
        piece = max(_MIN_PIECE_BYTES, -(-len(view) // self.threads))
        starts = range(0, len(view), piece)
        if len(starts) == 1:
            _pread_into(fd, view, offset)
            return
        futures = [self.pool.submit(_pread_into, fd, view[s:s + piece], offset + s) for s in starts]
        for future in futures:
            future.result()
