"""Loading from safetensors: a sharded checkpoint on disk gives the same model as the in-memory weights it
was written from, and tensors stream one at a time (no state dict of the whole model on the host)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kiln.models.loader.load import load_model, safetensors_weights
from kiln.models.loader.random_checkpoint import INDEX_NAME, write_random_checkpoint


@pytest.fixture(scope="module")
def sharded_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # shards of ~40 kB: tiny-llama (~0.3 MB in bf16) spreads over several files
    return write_random_checkpoint("tiny-llama", tmp_path_factory.mktemp("ckpt") / "tiny", dtype=torch.bfloat16,
                                   seed=3, max_shard_bytes=40_000)


def test_sharded_checkpoint_has_an_index_over_every_shard(sharded_tiny: Path) -> None:
    index = json.loads((sharded_tiny / INDEX_NAME).read_text())
    files = sorted(p.name for p in sharded_tiny.glob("*.safetensors"))
    assert len(files) > 2 and sorted(set(index["weight_map"].values())) == files
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for _, t in safetensors_weights(sharded_tiny, torch.device("cpu")))


def test_checkpoint_loads_the_same_tensors_as_the_dummy_weights(sharded_tiny: Path) -> None:
    from_disk = load_model(str(sharded_tiny), device=torch.device("cpu"), dtype="bf16")
    in_memory = load_model("tiny-llama", device=torch.device("cpu"), dtype="bf16", seed=3)
    assert from_disk.model_dir == sharded_tiny and in_memory.model_dir is None
    disk_params = dict(from_disk.model.named_parameters())
    memory_params = dict(in_memory.model.named_parameters())
    assert disk_params.keys() == memory_params.keys()
    for name, param in memory_params.items():
        assert param.dtype == torch.bfloat16
        torch.testing.assert_close(disk_params[name], param, rtol=0, atol=0, msg=name)


def test_weights_stream_one_tensor_at_a_time(sharded_tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first tensor reaches the model before the second is read: the loader never holds the checkpoint."""
    import safetensors

    reads: list[str] = []
    real_open = safetensors.safe_open

    class CountingOpen:
        def __init__(self, *args, **kwargs) -> None:
            self.inner = real_open(*args, **kwargs)

        def __enter__(self):
            self.handle = self.inner.__enter__()
            return self

        def __exit__(self, *exc) -> None:
            self.inner.__exit__(*exc)

        def keys(self):
            return self.handle.keys()

        def get_tensor(self, key: str) -> torch.Tensor:
            reads.append(key)
            return self.handle.get_tensor(key)

    monkeypatch.setattr(safetensors, "safe_open", CountingOpen)
    stream = safetensors_weights(sharded_tiny, torch.device("cpu"))
    first, _ = next(stream)
    assert reads == [first]
    rest = [name for name, _ in stream]
    assert reads == [first, *rest] and len(rest) > 1


def test_staged_upload_reads_every_tensor_exactly(tmp_path: Path):
    """The GPU read path (header parsed here, tensors grouped up to a staging buffer, each span read by
    several threads with preadv) returns what safetensors itself reads: a tensor larger than a buffer goes
    up in pieces, an fp32 tensor packed after an odd-sized fp8 one is realigned, empty and scalar tensors
    survive. On the CPU the same code runs without pinning or events."""
    from safetensors.torch import load_file, save_file

    from kiln.models.loader import staged_upload
    from kiln.models.loader.staged_upload import StagedUploader

    tensors = {"a_big": torch.randn(37, 50), "b_bf16": torch.randn(3, 4).to(torch.bfloat16),
               "c_fp8": torch.randn(3, 3).to(torch.float8_e4m3fn), "d_scale": torch.randn(5),
               "e_int": torch.arange(100, dtype=torch.int64), "f_empty": torch.empty(0, 3),
               "g_scalar": torch.tensor(2.5)}
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    reference = load_file(str(path))
    # a 1 KiB buffer splits a_big (7.4 kB) into pieces; 64-byte thread pieces split every span
    for threads, piece in ((1, 1 << 20), (3, 64)):
        staged_upload._MIN_PIECE_BYTES, saved = piece, staged_upload._MIN_PIECE_BYTES
        uploader = StagedUploader(torch.device("cpu"), buffer_bytes=1024, threads=threads)
        try:
            got = dict(uploader.tensors(path))
        finally:
            uploader.close()
            staged_upload._MIN_PIECE_BYTES = saved
        assert set(got) == set(reference)
        for name, ref in reference.items():
            assert got[name].dtype == ref.dtype and got[name].shape == ref.shape, name
            assert torch.equal(got[name].reshape(-1).view(torch.uint8), ref.reshape(-1).view(torch.uint8)), name


def test_staged_upload_names_an_unsupported_dtype(tmp_path: Path):
    from kiln.models.loader.staged_upload import read_header

    header = json.dumps({"w": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}).encode()
    path = tmp_path / "odd.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + b"\0")
    with pytest.raises(ValueError, match="'w' has dtype F4"):
        read_header(path)


