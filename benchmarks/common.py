"""What the benchmark scripts share: the stamp and tables they print, the GPU's ceilings and a decode step's
floor measured in the same run, decode-step timing, the offline workload with its step timeline, and a
sampling profiler for start-up.

Every entry point imports from here (and from kiln); nothing here imports an entry point.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import platform
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch

from kiln import SamplingParams

PROMPT_LEN = 128  # decode benchmarks: the prompt each request prefills before its timed steps


def stamp() -> str:
    """Date, device and commit, printed above every table so results can be filed as measured."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=False).stdout.strip() or "?"
    except OSError:
        commit = "?"
    if torch.cuda.is_available():
        device = torch.cuda.get_device_name()
    else:
        device = f"CPU ({platform.processor() or 'x86_64'}, {torch.get_num_threads()} threads)"
    return f"{datetime.date.today().isoformat()} | {device} | torch {torch.__version__} | commit {commit}"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


# -- the GPU's ceilings and a decode step's floor ------------------------------------------------------------
@dataclass
class Ceilings:
    copy_bytes_per_s: float
    matmul_flops_per_s: float


def measure_ceilings() -> Ceilings:
    """This GPU's device-to-device copy bandwidth and bf16 matmul rate, measured now (floors use them)."""
    n = 1 << 30  # 1 GiB each way: well past L2
    src = torch.randn(n // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    copy = 2 * n * 10 / (start.elapsed_time(end) / 1000)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    torch.cuda.synchronize()
    flops = 2 * 8192**3 * 10 / (start.elapsed_time(end) / 1000)
    del src, dst, a, b
    torch.cuda.empty_cache()
    return Ceilings(copy, flops)


def no_ceilings() -> Ceilings:
    """A CPU run: no measured ceilings, so no floors or roofline (NaN propagates into the tables)."""
    return Ceilings(float("nan"), float("nan"))


def weight_bytes(rt: Any) -> int:
    """Bytes of this rank's weights (each shared tensor once)."""
    params = {id(p): p for p in rt.engine.model.parameters()}.values()
    return sum(p.numel() * p.element_size() for p in params)


def decode_step_bytes(weights: int, batch: int, layers: int, kv_heads: int, head_dim: int,
                      prompt_len: int = PROMPT_LEN) -> int:
    """Bytes one decode step reads on one GPU: its weights once + each request's keys and values (16-bit) over
    its prompt and 16 tokens more."""
    return weights + batch * (prompt_len + 16) * 2 * layers * kv_heads * head_dim * 2


def decode_floor_seconds(rt: Any, batch: int, ceil: Ceilings, prompt_len: int = PROMPT_LEN) -> tuple[float, float]:
    """(bytes floor, compute floor) of one decode step on one GPU: decode_step_bytes vs 2*params FLOPs. Under
    tensor parallelism every GPU reads only its shard, so the floor is per shard."""
    wbytes = weight_bytes(rt)
    spec = rt.engine.loaded.spec
    kv_heads = rt.engine.kv_cache.shape[-2]  # KV heads held by this rank
    step_bytes = decode_step_bytes(wbytes, batch, spec.num_layers, kv_heads, spec.head_dim, prompt_len)
    flops = 2 * (wbytes / 2) * batch
    return step_bytes / ceil.copy_bytes_per_s, flops / ceil.matmul_flops_per_s


# -- decode steps -------------------------------------------------------------------------------------------
def start_decoding(engine: Any, batch: int, prompt_len: int, max_tokens: int) -> None:
    """Queue `batch` random prompts of `prompt_len` tokens (seeded by the batch size), greedy with EOS
    ignored, and step until every one has prefilled: the engine's next steps are pure decode."""
    vocab, rng = engine.loaded.spec.vocab_size, random.Random(batch)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request([rng.randrange(vocab) for _ in range(prompt_len)], params)
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in engine.scheduler.running):
        engine.step()


def decode_step_seconds(engine: Any, batch: int, prompt_len: int = PROMPT_LEN, steps: int = 32) -> float:
    """Mean time of one engine step while `batch` requests decode (random prompts of `prompt_len` tokens)."""
    return decode_step_timing(engine, batch, prompt_len, steps)[0]


