"""The decode table's gpt-fast-style anchor (benchmarks/bench_anchor.py) is a real Llama: on transformers' weights
its logits and greedy tokens are transformers' (CPU, fp32, eager: the benchmark compiles the same module)."""

from __future__ import annotations

import torch

from benchmarks.bench_anchor import AnchorLlama, Shape


def test_the_anchor_decodes_as_transformers(tiny_checkpoint) -> None:
    _, hf = tiny_checkpoint("tiny-llama")
    prompts = torch.tensor([[5, 17, 42, 7, 130], [99, 3, 250, 11, 64]])
    model = AnchorLlama(Shape.of(hf.config), batch=2, max_len=32, dtype=torch.float32, device="cpu")
    model.load_hf(hf.state_dict())
    with torch.no_grad():
        want_logits = hf(prompts).logits
        want = hf.generate(prompts, max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(prompts))
        logits = [model(prompts[:, p], torch.full((2,), p)) for p in range(prompts.shape[1])]  # the prompt, a step each
        tokens = [logits[-1].argmax(-1)]
        for p in range(prompts.shape[1], prompts.shape[1] + 7):
            tokens.append(model(tokens[-1], torch.full((2,), p)).argmax(-1))
    torch.testing.assert_close(torch.stack(logits, 1), want_logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(torch.stack(tokens, 1), want[:, prompts.shape[1]:])


def test_the_anchor_compiles_whole() -> None:
    """fullgraph=True: one graph a step (no break), the eager step's logits."""
    from kiln.models.loader.presets import preset_config

    eager = AnchorLlama(Shape.of(preset_config("tiny-llama")), 2, 16, torch.float32, "cpu").randomize()
    twin = AnchorLlama(eager.shape, 2, 16, torch.float32, "cpu")
    twin.load_state_dict(eager.state_dict())
    compiled = torch.compile(twin, fullgraph=True)
    for p in range(2):
        tokens, positions = torch.tensor([p, 3 * p + 1]), torch.full((2,), p)
        torch.testing.assert_close(compiled(tokens, positions), eager(tokens, positions), rtol=1e-5, atol=1e-5)
