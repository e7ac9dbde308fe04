"""Where start-up time goes: one record of every phase from `Engine(...)` to ready, and its one-line summary.

Phases, in the order a start runs them (docs/startup.md):
  load       weights from the checkpoint (or random weights) onto the device; on a GPU they stream in beside
             trace and compile, and only the wait for them afterwards counts here
  trace      Dynamo's capture of the model (0 on a warm start: the split graph comes from the cache)
  compile    the rest of the compile phase: Inductor compiles or cache loads, and a test forward per range
  kv         KV cache sizing (on a GPU, a profiling forward at the full token budget) and allocation
  capture    CUDA graph capture at every capture size
  tokenizer  the wait for the tokenizer, loaded on a thread since the engine's start (0 for a preset)
`total` is wall time from the engine's start to ready; what no phase covers (tensor-parallel spawn,
scheduler set-up) is `other`, so the phases never add up to more than the total.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch

PHASES = ("load", "tokenizer", "trace", "compile", "kv", "capture")


@dataclass(frozen=True)
class StartupTimes:
    """Seconds per start-up phase (see the module docstring)."""

    total: float
    load: float = 0.0
    tokenizer: float = 0.0
    trace: float = 0.0
    compile: float = 0.0
    kv: float = 0.0
    capture: float = 0.0

    @property
    def other(self) -> float:
        return max(self.total - sum(getattr(self, p) for p in PHASES), 0.0)

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "other": self.other}

    def summary(self) -> str:
        """The start-up log line: `kiln ready in 12.3 s: load 4.1, tokenizer 0.2, trace 1.0, ...`."""
        phases = ", ".join(f"{p} {getattr(self, p):.1f}" for p in PHASES)
        return f"kiln ready in {self.total:.1f} s: {phases}, other {self.other:.1f}"


class StartupClock:
    """Times phases as they run (a phase may run in parts: times add up) and freezes them into StartupTimes.

    On a GPU each phase ends with a device synchronisation, so work a phase queued is counted in that
    phase and not in whichever one next waits for the device.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.started = time.perf_counter()
        self.seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name not in self.seconds:
            raise ValueError(f"unknown start-up phase {name!r}; phases: {', '.join(PHASES)}")
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.seconds[name] += time.perf_counter() - start

    def move(self, seconds: float, source: str, target: str) -> None:
        """Re-attribute seconds measured inside another phase (the trace runs inside the compile phase)."""
        seconds = min(seconds, self.seconds[source])
        self.seconds[source] -= seconds
        self.seconds[target] += seconds

    def finish(self) -> StartupTimes:
        return StartupTimes(total=time.perf_counter() - self.started, **self.seconds)