def decode_step_timing(engine: Any, batch: int, prompt_len: int = PROMPT_LEN, steps: int = 32) -> tuple[float, float]:
    """(mean step, mean host time a step not spent waiting for the device's tokens), seconds, while `batch`
    requests decode. With overlapped scheduling a step is device-bound while the second is below the first; where
    they meet, the host's own work sets the step."""
    start_decoding(engine, batch, prompt_len, max_tokens=steps + 12)
    # Mean over back-to-back steps, synchronised only around the whole run: a sync before every step would
    # hide what overlapped scheduling overlaps (the host work of one step with the GPU work of the last).
    for _ in range(2):
        engine.step()
    sync()
    with device_waits() as waits:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        host_end = time.perf_counter()
        sync()
        elapsed = time.perf_counter() - start
    while engine.has_unfinished():
        engine.step()
    return elapsed / steps, (host_end - start - sum(waits)) / steps


@contextlib.contextmanager
def device_waits() -> Iterator[list[float]]:
    """The seconds each wait of the engine for a step's tokens (kiln.runtime.async_step.DeviceEvent) took while
    inside: the host's idle time on the device."""
    from kiln.runtime.async_step import DeviceEvent

    waits: list[float] = []
    untimed = DeviceEvent.synchronize

    def timed(event: DeviceEvent) -> None:
        start = time.perf_counter()
        untimed(event)
        waits.append(time.perf_counter() - start)

    DeviceEvent.synchronize = timed  # type: ignore[method-assign]
    try:
        yield waits
    finally:
        DeviceEvent.synchronize = untimed  # type: ignore[method-assign]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# -- the offline workload ------------------------------------------------------------------------------------
def throughput_workload(requests: int, low: int = 100, high: int = 1024) -> tuple[random.Random, list[tuple[int, int]]]:
    """(rng for the prompt tokens, (input, output) lengths uniform in [low, high]), seeded."""
    rng = random.Random(0)
    return rng, [(rng.randint(low, high), rng.randint(low, high)) for _ in range(requests)]


def offline_requests(rt: Any, lens: list[tuple[int, int]], rng: random.Random,
                     ) -> tuple[list[list[int]], list[SamplingParams]]:
    """The workload's prompts (random token ids) and greedy, EOS-ignoring sampling params."""
    vocab = rt.engine.loaded.spec.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(i)] for i, _ in lens]
    return prompts, [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for _, o in lens]


def warm_up(rt: Any, lens: list[tuple[int, int]], rng: random.Random) -> None:
    """A few short requests on prompts of their own: first-step costs, and nothing the timed prompts would
    find in the prefix cache."""
    prompts, _ = offline_requests(rt, lens[:4], rng)
    rt.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0))


def timed_generate(rt: Any, prompts: list[list[int]], params: list[SamplingParams],
                   timeline: dict | None = None) -> tuple[float, int]:
    """(seconds, output tokens) of one Runtime.generate over every request at once; `timeline`, when
    given, receives the run's per-step-kind breakdown (StepTimeline)."""
    sync()
    start = time.perf_counter()
    with StepTimeline(rt.engine) as steps:
        outs = rt.generate(prompts, params)
        sync()
    if timeline is not None:
        timeline.update(steps.summary())
        print(table(["steps", "count", "seconds", "ms/step", "prefill tokens", "decode tokens"],
                    [[k, v["steps"], v["seconds"], v["ms_per_step"], v["prefill_tokens"], v["decode_tokens"]]
                     for k, v in timeline.items()]), flush=True)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)


DECODE_BUCKETS = ((1, 8), (9, 32), (33, 64), (65, 128), (129, 256), (257, 1 << 20))


class StepTimeline:
    """Where an offline run's wall time goes, step by step: prefill-carrying steps vs decode-only steps by batch.

    Wraps `engine._launch` for the duration of a run and records each launch's time and batch composition.
    With async scheduling a launch happens once the previous step's tokens are processed, so the interval
    between two launches is one step's cost in the steady state (the GPU's or the host's, whichever bounds)."""

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


