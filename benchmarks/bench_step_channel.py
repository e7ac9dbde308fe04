"""The tensor-parallel step channel's host cost: gloo broadcasts vs the same-host shared-memory ring.

Rank 0 sends one decode step (header + host buffers, through kiln's real channel set-up) to world-1 spawned
workers; each worker takes it (copies it into its own host buffers) and answers through a shared counter,
the same way for both channels. Per channel and batch size it reports rank 0's time inside `send` (what
rank 0's host pays per step) and the round trip (send -> every worker has the step). Host-only: no model,
no device; meaningful on any machine (run it on the GPU host to see that host's CPU).

    python -m benchmarks.bench_step_channel [--world 2] [--batches 1 256] [--steps 2000] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import socket
import statistics
import time
import traceback
from types import SimpleNamespace

import torch

from benchmarks.common import table

# buffer sizes as on a GPU by default: max_num_batched_tokens, max_num_seqs, an 8k context in 16-token blocks
TOKENS, SEQS, BLOCKS_PER_SEQ = 8192, 256, math.ceil(8192 / 16)
CONTEXT_BLOCKS = 64  # block-table columns in use: a 1k-token context


def host_buffers(tokens: int = TOKENS, seqs: int = SEQS, blocks_per_seq: int = BLOCKS_PER_SEQ) -> SimpleNamespace:
    """The host buffers a ModelRunner has, at its dtypes (what a step channel reads and writes); the step
    channel tests use it too, at small sizes."""
    i64, i32 = torch.int64, torch.int32
    return SimpleNamespace(
        input_ids_cpu=torch.zeros(tokens, dtype=i64), positions_cpu=torch.zeros(tokens, dtype=i64),
        slot_mapping_cpu=torch.zeros(tokens, dtype=i64), query_start_loc_cpu=torch.zeros(seqs + 1, dtype=i32),
        seq_lens_cpu=torch.zeros(seqs, dtype=i32), block_tables_cpu=torch.zeros(seqs, blocks_per_seq, dtype=i32),
        logits_indices_cpu=torch.zeros(seqs, dtype=i64), pending_dst_cpu=torch.zeros(seqs, dtype=i64),
        pending_src_cpu=torch.zeros(seqs, dtype=i64), wait_host_buffers_free=lambda: None)


def decode_header(batch: int):
    from kiln.runtime.model_runner import BatchShape
    from kiln.runtime.step_channel import StepHeader

    shape = BatchShape(batch, batch, batch, batch, 1, CONTEXT_BLOCKS * 16, True, CONTEXT_BLOCKS)
    return StepHeader(shape, batch, True)  # async scheduling: every input token is pending


def open_channel(rank: int, world: int, kind: str, runner: SimpleNamespace):
    import torch.distributed as dist

    from kiln.runtime.distributed import open_step_channel

    os.environ["KILN_TP_STEP_CHANNEL"] = kind
    group = dist.group.WORLD
    return open_step_channel(rank, group, runner, torch.device("cpu"), local_workers=True)


def worker(rank: int, world: int, port: int, runs: list[str], answers) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    runner = host_buffers()
    for kind in runs:
        channel = open_channel(rank, world, kind, runner)
        taken = 0
        while channel.recv(runner) is not None:
            taken += 1
            answers[rank - 1] = taken
        channel.close()
    dist.destroy_process_group()


def measure(channel, runner, answers, batch: int, steps: int) -> dict[str, float]:
    header = decode_header(batch)
    sends, trips = [], []
    for step in range(1, steps + 1):
        start = time.perf_counter()
        channel.send(runner, header)
        sent = time.perf_counter()
        while min(answers) < step:
            os.sched_yield()  # this host may have fewer free cores than ranks
        trips.append(time.perf_counter() - start)
        sends.append(sent - start)
    warm = steps // 10  # leave out the first tenth (connections, page faults)
    return {"send_us": statistics.median(sends[warm:]) * 1e6, "send_p90_us": sorted(sends[warm:])[
        int(0.9 * (steps - warm))] * 1e6, "round_trip_us": statistics.median(trips[warm:]) * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 256])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    os.environ.setdefault("KILN_TP_SHM_SPIN_MS", "50")  # the GPU default: workers spin between steps
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    runs = [(kind, batch) for kind in ("gloo", "shm") for batch in args.batches]
    ctx = mp.get_context("spawn")
    answers = ctx.RawArray("q", args.world - 1)
    procs = [ctx.Process(target=worker, args=(rank, args.world, port, [k for k, _ in runs], answers), daemon=True)
             for rank in range(1, args.world)]
    for p in procs:
        p.start()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=args.world)
    runner = host_buffers()
    results: dict[str, dict] = {}
    for kind, batch in runs:  # a fresh channel per run (the set-up is a collective: the workers follow)
        key = f"{kind}/batch{batch}"
        channel = open_channel(0, args.world, kind, runner)
        for i in range(len(answers)):  # the workers opened theirs: none has taken a step of this run yet
            answers[i] = 0
        try:
            results[key] = measure(channel, runner, answers, batch, args.steps)
        except Exception:
            results[key] = {"error": traceback.format_exc()}
            print(results[key]["error"])
        channel.send_stop()
        channel.close()
    dist.destroy_process_group()
    for p in procs:
        p.join(timeout=30)
    rows = []
    for batch in args.batches:
        gloo, shm = results.get(f"gloo/batch{batch}", {}), results.get(f"shm/batch{batch}", {})
        for name in ("send_us", "round_trip_us"):
            if name in gloo and name in shm:
                rows.append([batch, name, f"{gloo[name]:.1f}", f"{shm[name]:.1f}", f"{gloo[name] / shm[name]:.1f}x"])
    print(f"step channel, {args.world} ranks, {os.cpu_count()} CPUs, median of {args.steps} steps")
    print(table(["batch", "metric", "gloo us", "shm us", "gloo/shm"], rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"world": args.world, "steps": args.steps, "cpus": os.cpu_count(), "results": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
