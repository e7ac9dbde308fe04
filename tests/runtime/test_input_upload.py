"""One upload a step (kiln/runtime/input_upload.py): the packed ints unpack into exactly what uploading each
array and then copying the pending tokens in wrote before, in torch and in the Triton kernel (the interpreter on
the CPU, compiled on a GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.runtime.input_upload import HEADER, ORDER, Counts, pack, staging_capacity, unpack_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOKENS, SEQS, BLOCKS = 40, 8, 6


def host_arrays(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"input_ids": rng.integers(0, 50_000, TOKENS), "positions": rng.integers(0, 4096, TOKENS),
            "slot_mapping": rng.integers(0, 1 << 30, TOKENS), "query_start_loc": rng.integers(0, TOKENS, SEQS + 1,
                                                                                             dtype=np.int32),
            "seq_lens": rng.integers(1, 4096, SEQS, dtype=np.int32), "logits_indices": rng.integers(0, TOKENS, SEQS),
            "block_tables": rng.integers(0, 1 << 20, (SEQS, BLOCKS), dtype=np.int32)}


def device_arrays(fill: int) -> dict[str, torch.Tensor]:
    i64 = {"dtype": torch.int64, "device": DEVICE}
    i32 = {"dtype": torch.int32, "device": DEVICE}
    return {"input_ids": torch.full((TOKENS,), fill, **i64), "positions": torch.full((TOKENS,), fill, **i64),
            "slot_mapping": torch.full((TOKENS,), fill, **i64), "query_start_loc": torch.full((SEQS + 1,), fill, **i32),
            "seq_lens": torch.full((SEQS,), fill, **i32), "logits_indices": torch.full((SEQS,), fill, **i64),
            "block_tables": torch.full((SEQS, BLOCKS), fill, **i32)}


def expected(host: dict[str, np.ndarray], counts: Counts, dst: np.ndarray, src: np.ndarray,
             sampled: torch.Tensor) -> dict[str, torch.Tensor]:
    """The uploads of before: each array's used prefix (the block tables' rows x width), the rest untouched, then
    input_ids[dst] = sampled[src]."""
    want = device_arrays(-7)
    for name, n in zip(ORDER, counts.lengths()):
        want[name][:n] = torch.from_numpy(np.asarray(host[name][:n]))
    rows, width = counts.reqs, counts.width
    want["block_tables"][:rows, :width] = torch.from_numpy(host["block_tables"][:rows, :width])
    if len(dst):
        want["input_ids"][torch.from_numpy(dst)] = sampled[torch.from_numpy(src)].to(DEVICE)
    return want


@pytest.mark.parametrize("kernel", ["torch", "triton", "triton from the header"])
@pytest.mark.parametrize("counts,pending", [
    (Counts(tokens=1, reqs=1, logits=1, width=3), [(0, 2)]),  # a decode step behind the one in flight
    (Counts(tokens=40, reqs=8, logits=8, width=6), [(3, 0), (17, 5), (39, 1)]),
    (Counts(tokens=16, reqs=8, logits=0, width=1), []),  # a capture's dummy batch: nothing samples
    (Counts(tokens=0, reqs=0, logits=0, width=0), []),
])
def test_unpacked_arrays_equal_the_uploads_of_each(kernel: str, counts: Counts, pending: list) -> None:
    """From the header: the kernel a CUDA graph captures, which takes the counts and the samples from the staged
    ints (its programs cover any step's ints; those past this step's write nothing)."""
    rng = np.random.default_rng(counts.tokens)
    host = host_arrays(rng)
    dst = np.array([d for d, _ in pending], dtype=np.int64)
    src = np.array([s for _, s in pending], dtype=np.int64)
    sampled = torch.tensor([101, 202, 303, 404, 505, 606], dtype=torch.int64)
    sampled_t = sampled.to(DEVICE) if pending else None
    staged = np.zeros(staging_capacity(TOKENS, SEQS, BLOCKS), dtype=np.int32)
    size = pack(staged, host, counts, dst, src, sampled_t.data_ptr() if pending else 0)
    assert size == HEADER + counts.total
    got = device_arrays(-7)
    staged_t = torch.from_numpy(staged[:size]).to(DEVICE)
    if kernel == "triton":
        from kiln.runtime.input_upload_triton import unpack_triton

        unpack_triton(staged_t, got, counts, sampled_t)
    elif kernel == "triton from the header":
        from kiln.runtime.input_upload_triton import unpack_from_header

        unpack_from_header(staged_t, got, staging_capacity(TOKENS, SEQS, BLOCKS))
    else:
        unpack_reference(staged_t, got, counts, sampled_t)
    want = expected(host, counts, dst, src, sampled)
    for name in want:
        assert torch.equal(got[name].cpu(), want[name].cpu()), name


def test_the_kernel_refuses_arrays_of_another_dtype() -> None:
    from kiln.runtime.input_upload_triton import unpack_triton

    arrays = device_arrays(0)
    arrays["positions"] = arrays["positions"].int()
    with pytest.raises(ValueError, match="positions"):
        unpack_triton(torch.zeros(4, dtype=torch.int32, device=DEVICE), arrays, Counts(1, 1, 1, 1), None)
