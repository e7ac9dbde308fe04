"""Tensor parallelism on one host, in one command: the all-reduce variants, then TP decode A/B.

    python -m benchmarks.bench_tp --json tp.json                      # 2 GPUs (H200 x2): ~7 minutes
    python -m benchmarks.bench_tp --device cpu --models tiny-llama --json /tmp/tp.json   # CPU smoke run

Part 1 (`allreduce`): 2 ranks; for bf16 messages of 8 KB .. 1 MB, NCCL (torch's functional all-reduce,
what the model traced before) against one-shot and two-shot over torch symmetric memory (P2P, no
multicast), each eagerly and replayed from a CUDA graph, with ratios against NCCL; every variant's sum is
checked against NCCL's. Then the fused all-reduce + residual add + RMSNorm op against NCCL + Inductor's
add + norm at decode shapes. The table ends with the thresholds it suggests for AllReducePolicy.

Part 2 (`decode`): one process per configuration (fresh NCCL state; a hang or crash costs one row):
Llama-3-8B TP=2 at batch 1/8/64 and Llama-3-70B TP=2 at batch 1/64, random bf16 weights, Triton attention,
-O2 with CUDA graphs at the batch sizes; all-reduce NCCL vs auto, pass allreduce_rmsnorm off vs on (and
8B TP=1). Each row gives the per-GPU floor: this rank's weight (+KV) bytes / the copy bandwidth measured
in the same process. Each part runs under a time limit; the parent kills its process group on expiry.

Multi-GPU runs set NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 (NVLink
multicast can take a shared host's GPUs down); CUDA graphs are on under TP by default.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(NO_MULTICAST)

# label -> (model, tensor parallel size, KILN_TP_ALLREDUCE, passes, batches); run in this order (most wanted
# first), so a run that hits its overall deadline loses the least useful rows
DECODE_CONFIGS: dict[str, tuple[str, int, str, tuple[str, ...], tuple[int, ...]]] = {
    "8b-auto-off": ("llama3-8b", 2, "auto", (), (1, 8, 64)),
    "8b-auto-pass": ("llama3-8b", 2, "auto", ("allreduce_rmsnorm",), (1, 8, 64)),
    "70b-auto-off": ("llama3-70b", 2, "auto", (), (1, 64)),
    "70b-auto-pass": ("llama3-70b", 2, "auto", ("allreduce_rmsnorm",), (1, 64)),
    "8b-nccl-off": ("llama3-8b", 2, "nccl", (), (1, 8, 64)),
    "8b-tp1": ("llama3-8b", 1, "nccl", (), (1, 8, 64)),
}


# -- orchestration ---------------------------------------------------------------------------------------
def run_part(args: list[str], timeout_s: float) -> dict[str, Any]:
    """Run `python -m benchmarks.bench_tp <args> --out F` in its own process group; -> its JSON or the failure."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = Path(f.name)
    cmd = [sys.executable, "-m", "benchmarks.bench_tp", *args, "--out", str(out)]
    env = {**os.environ, **NO_MULTICAST}
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    seconds = round(time.perf_counter() - start, 1)
    try:
        result = json.loads(out.read_text())
    except (OSError, ValueError):
        result = {"error": f"exit code {proc.returncode} after {seconds}s (no result)"}
    finally:
        out.unlink(missing_ok=True)
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # a worker left behind by a child that exited without shutdown
    except ProcessLookupError:
        pass
    result["wall_s"] = seconds
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd")
    ar = sub.add_parser("allreduce", help="(child) the all-reduce table")
    ar.add_argument("--device", default="cuda")
    ar.add_argument("--out", required=True)
    dec = sub.add_parser("decode", help="(child) one decode configuration")
    dec.add_argument("--config", required=True)
    dec.add_argument("--model", default=None, help="override the configuration's model (CPU smoke runs)")
    dec.add_argument("--device", default="cuda")
    dec.add_argument("--out", required=True)
    parser.add_argument("--json", default=None)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--configs", nargs="+", default=list(DECODE_CONFIGS), choices=list(DECODE_CONFIGS))
    parser.add_argument("--models", nargs="+", default=None,
                        help="replace every configuration's model (e.g. tiny-llama for a CPU smoke run)")
    parser.add_argument("--skip-allreduce", action="store_true")
    parser.add_argument("--budget-s", type=float, default=450, help="stop starting new parts after this")
    args = parser.parse_args()
    if args.cmd == "allreduce":
        from benchmarks.tp_allreduce_table import allreduce_child

        return allreduce_child(args.device, args.out)
    if args.cmd == "decode":
        from benchmarks.tp_decode_ab import decode_child

        return decode_child(DECODE_CONFIGS[args.config], args.config, args.model, args.device, args.out)

    from benchmarks.tp_allreduce_table import print_allreduce
    from benchmarks.tp_decode_ab import print_decode

    start = time.perf_counter()
    report: dict[str, Any] = {"env": NO_MULTICAST, "allreduce": None, "decode": {}}
    if not args.skip_allreduce:
        report["allreduce"] = run_part(["allreduce", "--device", args.device],
                                       timeout_s=120 if args.device == "cuda" else 300)
        print_allreduce(report["allreduce"])
    for label in args.configs:
        left = args.budget_s - (time.perf_counter() - start)
        if left < 30:
            report["decode"][label] = {"error": f"skipped: overall budget {args.budget_s}s spent"}
            continue
        extra = ["--model", args.models[0]] if args.models else []
        report["decode"][label] = run_part(["decode", "--config", label, "--device", args.device, *extra],
                                           timeout_s=min(left, 240 if args.device == "cuda" else 400))
        print(f"{label}: {report['decode'][label]}", flush=True)
    print_decode(report["decode"])
    report["total_s"] = round(time.perf_counter() - start, 1)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json} ({report['total_s']} s)")


if __name__ == "__main__":
    main()
