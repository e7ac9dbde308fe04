"""Speculative decoding at batch 1: tokens/s with and without it, acceptance per position, and the verify step's
cost against a plain decode step.

    python -m benchmarks.bench_spec_decode --device cpu                 # embedded SmolLM2, n-gram, k=4
    python -m benchmarks.bench_spec_decode --device cuda --verify-ratio # + Llama-3-8B shape, k=4, CUDA events
    python -m benchmarks.bench_spec_decode --draft-model <dir|preset>   # a draft model instead of n-gram

Tasks: `copy` (repeat a paragraph exactly, through the chat template), `edit` (rewrite a code snippet with one
change) and `free` (an open question: proposals rarely match, so this shows what speculation costs when it does
not help). Both arms run the same compiled runtime with the device's default scheduling (async on a GPU; with
n-gram proposals a step is overlapped unless it verifies, docs/spec_decode.md), proposals on or off. Prints a
table (tokens/s end to end, and the speed-up of the decode rate after the first token, which leaves out the
prefill both arms share) and each kind of step's host phases; --json writes every number.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch

from benchmarks.common import stamp
from kiln import Runtime, SamplingParams
from kiln.runtime.async_step import LaunchedStep
from kiln.runtime.spec_decode.ngram import NgramProposer

PARAGRAPH = ("Speculative decoding lets a small proposer guess several tokens ahead, and the large model checks "
             "all of the guesses in a single forward pass. When the guesses are right, the model emits several "
             "tokens for the price of one; when they are wrong, it keeps the tokens up to the first mistake and "
             "its own correction, so the output never changes.")
CODE = '''def moving_average(values, window):
    """Return the moving averages of values over a sliding window."""
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            averages.append(total / window)
    return averages
'''
TASKS = {
    # the embedded 135M model copies the paragraph almost word for word when asked this way; asked to "repeat
    # the following text exactly" it wrote a sentence of its own instead, so that prompt measured no copying
    "copy": "Here is a paragraph:\n\n" + PARAGRAPH + "\n\nWrite the paragraph again, word for word.",
    "edit": "Rename the function moving_average to rolling_mean in this code and output the whole code:\n\n" + CODE,
    "free": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


STEP_KINDS = ("verify behind", "verify on guess", "verify", "overlapped", "plain")


@contextlib.contextmanager
def host_phases(engine: Any) -> Iterator[dict[str, float]]:
    """Times the engine's host phases (inclusive ms, summed until the dict is cleared) by wrapping its objects'
    methods for the duration: where the host's part of a step goes. "sample_rows" (a verify's) includes its
    read-back wait; "tokens" is a plain step's."""
    import kiln.runtime.spec_decode.verify as verify_module
    from kiln.compiler.cuda_graphs import TorchGraph

    spent: dict[str, float] = {}
    runner = engine.runner
    targets = [(engine, "_complete", "complete"), (engine.scheduler, "schedule", "schedule"),
               (engine.scheduler, "advance", "advance"), (runner, "fill_host", "fill"),
               (runner, "to_device", "upload"), (runner, "_copy_pending_tokens", "upload"),
               (runner, "forward_context", "metadata"), (runner, "run_model", "forward"),
               (runner.model, "compute_logits", "logits"), (runner.sampler, "sample", "sample"),
               (verify_module, "sample_rows", "sample_rows"), (LaunchedStep, "token_ids", "tokens"),
               (TorchGraph, "replay", "replay")]
    if engine.speculation is not None:
        targets += [(engine.speculation, name, "propose") for name in ("propose", "propose_ahead", "wants_verify")]
        targets.append((engine.speculation, "after_verify", "advance"))

    def timed(fn: Any, phase: str) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[phase] = spent.get(phase, 0.0) + (time.perf_counter() - start) * 1e3
        return wrapper

    saved = [(obj, name, obj.__dict__.get(name)) for obj, name, _ in targets]
    for obj, name, phase in targets:
        setattr(obj, name, timed(getattr(obj, name), phase))
    try:
        yield spent
    finally:
        for obj, name, original in saved:
            if original is None:
                delattr(obj, name)
            else:
                setattr(obj, name, original)


