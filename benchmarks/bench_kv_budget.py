"""What the KV cache gets on one GPU at default settings: per model, the profiling forward's activation peak, the KV
budget, blocks and tokens, and a decode step on the engine so sized (a model that found no budget fails to
build: its row records the error). `--gpu-memory-utilization` stands in for a smaller GPU of the same kind (on a
139.8 GiB H200, 0.51 leaves what 0.9 leaves on an 80 GB H100).

    python -m benchmarks.bench_kv_budget --model qwen3-30b-a3b [--gpu-memory-utilization 0.51] [--profile-attention]
        [--quantization fp8] --json kv.json

`--profile-attention`: the profiling forward runs the torch reference's attention, as it did for every backend
before it left attention out (whose math-path scores then counted as activation peak): the same run's baseline.
One process per row: run.sh's `kv-budget` set calls this once for each.
"""

from __future__ import annotations

import argparse
import json
import logging
import traceback
from pathlib import Path

from benchmarks.common import decode_step_seconds, stamp, table
from kiln import Runtime

PROMPT_LEN = 128


class _BudgetRecord(logging.Handler):
    """The arguments of kiln's "GPU memory: ..." line: GiB total, in use, peak; cached or profiled; GiB budget."""

    def __init__(self) -> None:
        super().__init__()
        self.args: tuple | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg.startswith("GPU memory:"):
            self.args = record.args


def measure(model: str, utilization: float, quantization: str | None, profile_attention: bool) -> dict:
    handler = _BudgetRecord()
    logger = logging.getLogger("kiln")
    logger.setLevel(logging.INFO)  # the line is INFO; a script's loggers pass WARNING and above
    logger.addHandler(handler)
    row: dict = dict(model=model, gpu_memory_utilization=utilization, quantization=quantization or "none",
                     profile_attention=profile_attention)
    if profile_attention:
        from kiln.attention.triton_backend import TritonAttentionBackend

        TritonAttentionBackend.materializes_scores = True  # this process's engine; nothing else runs here
    try:
        rt = Runtime(model, device="cuda", load_format="dummy", gpu_memory_utilization=utilization,
                     quantization=quantization)
        total, used, peak, cached, budget = handler.args
        engine = rt.engine
        blocks = engine.worker.num_blocks
        row.update(total_gib=total, in_use_gib=used, activation_peak_gib=peak, peak_source=cached,
                   kv_budget_gib=budget, num_blocks=blocks,
                   kv_tokens=blocks * engine.config.cache.block_size,
                   decode_b1_ms=decode_step_seconds(engine, 1, PROMPT_LEN, steps=32) * 1e3)
    except Exception as exc:  # noqa: BLE001 - the row records why the model did not build
        row.update(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-2000:])
    finally:
        logger.removeHandler(handler)
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--profile-attention", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    row = measure(args.model, args.gpu_memory_utilization, args.quantization, args.profile_attention)
    columns = ["model", "gpu_memory_utilization", "profile_attention", "activation_peak_gib", "kv_budget_gib",
               "kv_tokens", "decode_b1_ms", "error"]
    print(stamp())
    print(table(columns, [[row.get(c, "-") for c in columns]]))
    if args.json:
        Path(args.json).write_text(json.dumps({"stamp": stamp(), "rows": [row]}, indent=1))


if __name__ == "__main__":
    main()
