"""bench_tp part 2: decode step time of one configuration (model, TP size, all-reduce, passes), one process.

Random bf16 weights drawn on the GPU, Triton attention, -O2, CUDA graphs captured at exactly the batch
sizes timed. The per-GPU floor is this rank's weight bytes (+ the batch's KV) over the copy bandwidth
measured in this process (benchmarks/bench_gpu.py). The process exits with os._exit once its JSON is
written: a TP shutdown that hangs must not cost the run.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

from benchmarks.common import table


def decode_child(config: tuple[str, int, str, tuple[str, ...], tuple[int, ...]], label: str, model_override: str | None,
                 device: str, out_path: str) -> None:
    model, tp, allreduce, passes, batches = config
    model = model_override or model
    if device != "cuda":  # a smoke run: small batches, CPU steps are slow
        batches = tuple(b for b in batches if b <= 2) or (1,)
    os.environ["KILN_TP_ALLREDUCE"] = allreduce
    result: dict[str, Any] = {"config": label, "model": model, "tp": tp, "allreduce": allreduce,
                              "passes": list(passes), "rows": []}
    rt = None
    try:
        from kiln import Runtime
        from kiln.passes import pass_manager_of

        on_gpu = device == "cuda"
        ceil = None
        if on_gpu:
            from benchmarks.bench_gpu import measure_ceilings

            ceil = measure_ceilings()
            result["copy_TB_s"] = ceil.copy_bytes_per_s / 1e12
        start = time.perf_counter()
        options: dict[str, Any] = dict(passes=passes) if passes else dict(enable_passes=False)
        rt = Runtime(model, device=device, dtype="bf16" if on_gpu else "fp32", load_format="dummy", level=2,
                     attention_backend="triton" if on_gpu else "torch", tensor_parallel_size=tp,
                     max_num_seqs=max(batches), max_num_batched_tokens=4096 if on_gpu else 512,
                     compile_sizes=(), cudagraph_capture_sizes=tuple(batches) if on_gpu else None,
                     gpu_memory_utilization=0.85, enable_prefix_caching=False, **options)
        result["build_s"] = round(time.perf_counter() - start, 1)
        manager = pass_manager_of(rt.engine.worker.compiled)
        result["rewrites"] = manager.summary() if manager else "-"
        for batch in batches:
            result["rows"].append(_decode_row(rt, batch, ceil, on_gpu))
            print(label, result["rows"][-1], flush=True)
    except Exception as exc:  # noqa: BLE001 - recorded, the parent prints it
        import traceback

        result["error"] = f"{type(exc).__name__}: {exc}"[:300]
        traceback.print_exc()
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    if rt is not None:  # give shutdown a few seconds; the parent kills what is left
        threading.Thread(target=rt.engine.shutdown, daemon=True).start()
        time.sleep(5 if tp > 1 else 0)
    os._exit(0)


def _decode_row(rt: Any, batch: int, ceil: Any, on_gpu: bool) -> dict[str, Any]:
    from benchmarks.bench_gpu import decode_floor_seconds, weight_bytes
    from benchmarks.common import decode_step_seconds

    steps = 32 if on_gpu else 4
    step = decode_step_seconds(rt.engine, batch, 128 if on_gpu else 16, steps)
    row = {"batch": batch, "step_ms": step * 1e3, "tokens_per_s": batch / step,
           "weight_GB_per_gpu": weight_bytes(rt) / 1e9}
    if ceil is not None:
        floor = max(decode_floor_seconds(rt, batch, ceil))
        row.update(floor_ms=floor * 1e3, x_floor=step / floor)
    return row


def print_decode(results: dict[str, dict]) -> None:
    body = []
    for label, res in results.items():
        if not res.get("rows"):
            body.append([label, res.get("model", "-"), res.get("tp", "-"), res.get("allreduce", "-"),
                         ",".join(res.get("passes", [])) or "off", "-", "-", "-", "-", "-",
                         str(res.get("error", "no rows"))[:80]])
            continue
        for r in res["rows"]:
            body.append([label, res["model"], res["tp"], res["allreduce"], ",".join(res["passes"]) or "off",
                         r["batch"], r["step_ms"], r["tokens_per_s"], r.get("floor_ms", float("nan")),
                         r.get("x_floor", float("nan")), f"build {res.get('build_s')}s; {res.get('rewrites')}"])
    print("\nTP decode (CUDA graphs at the batch sizes, triton attention); floor = weight+KV bytes per GPU / "
          "measured copy bandwidth\n")
    print(table(["config", "model", "TP", "all-reduce", "passes", "batch", "step ms", "tok/s", "floor ms",
                 "x floor", "note"], body))