def timed_steps(rt: Runtime, prompt: list[int], params: SamplingParams) -> dict[str, Any]:
    """One more generate, each engine step timed on the host and named by what it launched: a verify behind the
    step in flight, one prepared behind it on the lookup's guess and launched once the guess matched, a verify
    with nothing in flight, a plain step launched overlapped, or one launched alone
    (the first, or after a verify). -> per kind: count, mean ms (a step's time includes its waits) and the mean
    host phases (`host_phases`)."""
    engine, spec = rt.engine, rt.engine.speculation
    times: dict[str, list[float]] = {kind: [] for kind in STEP_KINDS}
    phases: dict[str, dict[str, float]] = {kind: {} for kind in STEP_KINDS}
    engine.add_request(prompt, params)
    with host_phases(engine) as spent:
        while engine.has_unfinished():
            spent.clear()
            kind = _timed_step(engine, spec, times)
            if kind is not None:
                for phase, ms in spent.items():
                    phases[kind][phase] = phases[kind].get(phase, 0.0) + ms
    return {kind: {"steps": len(t), "mean_ms": statistics.mean(t) if t else 0.0,
                   "phases_ms": {p: ms / len(t) for p, ms in sorted(phases[kind].items(), key=lambda x: -x[1])}
                   if t else {}} for kind, t in times.items()}


def _timed_step(engine: Any, spec: Any, times: dict[str, list[float]]) -> str | None:
    """One engine step, its time filed under the kind of step it launched (None: it launched none)."""
    stats = engine.stats
    before = (stats.steps, stats.verify_behind_steps, stats.overlapped_steps,
              spec.stats.num_drafts if spec is not None else 0, stats.verify_on_guess_steps)
    start = time.perf_counter()
    engine.step()
    elapsed = (time.perf_counter() - start) * 1e3
    if stats.steps == before[0]:
        return None  # only finished the step in flight
    if stats.verify_behind_steps > before[1]:
        kind = "verify behind"
    elif stats.verify_on_guess_steps > before[4]:
        kind = "verify on guess"
    elif spec is not None and spec.stats.num_drafts > before[3]:
        kind = "verify"
    else:
        kind = "overlapped" if stats.overlapped_steps > before[2] else "plain"
    times[kind].append(elapsed)
    return kind


