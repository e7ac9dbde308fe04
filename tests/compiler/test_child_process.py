"""kiln's worker processes (kiln/compiler/child_process.py, process_pool.py): calls run in another process and
their results and exceptions come back; `terminate` fails a running call at once; the child imports kiln from
where the parent did, never from its working directory."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import pytest

import kiln
from kiln.compiler.process_pool import WorkerPool


def _kiln_location() -> str:
    import kiln as imported

    return imported.__file__


def test_calls_results_exceptions_and_terminate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a `kiln` package in the working directory that would break the child if it imported that one
    (tmp_path / "kiln").mkdir()
    (tmp_path / "kiln" / "__init__.py").write_text("raise ImportError('the wrong kiln')\n")
    monkeypatch.chdir(tmp_path)
    pool = WorkerPool(1, "kiln-test", initializer=time.sleep, initargs=(0,))
    try:
        pid = pool.submit(os.getpid)
        where = pool.submit(_kiln_location)
        fails = pool.submit(math.sqrt, -1)
        assert pid.result(timeout=120) not in (os.getpid(), None)
        assert where.result(timeout=120) == kiln.__file__
        assert isinstance(fails.exception(timeout=120), ValueError)
        assert pool.submit(math.factorial, 5).result(timeout=120) == 120
        running = pool.submit(time.sleep, 60)
        queued = pool.submit(time.sleep, 60)
        while not running.running():
            time.sleep(0.01)
        start = time.monotonic()
        pool.terminate()
        assert isinstance(running.exception(timeout=30), ChildProcessError)
        assert queued.cancelled() and time.monotonic() - start < 30  # not the minute the calls would take
        assert [p.is_alive() for p in pool.processes] == [False]
        with pytest.raises(RuntimeError, match="shut down"):
            pool.submit(os.getpid)
    finally:
        pool.terminate()
