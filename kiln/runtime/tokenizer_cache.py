"""The loaded tokenizer, kept pickled under the cache root, so a later start skips AutoTokenizer's resolution.

`AutoTokenizer.from_pretrained` picks the tokenizer class from the model's config, and loading that config
imports transformers' model-configuration modules and through them `torch.distributed.tensor` and FSDP: on this
project's CPU machine 1.8 s and ~700 modules for the embedded model, against 0.6 s to unpickle the object it
returned (which imports only its own class's modules). The load runs on a thread beside the model's load and
compile (tokenizer_load.py), but imports hold the GIL: a warm start of the embedded model's shape took 3.9 s to
ready without a tokenizer and 5.7 s with one (docs/startup.md).

The pickle is named by a digest of transformers' and tokenizers' versions, the source directory's path and the
contents of every file in it but the weights (config.json included: the class depends on `model_type`), so it is
the object AutoTokenizer built from the same inputs. An unreadable pickle is deleted and the tokenizer loaded
again; one that cannot be written (an unpicklable tokenizer, a read-only cache) only costs the next start the
load. KILN_DISABLE_COMPILE_CACHE turns it off with the compile cache; `kiln cache clear` removes it.
"""

from __future__ import annotations

import hashlib
import logging
import pickle
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from kiln.cache import cache_disabled, cache_root
from kiln.cache.store import TOKENIZER_DIR, atomic_write

logger = logging.getLogger("kiln")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5", ".ckpt")
MAX_FILE_BYTES = 256 << 20  # larger files are weights in some other format, never tokenizer data


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "absent"


def tokenizer_digest(source: Path) -> str:
    """What AutoTokenizer's result depends on: the libraries, the directory and its non-weight files."""
    digest = hashlib.sha256(f"{_version('transformers')}\n{_version('tokenizers')}\n{source.resolve()}\n".encode())
    for path in sorted(source.iterdir()):
        if path.is_file() and not path.name.endswith(WEIGHT_SUFFIXES) and path.stat().st_size <= MAX_FILE_BYTES:
            digest.update(f"{path.name}\n".encode())
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:32]


def cached_tokenizer(source: Path, load: Callable[[], Any]) -> Any:
    """The tokenizer `load()` returns for the directory `source`, from the cache when it holds one."""
    if cache_disabled() or not source.is_dir():
        return load()
    path = cache_root() / TOKENIZER_DIR / f"{tokenizer_digest(source)}.pkl"
    try:
        return pickle.loads(path.read_bytes())  # noqa: S301 - written by kiln under the user's cache root
    except FileNotFoundError:
        pass
    except Exception as exc:  # noqa: BLE001 - a damaged or stale pickle means "load it again", never a failure
        logger.warning("discarding cached tokenizer %s (%s)", path.name, exc)
        path.unlink(missing_ok=True)
    tokenizer = load()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, pickle.dumps(tokenizer))
    except Exception as exc:  # noqa: BLE001 - not cached: the next start loads it again
        logger.info("tokenizer not cached (%s)", exc)
    return tokenizer