# -- a sampling profiler -------------------------------------------------------------------------------------
def _label(frame: FrameType) -> str:
    code = frame.f_code
    path = code.co_filename
    for marker in ("site-packages/", "/kiln/", "/benchmarks/", "/lib/python"):
        if marker in path:
            path = path[path.index(marker) + len(marker):]
            break
    return f"{path}:{code.co_firstlineno}({code.co_name})"


class StackSampler:
    """A sampling profiler for one thread: where its wall time goes, waits included, at ~1% overhead.

    cProfile instruments every call and slowed a measured start-up by 20-30%; this samples the thread's stack
    every `interval` seconds from a daemon thread instead. Each sample counts once for every distinct function
    on the stack (inclusive) and once for the innermost frame (self), so a function's share is the fraction of
    wall time it was running or waiting below. The sampler needs the GIL: a C call that holds it for long (no
    Python frame of its own) delays the next sample, so such stretches are under-counted and the time is spread
    over the samples around them; compare large shares, not small ones."""

    def __init__(self, thread: threading.Thread | None = None, interval: float = 0.005) -> None:
        self.target = (thread or threading.current_thread()).ident
        self.interval = interval
        self.samples = 0
        self.inclusive: collections.Counter[str] = collections.Counter()
        self.leaf: collections.Counter[str] = collections.Counter()
        self.paths: collections.Counter[str] = collections.Counter()  # innermost frame <- its callers
        self.timeline: list[tuple[float, str]] = []  # (seconds since start, innermost frame outside torch/triton)
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
            stack = []
            while frame is not None:
                stack.append(_label(frame))
                frame = frame.f_back
            self.leaf[stack[0]] += 1
            self.paths[" <- ".join(stack[:5])] += 1
            self.inclusive.update(set(stack))
            # kiln's, or another library's it called (filelock, jinja2, ...): the first frame in a package that
            # is not torch, triton, the standard library or the benchmark itself
            own_frame = next((label for label in stack if label.split(":")[0].count("/") and not
                              label.startswith(("torch/", "triton/", "<", "3.", "benchmarks", "bench_"))), "?")
            self.timeline.append((time.perf_counter() - self.started, own_frame))

    def report(self, top: int = 70) -> str:
        """The `top` functions by inclusive share, then by self share, as seconds of the sampled wall time."""
        scale = self.seconds / max(self.samples, 1)
        lines = [f"{self.samples} samples over {self.seconds:.2f} s (every {self.interval * 1e3:.0f} ms)",
                 "", "inclusive s  function"]
        lines += [f"{n * scale:11.2f}  {name}" for name, n in self.inclusive.most_common(top)]
        lines += ["", "self s       function"]
        lines += [f"{n * scale:11.2f}  {name}" for name, n in self.leaf.most_common(top // 2)]
        lines += ["", "self s       innermost five frames"]
        lines += [f"{n * scale:11.2f}  {name}" for name, n in self.paths.most_common(top // 2)]
        lines += ["", "timeline: per 0.25 s, the innermost frames outside torch, triton and the standard library "
                  "most sampled (share)"]
        buckets: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        for at, label in self.timeline:
            buckets[int(at / 0.25)][label] += 1
        for b in sorted(buckets):
            total = sum(buckets[b].values())
            top2 = ", ".join(f"{name} {n / total:.0%}" for name, n in buckets[b].most_common(2))
            lines.append(f"{b * 0.25:6.2f}  {top2}")
        return "\n".join(lines)


def eager_seconds(fn: Callable[[], object], calls: int, warmup: int = 1, device: str = "cuda") -> float:
    """Wall time of one fn() call launched eagerly, back to back (the host's launch cost included), after `warmup`
    untimed calls; a CUDA device is synchronized before and after."""
    for _ in range(warmup):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls


def graphed_microseconds(fn: Callable[[int], object], calls: int = 10, replays: int = 3) -> float:
    """GPU time of one fn(i) call, i = 0..calls-1 captured into one CUDA graph and replayed: what the call costs
    inside kiln's graphed steps, without the host's launch overhead. fn(0) runs first (compiles, allocations)."""
    fn(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    del graph
    return start.elapsed_time(end) * 1e3 / (calls * replays)
