"""Online serving: `kiln serve` (default settings) under `kiln bench serve` at several request rates.

One command starts the server on a dummy-weight preset with a synthetic word-level tokenizer of the preset's
vocabulary size (so prompts and streams are text, through the server's real tokenize/detokenize path), waits
until it serves, runs each rate with a bounded number of requests (Poisson arrivals; `inf` = all at once),
writes one JSON and stops the server (SIGTERM drain). A failed rate is recorded, not fatal.

Workload: prompt and output lengths uniform in [input_len * (1 - r), input_len * (1 + r)] (defaults: prompts
102-921 tokens, outputs 64-448), EOS ignored, greedy, streamed /v1/completions.

    # H200, Llama-3-8B shape (about 4 minutes with a cold compile; see docs/BENCHMARKS.md)
    python -m benchmarks.bench_serve --model llama3-8b --json serve.json
    # CPU dry run
    python -m benchmarks.bench_serve --model tiny-llama --device cpu --attention-backend auto --rates 4 inf \
        --num-prompts 4 8 --input-len 32 --output-len 8 --json /tmp/serve.json --serve-args -O0
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks.synthetic_tokenizer import write_word_tokenizer

COLUMNS = ["rate", "requests", "ok", "duration s", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50",
           "TPOT p99", "ITL p50", "ITL p99"]


class Server:
    """`python -m kiln serve ...` as a child process; the URL is read from its 'serving ... at' line."""

    def __init__(self, cmd: list[str], log: Path) -> None:
        self.log = log.open("w")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.lines: list[str] = []
        self.url: str | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            print(f"  serve| {line}", end="", flush=True)
            if line.startswith("kiln: serving") and " at " in line:
                self.url = line.split(" at ", 1)[1].split()[0].removesuffix("/v1")
                self._ready.set()
        self._ready.set()  # exited

    def wait_ready(self, timeout: float) -> str:
        self._ready.wait(timeout)
        if self.url is None:
            code = self.proc.poll()
            what = f"exited with status {code}" if code is not None else f"did not start within {timeout:.0f}s"
            raise RuntimeError(f"kiln serve {what}; see {self.log.name}")
        return self.url

    def stop(self, timeout: float = 60.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # the drain: in-flight requests finish, then exit 0
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def run_rate(url: str, model: str, tokenizer: Any, rate: float, num: int, args: argparse.Namespace) -> dict:
    from kiln.entrypoints.bench.datasets import random_requests
    from kiln.entrypoints.bench.serve import format_table, run_benchmark, summarize

    # seeded per rate, so a rerun sends the same prompts; the rates draw different ones (no prefix-cache help)
    requests = random_requests(num, args.input_len, args.output_len, args.range_ratio, seed=int(rate * 10) % 997
                               if math.isfinite(rate) else 999, tokenizer=tokenizer)
    results, duration, _ = asyncio.run(run_benchmark(url, "/v1/completions", model, requests, request_rate=rate,
                                                     ignore_eos=True, temperature=0.0, progress=False))
    summary = summarize(results, duration)
    print(format_table(summary, f"request rate {rate:g}"), flush=True)
    return {"request_rate": "inf" if math.isinf(rate) else rate, "num_prompts": num, **summary}


def row(r: dict) -> list:
    if "error" in r and "completed" not in r:
        return [r["request_rate"], r["num_prompts"], "FAILED"] + [float("nan")] * (len(COLUMNS) - 3)
    return [r["request_rate"], r["num_prompts"], r["completed"], r["duration_s"], r["request_throughput"],
            r["output_throughput"], r["ttft_ms"]["median"], r["ttft_ms"]["p99"], r["tpot_ms"]["median"],
            r["tpot_ms"]["p99"], r["itl_ms"]["median"], r["itl_ms"]["p99"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3-8b", help="a preset (dummy weights)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--attention-backend", default="triton")
    parser.add_argument("--rates", type=float, nargs="+", default=[1, 4, 16, math.inf])
    parser.add_argument("--num-prompts", type=int, nargs="+", default=[32, 64, 160, 256],
                        help="requests per rate (one number, or one per rate)")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--range-ratio", type=float, default=0.8)
    parser.add_argument("--ready-timeout", type=float, default=480.0, help="seconds for start-up (cold compile)")
    parser.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[],
                        help="anything after this goes to `kiln serve` (default: none = default settings)")
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    counts = args.num_prompts * len(args.rates) if len(args.num_prompts) == 1 else args.num_prompts
    if len(counts) != len(args.rates):
        parser.error("--num-prompts takes one number or one per rate")

    from transformers import AutoTokenizer

    from benchmarks.common import stamp
    from kiln.models.loader.presets import preset_config

    out: dict[str, Any] = {"stamp": stamp(), "model": args.model, "workload": {
        "input_len": args.input_len, "output_len": args.output_len, "range_ratio": args.range_ratio,
        "endpoint": "/v1/completions", "stream": True, "ignore_eos": True, "temperature": 0.0},
        "serve_args": args.serve_args, "rates": []}
    work = Path(tempfile.mkdtemp(prefix="kiln-bench-serve-"))
    config = preset_config(args.model)
    eos = config.eos_token_id if isinstance(config.eos_token_id, int) else None
    tokenizer_dir = write_word_tokenizer(work / "tokenizer", config.vocab_size, config.bos_token_id, eos)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    cmd = [sys.executable, "-m", "kiln", "serve", args.model, "--load-format", "dummy", "--tokenizer",
           str(tokenizer_dir), "--device", args.device, "--attention-backend", args.attention_backend, "--port",
           "0", "--served-model-name", args.model, "--no-progress", "--no-access-log", "--log-level", "warning",
           *args.serve_args]
    print(f"{out['stamp']}\n$ {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    server = Server(cmd, work / "serve.log")
    try:
        url = server.wait_ready(args.ready_timeout)
        out["startup_s"] = time.perf_counter() - start
        out["server_summary"] = "".join(server.lines)
        # two short requests first: first-request costs are not latency the rates should carry
        run_rate(url, args.model, tokenizer, math.inf, 2, argparse.Namespace(
            input_len=16, output_len=4, range_ratio=0.0))
        for rate, num in zip(args.rates, counts):
            try:
                out["rates"].append(run_rate(url, args.model, tokenizer, rate, num, args))
            except Exception as exc:  # one failed rate is a row, not the end of the run
                traceback.print_exc()
                out["rates"].append({"request_rate": "inf" if math.isinf(rate) else rate, "num_prompts": num,
                                     "error": f"{type(exc).__name__}: {exc}"})
    except Exception as exc:
        traceback.print_exc()
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        out["server_exit_code"] = server.stop()
        out["server_log_tail"] = (work / "serve.log").read_text()[-4000:]
        out["total_s"] = time.perf_counter() - start
        Path(args.json).write_text(json.dumps(out, indent=1, default=str) + "\n")

    from benchmarks.common import table

    print(table(COLUMNS, [row(r) for r in out["rates"]]))
    print(f"start-up {out.get('startup_s', float('nan')):.1f}s, total {out['total_s']:.1f}s, "
          f"server exit {out['server_exit_code']}; wrote {args.json}")


if __name__ == "__main__":
    main()
