"""Inductor's CPU vector-ISA checks remembered under the cache root (kiln/cache/vec_isa.py): a later process gets
the same ISAs without building or loading anything, a check the file does not record still runs, and a failed
check is never stored."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.cache.vec_isa import VEC_ISA_DIR
from tests.cache.test_torch_key import _python

# any check that runs fails: the child Python that loads the library cannot start
NO_PROBES = """
        import subprocess
        import sys
        from torch._inductor import cpu_vec_isa
        run = subprocess.run
        def failing_probe(command, *args, **kwargs):
            if command[0] == sys.executable:
                raise subprocess.CalledProcessError(1, command)
            return run(command, *args, **kwargs)
        subprocess.run = failing_probe
"""


def test_passed_checks_are_remembered(tmp_path: Path) -> None:
    first = _python("""
        from torch._inductor import cpu_vec_isa
        from kiln.cache.vec_isa import prime_vec_isa
        prime_vec_isa()
        print(" | ".join(str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()))
    """, tmp_path)
    if not first:
        pytest.skip("no vector ISA passed its check on this CPU")
    stored = list((tmp_path / VEC_ISA_DIR).glob("*.json"))
    assert len(stored) == 1
    passed = json.loads(stored[0].read_text())
    assert len(passed) >= 1
    # the next process: every probe would fail, yet the remembered checks give the same ISAs; a compile worker
    # handed the parent's file answers from it too
    second = _python(NO_PROBES + """
        from kiln.cache.vec_isa import prime_vec_isa, primed
        from kiln.compiler.parallel import _init_worker
        path = prime_vec_isa()
        assert path == primed()
        _init_worker({}, 1, None, None, path)  # remember_checks again: the same file, nothing replaced twice
        print(" | ".join(str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()))
    """, tmp_path)
    assert second == first
    # a check the file does not record runs (and fails here, so that ISA is gone), and its failure is not stored
    stored[0].write_text(json.dumps(passed[1:]))
    third = _python(NO_PROBES + """
        from kiln.cache.vec_isa import prime_vec_isa
        prime_vec_isa()
        print(" | ".join(str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()) or "none")
    """, tmp_path)
    assert third != first
    assert json.loads(stored[0].read_text()) == passed[1:]
