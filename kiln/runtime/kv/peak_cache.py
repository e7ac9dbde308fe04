"""The profiling forward's activation peak, remembered across starts (docs/startup.md, "KV sizing").

On a GPU the KV budget is what is left after the weights and the activation peak of one eager forward at the
full token budget (profile.py). That forward measures the same number every time the same model starts the
same way: the allocations of one forward are a function of its tensors' shapes and dtypes and of the code that
runs it. So the peak is kept in kiln's cache directory under a key of everything it depends on, and a start
that finds it skips the forward (on the H200 the 8B warm KV phase fell from 3.4 to 0.2-0.5 s, of which about
1 s is a net gain: the rest was first-use work the compiled forward then pays; docs/startup.md):
- the model's parameters and buffers (names, shapes, dtypes: the architecture, a tensor-parallel rank's shard,
  the quantization);
- the token budget, max_model_len (how the budget is split into sequences), the attention layout and whether
  the profile runs attention;
- kiln's model, attention and KV-profiling sources, and torch, triton, CUDA and the GPU's name.
A file that cannot be read is measured again. KILN_DISABLE_COMPILE_CACHE turns this cache off with the compile
cache; `kiln cache clear` removes it with the artifacts.
"""

from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path

import torch

from kiln.attention.base import AttentionLayout
from kiln.cache import cache_disabled, cache_key, cache_root
from kiln.cache.key import environment_factors, traced_source_digest
from kiln.cache.store import PEAK_DIR, atomic_write
from kiln.runtime.kv.profile import profile_activation_peak

logger = logging.getLogger("kiln")

PEAK_VERSION = 2  # bump when the profiling forward changes what it measures
SOURCES = ("models", "attention", "runtime/kv")  # the code whose allocations the peak counts


def peak_key(model: torch.nn.Module, device: torch.device, num_tokens: int, layout: AttentionLayout,
             max_model_len: int, run_attention: bool = False) -> str:
    tensors = [(name, list(t.shape), str(t.dtype))
               for name, t in itertools.chain(model.named_parameters(), model.named_buffers())]
    factors = {"version": PEAK_VERSION, "environment": environment_factors(device), "tensors": tensors,
               "num_tokens": int(num_tokens), "max_model_len": int(max_model_len), "layout": repr(layout),
               "run_attention": run_attention, "source": traced_source_digest(packages=SOURCES)}
    return cache_key(factors)


def peak_path(key: str) -> Path:
    return cache_root() / PEAK_DIR / f"{key}.json"


def activation_peak(model: torch.nn.Module, device: torch.device, num_tokens: int, layout: AttentionLayout,
                    max_model_len: int, run_attention: bool = False) -> tuple[int, bool]:
    """(peak bytes, whether it came from the cache): the cached peak for this key, else the profiling
    forward's, saved for the next start."""
    if cache_disabled():
        return profile_activation_peak(model, device, num_tokens, layout, max_model_len, run_attention), False
    path = peak_path(peak_key(model, device, num_tokens, layout, max_model_len, run_attention))
    try:
        peak = json.loads(path.read_text())["peak_bytes"]
        if isinstance(peak, int) and peak >= 0:
            return peak, True
        logger.warning("ignoring %s: peak_bytes %r is not a byte count", path, peak)
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.warning("ignoring unreadable %s (%s): profiling again", path, exc)
    peak = profile_activation_peak(model, device, num_tokens, layout, max_model_len, run_attention)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps({"peak_bytes": peak}).encode())
    except OSError as exc:  # a read-only cache directory costs the next start a profile, nothing else
        logger.warning("could not save the activation peak to %s: %s", path, exc)
    return peak, False
