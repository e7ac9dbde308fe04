"""Where an offline run's wall time goes, step by step: prefill-carrying steps vs decode-only steps by batch.

Wraps `engine._launch` for the duration of a run and records each launch's time and batch composition.
With async scheduling a launch happens once the previous step's tokens are processed, so the interval
between two launches is one step's cost in the steady state (the GPU's or the host's, whichever bounds).
"""

from __future__ import annotations

import time
from typing import Any

DECODE_BUCKETS = ((1, 8), (9, 32), (33, 64), (65, 128), (129, 256), (257, 1 << 20))


class StepTimeline:
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.records: list[tuple[float, int, int]] = []  # (launch time, prefill tokens, decode rows)

    def __enter__(self) -> StepTimeline:
        launch = self.engine._launch

        def timed_launch(sched):
            prefill = sum(n for n in sched.num_new_tokens if n > 1)
            decodes = sum(1 for n in sched.num_new_tokens if n == 1)
            self.records.append((time.perf_counter(), prefill, decodes))
            return launch(sched)

        self.engine._launch = timed_launch
        return self

    def __exit__(self, *exc: object) -> None:
        del self.engine._launch  # back to the class's method
        self.end = time.perf_counter()

    def summary(self) -> dict[str, Any]:
        """Seconds and steps per kind; the last step's interval runs to the end of the run."""
        times = [r[0] for r in self.records] + [self.end]
        kinds: dict[str, dict[str, float]] = {}
        for (start, prefill, decodes), stop in zip(self.records, times[1:]):
            if prefill:
                kind = "prefill-carrying"
            else:
                low, high = next(b for b in DECODE_BUCKETS if b[0] <= decodes <= b[1])
                kind = f"decode {low}-{high}"
            row = kinds.setdefault(kind, {"steps": 0, "seconds": 0.0, "prefill_tokens": 0, "decode_tokens": 0})
            row["steps"] += 1
            row["seconds"] += stop - start
            row["prefill_tokens"] += prefill
            row["decode_tokens"] += decodes
        for row in kinds.values():
            row["ms_per_step"] = 1e3 * row["seconds"] / row["steps"]
        return kinds
