"""The compile-cache key: a sha256 over everything that can change what Inductor produces for a piece.

A stale hit would run code compiled for a different model, config or torch: silently wrong. A spurious
miss only costs one cold start. So the key errs towards inclusion, with one exception: anything that
names a *place* (HOME, the cache dir, the model dir, a dump dir) is excluded, so a moved checkout or a CI
runner with another HOME still hits. The factors are written beside the artifacts so a miss can be
explained by diffing two `cache_key_factors.json` files.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

KEY_VERSION = 1  # bump when the layout or the artifact format changes meaning
KILN_ROOT = Path(__file__).resolve().parent.parent
# The code Dynamo traces or that shapes what is compiled: the model definitions, the compiler, the passes.
TRACED_PACKAGES = ("models", "compiler", "passes")
# Environment switches that change what is compiled (kiln/models/dense_gemm.py: whether projections go through
# kiln::dense_gemm at all; kiln/models/gemv.py: which weights the rmsnorm_gemm pass rewrites for).
TRACED_ENVIRONMENT = ("KILN_BF16_TRITON_MAX_M", "KILN_GEMV", "KILN_GEMV_MAX_BYTES")
# Resolved CompilationConfig fields that do not change compiled code (diagnostics, paths, compile workers).
EXCLUDED_COMPILATION_FIELDS = frozenset({"debug_dump_path", "debug_check_graph_inputs", "compile_workers"})


def environment_factors(device: torch.device | str) -> dict[str, Any]:
    device = torch.device(device)
    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    factors: dict[str, Any] = {"torch": torch.__version__, "triton": triton_version,
                               "python": platform.python_version(), "machine": platform.machine(),
                               "traced_environment": {name: os.environ.get(name) for name in TRACED_ENVIRONMENT}}
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        factors["device"] = torch.cuda.get_device_name(index)
        factors["capability"] = list(torch.cuda.get_device_capability(index))
        factors["cuda"] = torch.version.cuda
    else:
        # CPU artifacts are C++ built for this ISA; loading AVX512 code on an AVX2 host would crash
        factors["device"] = "cpu"
        factors["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    return factors


def traced_source_digest(root: Path = KILN_ROOT, packages: Iterable[str] = TRACED_PACKAGES) -> str:
    """sha256 over the *contents* of the traced packages' sources, named relative to `root`."""
    digest = hashlib.sha256()
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            digest.update(path.relative_to(root).as_posix().encode())
            digest.update(b"\0")
            digest.update(path.read_bytes())
            digest.update(b"\0")
    return digest.hexdigest()


def inductor_config_digest(patches: Mapping[str, Any] | None = None) -> str:
    """Inductor's global config (portable subset) plus kiln's patches, with the pass hook as its uuid."""
    import torch._inductor.config as inductor_config

    config = dict(inductor_config.save_config_portable())
    for name, value in (patches or {}).items():
        uuid = getattr(value, "uuid", None)
        config[name] = uuid() if callable(uuid) else value
    return hashlib.sha256(json.dumps(_plain(config), sort_keys=True).encode()).hexdigest()


def compilation_factors(config: Any) -> dict[str, Any]:
    fields = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(config)
    return {k: _plain(v) for k, v in sorted(fields.items()) if k not in EXCLUDED_COMPILATION_FIELDS}


def key_factors(*, spec: Any, dtype: torch.dtype | str, compilation: Any, max_num_tokens: int,
                device: torch.device | str, attention_backend: str, pass_uuid: str | None,
                inductor_patches: Mapping[str, Any] | None = None, tp_size: int = 1,
                source_root: Path = KILN_ROOT) -> dict[str, Any]:
    """Every factor, as plain JSON. `spec` is a kiln.models.base.ModelSpec (a dataclass)."""
    return {
        "key_version": KEY_VERSION,
        "environment": environment_factors(device),
        "model": _plain(dataclasses.asdict(spec) if dataclasses.is_dataclass(spec) else spec),
        "dtype": str(dtype),
        "compilation": compilation_factors(compilation),
        "max_num_tokens": int(max_num_tokens),
        "tp_size": int(tp_size),
        "attention_backend": attention_backend,
        "pass_uuid": pass_uuid,
        "traced_source": traced_source_digest(source_root),
        "inductor_config": inductor_config_digest(inductor_patches),
    }


def cache_key(factors: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()[:32]


def _plain(value: Any) -> Any:
    """JSON-stable form. Unknown objects become their type name: a repr could hold a memory address,
    which would make every process compute a different key."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_plain(v) for v in value]
        return sorted(items, key=repr) if isinstance(value, (set, frozenset)) else items
    if isinstance(value, torch.dtype):
        return str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain(dataclasses.asdict(value))
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


if __name__ == "__main__":  # print this environment's factors (debugging a CI miss)
    json.dump(environment_factors(sys.argv[1] if len(sys.argv) > 1 else "cpu"), sys.stdout, indent=2)
