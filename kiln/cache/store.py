"""The on-disk artifact store: `$KILN_CACHE_DIR/compile/<key>/rank_<r>/`, one file per (piece, range|size).

Each artifact file is `MAGIC`, one JSON header line (format version, payload size and sha256), then the
bytes of Inductor's binary `CompiledArtifact`. Header and payload live in one file, written to a temp
name and `os.replace`d, so a reader sees either nothing or a complete, self-checking file; a truncated,
garbage or incompatible one is logged, deleted and reported as a miss (the compiler then recompiles it),
never loaded and never fatal.

Concurrency: the first process to find a key not ready takes the directory's file lock and fills it;
others wait for it (then find it ready and only load), or, past `lock_timeout`, compile privately,
still loading what is there and writing atomically. The `ready` marker is written last.

While kiln compiles, Inductor's own cache (generated code, built C++ libraries, FX graph cache) and the
Triton kernel cache are pointed under the key directory (`inductor/`, `triton/`), so a warm start needs
nothing outside `$KILN_CACHE_DIR`: loading an artifact on another host, or after /tmp was cleaned, finds
the built kernels beside it instead of rebuilding them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

logger = logging.getLogger("kiln.cache")

FORMAT_VERSION = 1
MAGIC = b"KILNART1\n"
ARTIFACT_SUFFIX = ".kart"
READY = "ready.json"
SPLIT_GRAPH = "split_graph.txt"
FACTORS = "cache_key_factors.json"
PEAK_DIR = "kv_peak"  # under the cache root: remembered KV-profiling peaks (kiln/runtime/kv/peak_cache.py)
TOKENIZER_DIR = "tokenizers"  # under the cache root: loaded tokenizers, pickled (kiln/runtime/tokenizer_cache.py)
CAPTURE = "captured_graph.bin"  # the split graph and its input sources: lets a warm start skip Dynamo
LOCK = ".lock"
ARTIFACT_HASH_CHARS = 32  # of a piece's structural hash in its artifact names (and in split_graph.txt)
DEFAULT_LOCK_TIMEOUT = 1800.0  # a cold -O3 start of a large model can take this long


class CorruptArtifact(Exception):
    """An artifact file that must not be loaded; the message says why."""


def cache_root() -> Path:
    return Path(os.environ.get("KILN_CACHE_DIR") or Path.home() / ".cache" / "kiln")


def compile_root(root: Path | None = None) -> Path:
    return (root or cache_root()) / "compile"


def cache_disabled() -> bool:
    return os.environ.get("KILN_DISABLE_COMPILE_CACHE", "").strip().lower() in ("1", "true", "yes", "on")


def switched_off(knob: str) -> bool:
    """One of the start-up memos' A/B knobs set to 0 (`KILN_TORCH_KEY_MEMO=0`, ...): Inductor's or Triton's own way."""
    return os.environ.get(knob, "1").strip() == "0"


def atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def pack(payload: bytes) -> bytes:
    header = {"format": FORMAT_VERSION, "size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    return MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n" + payload


def unpack(data: bytes) -> bytes:
    """The payload of a packed artifact; CorruptArtifact with the reason if it cannot be trusted."""
    if not data.startswith(MAGIC):
        raise CorruptArtifact("bad magic (not a kiln artifact, or overwritten)")
    end = data.find(b"\n", len(MAGIC))
    if end < 0:
        raise CorruptArtifact("truncated header")
    try:
        header = json.loads(data[len(MAGIC):end])
    except ValueError as exc:
        raise CorruptArtifact(f"unreadable header ({exc})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT_VERSION:
        raise CorruptArtifact(f"format {header.get('format') if isinstance(header, dict) else '?'}, "
                              f"expected {FORMAT_VERSION}")
    payload = data[end + 1:]
    if len(payload) != header.get("size"):
        raise CorruptArtifact(f"truncated: {len(payload)} of {header.get('size')} bytes")
    if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        raise CorruptArtifact("checksum mismatch")
    return payload


def verify_file(path: Path) -> str | None:
    """None if the artifact file is sound, else why not."""
    try:
        unpack(path.read_bytes())
    except (CorruptArtifact, OSError) as exc:
        return str(exc)
    return None


def artifact_name(piece_hash: str, key: Any) -> str:
    return f"{piece_hash[:ARTIFACT_HASH_CHARS]}_{key}{ARTIFACT_SUFFIX}"


class CompileCacheStore:
    """kiln.compiler.inductor.ArtifactStore over one key's rank directory; counts hits, saves, recoveries."""

    def __init__(self, key_dir: Path, rank: int = 0, factors: dict[str, Any] | None = None,
                 lock_timeout: float = DEFAULT_LOCK_TIMEOUT) -> None:
        self.key_dir = Path(key_dir)
        self.dir = self.key_dir / f"rank_{rank}"
        self.factors = factors
        self.lock_timeout = lock_timeout
        self.hits = self.saves = self.recovered = 0
        self.mode = "closed"  # "read" (ready: load only), "write" (we hold the lock), "private"
        self.cold_seconds: float | None = None  # the compile phase of the start that filled this key
        self._lock = FileLock(str(self.dir / LOCK))

    @property
    def key(self) -> str:
        return self.key_dir.name

    @property
    def ready(self) -> bool:
        return (self.dir / READY).is_file()

    def begin(self) -> None:
        """Before the first load: become the writer, wait for one, or (after the timeout) go private."""
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.factors is not None and not (self.key_dir / FACTORS).exists():
            atomic_write(self.key_dir / FACTORS, json.dumps(self.factors, indent=2, sort_keys=True).encode())
        if self._read_ready():
            self.mode = "read"
            return
        start = time.perf_counter()
        try:
            self._lock.acquire(timeout=self.lock_timeout)
        except Timeout:
            logger.warning("compile cache %s: another process has held the lock for %.0f s; compiling "
                           "privately", self.key[:12], self.lock_timeout)
            self.mode = "private"
            return
        if self._read_ready():  # another process filled it while we waited
            self._lock.release()
            logger.info("compile cache %s: waited %.1f s for another process to fill it", self.key[:12],
                        time.perf_counter() - start)
            self.mode = "read"
            return
        self.mode = "write"

    def load(self, piece_hash: str, key: Any) -> Any:
        if self.mode == "closed":
            self.begin()
        path = self.dir / artifact_name(piece_hash, key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            artifact = artifact_from_bytes(unpack(data), self.dir)
        except Exception as exc:  # noqa: BLE001 - any failure to load means "recompile", never "crash"
            logger.warning("compile cache %s: discarding artifact %s (%s); recompiling", self.key[:12],
                           path.name, exc)
            path.unlink(missing_ok=True)
            (self.dir / READY).unlink(missing_ok=True)  # incomplete again until this start re-marks it
            self.recovered += 1
            return None
        self.hits += 1
        return artifact

    def load_payload(self, piece_hash: str, key: Any) -> bytes | None:
        """An artifact's checked bytes, not loaded into Inductor (None if absent or damaged): for a thread
        that must not touch Inductor (background compiles)."""
        try:
            return unpack((self.dir / artifact_name(piece_hash, key)).read_bytes())
        except (OSError, CorruptArtifact):
            return None

    def save(self, piece_hash: str, key: Any, artifact: Any) -> None:
        if getattr(artifact, "save", None) is None:  # compile_fx fallback (old torch): nothing portable to store
            return
        try:
            payload = artifact_to_bytes(artifact, self.dir)
        except Exception as exc:  # noqa: BLE001 - a cache that cannot write must not stop start-up
            logger.warning("compile cache %s: could not save %s for %s (%s)", self.key[:12], piece_hash[:12],
                           key, exc)
            return
        self.save_payload(piece_hash, key, payload)

    def save_payload(self, piece_hash: str, key: Any, payload: bytes) -> None:
        """An artifact already serialized (`artifact_to_bytes`, e.g. by a compile worker process)."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            atomic_write(self.dir / artifact_name(piece_hash, key), pack(payload))
        except Exception as exc:  # noqa: BLE001 - a cache that cannot write must not stop start-up
            logger.warning("compile cache %s: could not save %s for %s (%s)", self.key[:12], piece_hash[:12],
                           key, exc)
            return
        self.saves += 1

    def load_capture(self) -> bytes | None:
        """The saved captured graph of a ready key (None otherwise); a damaged one is deleted, not used."""
        if self.mode == "closed":
            self.begin()
        path = self.dir / CAPTURE
        if self.mode != "read" or not path.is_file():
            return None
        try:
            return unpack(path.read_bytes())
        except Exception as exc:  # noqa: BLE001 - fall back to tracing, never to a wrong graph
            logger.warning("compile cache %s: discarding %s (%s); tracing with Dynamo", self.key[:12], CAPTURE, exc)
            path.unlink(missing_ok=True)
            return None

    def finish(self, split_graph: Callable[[], str] | None = None, compile_seconds: float | None = None,
               capture: bytes | None = None) -> None:
        """After warm-up: record the split graph (its text, made only if written; `capture` for warm starts)
        and mark the key ready (if we wrote), release the lock."""
        try:
            if capture is not None and self.mode != "closed" and not (self.dir / CAPTURE).is_file():
                atomic_write(self.dir / CAPTURE, pack(capture))  # also replaces one found damaged on a hit
            if self.mode in ("write", "private") or (self.recovered and not self.ready):
                if split_graph is not None:
                    atomic_write(self.dir / SPLIT_GRAPH, split_graph().encode())
                marker = {"format": FORMAT_VERSION, "created": time.time(), "cold_seconds": compile_seconds,
                          "artifacts": sorted(p.name for p in self.dir.glob(f"*{ARTIFACT_SUFFIX}"))}
                atomic_write(self.dir / READY, json.dumps(marker, indent=2).encode())
        finally:
            self.close()

    @contextmanager
    def own_caches(self) -> Iterator[None]:
        """Inductor's and Triton's caches under this key's directory for the duration (restored after)."""
        from torch._inductor.utils import clear_caches

        saved = {name: os.environ.get(name) for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(self.key_dir / "inductor")
        os.environ["TRITON_CACHE_DIR"] = str(self.key_dir / "triton")
        clear_caches()  # Inductor memoises its cache paths
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            clear_caches()

    def close(self) -> None:
        if self.mode == "write" and self._lock.is_locked:
            self._lock.release()
        self.mode = "closed"

    def _read_ready(self) -> bool:
        try:
            marker = json.loads((self.dir / READY).read_text())
        except (OSError, ValueError):
            return False
        self.cold_seconds = marker.get("cold_seconds")
        return marker.get("format") == FORMAT_VERSION


def artifact_to_bytes(artifact: Any, where: Path | None = None) -> bytes:
    """Inductor's binary `CompiledArtifact` format (the kernels it built are bundled in it)."""
    with tempfile.TemporaryDirectory(dir=where, prefix=".save.") as tmp:
        out = Path(tmp) / "artifact.bin"
        artifact.save(path=str(out), format="binary")
        return out.read_bytes()


def artifact_from_bytes(payload: bytes, where: Path | None = None) -> Any:
    from torch._inductor import CompiledArtifact

    with tempfile.TemporaryDirectory(dir=where, prefix=".load.") as tmp:
        path = Path(tmp) / "artifact.bin"
        path.write_bytes(payload)
        return CompiledArtifact.load(path=str(path), format="binary")
