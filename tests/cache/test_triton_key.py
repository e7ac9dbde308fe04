"""Triton's triton_key remembered under the cache root (kiln/cache/triton_key.py): computed and stored once, then
every binding of Triton's function returns the stored value, including modules imported afterwards and compile
workers."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.cache.triton_key import TRITON_KEY_DIR
from tests.cache.test_torch_key import _python

pytest.importorskip("triton")


def test_the_stored_key_replaces_the_hash(tmp_path: Path) -> None:
    first = _python("""
        import triton.runtime.cache as cache
        from kiln.cache.triton_key import prime_triton_key
        value = prime_triton_key()
        assert value == cache.triton_key()
        print(value)
    """, tmp_path)
    stored = list((tmp_path / TRITON_KEY_DIR).glob("*.txt"))
    assert len(stored) == 1 and stored[0].read_text() == first
    # the next process reads it: a planted value shows where the key comes from, in the modules bound before
    # priming (Triton's cache and autotuner) and in one imported after it (Inductor's triton_compat)
    stored[0].write_text("planted")
    second = _python("""
        import triton.runtime.autotuner as autotuner
        import triton.runtime.cache as cache
        from kiln.cache.triton_key import prime_triton_key, primed
        assert prime_triton_key() == primed() == "planted"
        from torch._inductor.runtime import triton_compat
        keys = [cache.triton_key(), autotuner.triton_key(), triton_compat.triton_key()]
        # a compile worker is handed the parent's value
        from kiln.compiler.parallel import _init_worker
        _init_worker({}, 1, None, "from the parent")
        print(*keys, cache.triton_key() == triton_compat.triton_key() == "from the parent")
    """, tmp_path)
    assert second == "planted planted planted True"
