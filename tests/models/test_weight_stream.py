"""Weights streamed in on a thread (load_model(background=True), the GPU default): the loaders fill the
materialised parameters in place, so a graph traced or captured before the weights land stays valid; the
result equals a load in line; a load error surfaces at the wait; a runtime built that way generates the same
tokens."""

from __future__ import annotations

import time

import pytest
import torch

from kiln import Runtime, SamplingParams
from kiln.models.llama import LlamaForCausalLM
from kiln.models.loader.load import load_model
from kiln.runtime import worker
from tests.conftest import random_prompts

CPU = torch.device("cpu")


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_streamed_weights_fill_the_parameters_in_place(tiny_checkpoint, preset: str) -> None:
    path = str(tiny_checkpoint(preset)[0])
    streamed = load_model(path, device=CPU, dtype="fp32", background=True)
    assert streamed.weights is not None
    before = {n: (p, p.data_ptr()) for n, p in streamed.model.named_parameters(remove_duplicate=False)}
    assert not streamed.model.training  # set before the thread starts: Dynamo guards on it
    streamed.wait_for_weights()
    assert streamed.weights is None
    after = dict(streamed.model.named_parameters(remove_duplicate=False))
    assert after.keys() == before.keys()
    assert all(after[n] is p and after[n].data_ptr() == ptr for n, (p, ptr) in before.items())  # same tensors
    inline = load_model(path, device=CPU, dtype="fp32")
    assert inline.weights is None
    for name, p in inline.model.named_parameters(remove_duplicate=False):
        torch.testing.assert_close(after[name], p, rtol=0, atol=0)


def test_a_load_error_is_raised_at_the_wait(tiny_checkpoint, tmp_path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    source = tiny_checkpoint("tiny-llama")[0]
    broken = tmp_path / "broken"
    shutil.copytree(source, broken)
    for shard in broken.glob("*.safetensors"):
        tensors = load_file(shard)
        save_file({k: v for k, v in tensors.items() if "layers.0.mlp.down_proj" not in k}, shard)
    loaded = load_model(str(broken), device=CPU, dtype="fp32", background=True)
    with pytest.raises(ValueError, match="missing weights: .*layers.0.mlp.down_proj"):
        loaded.wait_for_weights()


def test_a_runtime_compiled_while_its_weights_stream_in(tiny_checkpoint, monkeypatch) -> None:
    path = str(tiny_checkpoint("tiny-llama")[0])
    options = dict(device="cpu", dtype="fp32", max_num_batched_tokens=64, max_num_seqs=4)
    prompts = random_prompts([5, 9, 3], 256, seed=11)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in Runtime(path, level=0, **options).generate(prompts, params)]
    monkeypatch.setattr(worker, "BACKGROUND_WEIGHT_DEVICES", frozenset({"cpu"}))
    fill = LlamaForCausalLM.load_weights

    def late_fill(self, weights):  # the weights land well after the trace has started
        time.sleep(1.5)
        return fill(self, weights)

    monkeypatch.setattr(LlamaForCausalLM, "load_weights", late_fill)
    streamed = Runtime(path, level=1, **options)  # traced and compiled while the weights stream in
    assert streamed.engine.loaded.weights is None  # waited for before the KV cache
    assert [o.outputs[0].token_ids for o in streamed.generate(prompts, params)] == expected
