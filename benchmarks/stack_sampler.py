"""A sampling profiler for one thread: where its wall time goes, waits included, at ~1% overhead.

cProfile instruments every call and distorted start-up by 20-30% (docs/BENCHMARKS.md, seventh session); this
samples the thread's stack every `interval` seconds from a daemon thread instead. Each sample counts once
for every distinct function on the stack (inclusive) and once for the innermost frame (self), so a
function's share is the fraction of wall time it was running or waiting below. The sampler needs the GIL:
a C call that holds it for long (no Python frame of its own) delays the next sample, so such stretches are
under-counted and the time is spread over the samples around them; compare large shares, not small ones.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from types import FrameType


def _label(frame: FrameType) -> str:
    code = frame.f_code
    path = code.co_filename
    for marker in ("site-packages/", "/kiln/", "/benchmarks/", "/lib/python"):
        if marker in path:
            path = path[path.index(marker) + len(marker):]
            break
    return f"{path}:{code.co_firstlineno}({code.co_name})"


class StackSampler:
    def __init__(self, thread: threading.Thread | None = None, interval: float = 0.005) -> None:
        self.target = (thread or threading.current_thread()).ident
        self.interval = interval
        self.samples = 0
        self.inclusive: collections.Counter[str] = collections.Counter()
        self.leaf: collections.Counter[str] = collections.Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kiln-stack-sampler", daemon=True)

    def __enter__(self) -> StackSampler:
        self.started = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.seconds = time.perf_counter() - self.started

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            frame = sys._current_frames().get(self.target)
            if frame is None:
                continue
            self.samples += 1
            self.leaf[_label(frame)] += 1
            seen = set()
            while frame is not None:
                seen.add(_label(frame))
                frame = frame.f_back
            self.inclusive.update(seen)

    def report(self, top: int = 70) -> str:
        """The `top` functions by inclusive share, then by self share, as seconds of the sampled wall time."""
        scale = self.seconds / max(self.samples, 1)
        lines = [f"{self.samples} samples over {self.seconds:.2f} s (every {self.interval * 1e3:.0f} ms)",
                 "", "inclusive s  function"]
        lines += [f"{n * scale:11.2f}  {name}" for name, n in self.inclusive.most_common(top)]
        lines += ["", "self s       function"]
        lines += [f"{n * scale:11.2f}  {name}" for name, n in self.leaf.most_common(top // 2)]
        return "\n".join(lines)
