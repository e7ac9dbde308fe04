"""Inductor's write_atomic, replaced (kiln/cache/inductor_writes.py): a file that holds the bytes is left alone,
any other write still happens, in every module that bound the function."""

from __future__ import annotations

from pathlib import Path

from torch._functorch._aot_autograd import autograd_cache
from torch._inductor import codecache

from kiln.cache import inductor_writes


def test_only_unchanged_files_are_left_alone(tmp_path: Path) -> None:
    inductor_writes.skip_unchanged_writes()
    assert autograd_cache.write_atomic is codecache.write_atomic  # bound by name there: replaced too
    path = tmp_path / "entry"
    codecache.write_atomic(str(path), b"first")
    inode, skipped = path.stat().st_ino, inductor_writes.skipped
    codecache.write_atomic(str(path), b"first")
    assert path.stat().st_ino == inode and inductor_writes.skipped == skipped + 1
    for content in (b"other", b"longer bytes"):  # same size, then another size: written
        codecache.write_atomic(str(path), content)
        assert path.read_bytes() == content
    codecache.write_atomic(str(path), "longer bytes")  # text: always written (a new file)
    assert path.read_text() == "longer bytes" and path.stat().st_ino != inode
    codecache.write_atomic(str(tmp_path / "new" / "entry"), b"x", make_dirs=True)  # Inductor's arguments pass on
    assert (tmp_path / "new" / "entry").read_bytes() == b"x"
    assert inductor_writes.skipped == skipped + 1
