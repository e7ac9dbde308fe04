"""The compiler's imports run on a thread beside a GPU start's weight load (runtime/compiler_imports.py): only
where the start compiles on a GPU, off by KILN_COMPILER_PREIMPORT=0, and they leave the modules imported."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kiln.runtime.compiler_imports import start_compiler_imports

CHECK = """
import sys, torch
from kiln.runtime.compiler_imports import MODULES, start_compiler_imports
assert not any(m in sys.modules for m in ("torch._dynamo", "sympy", "kiln.compiler")), "imported before the thread"
thread = start_compiler_imports(2, torch.device("cuda"))  # a device object needs no GPU
assert thread is not None and thread.name == "kiln-compiler-imports"
thread.join(120)
missing = [m for m in MODULES if m not in sys.modules]
assert not missing, missing
print("ok")
"""


def test_imports_the_compiler_stack_on_a_thread() -> None:
    # a fresh interpreter: this one imported the compiler long ago
    result = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


@pytest.mark.parametrize("level, device", [(0, "cuda"), (2, "cpu")])
def test_no_thread_without_a_compile_on_a_gpu(level: int, device: str) -> None:
    assert start_compiler_imports(level, torch.device(device)) is None


def test_switch_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_COMPILER_PREIMPORT", "0")
    assert start_compiler_imports(2, torch.device("cuda")) is None


def test_the_engine_joins_the_thread_before_its_compile_phase(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compile phase imports the same modules, and two threads importing that stack at once can hand one of
    them a half-initialised module (a KeyError: 'torch._dynamo' on the H200): the phase waits for the thread."""
    import threading
    import time

    from kiln import Runtime
    from kiln.runtime import engine as engine_module
    from kiln.runtime.worker import Worker

    finished = threading.Event()

    def slow_imports(level: int, device: torch.device) -> threading.Thread:
        thread = threading.Thread(target=lambda: (time.sleep(0.5), finished.set()))
        thread.start()
        return thread

    seen: list[bool] = []
    warm_up = Worker.warm_up

    def recording_warm_up(self: Worker) -> None:
        seen.append(finished.is_set())
        warm_up(self)

    monkeypatch.setattr(engine_module, "start_compiler_imports", slow_imports)
    monkeypatch.setattr(Worker, "warm_up", recording_warm_up)
    rt = Runtime("tiny-llama", load_format="dummy", device="cpu", level=0)
    rt.shutdown()
    assert seen == [True]
