"""Inductor's torch_key remembered under the cache root (kiln/cache/torch_key.py): stored once, then handed to
Inductor instead of walking torch's sources; keyed by the files it covers; passed to compile workers."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from kiln.cache.torch_key import TORCH_KEY_DIR, torch_fingerprint

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str, cache_dir: Path, timeout: float = 600) -> str:
    """Run `code` in a fresh interpreter (Inductor's memo starts empty) with the cache at `cache_dir`."""
    env = {**os.environ, "KILN_CACHE_DIR": str(cache_dir), "PYTHONPATH": str(ROOT)}
    env.pop("KILN_DISABLE_COMPILE_CACHE", None)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_the_stored_key_replaces_the_walk(tmp_path: Path) -> None:
    first = _python("""
        from torch._inductor import codecache
        from kiln.cache.torch_key import prime_torch_key
        value = prime_torch_key()
        assert value == codecache.torch_key()
        print(value.hex())
    """, tmp_path)
    stored = list((tmp_path / TORCH_KEY_DIR).glob("*.bin"))
    assert len(stored) == 1 and stored[0].read_bytes().hex() == first
    # the next process reads it: Inductor's walk must not run (it would raise), and its memo holds the file's
    # bytes (a planted value shows that they come from the file, not from a recomputation)
    stored[0].write_bytes(b"k" * 32)
    second = _python("""
        from torch._inductor import codecache
        def no_walk(*args, **kwargs):
            raise AssertionError("torch_key walked torch's sources")
        codecache.build_code_hash = no_walk
        from kiln.cache.torch_key import prime_torch_key, primed
        assert prime_torch_key() == codecache.torch_key() == primed()
        print(codecache.torch_key().hex())
    """, tmp_path)
    assert bytes.fromhex(second) == b"k" * 32


def test_fingerprint_follows_module_files_only(tmp_path: Path) -> None:
    package = tmp_path / "torch"
    (package / "_inductor").mkdir(parents=True)
    (package / "__pycache__").mkdir()
    (package / "_inductor" / "codecache.py").write_text("x = 1\n")
    (package / "_C.so").write_bytes(b"\0")
    before = torch_fingerprint(package)
    (package / "__pycache__" / "codecache.cpython-311.pyc").write_bytes(b"compiled")
    (package / "README.txt").write_text("not a module")
    assert torch_fingerprint(package) == before  # bytecode and other files are not what torch_key reads
    (package / "_inductor" / "codecache.py").write_text("x = 22\n")  # an edited module: size and mtime
    edited = torch_fingerprint(package)
    assert edited != before
    stat = (package / "_C.so").stat()
    os.utime(package / "_C.so", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a rebuilt extension
    assert torch_fingerprint(package) != edited