def run_task(rt: Runtime, prompt: list[int], max_tokens: int, speculate: bool, spec: Any, default_async: bool,
             repeats: int, behind: bool = True) -> dict[str, Any]:
    """`behind`: n-gram verify steps may launch behind the step in flight (the engine's default)."""
    engine = rt.engine
    engine.speculation = spec if speculate else None
    engine.async_scheduling = default_async and (not speculate or isinstance(spec.proposer, NgramProposer))
    engine.verify_behind_inflight = behind
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    rt.generate([prompt], params)  # warm: every shape this task runs
    before = dict(spec.stats.as_dict()) if spec is not None else {}
    rates, decode_rates, tokens = [], [], None
    for _ in range(repeats):
        _sync(engine.device)
        start = time.perf_counter()
        request = rt.generate([prompt], params)[0]
        _sync(engine.device)
        out = request.outputs[0]
        rates.append(len(out.token_ids) / (time.perf_counter() - start))
        # the tokens after the first over the time after it: the prefill, alike in both arms, left out
        decode_rates.append((len(out.token_ids) - 1) / request.metrics.decode_time)
        tokens = out.token_ids
    result: dict[str, Any] = {"tokens_per_s": statistics.median(rates), "num_tokens": len(tokens),
                              "decode_tokens_per_s": statistics.median(decode_rates),
                              "token_ids": tokens, "step_kinds": timed_steps(rt, prompt, params)}
    if speculate:
        after = spec.stats.as_dict()
        drafts = after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
        proposed = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
        accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
        per_pos = [a - b for a, b in zip(after["spec_decode_num_accepted_tokens_per_pos"],
                                         before["spec_decode_num_accepted_tokens_per_pos"])]
        result.update(acceptance=accepted / proposed if proposed else 0.0,
                      accepted_per_pos=[p / drafts if drafts else 0.0 for p in per_pos],
                      mean_accepted=accepted / drafts if drafts else 0.0, verify_steps=drafts // repeats)
    return result


def bench_tasks(args: argparse.Namespace) -> dict[str, Any]:
    spec_config: dict[str, Any] = {"method": "ngram", "num_speculative_tokens": args.k,
                                   "prompt_lookup_max": args.lookup_max, "prompt_lookup_min": args.lookup_min}
    if args.draft_model:
        draft = args.draft_model
        if draft == "self":  # the target drafting for itself: every greedy proposal is accepted
            from kiln.models.loader.load import model_directory

            draft = str(model_directory(args.model) or args.model)
        spec_config = {"method": "draft_model", "model": draft, "num_speculative_tokens": args.k}
    kwargs: dict[str, Any] = dict(device=args.device, level=args.level, speculative_config=spec_config)
    if args.compile_sizes:
        kwargs["compile_sizes"] = tuple(args.compile_sizes)
    if args.capture_sizes:  # batch 1 needs only the small graphs: fewer captures, a quicker start
        kwargs["cudagraph_capture_sizes"] = tuple(args.capture_sizes)
    if args.device == "cpu":
        kwargs["dtype"] = "fp32"
    start = time.perf_counter()
    rt = Runtime(args.model, **kwargs)
    ready = time.perf_counter() - start
    engine = rt.engine
    rt.finish_background_compiles(timeout=args.background_timeout)
    spec = engine.speculation
    default_async = engine.device.type == "cuda"
    results: dict[str, Any] = {"ready_seconds": ready, "spec_config": spec_config, "tasks": {}}
    for task in args.tasks:
        prompt = rt.apply_chat_template([{"role": "user", "content": TASKS[task]}])
        on = run_task(rt, prompt, args.max_tokens, True, spec, default_async, args.repeats)
        off = run_task(rt, prompt, args.max_tokens, False, spec, default_async, args.repeats)
        entry = results["tasks"][task] = {"spec": on, "plain": off, "speedup": on["tokens_per_s"] / off["tokens_per_s"],
                                          "decode_speedup": on["decode_tokens_per_s"] / off["decode_tokens_per_s"],
                                          "prompt_tokens": len(prompt)}
        if args.drain_arm and default_async:  # the A/B: every verify drains the step in flight first
            drain = entry["spec_drain"] = run_task(rt, prompt, args.max_tokens, True, spec, default_async,
                                                   args.repeats, behind=False)
            entry["speedup_drain"] = drain["tokens_per_s"] / off["tokens_per_s"]
            entry["same_tokens_drain"] = drain.pop("token_ids") == on["token_ids"]
        entry["same_tokens"] = on.pop("token_ids") == off.pop("token_ids")
    engine.speculation = spec
    rt.shutdown()
    return results


class NoBackoff(dict):
    """A backoff table that never records a miss: the fixed proposals are always rejected, and every step of
    the verify arm must verify."""

    def __setitem__(self, key: Any, value: Any) -> None:
        pass


class FixedProposer:
    """k proposals every step whatever the context (the verify step's cost does not depend on their values)."""

    def __init__(self, k: int) -> None:
        self.k = k

    def propose(self, reqs: list, limits: list[int]) -> list[list[int]]:
        return [[7] * min(self.k, limit) for limit in limits]


def bench_verify_ratio(args: argparse.Namespace) -> dict[str, Any]:
    """One request (512-token context) of the `--ratio-model` preset: plain decode steps against verify steps of
    k + 1 tokens, both synchronous, timed by CUDA events around each engine step, in one process."""
    from kiln.runtime.spec_decode.decoder import SpecDecoder

    extra = {"cudagraph_capture_sizes": tuple(args.capture_sizes)} if args.capture_sizes else {}
    rt = Runtime(args.ratio_model, device=args.device, level=args.level, max_model_len=args.ratio_max_model_len,
                 speculative_config={"method": "ngram", "num_speculative_tokens": args.k}, **extra)
    rt.finish_background_compiles(timeout=args.background_timeout)
    engine = rt.engine
    verify = SpecDecoder(FixedProposer(args.k), args.k, engine.kv)
    verify.backoff = NoBackoff()
    vocab = engine.loaded.spec.vocab_size
    prompt = [(i * 7919) % vocab for i in range(args.ratio_context)]
    on_gpu = engine.device.type == "cuda"

    graphs = engine.runner.graphs
    full_verify_len = graphs.full_verify_len if graphs is not None else 0

    def start_request(speculation: Any, steps: int, full_verify: bool = True) -> None:
        """One request past its prefill and a few steps, each step then a verify (`speculation`) or a plain one."""
        engine.speculation = speculation
        if graphs is not None:  # off: verify batches run in PIECEWISE graphs, as mixed batches do
            graphs.full_verify_len = full_verify_len if full_verify else 0
        engine.add_request(prompt, SamplingParams(max_tokens=3 * steps + 64, temperature=0.0, ignore_eos=True))
        while any(r.num_computed_tokens < r.num_tokens - 1 for r in engine.scheduler.running) or \
                engine.scheduler.waiting:
            engine.step()
        for _ in range(3):
            engine.step()

    def time_steps(speculation: Any, steps: int, full_verify: bool = True) -> list[float]:
        start_request(speculation, steps, full_verify)
        times = []
        drafts = speculation.stats.num_drafts if speculation is not None else 0
        for _ in range(steps):
            if on_gpu:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                engine.step()
                end.record()
                end.synchronize()
                times.append(begin.elapsed_time(end) / 1e3)
            else:
                start = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - start)
        if speculation is not None and speculation.stats.num_drafts - drafts != steps:
            raise RuntimeError(f"{speculation.stats.num_drafts - drafts} of {steps} timed steps verified")
        for request_id in list(engine.parents):
            engine.abort(request_id)
        return times

    rounds: list = []
    for _ in range(2):  # interleaved, so drift hits all alike
        rounds.append((time_steps(None, args.ratio_steps), time_steps(verify, args.ratio_steps, False),
                       time_steps(verify, args.ratio_steps, True)))
    plain, piecewise, full = (statistics.median([t for r in rounds for t in r[i]]) for i in range(3))
    result = {"model": args.ratio_model, "k": args.k, "plain_step_ms": plain * 1e3,
              "verify_step_ms": full * 1e3, "ratio": full / plain, "verify_piecewise_ms": piecewise * 1e3,
              "ratio_piecewise": piecewise / plain, "full_verify_graphs": bool(full_verify_len),
              "graph_replays": dict(engine.graph_replays)}
    if args.profile_steps and on_gpu:  # where each kind of step goes: kernels by kind, GPU idle, the host's calls
        from benchmarks.bench_profile import profile_steps

        result["profile"] = {}
        for name, speculation in (("plain", None), ("verify", verify)):
            start_request(speculation, 3 * args.profile_steps + 2)
            result["profile"][name] = profile_steps(engine, args.profile_steps, torch.cuda.synchronize, None, True)
            for request_id in list(engine.parents):
                engine.abort(request_id)
    rt.shutdown()
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF dir or preset (default: the embedded SmolLM2)")
    parser.add_argument("--draft-model", default=None,
                        help="draft model proposals instead of n-gram: an HF dir, a preset, or 'self' (the target)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--level", type=int, default=2)
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--compile-sizes", type=int, nargs="*", default=None)
    parser.add_argument("--capture-sizes", type=int, nargs="*", default=None)
    parser.add_argument("--background-timeout", type=float, default=120.0,
                        help="seconds to wait for -O2's background compiles before measuring")
    parser.add_argument("--tasks", nargs="*", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--drain-arm", action="store_true",
                        help="async scheduling: also speculate with every verify draining the step in flight")
    parser.add_argument("--skip-tasks", action="store_true", help="only the verify-step ratio")
    parser.add_argument("--verify-ratio", action="store_true", help="also time verify vs plain decode steps")
    parser.add_argument("--ratio-model", default="llama3-8b")
    parser.add_argument("--ratio-steps", type=int, default=20)
    parser.add_argument("--ratio-max-model-len", type=int, default=4096)
    parser.add_argument("--ratio-context", type=int, default=512, help="prompt tokens before the timed steps")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="GPU: also profile this many plain and verify steps of the ratio model (bench_profile)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (CPU): 1 keeps a shared machine's other load from stalling OpenMP regions")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results: dict[str, Any] = {"stamp": stamp(), "args": vars(args)}
    print(results["stamp"])
    if not args.skip_tasks:
        results.update(bench_tasks(args))
        print(f"{'task':6} {'plain tok/s':>11} {'spec tok/s':>10} {'speedup':>7} {'decode':>7} {'accept':>6} "
              f"{'tok/verify':>10} {'same':>5}  accepted per position")
        for task, r in results["tasks"].items():
            s = r["spec"]
            print(f"{task:6} {r['plain']['tokens_per_s']:11.1f} {s['tokens_per_s']:10.1f} {r['speedup']:6.2f}x "
                  f"{r['decode_speedup']:6.2f}x {s['acceptance']:6.2f} {1 + s['mean_accepted']:10.2f} "
                  f"{str(r['same_tokens']):>5}  " + " ".join(f"{p:.2f}" for p in s["accepted_per_pos"]))
            arms = [("spec", s), ("plain", r["plain"])] + ([("drain", r["spec_drain"])] if "spec_drain" in r else [])
            if "spec_drain" in r:
                print(f"       drain arm: {r['spec_drain']['tokens_per_s']:.1f} tok/s = {r['speedup_drain']:.2f}x, "
                      f"same tokens as spec: {r['same_tokens_drain']}")
            for name, arm in arms:
                print(f"       {name} steps: " + ", ".join(f"{kind} {v['steps']} x {v['mean_ms']:.2f} ms"
                                                     for kind, v in arm["step_kinds"].items() if v["steps"]))
            for kind in ("verify on guess", "verify", "plain"):  # the host's phases of the steps launched alone
                phases = s["step_kinds"][kind]["phases_ms"]
                if phases:
                    print(f"       spec {kind} step, host ms: "
                          + ", ".join(f"{p} {ms:.3f}" for p, ms in phases.items()))
    if args.verify_ratio:
        ratio = bench_verify_ratio(args)
        results["verify_ratio"] = ratio
        print(f"verify step ({ratio['model']}, batch 1, k={ratio['k']}): plain decode {ratio['plain_step_ms']:.2f} ms; "
              f"verify {ratio['verify_step_ms']:.2f} ms = {ratio['ratio']:.3f}x (FULL verify graphs: "
              f"{ratio['full_verify_graphs']}); verify without them {ratio['verify_piecewise_ms']:.2f} ms = "
              f"{ratio['ratio_piecewise']:.3f}x; replays {ratio['graph_replays']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
